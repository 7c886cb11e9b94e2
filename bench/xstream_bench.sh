#!/bin/bash
# Cross-host stream round (StreamOptions::listen, docs/cross-host.md) between two "hosts"
# (network namespaces joined by a veth pair, each with its own /dev/shm and sysfs), at
# stream_bench's shapes (32 x 64 KiB, 4 x 2 MiB, 1 x 64 MiB), against ucx_perftest's ucp_am_bw
# and ucp_get at the same message sizes on the same link in the same run. UCX_TLS=tcp. Needs
# root. Holds the machine-wide benchmark lock.
#
#   bench/xstream_bench.sh [--rounds N (20)] [--runs R (5)] [--build-dir build]
#                          [--against OTHER --pairs P (6)] [--only I]
#
# --against OTHER: a build of another revision (its build folder) run in turns with --build-dir,
# P times each, in the same namespaces, before ucx_perftest; printed: each build's median over
# its runs of every part of the round, and this build's over the other's. --only I: that shape
# alone (0: 32 x 64 KiB, 1: 4 x 2 MiB, 2: 1 x 64 MiB), for a comparison of one shape.
set -eu
rounds=20
build=build
against=
pairs=6
runs=5
only=-1
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --against) against=$2; shift 2 ;;
    --pairs) pairs=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    *) echo "xstream_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "xstream_bench.sh: needs root (namespaces)" >&2; exit 2; }
bench=$(realpath "$build/bin/xstream_bench")
command -v ucx_perftest >/dev/null || { echo "xstream_bench.sh: needs ucx_perftest (ucx-utils)" >&2; exit 2; }

exec 9>/tmp/expert-arena-bench.lock
flock 9

