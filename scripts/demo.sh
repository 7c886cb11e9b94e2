#!/usr/bin/env bash
# The main job: two moe-engine processes start at once on one shared expert arena in
# /dev/shm. One loads the model's experts, the other waits and attaches without reading
# them; both route the same tokens through the experts and print the same checksum, while
# the arena is in RAM once. Installs what is missing and builds on first use.
# Leaves only the arena file it names (remove it with: build/bin/expert-arena rm PATH).
#
#   scripts/demo.sh [--arena PATH] [--layers L] [--experts E] [--hidden H] [--ffn F]
#                   [--dtype f32|f16|bf16|q8_0] [--tokens N]
#
# The default model is 8 layers x 16 experts of hidden 768, ffn 2048 in f16: 1.1 GiB of
# experts, generated into a temporary directory that is deleted at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

arena=/dev/shm/expert-arena-demo.arena
layers=8 experts=16 hidden=768 ffn=2048 dtype=f16 tokens=16
usage="usage: scripts/demo.sh [--arena PATH] [--layers L] [--experts E] [--hidden H] [--ffn F] [--dtype f32|f16|bf16|q8_0] [--tokens N]"
while (($#)); do
  case $1 in
    --arena) arena=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --experts) experts=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --ffn) ffn=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done

# The shared library too: the Python and C lines of the docs load build/lib/libexpert_arena.so.
# A first configure makes warnings not errors (they are in CI and in a developer's preset
# build): a newer compiler's new warning must not stop a demo. An existing build/ keeps its
# configuration.
# The Python package too (target expert_arena_python, into build/python), when the configure
# found what it needs (pybind11, NumPy, Python's headers): the docs' Python lines use it.
python_module() { compgen -G 'build/python/expert_arena/_core*.so' >/dev/null; }
if [[ ! -x build/bin/expert-arena || ! -x build/bin/moe-engine || ! -e build/lib/libexpert_arena.so ]] ||
   { [[ -d build/python/CMakeFiles/expert_arena_python.dir ]] && ! python_module; }
then
  bash scripts/install-deps.sh
  [[ -f build/CMakeCache.txt ]] || cmake --preset default -DEXPERT_ARENA_WERROR=OFF >/dev/null
  targets=(expert-arena moe-engine expert_arena)
  [[ -d build/python/CMakeFiles/expert_arena_python.dir ]] && targets+=(expert_arena_python)
  cmake --build --preset default -j2 --target "${targets[@]}"
fi
bin=build/bin

work=$(mktemp -d /tmp/expert-arena-demo-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s.%N)
model=$work/model.gguf
"$bin/expert-arena" gen-model --format gguf --out "$model" --layers "$layers" \
  --experts "$experts" --hidden "$hidden" --ffn "$ffn" --dtype "$dtype" --seed 1
"$bin/expert-arena" rm "$arena" >/dev/null 2>&1 || true   # a fresh start (refused if in use)

# Both engines at once. --hold keeps each one mapped after it reports, so the second report
# is taken while the first engine still shares the arena; SIGTERM ends them.
for i in 1 2; do
  "$bin/moe-engine" --model "$model" --shared-expert-arena "$arena" --tokens "$tokens" \
    --json --hold > "$work/engine$i.json" 2> "$work/engine$i.log" &
  pids+=($!)
done
for i in 1 2; do
  for _ in $(seq 1 1200); do
    [[ -s "$work/engine$i.json" ]] && break
    kill -0 "${pids[$((i - 1))]}" 2>/dev/null || break
    sleep 0.1
  done
done
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
pids=()
cat "$work/engine1.log" "$work/engine2.log"
if ((status)) || [[ ! -s "$work/engine1.json" || ! -s "$work/engine2.json" ]]; then
  echo "demo: an engine failed (see above)" >&2
  exit 1
fi

python3 - "$work/engine1.json" "$work/engine2.json" "$(date +%s.%N)" "$start" <<'PY'
import json, sys
rows = [json.load(open(p)) for p in sys.argv[1:3]]
mib = lambda b: "%.0f MiB" % (b / 2**20) if b >= 2**20 else "%.0f KiB" % (b / 2**10)
r0 = rows[0]
print("\nmodel: %d layers x %d experts, hidden %d, ffn %d, %s: %.2f GiB of experts; "
      "%d tokens, top-%d"
      % (r0["layers"], r0["experts"], r0["hidden"], r0["ffn"], r0["dtype"],
         r0["tensor_bytes"] / 2**30, r0["tokens"], r0["top_k"]))
cols = [("engine", lambda i, r: str(i)), ("role", lambda i, r: r["role"]),
        ("open s", lambda i, r: "%.3f" % r["seconds"]),
        ("compute s", lambda i, r: "%.2f" % r["compute_seconds"]),
        ("bytes read", lambda i, r: mib(r["bytes_read"])),
        ("RSS", lambda i, r: mib(r["rss_bytes"])),
        ("of it shared", lambda i, r: mib(r["shared_bytes"])),
        ("2 MiB pages", lambda i, r: "%.0f%%" % (100 * r["huge_bytes"] / max(1, r["mapped_bytes"]))),
        ("checksum", lambda i, r: r["checksum"])]
table = [[c[0] for c in cols]] + [[c[1](i, r) for c in cols] for i, r in enumerate(rows, 1)]
widths = [max(len(row[k]) for row in table) for k in range(len(cols))]
for row in table:
    print("  ".join(v.rjust(w) if k not in (1,) else v.ljust(w)
                    for k, (v, w) in enumerate(zip(row, widths))))
same = rows[0]["checksum"] == rows[1]["checksum"]
private = sum(r["rss_bytes"] - r["arena_rss_bytes"] for r in rows)
print("\nchecksums %s; the two engines hold %s of their own plus one %s arena "
      "(two private engines would hold two copies); %.1f s in all"
      % ("identical" if same else "DIFFER", mib(private), mib(rows[0]["arena_rss_bytes"]),
         float(sys.argv[3]) - float(sys.argv[4])))
sys.exit(0 if same and {r["role"] for r in rows} == {"loaded", "attached"} else 1)
PY
echo "arena left in place for the next engine: $arena  (remove: $bin/expert-arena rm $arena)"
