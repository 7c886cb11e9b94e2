#!/usr/bin/env bash
# One command for a GPU machine: builds expert-arena with CUDA in its own build directory,
# runs the GPU unit tests for real, then bench/gpu_check.cc, which prints one table:
# registration seconds per GiB on a 4 KiB-page vs a 2 MiB-page backing of the same size
# (serial vs parallel chunks), host-to-device GB/s from the registered arena vs from
# cudaMallocHost memory vs from pageable memory (target: registered >= 0.95 x cudaMallocHost),
# and a correctness check (a tensor copied to the device equals the host bytes, and so do the
# registered pages read in place through their device address, as vLLM's --cpu-offload-gb
# reads them with the expert_arena loader); then a Python
# step (bench/gpu_check_python.py): arena.torch(name).to("cuda", non_blocking=True) from an
# arena opened with gpu="cuda" is a DMA copy from memory torch sees as pinned, timed against
# a copy from pageable memory (skipped, saying why, without torch+CUDA or the package).
#
#   bench/gpu_check.sh                   build, test, measure cuda:0 (under 5 minutes on 1 GPU)
#   bench/gpu_check.sh --device cuda:1 --size-gib 4 --dir-2m /mnt/huge [--dir-4k DIR|anonymous]
#   bench/gpu_check.sh --no-build --build-dir build --dry-run     (what ctest runs, no GPU)
#
# Needs Debian/Ubuntu with the CUDA toolkit at /usr/local/cuda (or CUDAToolkit_ROOT); missing
# -dev packages are installed with scripts/install-deps.sh when apt works. Run as root, it
# mounts a tmpfs huge=always for the 2 MiB-page backing (and one huge=never for the 4 KiB
# backing when /dev/shm is too small), and unmounts them; otherwise the 2 MiB backing is
# /dev/shm made of 2 MiB pages with MADV_COLLAPSE, or anonymous memory when /dev/shm is small.
# Without a usable device it says "no CUDA device: <reason>; nothing measured" and exits 0.
# Exit status: 0 passed (or nothing to measure), 1 a check failed, 2 could not build or run.
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir="build-gpu-check"
device=cuda:0
build=1
dry_run=0
run_tests=1
size_gib=""
dir_4k=""
dir_2m=""
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while (($#)); do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --size-gib) size_gib=$2; shift 2 ;;
    --dir-4k) dir_4k=$2; shift 2 ;;
    --dir-2m) dir_2m=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --no-tests) run_tests=0; shift ;;
    --dry-run) dry_run=1; run_tests=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$device" in
  cuda|cuda:[0-9]*) ;;
  *) echo "gpu_check.sh: --device $device: this script builds CUDA; use cuda or cuda:N" >&2; exit 2 ;;
esac
log=$(mktemp /tmp/ea-gpu-check-XXXXXX.log)
mnt=""
cleanup() {
  local m
  for m in $mnt; do umount "$m" 2>/dev/null || true; rmdir "$m" 2>/dev/null || true; done
  rm -f "$log"
}
trap cleanup EXIT
die() { echo "gpu_check.sh: $*" >&2; exit 2; }

if ((build)); then
  # Build dependencies: install what is missing when apt can, say what to do otherwise.
  if ! bash scripts/install-deps.sh >"$log" 2>&1; then
    cat "$log" >&2
    die "build dependencies are missing and scripts/install-deps.sh could not install them" \
        "(it needs apt-get and root or sudo); install them, then rerun"
  fi
  cuda_root=${CUDAToolkit_ROOT:-/usr/local/cuda}
  [[ -f "$cuda_root/include/cuda_runtime_api.h" ]] ||
    die "no CUDA toolkit at $cuda_root (cuda_runtime_api.h missing); set CUDAToolkit_ROOT"
  echo "gpu_check.sh: building with CUDA in $build_dir (log: $log)"
  if ! { cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
           -DEXPERT_ARENA_CUDA=ON -DEXPERT_ARENA_HIP=OFF -DCUDAToolkit_ROOT="$cuda_root" &&
         cmake --build "$build_dir" -j"$(nproc)"; } >"$log" 2>&1; then
    tail -40 "$log" >&2
    die "the build failed (the last 40 lines of its log are above)"
  fi
