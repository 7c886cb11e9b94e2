#!/usr/bin/env bash
# NUMA on a real multi-socket host (docs/numa.md): an arena bound to each memory node in turn
# (`expert-arena load --numa node:N`), read from each node's CPUs (taskset to the node's
# cpulist: no numactl needed) by the moe-engine: its CPU expert reads (random experts, the CPU
# kernels) and, with a GPU, its host-to-device copies of the experts through the registered
# arena. Prints one table row per (memory node, CPU node). On a one-node host it says so and
# measures the one node.
#
#   bench/numa_bench.sh [MiB] [tokens] [gpu]     (default 1024 MiB, 64 tokens, gpu "none";
#                                                 e.g. "cuda:0" on a GPU host)
#
# The arenas live in /dev/shm (one at a time, removed after each node) and the model in /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
mib=${1:-1024}
tokens=${2:-64}
gpu=${3:-none}
bin=${EXPERT_ARENA_BIN_DIR:-build/bin}
for t in expert-arena moe-engine; do
  [[ -x $bin/$t ]] || { echo "build first: $bin/$t" >&2; exit 2; }
done
command -v taskset >/dev/null || { echo "needs taskset (util-linux)" >&2; exit 2; }

work=$(mktemp -d /tmp/ea-numa-bench-XXXXXX)
arena=/dev/shm/ea-numa-bench-$$.arena
trap 'rm -f "$arena"; rm -rf "$work"' EXIT

# "0-3,8" -> "0 1 2 3 8"
expand() {
  local part out=()
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    [[ -z $part ]] && continue
    if [[ $part == *-* ]]; then out+=($(seq "${part%-*}" "${part#*-}")); else out+=("$part"); fi
  done
  echo "${out[@]}"
}
nodes=$(expand "$(cat /sys/devices/system/node/has_memory 2>/dev/null || echo 0)")
cpu_nodes=()
for n in $nodes; do
  [[ -s /sys/devices/system/node/node$n/cpulist ]] && cpu_nodes+=("$n")
done
count=$(wc -w <<<"$nodes")
if ((count <= 1)); then
  echo "numa_bench: one memory node on this host (node $nodes): nothing to compare across" \
    "nodes; measuring the one node"
fi

# Experts of 3 x 2048 x 1024 f16 (12 MiB): layers x 32 experts make about `mib` MiB.
layers=$(( (mib + 32 * 12 - 1) / (32 * 12) ))
model=$work/m.gguf
"$bin/expert-arena" gen-model --format gguf --out "$model" --layers "$layers" --experts 32 \
  --hidden 2048 --ffn 1024 --dtype f16 >/dev/null
cat "$model" >/dev/null

echo "numa_bench: $(uname -r), nodes $nodes, model $(( $(stat -c %s "$model") >> 20 )) MiB, $tokens tokens, gpu $gpu, $(date -u +%F)"
echo
echo "| arena on node | CPUs of node | on the node | expert reads s | host-to-device GB/s |"
echo "|---|---|---|---|---|"
for mem in $nodes; do
  load=$("$bin/expert-arena" load --model "$model" --arena "$arena" --numa "node:$mem" --json \
    2>"$work/load.err") || { cat "$work/load.err" >&2; exit 1; }
  for cpu in "${cpu_nodes[@]}"; do
    cpus=$(cat /sys/devices/system/node/node$cpu/cpulist)
    engine=$(taskset -c "$cpus" "$bin/moe-engine" --model "$model" --shared-expert-arena "$arena" \
      --tokens "$tokens" --gpu "$gpu" --json 2>"$work/err") ||
      { echo "| $mem | $cpu | failed: $(tail -1 "$work/err") | | |"; continue; }
    python3 - "$mem" "$cpu" "$load" "$engine" <<'PY'
import json, sys
mem, cpu, l, e = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
nodes = {n["node"]: n["bytes"] for n in (l.get("numa") or {}).get("nodes", [])}
total = sum(nodes.values())
share = "%.0f%%" % (100.0 * nodes.get(int(mem), 0) / total) if total else "(one node)"
h2d = ("%.1f" % (e["gpu_copied_bytes"] / e["gpu_copy_seconds"] / 1e9)
       if e.get("gpu_copy_seconds") else "no GPU")
print("| %s | %s | %s | %.3f | %s |" % (mem, cpu, share, e["compute_seconds"], h2d))
PY
  done
  "$bin/expert-arena" rm "$arena" >/dev/null
done
