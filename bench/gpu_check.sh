#!/usr/bin/env bash
# One command for a GPU machine: builds expert-arena with CUDA in its own build directory,
# runs the GPU unit tests for real, then bench/gpu_check.cc, which prints one table:
# registration seconds per GiB on a 4 KiB-page vs a 2 MiB-page backing of the same size
# (serial vs parallel chunks), host-to-device GB/s from the registered arena vs from
# cudaMallocHost memory vs from pageable memory (target: registered >= 0.95 x cudaMallocHost),
# and a correctness check (a tensor copied to the device equals the host bytes).
#
#   bench/gpu_check.sh                   build, test, measure cuda:0 (under 5 minutes on 1 GPU)
#   bench/gpu_check.sh --device cuda:1 --size-gib 4 --dir-2m /mnt/huge
#   bench/gpu_check.sh --no-build --build-dir build --dry-run     (what ctest runs, no GPU)
#
# Needs Debian/Ubuntu with the CUDA toolkit at /usr/local/cuda (or CUDAToolkit_ROOT); missing
# -dev packages are installed with scripts/install-deps.sh when apt works. Run as root, it
# mounts a tmpfs huge=always for the 2 MiB-page backing (and unmounts it) unless --dir-2m is
# given; otherwise the 2 MiB backing is /dev/shm made of 2 MiB pages with MADV_COLLAPSE.
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
dir_2m=""
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --size-gib) size_gib=$2; shift 2 ;;
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
  if [[ -n "$mnt" ]]; then umount "$mnt" 2>/dev/null || true; rmdir "$mnt" 2>/dev/null || true; fi
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
  if ! { cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
           -DEXPERT_ARENA_CUDA=ON -DEXPERT_ARENA_HIP=OFF -DCUDAToolkit_ROOT="$cuda_root" &&
         cmake --build "$build_dir" -j"$(nproc)" --target gpu_check gpu_test; } >"$log" 2>&1; then
    tail -40 "$log" >&2
    die "the build failed (full log above: $log)"
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

if [[ -z "$dir_2m" && $(id -u) -eq 0 ]]; then
  size=${size_gib:-8}
  mnt=$(mktemp -d /tmp/ea-gpu-check-huge-XXXXXX)
  if mount -t tmpfs -o "size=$((size + 1))G,huge=always,mode=0700" tmpfs "$mnt" 2>>"$log"; then
    dir_2m=$mnt
  else
    rmdir "$mnt"; mnt=""
    echo "gpu_check.sh: could not mount a tmpfs huge=always; the 2 MiB backing is /dev/shm collapsed"
  fi
fi
[[ -n "$dir_2m" ]] && args+=(--dir-2m "$dir_2m")
"$bin" "${args[@]}"
