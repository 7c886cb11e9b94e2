#!/usr/bin/env bash
# Warm loads against the minimal loader (the ceiling of item "loads at the ceiling" in
# docs/scale.md), per backing: plain /dev/shm, a tmpfs mounted huge=always, and hugetlbfs
# (vm.nr_hugepages raised for the run and restored). The minimal loader fallocates, maps
# 2 MiB-aligned, populates and copies on two threads (bench/load_bench.cc MinimalLoad; on plain
# /dev/shm also once collapsing to 2 MiB pages as the arena does, the ceiling there), and once
# more checksumming what it copies (XXH3, as the arena does); best of three of each,
# alternating, from a warm page cache. Needs root (mounts); everything it
# creates is removed at exit. Holds the machine-wide benchmark lock.
#
#   sudo bench/load_ceiling.sh [GiB (default 2)] [--build-dir build]
set -euo pipefail
cd "$(dirname "$0")/.."
gib=${1:-2}
build=${2:-build}
[[ $(id -u) -eq 0 ]] || { echo "needs root (mounts tmpfs/hugetlbfs)" >&2; exit 2; }
exec 9>/tmp/expert-arena-bench.lock
flock 9
work=$(mktemp -d /tmp/ea-ceiling-XXXXXX)
saved_nr=$(cat /proc/sys/vm/nr_hugepages)
cleanup() {
  for m in "$work"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
  echo "$saved_nr" > /proc/sys/vm/nr_hugepages
  rm -rf "$work"
}
trap cleanup EXIT
model=$work/model.gguf
# Qwen3-30B-A3B-shaped layers as load_bench.sh: 144 MiB of experts a layer.
"$build/bin/expert-arena" gen-model --format gguf --out "$model" --layers $((gib * 7)) \
  --experts 16 --hidden 2048 --ffn 768 --dtype bf16 >&2
bytes=$(stat -c %s "$model")
mib=$(( bytes / 1048576 + 64 ))
dirs=(--ceiling-dir /dev/shm)
mkdir -p "$work/mnt-tmpfs"
mount -t tmpfs -o size=${mib}m,huge=always,mode=0700 tmpfs "$work/mnt-tmpfs"
dirs+=(--ceiling-dir "$work/mnt-tmpfs")
pages=$(( mib / 2 + 2 ))
echo $(( saved_nr + pages )) > /proc/sys/vm/nr_hugepages
if (( $(cat /proc/sys/vm/nr_hugepages) >= saved_nr + pages )); then
  mkdir -p "$work/mnt-hugetlbfs"
  mount -t hugetlbfs -o pagesize=2M,size=$((pages * 2))m,mode=0700 none "$work/mnt-hugetlbfs"
  dirs+=(--ceiling-dir "$work/mnt-hugetlbfs")
else
  echo "hugetlbfs skipped: the kernel gave $(( $(cat /proc/sys/vm/nr_hugepages) - saved_nr )) of $pages huge pages" >&2
fi
"$build/bin/load_bench" --model "$model" --runs 3 --ceiling-only "${dirs[@]}"
