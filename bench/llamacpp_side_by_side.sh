#!/usr/bin/env bash
# Side by side with the real llama.cpp on the same MoE GGUF: N = 1, 2, 4 engines started at
# once, each way:
#   llama-mmap     llama.cpp, its default mmap of the model (page cache shared)
#   llama-nommap   llama.cpp with use_mmap = false (a private copy per process)
#   arena-shm      moe-engine --shared-expert-arena on /dev/shm
#   arena-thp      moe-engine --shared-expert-arena on a tmpfs mounted huge=always
#   arena-hugetlb  moe-engine --shared-expert-arena on hugetlbfs (vm.nr_hugepages raised)
# cold (page cache dropped, no arena) and warm; time to ready per engine, host memory for the
# N engines (PSS summed, free(1) deltas, MemAvailable drop), VmPTE, the share of the weights on
# 2 MiB pages, and a restart of one engine while the others run. See docs/llamacpp.md.
#
#   sudo flock /tmp/expert-arena-bench.lock bench/llamacpp_side_by_side.sh [OUT_DIR]
#     env: LAYERS=16 EXPERTS=16 HIDDEN=2048 FFN=768 DTYPE=bf16 (a 2.6 GiB qwen3-moe GGUF),
#          NS=1,2,4, WAYS="llama-mmap llama-nommap arena-shm arena-thp arena-hugetlb"
#
# llama.cpp is the prebuilt libllama of the npm package @node-llama-cpp/linux-x64, driven by
# node-llama-cpp (tools/llama-peer/llama-peer.mjs), installed by scripts/llamacpp-peer.sh.
# Needs root (drop_caches, mounts, nr_hugepages). Everything it makes is undone at exit:
# mounts, arenas, nr_hugepages, the model file.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/$(date -u +%F)-vm}
layers=${LAYERS:-16} experts=${EXPERTS:-16} hidden=${HIDDEN:-2048} ffn=${FFN:-768}
dtype=${DTYPE:-bf16} ns=${NS:-1,2,4}
ways=${WAYS:-llama-mmap llama-nommap arena-shm arena-thp arena-hugetlb}
bin=${EXPERT_ARENA_BIN_DIR:-build/bin}
[[ -x $bin/expert-arena && -x $bin/moe-engine ]] ||
  { echo "build first: cmake --build --preset default --target expert-arena moe-engine" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "needs root (drop_caches, tmpfs/hugetlbfs mounts)" >&2; exit 2; }
command -v gnuplot >/dev/null || { echo "needs gnuplot (gnuplot-nox)" >&2; exit 2; }
prefix=$(scripts/llamacpp-peer.sh --prefix)
node=$(scripts/llamacpp-peer.sh --node)
mkdir -p "$out"

work=$(mktemp -d /var/tmp/ea-llamacpp-bench-XXXXXX)  # on disk: cold reads come from the disk
model=$work/qwen3-moe.gguf
saved_nr=$(cat /proc/sys/vm/nr_hugepages)
shm_arena=/dev/shm/ea-llamacpp-bench-$$
cleanup() {
  for a in "$shm_arena" "$work"/mnt-*/arena; do
    [[ -e $a ]] && "$bin/expert-arena" rm "$a" >/dev/null 2>&1 || rm -f "$a"
  done
  for m in "$work"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount "$m"; done
  echo "$saved_nr" > /proc/sys/vm/nr_hugepages
  rm -rf "$work"
}
trap cleanup EXIT

{
  echo "command: LAYERS=$layers EXPERTS=$experts HIDDEN=$hidden FFN=$ffn DTYPE=$dtype NS=$ns bench/llamacpp_side_by_side.sh $out"
  echo "date: $(date -u +%FT%TZ); kernel $(uname -r); $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "node $("$node" --version); npm packages node-llama-cpp and @node-llama-cpp/linux-x64" \
    "$(basename "$prefix" | sed 's/node-llama-cpp-//'); llama.cpp build: $(cat "$prefix/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/_nlcBuildMetadata.json")"
  echo "THP: enabled $(cat /sys/kernel/mm/transparent_hugepage/enabled), shmem_enabled $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled)"
  echo "model on: $(df --output=source,fstype /var/tmp | tail -1)"
  echo "free -m before the run:"
  free -m
} | tee "$out/llamacpp_env.txt" >&2
"$bin/expert-arena" gen-model --format gguf --layout qwen3-moe --dtype "$dtype" --out "$model" \
  --layers "$layers" --experts "$experts" --hidden "$hidden" --ffn "$ffn" | tee "$out/llamacpp_model.txt"
model_bytes=$(stat -c %s "$model")
"$bin/expert-arena" gen-model --format gguf --layout qwen3-moe --dtype "$dtype" \
  --out "$work/tiny.gguf" --layers 2 --experts 4 --hidden 256 --ffn 128 >/dev/null
expert_bytes=$("$bin/expert-arena" load --model "$model" --arena "$shm_arena" --json 2>/dev/null |
  /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["data_bytes"])')
"$bin/expert-arena" rm "$shm_arena" >/dev/null
arena_mib=$(( expert_bytes / 1048576 + 8 ))

