#!/usr/bin/env bash
# Runs every benchmark behind DETAILS.md's figures (docs/benchmarks.md) once and keeps what
# each printed, with the machine it ran on, in bench/results/<date>-<host>/ — so an operator
# can rerun them on their own host and compare like with like (every figure there is a ratio
# against a ceiling or a peer measured in the same run; absolute times move with the machine).
#
#   sudo bench/run_all.sh [--out DIR] [--gib N] [--skip NAME ...]
#
#   --out DIR    where the results go (default bench/results/<UTC date>-<hostname>)
#   --gib N      size of the arena backing benchmark (default 4; it needs ~2N GiB of RAM)
#   --skip NAME  leave one out: load, backing, stream, ceiling, collapse, gpu (repeatable)
#
# Needs root (the backing benchmark mounts tmpfs and hugetlbfs, the cold loader run drops the
# page cache) and a default build (cmake --preset default && cmake --build build). Each
# benchmark takes the machine-wide lock /tmp/expert-arena-bench.lock itself, so this script
# never holds it. The GPU check runs only where `nvidia-smi -L` or `rocm-smi` finds a device.
# Every file starts with the command that produced it and the load average around it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="bench/results/$(date -u +%F)-$(hostname -s)"
gib=4
skip=" "
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --gib) gib=$2; shift 2 ;;
    --skip) skip+="$2 "; shift 2 ;;
    *) echo "run_all.sh: unknown argument $1 (see the comment at the top)" >&2; exit 2 ;;
  esac
done
[[ -x build/bin/expert-arena && -x build/bin/stream_bench && -x build/bin/put_ceiling_bench ]] ||
  { echo "build first: cmake --preset default && cmake --build build" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "run_all.sh needs root (mounts, drop_caches)" >&2; exit 2; }
mkdir -p "$out"

# machine.txt gains one block per invocation (a rerun of one benchmark into the same folder
# keeps the description of the earlier run).
{
  echo "date:       $(date -u '+%F %T UTC')"
  echo "commit:     $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "host:       $(hostname -s)"
  echo "kernel:     $(uname -r)"
  echo "cpu:        $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') x $(nproc)"
  echo "memory:     $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "/dev/shm:   $(df -h --output=size /dev/shm | tail -1 | tr -d ' ')"
  echo "thp:        enabled $(cat /sys/kernel/mm/transparent_hugepage/enabled), shmem_enabled $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled)"
  echo "glibc:      $(ldd --version | head -1)"
  echo "load:       $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "benchmarks: all but:${skip% }"
  echo
} | tee -a "$out/machine.txt"

# run NAME COMMAND...: prints and keeps the output of one benchmark.
run() {
  local name=$1
  shift
  if [[ $skip == *" $name "* ]]; then
    echo "== $name: skipped (--skip $name)"
    return 0
  fi
  local file="$out/$name.txt"
  echo "== $name: $*"
  {
    echo "\$ $*"
    echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
  } > "$file"
  local rc=0
  "$@" 2>&1 | tee -a "$file" || rc=$?
  {
    echo
    echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg); exit status $rc"
  } >> "$file"
  if [[ $rc -ne 0 ]]; then
    echo "run_all.sh: $name failed with status $rc (output in $file)" >&2
    failed+=" $name"
  fi
}
failed=""

run load bench/load_bench.sh
run backing bench/arena_backing_bench.sh "$gib" 2
run stream flock /tmp/expert-arena-bench.lock build/bin/stream_bench
run ceiling flock /tmp/expert-arena-bench.lock build/bin/put_ceiling_bench
run collapse flock /tmp/expert-arena-bench.lock build/bin/collapse_bench 1024 2
if [[ $skip == *" gpu "* ]] ||
   { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; } ||
   { command -v rocm-smi >/dev/null && rocm-smi >/dev/null 2>&1; }; then
  run gpu bench/gpu_check.sh
else
  echo "== gpu: no GPU found (nvidia-smi -L / rocm-smi); the GPU check was not run" |
    tee "$out/gpu.txt"
fi

echo
echo "results in $out:"
ls -1 "$out"
if [[ -n $failed ]]; then
  echo "run_all.sh: failed:$failed" >&2
  exit 1
fi
