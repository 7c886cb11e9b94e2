#!/usr/bin/env bash
# The same arena on 4 KiB, 2 MiB and 1 GiB pages, one run: the load, a populate of the whole
# arena by a second process (the attach: MADV_POPULATE_READ of the mapping), and the
# moe-engine's expert reads (random experts through the router, the CPU kernels) on it.
#
#   sudo bench/page_size_bench.sh [GiB] [tokens] [rounds]   (default 2 GiB, 64 tokens, 2 rounds)
#
# Backings, each a filesystem of this script's own, removed at exit:
#   4k       a tmpfs mounted huge=never (loaded with --huge off: 4 KiB pages whatever the kernel)
#   2m-thp   a tmpfs mounted huge=always
#   2m-tlb   hugetlbfs pagesize=2M (vm.nr_hugepages raised for the run)
#   1g-tlb   hugetlbfs pagesize=1G (/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
#            raised at run time; a host whose memory is too fragmented for 1 GiB pages gets
#            fewer, and the row says so)
# Every pool is put back as it was. The model is a synthetic f16 GGUF (gen-model) in /tmp, read
# once beforehand so loads read it from the page cache. Rounds: the backings in turn, then
# again (the first touch of VM memory is slow on round 1; see arena_backing_bench.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
gib=${1:-2}
tokens=${2:-64}
rounds=${3:-2}
bin=${EXPERT_ARENA_BIN_DIR:-build/bin}
for t in expert-arena moe-engine; do
  [[ -x $bin/$t ]] || { echo "build first: $bin/$t" >&2; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { echo "needs root (mounts tmpfs and hugetlbfs, sets the pools)" >&2; exit 2; }

# The pools and mounts are system state the tests' ScopedMount also changes: under its lock.
exec 9>/tmp/expert-arena-test-system.lock
flock 9
work=$(mktemp -d /tmp/ea-page-size-XXXXXX)
nr2=/proc/sys/vm/nr_hugepages
nr1=/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
saved2=$(cat $nr2)
saved1=$(cat $nr1 2>/dev/null || echo "")
cleanup() {
  for m in "$work"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
  echo "$saved2" >$nr2
  [[ -z $saved1 ]] || echo "$saved1" >$nr1
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Experts of 3 x 2048 x 1024 f16 (12 MiB): layers x 32 experts make at most `gib` GiB.
layers=$(( gib * 1024 / (32 * 12) ))
model=$work/m.gguf
"$bin/expert-arena" gen-model --format gguf --out "$model" --layers "$layers" --experts 32 \
  --hidden 2048 --ffn 1024 --dtype f16 >/dev/null
cat "$model" >/dev/null
model_bytes=$(stat -c %s "$model")
# The arena: the experts and a 2 MiB header region, in whole 1 GiB pages.
pages1g=$(( (model_bytes + (4 << 20) + (1 << 30) - 1) / (1 << 30) ))

mkdir -p "$work"/mnt-{4k,2m-thp,2m-tlb,1g-tlb}
mount -t tmpfs -o size=$((gib + 1))g,huge=never,mode=0700 tmpfs "$work/mnt-4k"
mount -t tmpfs -o size=$((gib + 1))g,huge=always,mode=0700 tmpfs "$work/mnt-2m-thp"
echo $((saved2 + (model_bytes >> 21) + 8)) >$nr2
mount -t hugetlbfs -o pagesize=2M,mode=0700 hugetlbfs "$work/mnt-2m-tlb"
have1g=0
if [[ -n $saved1 ]]; then
  # 1 GiB of contiguous free memory per page: compact first.
  echo 1 >/proc/sys/vm/compact_memory 2>/dev/null || true
  echo $((saved1 + pages1g)) >$nr1 || true
  got=$(cat $nr1)
  if ((got - saved1 >= pages1g)); then
    mount -t hugetlbfs -o pagesize=1G,mode=0700 hugetlbfs "$work/mnt-1g-tlb" && have1g=1
  else
    echo "1 GiB pages: asked for $pages1g, the kernel gave $((got - saved1)) (fragmented memory)" >&2
  fi
else
  echo "1 GiB pages: this kernel has no hugepages-1048576kB pool" >&2
fi

echo "page_size_bench: $(uname -r), $(nproc) CPUs, model $((model_bytes >> 20)) MiB ($layers layers x 32 experts, 2048 x 1024 f16), $tokens tokens, top-k default, $(date -u +%F)"
echo
echo "| round: pages | load s | attach (populate) s | populate GiB/s | expert reads s | experts used | on huge pages |"
echo "|---|---|---|---|---|---|---|"
run() {
  local name=$1 dir=$2 round=$3 huge=()
  [[ $name == 4k ]] && huge=(--huge off)
  local arena=$dir/page-size.arena
  local load attach engine
  load=$("$bin/expert-arena" load --model "$model" --arena "$arena" "${huge[@]}" --json 2>"$work/err") ||
    { echo "| $round: $name | failed: $(tail -1 "$work/err") |"; return; }
  attach=$("$bin/expert-arena" load --model "$model" --arena "$arena" --json 2>/dev/null)
  engine=$("$bin/moe-engine" --model "$model" --shared-expert-arena "$arena" --tokens "$tokens" \
    --json 2>/dev/null)
  "$bin/expert-arena" rm "$arena" >/dev/null
  python3 - "$round: $name" "$load" "$attach" "$engine" <<'PY'
import json, sys
name, l, a, e = sys.argv[1], *(json.loads(x) for x in sys.argv[2:5])
assert l["role"] == "loaded" and a["role"] == "attached" and e["role"] == "attached"
gib = a["mapped_bytes"] / (1 << 30) if a.get("mapped_bytes") else l["data_bytes"] / (1 << 30)
print("| %s | %.2f | %.3f | %.1f | %.3f | %d of %d | %.0f%% |" % (
    name, l["seconds"], a["seconds"], gib / a["seconds"], e["compute_seconds"],
    e["experts_used"], e["layers"] * e["experts"],
    100.0 * e["huge_bytes"] / max(e["mapped_bytes"], 1)))
PY
}
for round in $(seq 1 "$rounds"); do
  run 4k "$work/mnt-4k" "$round"
  run 2m-thp "$work/mnt-2m-thp" "$round"
  run 2m-tlb "$work/mnt-2m-tlb" "$round"
  if ((have1g)); then run 1g-tlb "$work/mnt-1g-tlb" "$round"; fi
done
