#!/usr/bin/env bash
# The main job: two moe-engine processes start at once on one shared expert arena in
# /dev/shm. One loads the model's experts, the other waits and attaches without reading
# them; then a third engine starts alone and attaches in milliseconds, as every later engine
# and every restart does. All route the same tokens through the experts and print the same
# checksum, while the arena is in RAM once. Installs what is missing and builds on first use.
#
#   scripts/demo.sh [--arena PATH] [--layers L] [--experts E] [--hidden H] [--ffn F]
#                   [--dtype f32|f16|bf16|q8_0] [--tokens N] [--rm]
#
# The default model is 8 layers x 16 experts of hidden 768, ffn 2048 in f16: 1.1 GiB of
# experts, generated once into ${XDG_CACHE_HOME:-~/.cache}/expert-arena/demo/ and kept there, so
# the arena left in /dev/shm is one the next run (or any engine given that model) attaches to.
# --rm removes the arena at the end instead (the cached model stays; delete the directory to
# free it).
set -euo pipefail
cd "$(dirname "$0")/.."

arena=/dev/shm/expert-arena-demo.arena
layers=8 experts=16 hidden=768 ffn=2048 dtype=f16 tokens=16 remove=0
usage="usage: scripts/demo.sh [--arena PATH] [--layers L] [--experts E] [--hidden H] [--ffn F] [--dtype f32|f16|bf16|q8_0] [--tokens N] [--rm]"
while (($#)); do
  case $1 in
    --arena) arena=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --experts) experts=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --ffn) ffn=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --rm) remove=1; shift ;;
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
  bash scripts/install-deps.sh --for-demo   # Debian's build packages only: no torch, no vLLM
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
# The model is kept: an arena's identity holds its model's path and mtime, so a model made
# anew each run would make the arena of the last run one of "another model", loaded again.
cache=${XDG_CACHE_HOME:-$HOME/.cache}/expert-arena/demo
model=$cache/model-${layers}x${experts}-h${hidden}-f${ffn}-${dtype}.gguf
if [[ -s $model ]]; then
  echo "demo: model $model (cached by an earlier run)"
else
  mkdir -p "$cache"
  "$bin/expert-arena" gen-model --format gguf --out "$work/model.gguf" --layers "$layers" \
    --experts "$experts" --hidden "$hidden" --ffn "$ffn" --dtype "$dtype" --seed 1
  mv "$work/model.gguf" "$model"   # whole or not at all: a killed run leaves no half model
  echo "demo: model cached in $model"
fi

# Waits until engine $1 has written its report (or exited).
wait_report() {
  for _ in $(seq 1 1200); do
    [[ -s "$work/engine$1.json" ]] && return 0
    kill -0 "${pids[$(($1 - 1))]}" 2>/dev/null || return 0
    sleep 0.1
  done
}
# Starts engine $1 in the background.
start_engine() {
  "$bin/moe-engine" --model "$model" --shared-expert-arena "$arena" --tokens "$tokens" \
    --json --hold > "$work/engine$1.json" 2> "$work/engine$1.log" &
  pids+=($!)
}

# Two engines at once. --hold keeps each one mapped after it reports, so the later reports
# are taken while the first engines still share the arena; SIGTERM ends them.
for i in 1 2; do start_engine "$i"; done
for i in 1 2; do wait_report "$i"; done
# The third starts alone once the arena is published: what a restart or a new engine sees.
start_engine 3
wait_report 3
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
pids=()
cat "$work/engine1.log" "$work/engine2.log" "$work/engine3.log"
if ((status)) || [[ ! -s "$work/engine1.json" || ! -s "$work/engine2.json" ||
                    ! -s "$work/engine3.json" ]]; then
  echo "demo: an engine failed (see above)" >&2
  exit 1
fi

python3 - "$work/engine1.json" "$work/engine2.json" "$work/engine3.json" "$(date +%s.%N)" \
  "$start" <<'PY'
import json, sys
rows = [json.load(open(p)) for p in sys.argv[1:4]]
mib = lambda b: "%.0f MiB" % (b / 2**20) if b >= 2**20 else "%.0f KiB" % (b / 2**10)
r0 = rows[0]
print("\nmodel: %d layers x %d experts, hidden %d, ffn %d, %s: %.2f GiB of experts; "
      "%d tokens, top-%d"
      % (r0["layers"], r0["experts"], r0["hidden"], r0["ffn"], r0["dtype"],
         r0["tensor_bytes"] / 2**30, r0["tokens"], r0["top_k"]))
ms = lambda s: "%.0f ms" % (s * 1e3) if s < 10 else "%.1f s" % s
cols = [("engine", lambda i, r: str(i) + (" (alone)" if i == 3 else "")),
        ("role", lambda i, r: r["role"]),
        ("open", lambda i, r: ms(r["seconds"])),
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
same = len({r["checksum"] for r in rows}) == 1
private = sum(r["rss_bytes"] - r["arena_rss_bytes"] for r in rows)
print("\nchecksums %s; the three engines hold %s of their own plus one %s arena "
      "(three private engines would hold three copies); %.1f s in all"
      % ("identical" if same else "DIFFER", mib(private), mib(rows[0]["arena_rss_bytes"]),
         float(sys.argv[4]) - float(sys.argv[5])))
third = rows[2]
print("engine 3, started alone after the pair, %s in %s having read %s of the model (its "
      "header), not %.2f GiB" % (third["role"], ms(third["seconds"]), mib(third["bytes_read"]),
                                 third["tensor_bytes"] / 2**30))
roles = [r["role"] for r in rows]
if roles[:2] == ["attached", "attached"]:
    print("(the arena was published by an earlier run of this model: every engine attached)")
pair_ok = sorted(roles[:2]) in (["attached", "loaded"], ["attached", "attached"])
sys.exit(0 if same and pair_ok and roles[2] == "attached" else 1)
PY
if ((remove)); then
  "$bin/expert-arena" rm "$arena"
  echo "demo: removed the arena (--rm); the model stays cached in $model"
else
  echo "demo: arena left in place: $arena; the next run attaches to it (its model is cached in"
  echo "  $cache). Free it: $bin/expert-arena rm $arena (or run the demo with --rm)"
fi
