#!/bin/bash
# Peer fill across two "hosts" (network namespaces joined by a veth pair, each with its own
# /dev/shm and sysfs), by each transport of `serve` (am: the server sends the ranges asked
# for; get: the client reads the server's registration), against ucx_perftest on the same link
# in the same run (ucp_get, ucp_am_bw and ucp_put_bw, same message size as the fill's chunks),
# and against a cold load of the same
# model from the disk. Optionally under tc rate limits (tbf: this VM's kernel has no
# sch_netem), to show that the fill tracks the link. Needs root. Holds the machine-wide
# benchmark lock. Writes OUT/peer_fill.tsv (a row per fill) and, with gnuplot, OUT/peer_fill.png.
#
#   bench/peer_fill_bench.sh [--gib N (4)] [--rates "none 10gbit 1gbit"] [--dir DIR (/tmp)]
#                            [--build-dir build] [--runs R (2)] [--out OUT (bench/results)]
#                            [--transport "am get" (both, alternating in each run)]
set -eu
gib=4
rates="none"
dir=/tmp
build=build
runs=2
out=bench/results
transports="am get"
while [ $# -gt 0 ]; do
  case "$1" in
    --gib) gib=$2; shift 2 ;;
    --rates) rates=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --transport) transports=$2; shift 2 ;;
    *) echo "peer_fill_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "peer_fill_bench.sh: needs root (namespaces, drop_caches)" >&2; exit 2; }
tool=$(realpath "$build/bin/expert-arena")
command -v ucx_perftest >/dev/null || { echo "peer_fill_bench.sh: needs ucx_perftest (ucx-utils)" >&2; exit 2; }

mkdir -p "$out"
tsv="$out/peer_fill.tsv"
printf 'link\trun\ttransport\tfill_mib_s\tucp_get_mib_s\tucp_am_bw_mib_s\tucp_put_bw_mib_s\tcold_disk_mib_s\tlink_mib_s\n' >"$tsv"

exec 9>/tmp/expert-arena-bench.lock
flock 9

tag=eab$$
run=/run/$tag
model="$dir/$tag.gguf"
chunk_mib=${EXPERT_ARENA_PEER_CHUNK_MIB:-16}
server=
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null || true
  for h in a b; do
    umount "$run/$h.mnt" 2>/dev/null || true
    ip netns del "$tag$h" 2>/dev/null || true
  done
  umount "$run" 2>/dev/null || true
  rm -rf "$run" "$model"
}
trap cleanup EXIT INT TERM

# Qwen3-30B-A3B-shaped expert layers (hidden 2048, expert ffn 768, 16 experts, bf16): 144 MiB
# of experts a layer.
layers=$(( gib * 1024 / 144 ))
"$tool" gen-model --format gguf --out "$model" --layers "$layers" --experts 16 --hidden 2048 \
  --ffn 768 --dtype bf16 >/dev/null

mkdir -p "$run"
mount --bind "$run" "$run"
mount --make-private "$run"
ip netns add ${tag}a
ip netns add ${tag}b
ip link add ${tag}va type veth peer name ${tag}vb
ip link set ${tag}va netns ${tag}a
ip link set ${tag}vb netns ${tag}b
ip -n ${tag}a addr add 10.213.250.1/24 dev ${tag}va
ip -n ${tag}b addr add 10.213.250.2/24 dev ${tag}vb
for h in a b; do
  ip -n $tag$h link set ${tag}v$h up
  ip -n $tag$h link set lo up
  touch "$run/$h.mnt"
  nsenter --net=/run/netns/$tag$h unshare --mount="$run/$h.mnt" --propagation private \
    sh -c "mount -t tmpfs -o size=$(( gib + 1 ))g tmpfs /dev/shm && umount -l /sys && mount -t sysfs sysfs /sys"
done
on() { h=$1; shift; nsenter --net=/run/netns/$tag$h --mount="$run/$h.mnt" -- env UCX_TLS=tcp "$@"; }
json() { /usr/bin/python3 -c "import json,sys; j=json.loads([l for l in sys.stdin if l.startswith('{')][0]); print($1)"; }

echo "# peer_fill_bench: $(date -u +%F), $(nproc) cores, $(uname -r), UCX $(ucx_info -v | sed -n "s/^# Version //p"), UCX_TLS=tcp, chunk ${chunk_mib} MiB, load average $(cut -d' ' -f1-3 /proc/loadavg)"

# Cold load from the disk on host a (page cache dropped): what a host without a peer does.
sync
echo 3 > /proc/sys/vm/drop_caches
cold=$(on a "$tool" load --model "$model" --arena /dev/shm/bench.arena --json)
data_bytes=$(echo "$cold" | json "j['tensor_bytes']")
mib=$(( data_bytes / 1048576 ))
echo "arena: $mib MiB of experts ($layers layers)"
echo "cold load from disk: $(echo "$cold" | json "'%.2f s, %.0f MiB/s (%s)' % (j['seconds'], j['tensor_bytes']/1048576/j['seconds'], j['reader'])")"
cold_mibs=$(echo "$cold" | json "'%.0f' % (j['tensor_bytes']/1048576/j['seconds'])")

