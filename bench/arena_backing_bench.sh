#!/usr/bin/env bash
# The shared arena on its three backings, one run: load time, attach time (another process),
# model bytes read by the attach, and the share of the mapping on 2 MiB pages.
#
#   sudo bench/arena_backing_bench.sh [GiB] [rounds]   (default 4 GiB, 2 rounds; needs root)
#
# Backings: plain /dev/shm (4 KiB tmpfs; 2 MiB pages only by MADV_COLLAPSE of the empty
# file), a tmpfs mounted huge=always, and hugetlbfs (vm.nr_hugepages raised for the run and
# restored). The model is a raw file in /tmp (random bytes, loaded with --format raw as one
# u8 tensor: the backings are what is measured, not a reader), read once beforehand so the
# load is from the page cache. Everything it creates is removed at exit.
#
# Rounds: the three backings in turn, then again. On a VM the first touch of guest memory
# the host has not backed yet (fresh, or handed back by free page reporting) is slow, and
# the first backing of round 1 pays it for all; round 2 runs on memory just freed by round 1,
# as a restarted engine or a second arena on a busy host would. Both rounds are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
gib=${1:-4}
rounds=${2:-2}
bin=${EXPERT_ARENA_BIN:-build/bin/expert-arena}
[[ -x $bin ]] || { echo "build first: cmake --preset default && cmake --build build" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "needs root (mounts tmpfs/hugetlbfs)" >&2; exit 2; }

work=$(mktemp -d /tmp/ea-bench-XXXXXX)
model=$work/model.bin
saved_nr=$(cat /proc/sys/vm/nr_hugepages)
cleanup() {
  for m in "$work"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
  rm -f /dev/shm/ea-bench-arena
  echo "$saved_nr" > /proc/sys/vm/nr_hugepages
  rm -rf "$work"
}
trap cleanup EXIT

echo "making a ${gib} GiB model in $model" >&2
head -c $((gib * 1024 * 1024 * 1024)) /dev/urandom > "$model"
cat "$model" > /dev/null   # warm the page cache

arena_bytes=$(( (gib * 1024 + 2) * 1024 * 1024 ))
run_backing() {
  local name=$1 dir=$2
  local arena=$dir/ea-bench-arena
  local load attach
  load=$("$bin" load --format raw --model "$model" --arena "$arena" --json 2>/dev/null)
  attach=$("$bin" load --format raw --model "$model" --arena "$arena" --json 2>/dev/null)
  "$bin" rm "$arena" >/dev/null
  python3 - "$name" "$load" "$attach" "$round" <<'PY'
import json, sys
name, l, a = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
name = f"{sys.argv[4]}: {name}"
assert l["role"] == "loaded" and a["role"] == "attached", (l["role"], a["role"])
mapping = l["data_bytes"] + 2 * 1024 * 1024
print(f"| {name:<22} | {l['seconds']:7.2f} | {l['load_seconds']:7.2f} | {l['collapse_seconds']:8.2f} "
      f"| {a['seconds']*1000:9.1f} | {100*a['seconds']/l['seconds']:6.2f}% | {a['bytes_read']:>10} "
      f"| {100*l['huge_bytes']/mapping:6.1f}% | {100*a['huge_bytes']/mapping:6.1f}% |")
PY
}

# On /dev/shm the 2 MiB pages are made alongside the reads, so there "read s"
# includes waiting for pages and "collapse" overlaps it: load s < read s + collapse.
echo "| round: backing         | load s  | read s  | collapse | attach ms | attach/load | attach read | huge (L) | huge (A) |"
echo "|------------------------|---------|---------|----------|-----------|-------------|-------------|----------|----------|"
for round in $(seq 1 "$rounds"); do
  run_backing "/dev/shm (collapse)" /dev/shm

  mkdir -p "$work/mnt-tmpfs"
  mount -t tmpfs -o size=$((arena_bytes / 1048576 + 8))m,huge=always,mode=0700 tmpfs "$work/mnt-tmpfs"
  run_backing "tmpfs huge=always" "$work/mnt-tmpfs"
  umount "$work/mnt-tmpfs"

  pages=$(( arena_bytes / 2097152 + 2 ))
  echo $(( saved_nr + pages )) > /proc/sys/vm/nr_hugepages
  got=$(cat /proc/sys/vm/nr_hugepages)
  if (( got < saved_nr + pages )); then
    echo "| $round: hugetlbfs           | skipped: the kernel gave $((got - saved_nr)) of $pages huge pages |"
  else
    mkdir -p "$work/mnt-hugetlbfs"
    mount -t hugetlbfs -o pagesize=2M,size=$((pages * 2))m,mode=0700 none "$work/mnt-hugetlbfs"
    run_backing "hugetlbfs" "$work/mnt-hugetlbfs"
    umount "$work/mnt-hugetlbfs"
  fi
  echo "$saved_nr" > /proc/sys/vm/nr_hugepages
done