tag=eax$$
run=/run/$tag
pids=
cleanup() {
  for p in $pids; do kill "$p" 2>/dev/null || true; done
  for h in a b; do
    umount "$run/$h.mnt" 2>/dev/null || true
    ip netns del "$tag$h" 2>/dev/null || true
  done
  umount "$run" 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT INT TERM

mkdir -p "$run"
mount --bind "$run" "$run"
mount --make-private "$run"
ip netns add ${tag}a
ip netns add ${tag}b
ip link add ${tag}va type veth peer name ${tag}vb
ip link set ${tag}va netns ${tag}a
ip link set ${tag}vb netns ${tag}b
ip -n ${tag}a addr add 10.213.251.1/24 dev ${tag}va
ip -n ${tag}b addr add 10.213.251.2/24 dev ${tag}vb
for h in a b; do
  ip -n $tag$h link set ${tag}v$h up
  ip -n $tag$h link set lo up
  touch "$run/$h.mnt"
  nsenter --net=/run/netns/$tag$h unshare --mount="$run/$h.mnt" --propagation private \
    sh -c "mount -t tmpfs -o size=2g tmpfs /dev/shm && umount -l /sys && mount -t sysfs sysfs /sys"
done
for i in $(seq 100); do
  ip -n ${tag}a link show ${tag}va | grep -q LOWER_UP && ip -n ${tag}b link show ${tag}vb | grep -q LOWER_UP && break
  sleep 0.1
done
# Each "host" on a core of its own (a: 0, b: the last), as two hosts would be: unpinned, where
# the scheduler put the two sides swung a round by 2x between runs.
core() { [ "$1" = a ] && echo 0 || echo $(( $(nproc) - 1 )); }
on() { h=$1; shift; nsenter --net=/run/netns/$tag$h --mount="$run/$h.mnt" -- taskset -c "$(core $h)" env UCX_TLS=tcp "$@"; }

echo "# xstream_bench: $(date -u '+%F %H:%M') UTC, $(nproc) cores ($(lscpu | sed -n 's/^Model name: *//p' | head -1)), $(uname -r), UCX $(ucx_info -v | sed -n "s/^# Version //p"), UCX_TLS=tcp, $rounds rounds a shape (median), $runs runs"

mkfifo "$run/descs" "$run/acks"
rounds_of() {  # the xstream_bench binary -> its JSON lines
  on b "$1" consume --fifo "$run" &
  pids="$pids $!"
  on a "$1" produce --listen 10.213.251.1:0 --fifo "$run" --rounds "$rounds" --only "$only"
  wait
  pids=
}
if [ -n "$against" ]; then
  other=$(realpath "$against/bin/xstream_bench")
  # In turns, the first of a pair alternating (ABBA): which of two runs went first moved a
  # shape's median by up to 1.6x between two runs of one build.
  for i in $(seq "$pairs"); do
    if [ $((i % 2)) = 1 ]; then
      rounds_of "$bench" | sed 's/^{/{"build": "this", /'
      rounds_of "$other" | sed 's/^{/{"build": "other", /'
    else
      rounds_of "$other" | sed 's/^{/{"build": "other", /'
      rounds_of "$bench" | sed 's/^{/{"build": "this", /'
    fi
  done > "$run/pairs.json"
  /usr/bin/python3 - "$run/pairs.json" "$build" "$against" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("# %s against %s, %d runs each, taking turns (ABBA)" % (sys.argv[2], sys.argv[3], len(runs) // 2 // 3))
for shape in dict.fromkeys(r["shape"] for r in runs):
    med = {}
    for b in ("this", "other"):
        rs = [r for r in runs if r["shape"] == shape and r["build"] == b]
        med[b] = {k: statistics.median(r[k] for r in rs) for k in
                  ("median_round_ms", "median_put_ms", "median_open_ms", "median_release_ms")}
    print("%s: round %.2f / %.2f ms (%.2fx), OpenMany %.2f / %.2f ms (%.2fx), puts %.2f / %.2f ms"
          % (shape, med["this"]["median_round_ms"], med["other"]["median_round_ms"],
             med["other"]["median_round_ms"] / med["this"]["median_round_ms"],
             med["this"]["median_open_ms"], med["other"]["median_open_ms"],
             med["other"]["median_open_ms"] / med["this"]["median_open_ms"],
             med["this"]["median_put_ms"], med["other"]["median_put_ms"]))
    for b in ("this", "other"):
        print("  %s: OpenMany of each run %s ms" % (b, " ".join(
            "%.2f" % r["median_open_ms"] for r in runs if r["shape"] == shape and r["build"] == b)))
PY
  echo "# (ms: this build / the other; Nx: the other's time over this one's, above 1 this is faster)"
fi
perftest() {  # test size iterations -> the Final line's overall bandwidth (MB/s, 2^20 B)
  on a ucx_perftest -p 13398 >/dev/null 2>&1 &
  pids=$!
  sleep 1
  r=$(on b ucx_perftest 10.213.251.1 -p 13398 -t "$1" -s "$2" -n "$3" 2>&1 || true)
  wait $pids || true
  pids=
  echo "$r" | awk '/Final:/ {print $7}'
}

# The stream rounds and ucx_perftest in turns, --runs times: one connection's speed on this
# link swung 2x from one run to the next (both the stream's and ucx_perftest's), so one run of
# each says little; the medians over the runs are compared.
for i in $(seq "$runs"); do
  rounds_of "$bench" > "$run/stream.$i.json"
  for shape in "65536 32" "2097152 4" "67108864 1"; do
    set -- $shape
    iters=$(( 256 * 1048576 / ($1 * $2) * $2 ))
    [ $iters -lt 64 ] && iters=64
    echo "{\"size\": $1, \"am_bw\": $(perftest ucp_am_bw "$1" "$iters")}" > "$run/am.$i.$1.json"
    [ "$i" = 1 ] && echo "{\"size\": $1, \"get\": $(perftest ucp_get "$1" "$iters")}" > "$run/get.$1.json"
  done
done
cat "$run"/stream.*.json | sed 's/^{/{"kind": "stream", /' > "$run/all.json"
cat "$run"/am.*.json "$run"/get.*.json >> "$run/all.json"
/usr/bin/python3 - "$run/all.json" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
shapes = {"32 x 64 KiB": 65536, "4 x 2 MiB": 2097152, "1 x 64 MiB": 67108864}
for shape, size in shapes.items():
    st = [r for r in rows if r.get("kind") == "stream" and r["shape"] == shape]
    am = [r["am_bw"] for r in rows if r.get("size") == size and "am_bw" in r]
    get = [r["get"] for r in rows if r.get("size") == size and "get" in r]
    rnd = statistics.median(r["mib_per_s"] for r in st)
    opn = statistics.median(r["open_mib_per_s"] for r in st)
    amm = statistics.median(am)
    print("%s, %d runs: stream round %.2f ms = %.0f MiB/s (runs %.0f-%.0f), of it puts %.2f ms, "
          "OpenMany %.2f ms = %.0f MiB/s, releases %.2f ms; ucp_am_bw %.0f MiB/s (runs %.0f-%.0f), "
          "ucp_get %s MiB/s; round / am_bw %.2fx, OpenMany / am_bw %.2fx"
          % (shape, len(st), statistics.median(r["median_round_ms"] for r in st), rnd,
             min(r["mib_per_s"] for r in st), max(r["mib_per_s"] for r in st),
             statistics.median(r["median_put_ms"] for r in st),
             statistics.median(r["median_open_ms"] for r in st), opn,
             statistics.median(r["median_release_ms"] for r in st), amm, min(am), max(am),
             "%.0f" % get[0] if get else "?", rnd / amm, opn / amm))
PY
