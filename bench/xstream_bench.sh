#!/bin/bash
# Cross-host stream round (StreamOptions::listen, docs/cross-host.md) between two "hosts"
# (network namespaces joined by a veth pair, each with its own /dev/shm and sysfs), at
# stream_bench's shapes (32 x 64 KiB, 4 x 2 MiB, 1 x 64 MiB), against ucx_perftest's ucp_am_bw
# and ucp_get at the same message sizes on the same link in the same run. UCX_TLS=tcp. Needs
# root. Holds the machine-wide benchmark lock.
#
#   bench/xstream_bench.sh [--rounds N (20)] [--build-dir build]
set -eu
rounds=20
build=build
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
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
on() { h=$1; shift; nsenter --net=/run/netns/$tag$h --mount="$run/$h.mnt" -- env UCX_TLS=tcp "$@"; }

echo "# xstream_bench: $(date -u +%F), $(nproc) cores, $(uname -r), UCX $(ucx_info -v | sed -n "s/^# Version //p"), UCX_TLS=tcp, $rounds rounds a shape (median)"

mkfifo "$run/descs" "$run/acks"
on b "$bench" consume --fifo "$run" &
pids="$pids $!"
out=$(on a "$bench" produce --listen 10.213.251.1:0 --fifo "$run" --rounds "$rounds")
wait
pids=

perftest() {  # test size iterations -> the Final line's overall bandwidth (MB/s, 2^20 B)
  nsenter --net=/run/netns/${tag}a --mount="$run/a.mnt" -- env UCX_TLS=tcp \
    ucx_perftest -p 13398 >/dev/null 2>&1 &
  pids=$!
  sleep 1
  r=$(on b ucx_perftest 10.213.251.1 -p 13398 -t "$1" -s "$2" -n "$3" 2>&1 || true)
  wait $pids || true
  pids=
  echo "$r" | awk '/Final:/ {print $7}'
}

line() {  # shape size count
  s=$(echo "$out" | /usr/bin/python3 -c "import json,sys; j=[json.loads(l) for l in sys.stdin if l.startswith('{')]; j=[x for x in j if x['shape']=='$1'][0]; print('%.2f ms a round = %.0f MiB/s' % (j['median_round_ms'], j['mib_per_s']))")
  iters=$(( 256 * 1048576 / ($2 * $3) * $3 ))
  [ $iters -lt 64 ] && iters=64
  am=$(perftest ucp_am_bw "$2" "$iters")
  get=$(perftest ucp_get "$2" "$iters")
  echo "$1: stream round $s; ucx_perftest ucp_am_bw $am MiB/s, ucp_get $get MiB/s ($iters x $2 B)"
}
line "32 x 64 KiB" 65536 32
line "4 x 2 MiB" 2097152 4
line "1 x 64 MiB" 67108864 1
