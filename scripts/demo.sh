#!/usr/bin/env bash
# The main job on an embedded default: two engines start at once on one shared arena in
# /dev/shm; one loads the model, the other waits and attaches; both print the same checksum.
# Installs what is missing and builds on first use. Leaves only the arena file it names
# (remove it with: build/bin/expert-arena rm PATH).
#
#   scripts/demo.sh [--arena PATH] [--size-mib N]
set -euo pipefail
cd "$(dirname "$0")/.."
arena=/dev/shm/expert-arena-demo.arena
size_mib=1024
while (($#)); do
  case $1 in
    --arena) arena=$2; shift 2 ;;
    --size-mib) size_mib=$2; shift 2 ;;
    *) echo "usage: scripts/demo.sh [--arena PATH] [--size-mib N]" >&2; exit 2 ;;
  esac
done

if [[ ! -x build/bin/expert-arena ]]; then
  bash scripts/install-deps.sh
  cmake --preset default >/dev/null
  cmake --build --preset default -j2 --target expert-arena
fi
bin=build/bin/expert-arena

work=$(mktemp -d /tmp/expert-arena-demo-XXXXXX)
trap 'rm -rf "$work"' EXIT
model=$work/model.bin
head -c $((size_mib * 1024 * 1024)) /dev/urandom > "$model"
"$bin" rm "$arena" >/dev/null 2>&1 || true   # a fresh start (refused if an engine uses it)

"$bin" load --model "$model" --arena "$arena" --json > "$work/a.json" 2> "$work/a.log" &
a=$!
sleep 0.05
"$bin" load --model "$model" --arena "$arena" --json > "$work/b.json" 2> "$work/b.log" &
b=$!
wait $a
wait $b
cat "$work/a.log" "$work/b.log"
sum=$("$bin" info "$arena" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["tensors"][0]["checksum"])')
python3 - "$work/a.json" "$work/b.json" "$sum" <<'PY'
import json, sys
rows = [json.load(open(p)) for p in sys.argv[1:3]]
print(f"{'engine':<8} {'role':<9} {'seconds':>8} {'bytes read':>12} {'2 MiB pages':>12} {'checksum':>18}")
for i, r in enumerate(rows, 1):
    print(f"{i:<8} {r['role']:<9} {r['seconds']:>8.3f} {r['bytes_read']:>12} "
          f"{100*r['huge_bytes']/(r['data_bytes']+2*1024*1024):>11.1f}% {sys.argv[3]:>18}")
PY
"$bin" verify "$arena"
echo "arena left in place for the next engine: $arena  (remove: $bin rm $arena)"