perftest() {  # test iterations -> overall MiB/s of the Final line
  nsenter --net=/run/netns/${tag}a --mount="$run/a.mnt" -- env UCX_TLS=tcp \
    ucx_perftest -p 13399 >/dev/null 2>&1 &
  server=$!
  sleep 1
  out=$(on b ucx_perftest 10.213.250.1 -p 13399 -t "$1" -s $(( chunk_mib * 1048576 )) -n "$2" 2>&1 || true)
  wait $server || true
  echo "$out" | awk '/Final:/ {print $7}'
}

for rate in $rates; do
  if [ "$rate" != none ]; then
    for h in a b; do
      ip netns exec $tag$h tc qdisc replace dev ${tag}v$h root tbf rate "$rate" burst 4mb latency 200ms
    done
  fi
  get=$(perftest ucp_get $(( mib / chunk_mib )))
  am_bw=$(perftest ucp_am_bw $(( mib / chunk_mib )))
  # put over tcp needs the target's worker to progress; ucx_perftest's target does not: at
  # ~26 MiB/s the whole size would take minutes, so 32 messages of the same size.
  put=$(perftest ucp_put_bw 32)
  for r in $(seq "$runs"); do
  for transport in $transports; do
    serve_out=$(mktemp)
    # Not through on(): $! must be the server itself (nsenter and env exec it), so that the
    # TERM below reaches it.
    nsenter --net=/run/netns/${tag}a --mount="$run/a.mnt" -- env UCX_TLS=tcp \
      "$tool" serve /dev/shm/bench.arena --listen 10.213.250.1:0 --token peer-fill-bench --transport "$transport" --json \
      >"$serve_out" 2>/dev/null &
    server=$!
    for i in $(seq 100); do grep -q port "$serve_out" && break; sleep 0.1; done
    port=$(json "j['port']" <"$serve_out")
    fill=$(on b "$tool" load --arena /dev/shm/bench.arena --from-peer 10.213.250.1:$port --token peer-fill-bench --json)
    kill -TERM $server; wait $server || true
    rm -f "$serve_out"
    on b "$tool" verify /dev/shm/bench.arena >/dev/null
    on b "$tool" rm /dev/shm/bench.arena >/dev/null
    echo "link $rate: fill run $r by $(echo "$fill" | json "j['peer_transport']"): $(echo "$fill" | json "'%.2f s in all, fill %.2f s = %.0f MiB/s; peer_bytes %d' % (j['seconds'], j['load_seconds'], j['tensor_bytes']/1048576/j['load_seconds'], j['peer_bytes'])"); ucx_perftest ucp_get $get MiB/s, ucp_am_bw $am_bw MiB/s, ucp_put_bw $put MiB/s; load average $(cut -d' ' -f1 /proc/loadavg)"
    # The link's own rate in MiB/s (tbf counts bits of whole frames), or nothing unlimited.
    case "$rate" in
      none) link_mibs=NaN ;;
      *gbit) link_mibs=$(( ${rate%gbit} * 1000000000 / 8 / 1048576 )) ;;
      *mbit) link_mibs=$(( ${rate%mbit} * 1000000 / 8 / 1048576 )) ;;
      *) link_mibs=NaN ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rate" "$r" "$transport" \
      "$(echo "$fill" | json "'%.0f' % (j['tensor_bytes']/1048576/j['load_seconds'])")" \
      "$get" "$am_bw" "$put" "$cold_mibs" "$link_mibs" >>"$tsv"
  done
  done
  if [ "$rate" != none ]; then
    for h in a b; do ip netns exec $tag$h tc qdisc del dev ${tag}v$h root; done
  fi
done

command -v gnuplot >/dev/null || { echo "peer_fill_bench.sh: no gnuplot (gnuplot-nox); $tsv written" >&2; exit 0; }
gnuplot <<PLOT
set terminal pngcairo size 1100,650 font ",10" noenhanced
set output "$out/peer_fill.png"
set datafile separator "\t"
set title "expert-arena peer fill of a $mib MiB arena between two network namespaces, UCX_TLS=tcp ($(date -u +%Y-%m-%d), $(nproc)-core VM)"
set grid ytics mytics
set key top right
set logscale y
set ylabel "MiB/s (log scale)"
set xlabel "link (tc tbf rate; none = the bare veth pair)"
set style data linespoints
set xtics rotate by 0
plot "$tsv" every ::1 using 0:(stringcolumn(3) eq "am" ? \$4 : NaN):xtic(stringcolumn(1)."/".stringcolumn(2)."/".stringcolumn(3)) pt 7 ps 1.5 lw 2 title "expert-arena load --from-peer, serve --transport am", \
     "" every ::1 using 0:(stringcolumn(3) eq "get" ? \$4 : NaN) pt 9 ps 1.5 lw 2 title "expert-arena load --from-peer, serve --transport get", \
     "" every ::1 using 0:5 pt 5 lw 1 dt 2 title "ucx_perftest ucp_get (same run, same link)", \
     "" every ::1 using 0:6 pt 6 lw 1 dt 2 title "ucx_perftest ucp_am_bw", \
     "" every ::1 using 0:7 pt 4 lw 1 dt 3 title "ucx_perftest ucp_put_bw", \
     "" every ::1 using 0:8 lw 1 dt 4 title "cold load from the disk (page cache dropped)", \
     "" every ::1 using 0:9 pt 2 lw 1 title "link rate"
PLOT
echo "wrote $tsv and $out/peer_fill.png"