args=()
for way in $ways; do
  case $way in
    llama-mmap|llama-nommap) args+=(--way "$way") ;;
    arena-shm) args+=(--way "arena-shm=$shm_arena") ;;
    arena-thp)
      mkdir -p "$work/mnt-thp"
      mount -t tmpfs -o size=${arena_mib}m,huge=always,mode=0700 tmpfs "$work/mnt-thp"
      args+=(--way "arena-thp=$work/mnt-thp/arena") ;;
    arena-hugetlb)
      pages=$(( arena_mib / 2 + 2 ))
      echo $(( saved_nr + pages )) > /proc/sys/vm/nr_hugepages
      if (( $(cat /proc/sys/vm/nr_hugepages) < saved_nr + pages )); then
        echo "arena-hugetlb skipped: the kernel gave $(( $(cat /proc/sys/vm/nr_hugepages) - saved_nr )) of $pages huge pages" >&2
        echo "$saved_nr" > /proc/sys/vm/nr_hugepages
        continue
      fi
      mkdir -p "$work/mnt-hugetlb"
      mount -t hugetlbfs -o pagesize=2M,size=$(( pages * 2 ))m,mode=0700 none "$work/mnt-hugetlb"
      args+=(--way "arena-hugetlb=$work/mnt-hugetlb/arena") ;;
    *) echo "unknown way $way" >&2; exit 2 ;;
  esac
done

csv=$out/llamacpp_side_by_side.csv
/usr/bin/python3 bench/llamacpp_side_by_side.py --model "$model" --weight-bytes "$model_bytes" \
  --baseline-model "$work/tiny.gguf" --node-prefix "$prefix" --node "$node" --llama-peer tools/llama-peer/llama-peer.mjs \
  --moe-engine "$bin/moe-engine" --expert-arena "$bin/expert-arena" --ns "$ns" --csv "$csv" \
  "${args[@]}"

/usr/bin/python3 - "$csv" "$model_bytes" "$expert_bytes" > "$out/llamacpp_side_by_side.txt" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
model, experts = int(sys.argv[2]), int(sys.argv[3])
def restart(r):
    return f"{float(r['restart_s']):.2f}" if r["restart_s"] else "-"
print(f"model {model / 2**30:.2f} GiB (experts {experts / 2**30:.2f} GiB; the arena ways hold "
      f"the experts, llama.cpp every weight)")
print("| way | cache | N | ready mean s | ready max s | load s (in process) | host GiB (PSS sum) | free used Δ GiB "
      "| buff/cache Δ GiB | MemAvailable drop GiB | VmPTE KiB/engine | weights on 2 MiB pages "
      "| restart s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['way']} | {r['cache']} | {r['n']} | {float(r['ready_mean_s']):.2f} "
          f"| {float(r['ready_max_s']):.2f} | {float(r['load_mean_s']):.2f} | {float(r['host_gib']):.2f} "
          f"| {float(r['free_used_delta_gib']):.2f} | {float(r['free_buffcache_delta_gib']):.2f} "
          f"| {float(r['available_drop_gib']):.2f} | {float(r['vmpte_kib']):.0f} "
          f"| {float(r['huge_pct']):.0f}% | {restart(r)} |")
PY
cat "$out/llamacpp_side_by_side.txt"

# Chart: host memory (warm) and time to ready (cold and warm, slowest engine) against N.
data=$work/plot.dat
/usr/bin/python3 - "$csv" "$data" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
ways = []
for r in rows:
    if r["way"] not in ways and r["way"] != "llama-runtime":
        ways.append(r["way"])
with open(sys.argv[2], "w") as f:
    for w in ways:
        f.write(f'"{w}"\n')
        for r in rows:
            if r["way"] == w and r["cache"] == "warm":
                cold = next((c for c in rows if c["way"] == w and c["n"] == r["n"]
                             and c["cache"] == "cold"), None)
                f.write(f'{r["n"]} {r["host_gib"]} {r["ready_max_s"]} '
                        f'{cold["ready_max_s"] if cold else "NaN"} {r["load_mean_s"]}\n')
        f.write("\n\n")
PY
nways=$(grep -c '^"' "$data")
gnuplot <<EOF
set terminal pngcairo size 1400,1000 font ",11" noenhanced
set output "$out/llamacpp_side_by_side.png"
set multiplot layout 2,2 title "N engines on one $(( model_bytes / 1048576 )) MiB qwen3-moe GGUF: llama.cpp (npm @node-llama-cpp/linux-x64) vs moe-engine --shared-expert-arena ($(date -u +%F), 2-core VM)"
set key top left
set xlabel "engines (N)"
set xtics (1, 2, 4)
set grid
set ylabel "host memory, GiB (PSS summed; warm)"
plot for [i=0:$((nways - 1))] "$data" index i using 1:2 with linespoints lw 2 title columnheader(1)
set ylabel "time to ready, s (slowest engine; warm)"
plot for [i=0:$((nways - 1))] "$data" index i using 1:3 with linespoints lw 2 title columnheader(1)
set ylabel "time to ready, s (slowest engine; cold page cache)"
plot for [i=0:$((nways - 1))] "$data" index i using 1:4 with linespoints lw 2 title columnheader(1)
set ylabel "model load / arena open in the process, s (mean; warm)"
plot for [i=0:$((nways - 1))] "$data" index i using 1:5 with linespoints lw 2 title columnheader(1)
unset multiplot
EOF
echo "wrote $csv, $out/llamacpp_side_by_side.txt, $out/llamacpp_side_by_side.png" >&2