fi

bin="$build_dir/bin/gpu_check"
[[ -x "$bin" ]] || die "$bin is not built (run without --no-build, or build target gpu_check)"

args=(--device "$device")
[[ -n "$size_gib" ]] && args+=(--size-gib "$size_gib")
if ((dry_run)); then
  out=$("$bin" "${args[@]}" --dry-run) || { echo "$out"; die "$bin --dry-run failed"; }
  echo "$out"
  grep -qE "(nothing measured)$" <<<"$out" || die "the dry run did not end with its last line"
  exit 0
fi

# No usable device: one line, exit 0 (the build above is the check that matters here).
rc=0
probe=$("$bin" --device "$device" --probe) || rc=$?
case $rc in
  0) ;;
  3) echo "$probe"; exit 0 ;;
  *) echo "$probe"; die "$bin --probe failed (exit $rc)" ;;
esac

if ((run_tests)); then
  echo "gpu_check.sh: GPU unit tests (ctest -L gpu)"
  if ! (cd "$build_dir" && ctest -L gpu --output-on-failure) >"$log" 2>&1; then
    tail -60 "$log"
    echo "gpu_check.sh: GPU unit tests FAILED"
    exit 1
  fi
  grep -E "tests passed|Skipped" "$log" | sed 's/^/  /'
fi

# Where the backings live. As root: tmpfs mounts made here (huge=always for the 2 MiB
# backing; huge=never for the 4 KiB one when /dev/shm is too small, as in a container).
# Otherwise /dev/shm, or private anonymous memory when /dev/shm cannot hold a backing.
need_kib=$(( (${size_gib:-8} + 1) * 1024 * 1024 ))
shm_kib=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 | tr -d ' ' || echo 0)
mount_tmpfs() {  # mount_tmpfs HUGE -> prints the mount point, or nothing
  local dir
  dir=$(mktemp -d /tmp/ea-gpu-check-mnt-XXXXXX)
  if mount -t tmpfs -o "size=${need_kib}k,huge=$1,mode=0700" tmpfs "$dir" 2>>"$log"; then
    echo "$dir"
  else
    rmdir "$dir"
  fi
}
if [[ -z "$dir_4k" ]]; then
  if ((shm_kib >= need_kib)); then
    dir_4k=/dev/shm
  elif [[ $(id -u) -eq 0 ]] && dir_4k=$(mount_tmpfs never) && [[ -n "$dir_4k" ]]; then
    mnt+=" $dir_4k"
  else
    echo "gpu_check.sh: /dev/shm has $((shm_kib / 1024)) MiB free: the 4 KiB backing is anonymous memory"
    dir_4k=anonymous
  fi
fi
if [[ -z "$dir_2m" ]]; then
  if [[ $(id -u) -eq 0 ]] && dir_2m=$(mount_tmpfs always) && [[ -n "$dir_2m" ]]; then
    mnt+=" $dir_2m"
  elif [[ "$dir_4k" == anonymous || "$dir_4k" != /dev/shm ]]; then
    dir_2m=anonymous
    echo "gpu_check.sh: no tmpfs huge=always mount: the 2 MiB backing is anonymous memory"
  else
    dir_2m=/dev/shm
    echo "gpu_check.sh: not root: the 2 MiB backing is /dev/shm made of 2 MiB pages by MADV_COLLAPSE"
  fi
fi
args+=(--dir-4k "$dir_4k" --dir-2m "$dir_2m")
rc=0
"$bin" "${args[@]}" || rc=$?

# The Python step: an arena opened from Python with gpu="cuda" is pinned memory to torch, and
# .to("cuda", non_blocking=True) from it is timed against a pageable copy. It skips, saying
# why, without the package (EXPERT_ARENA_PYTHON), torch with CUDA, or a device.
echo "gpu_check.sh: Python step (bench/gpu_check_python.py)"
py_rc=0
PYTHONPATH="$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-/usr/bin/python3}" \
  bench/gpu_check_python.py --bin "$build_dir/bin" --device "$device" || py_rc=$?
if ((rc == 0 && py_rc != 0)); then rc=$py_rc; fi
exit "$rc"
