#!/usr/bin/env bash
# NUMA placement on Debian's real kernels (docs/numa.md): boots each kernel under QEMU with two
# NUMA nodes (one vCPU and 1 GiB each), the project's built expert-arena and the libraries it
# needs in an initramfs, and checks in the guest where an arena's pages land (read back from
# the loader's /proc/self/numa_maps, as the start line and --json report them):
#   - interleave splits the pages between the nodes within 35-65% (tmpfs and hugetlbfs), and so
#     does auto, the default;
#   - node:0 loaded from node 1's CPU (taskset) puts >= 95% on node 0;
#   - local loaded from node 1's CPU puts >= 95% on node 1 (first touch);
#   - on hugetlbfs the pages come from the per-node pools, and node:1 with too small a pool on
#     node 1 is refused naming node 1 and its free pages;
#   - replicate: an engine on each node's CPU loads its node's replica (the node in the file
#     name), >= 95% local, and a second engine on node 1 attaches to node 1's;
#   - a cpuset limited to node 1 (cgroup v2): interleave lands on node 1 and node:0 is refused;
#   - under Docker's and Podman's seccomp profiles (ea-kernel-profile), where mbind needs
#     CAP_SYS_NICE: auto loads on first touch saying why, interleave is refused naming mbind.
#   - on /dev/shm, a tmpfs mounted huge=always and hugetlbfs: two moe-engines started at once
#     (one loads, one attaches, the same checksum; wholly on 2 MiB pages on the last two); on
#     one of the three a kernel (5.10 /dev/shm, 6.1 huge=always, 6.12 hugetlbfs), a subset of
#     arena_protocol_test's multi-process tests (a waiter, a killed loader) and of
#     stream_process_test's (a round trip, a sweep of a killed producer, a dead consumer's
#     holds);
#   - stream_numa_test: a producer pinned to node 1 puts its segments there (>= 95%), node:0
#     puts them on node 0, interleave splits them.
# Then, on the host, the start line of the same load on /dev/shm and on tmpfs huge=always under
# tools/kernel-profile's linux-5.10 and linux-6.1 profiles is compared with real 5.10's and 6.1's:
# what the kernel lacks and the page counts must agree (docs/kernels.md).
# The guest prints one "EA-CHECK <name> PASS|FAIL <what it saw>" line per check on the serial
# console; this script exits non-zero naming the kernel and each failing check.
#
# Kernels: Debian's linux-image-*-cloud-amd64, fetched with apt-get download into
# ${XDG_CACHE_HOME:-~/.cache}/expert-arena/kernels (once). bookworm (6.1) through the machine's
# own apt lists; bullseye (5.10) and trixie (6.12) through a sources list and apt state of this
# script's own under the cache. EA_QEMU_KERNELS picks them ("bookworm", ...; default "all": the
# three). Each boot is bounded by timeout (EA_QEMU_TIMEOUT seconds, default 300).
#
#   tests/kernel/qemu_numa.sh [BUILD_DIR]      (default: build)
#
# Needs qemu-system-x86_64, busybox (busybox-static), dpkg-deb and apt-get; without them it
# skips, and fails in CI.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
bin=$build/bin
started=$SECONDS
timeout_s=${EA_QEMU_TIMEOUT:-300}
kernels=${EA_QEMU_KERNELS:-all}
[[ $kernels == all ]] && kernels="bullseye bookworm trixie"

skip() {
  if [[ "${CI:-}" == "true" ]]; then
    echo "qemu_numa: FAIL (CI): $*" >&2
    exit 1
  fi
  echo "qemu_numa: SKIP: $*"
  exit 0
}

for tool in qemu-system-x86_64 busybox dpkg-deb apt-get ldd strip; do
  command -v $tool >/dev/null || skip "$tool not found (apt-get install qemu-system-x86 busybox-static)"
done
[[ -x $bin/expert-arena ]] || skip "$bin/expert-arena not built"
busybox_bin=$(command -v busybox)
{ ldd "$busybox_bin" 2>&1 || true; } | grep -q "not a dynamic" ||
  skip "$busybox_bin is not static (busybox-static)"

cache=${XDG_CACHE_HOME:-$HOME/.cache}/expert-arena/kernels
mkdir -p "$cache"
work=$(mktemp -d /tmp/ea-qemu-numa-XXXXXX)
trap 'umount "$work"/host-*/thp 2>/dev/null || true; rm -rf "$work"' EXIT

# ---- the kernels -------------------------------------------------------------------------
# apt-get with this script's own sources list and state for a suite other than the host's.
apt_for() {
  local suite=$1
  local root=$cache/apt-$suite
  mkdir -p "$root/state/lists/partial" "$root/cache/archives/partial" "$root/parts"
  echo "deb http://deb.debian.org/debian $suite main" >"$root/sources.list"
  echo "-o Dir::Etc::sourcelist=$root/sources.list -o Dir::Etc::sourceparts=$root/parts" \
    "-o Dir::State=$root/state -o Dir::State::status=/var/lib/dpkg/status" \
    "-o Dir::Cache=$root/cache -o APT::Get::List-Cleanup=0"
}

# Prints the path of the vmlinuz of `suite`'s cloud kernel, fetching it the first time.
fetch_kernel() {
  local suite=$1 opts="-o APT::Sandbox::User=root"
  local existing
  existing=$(ls "$cache/$suite"/boot/vmlinuz-* 2>/dev/null | head -1 || true)
  if [[ -n $existing ]]; then
    echo "$existing"
    return
  fi
  local host_suite
  host_suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  if [[ $suite != "$host_suite" ]]; then
    opts="$opts $(apt_for "$suite")"
    # shellcheck disable=SC2086
    apt-get $opts update -qq >&2 || return 1
  fi
  local pkg
  # shellcheck disable=SC2086
  pkg=$(apt-cache $opts depends linux-image-cloud-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  [[ -n $pkg ]] || return 1
  # shellcheck disable=SC2086
  (cd "$cache" && apt-get $opts download -qq "$pkg" >&2) || return 1
  mkdir -p "$cache/$suite"
  dpkg-deb -x "$(ls "$cache"/"$pkg"_*.deb | head -1)" "$cache/$suite.tmp"
  mkdir -p "$cache/$suite/boot"
  cp "$cache/$suite.tmp"/boot/vmlinuz-* "$cache/$suite/boot/"
  rm -rf "$cache/$suite.tmp" "$cache"/"$pkg"_*.deb
  ls "$cache/$suite"/boot/vmlinuz-* | head -1
}

# ---- the initramfs -----------------------------------------------------------------------
root=$work/root
mkdir -p "$root"/{bin,sbin,proc,sys,dev,tmp,mnt/huge,lib64,usr/lib}
cp "$busybox_bin" "$root/bin/busybox"
# The console init writes to (the kernel opens it before init runs).
mknod -m 600 "$root/dev/console" c 5 1 2>/dev/null || true
for applet in sh mount umount mkdir cat echo grep sed awk taskset poweroff sleep rm ls head \
  tr cut wc expr seq sort tail find; do
  ln -sf busybox "$root/bin/$applet"
done
strip -o "$root/bin/expert-arena" "$bin/expert-arena"
# Docker's and Podman's seccomp profiles (tools/kernel-profile), for auto's fallback.
profile_bin=""
if [[ -x $bin/ea-kernel-profile ]]; then
  strip -o "$root/bin/ea-kernel-profile" "$bin/ea-kernel-profile"
  profile_bin=$bin/ea-kernel-profile
fi
# The engines, the multi-process protocol and stream tests, and the stream placement test, run
# on each backing in the guest (below).
guest_tests="moe-engine arena_protocol_test stream_process_test stream_numa_test"
guest_bins=()
for t in $guest_tests; do
  [[ -x $bin/$t ]] || skip "$bin/$t not built"
  strip -o "$root/bin/$t" "$bin/$t"
  guest_bins+=("$bin/$t")
done
# The shared libraries they need, where ldd finds them (stripped: the GPU runtimes are large).
ldd "$bin/expert-arena" $profile_bin "${guest_bins[@]}" | awk '/=> \// {print $3} /^\t\/lib64/ {print $1}' | sort -u |
  while read -r lib; do
    dest=$root$(dirname "$lib")
    mkdir -p "$dest"
    strip --strip-unneeded -o "$dest/$(basename "$lib")" "$lib" 2>/dev/null ||
      cp -L "$lib" "$dest/"
  done
# ldd names some by their build-tree path (libcudart of the PyPI wheel): the loader finds them
# through LD_LIBRARY_PATH in the guest.
ld_path=$(ldd "$bin/expert-arena" "${guest_bins[@]}" | awk '/=> \// {print $3}' | xargs -n1 dirname | sort -u | tr '\n' ':')

cat >"$root/init" <<EOF
#!/bin/sh
export PATH=/bin LD_LIBRARY_PATH=${ld_path}
EOF
cat >>"$root/init" <<'EOF'
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/shm /sys/fs/cgroup
mount -t tmpfs -o size=900m tmpfs /dev/shm
ea=/bin/expert-arena
echo "EA-KERNEL $(cat /proc/sys/kernel/osrelease) nodes $(cat /sys/devices/system/node/has_memory 2>/dev/null)"

# "<node0 bytes> <node1 bytes>" from a load's --json (the numa object's nodes).
split() {
  nodes=$(echo "$1" | grep -o '"nodes":\[[^]]*\]')
  n0=$(echo "$nodes" | grep -o '"bytes":[0-9]*,"node":0' | sed 's/"bytes":\([0-9]*\).*/\1/')
  n1=$(echo "$nodes" | grep -o '"bytes":[0-9]*,"node":1' | sed 's/"bytes":\([0-9]*\).*/\1/')
  echo "${n0:-0} ${n1:-0}"
}
# check NAME WANT ARGS...: WANT is "interleave", "node0" or "node1"; ARGS run the load.
check() {
  name=$1 want=$2
  shift 2
  out=$("$@" 2>/tmp/err)
  rc=$?
  set -- $(split "$out")
  total=$(($1 + $2))
  if [ $rc -ne 0 ] || [ $total -eq 0 ]; then
    echo "EA-CHECK $name FAIL rc $rc, nodes '$1 $2': $(cat /tmp/err | tail -3)"
    return
  fi
  p0=$(($1 * 100 / total)) p1=$(($2 * 100 / total))
  case $want in
    interleave) ok=$([ $p0 -ge 35 ] && [ $p0 -le 65 ] && echo 1) ;;
    node0) ok=$([ $p0 -ge 95 ] && echo 1) ;;
    node1) ok=$([ $p1 -ge 95 ] && echo 1) ;;
  esac
  policy=$(echo "$out" | grep -o '"policy":"[^"]*"')
  echo "EA-CHECK $name $([ -n "$ok" ] && echo PASS || echo FAIL) node0 $p0% node1 $p1% of $total bytes ($policy, want $want)"
  [ -n "$ok" ] || echo "EA-LINE $name $(grep 'expert-arena: ' /tmp/err | tail -1)"
}
# refused NAME PATTERN ARGS...: the load must fail with a message matching PATTERN.
refused() {
  name=$1 pattern=$2
  shift 2
  if "$@" >/dev/null 2>/tmp/err; then
    echo "EA-CHECK $name FAIL: loaded, a refusal was expected"
  elif grep -q "$pattern" /tmp/err; then
    echo "EA-CHECK $name PASS refused: $(head -c 300 /tmp/err)"
  else
    echo "EA-CHECK $name FAIL wrong refusal: $(head -c 300 /tmp/err)"
  fi
}

$ea gen-model --format gguf --out /tmp/m.gguf --layers 2 --experts 8 --hidden 512 --ffn 1024 \
  --dtype f16 >/dev/null || echo "EA-CHECK gen-model FAIL"
load() { $ea load --model /tmp/m.gguf --json --arena "$@"; }

for backing in shm huge; do
  if [ $backing = huge ]; then
    for n in 0 1; do
      echo 40 >/sys/devices/system/node/node$n/hugepages/hugepages-2048kB/nr_hugepages
    done
    mount -t hugetlbfs -o pagesize=2M none /mnt/huge || echo "EA-CHECK hugetlbfs-mount FAIL"
    dir=/mnt/huge
  else
    dir=/dev/shm
  fi
  check $backing-interleave interleave load $dir/i.arena --numa interleave
  # The metrics of the directory: the arena's bytes on each node (expert_arena_arena_node_bytes).
  m0=$($ea metrics $dir | grep '^expert_arena_arena_node_bytes{' | grep 'node="0"' | awk '{print $2}')
  m1=$($ea metrics $dir | grep '^expert_arena_arena_node_bytes{' | grep 'node="1"' | awk '{print $2}')
  if [ "${m0:-0}" -gt 0 ] && [ "${m1:-0}" -gt 0 ]; then
    echo "EA-CHECK $backing-metrics-node-bytes PASS node0 $m0 node1 $m1 bytes"
  else
    echo "EA-CHECK $backing-metrics-node-bytes FAIL node0 '${m0}' node1 '${m1}'"
  fi
  rm -f $dir/i.arena
  check $backing-auto interleave load $dir/a.arena
  rm -f $dir/a.arena
  check $backing-interleave-huge-off interleave load $dir/o.arena --numa interleave --huge off
  rm -f $dir/o.arena
  check $backing-interleave-pages-first interleave load $dir/p.arena --numa interleave --pages-first
  rm -f $dir/p.arena
  check $backing-node0-from-cpu1 node0 taskset -c 1 $ea load --model /tmp/m.gguf --json \
    --arena $dir/n0.arena --numa node:0
  rm -f $dir/n0.arena
  check $backing-local-from-cpu1 node1 taskset -c 1 $ea load --model /tmp/m.gguf --json \
    --arena $dir/l.arena --numa local
  rm -f $dir/l.arena
  check $backing-node1-from-cpu0 node1 taskset -c 0 $ea load --model /tmp/m.gguf --json \
    --arena $dir/n1.arena --numa node:1
  rm -f $dir/n1.arena
  # replicate: an engine on each node loads its own node's replica; a second engine on node 1
  # attaches to node 1's.
  check $backing-replicate-cpu0 node0 taskset -c 0 $ea load --model /tmp/m.gguf --json \
    --arena $dir/r.arena --numa replicate
  check $backing-replicate-cpu1 node1 taskset -c 1 $ea load --model /tmp/m.gguf --json \
    --arena $dir/r.arena --numa replicate
  check $backing-replicate-attach-cpu1 node1 taskset -c 1 $ea load --model /tmp/m.gguf --json \
    --arena $dir/r.arena --numa replicate
  if [ -e $dir/r.node0.arena ] && [ -e $dir/r.node1.arena ] && [ ! -e $dir/r.arena ] &&
    echo "$out" | grep -q '"role":"attached"'; then
    echo "EA-CHECK $backing-replicate-files PASS r.node0.arena and r.node1.arena, the third attached"
  else
    echo "EA-CHECK $backing-replicate-files FAIL: $(ls $dir) $(echo "$out" | grep -o '"role":"[a-z]*"')"
  fi
  rm -f $dir/r.node0.arena $dir/r.node1.arena
done
# A container's seccomp profile without CAP_SYS_NICE refuses mbind: auto loads on first touch and
# says why; interleave asked by name is refused naming mbind.
if [ -x /bin/ea-kernel-profile ]; then
  for profile in docker podman; do
    out=$(ea-kernel-profile --profile $profile -- $ea load --model /tmp/m.gguf --json \
      --arena /dev/shm/d.arena 2>/tmp/err)
    if echo "$out" | grep -q '"note":"first touch (--numa auto: mbind interleave'; then
      echo "EA-CHECK $profile-auto-first-touch PASS $(echo "$out" | grep -o '"note":"first touch[^"]*"')"
    else
      echo "EA-CHECK $profile-auto-first-touch FAIL $(echo "$out" | grep -o '"numa":{[^}]*}') $(tail -2 /tmp/err)"
    fi
    rm -f /dev/shm/d.arena
    refused $profile-interleave-refused "mbind interleave to nodes 0-1" ea-kernel-profile \
      --profile $profile -- $ea load --model /tmp/m.gguf --arena /dev/shm/d.arena --numa interleave
    rm -f /dev/shm/d.arena
  done
else
  echo "EA-CHECK seccomp-profiles FAIL: ea-kernel-profile not built"
fi
# A node whose pool cannot hold the arena: refused naming the node and what it has.
echo 4 >/sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages
refused huge-node1-without-room "node 1, which has 8.0 MiB free" load /mnt/huge/r.arena --numa node:1
rm -f /mnt/huge/r.arena
umount /mnt/huge

# A cpuset limited to node 1 (a pod pinned to one socket).
if mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null &&
  echo +cpuset >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
  mkdir /sys/fs/cgroup/pod
  echo 1 >/sys/fs/cgroup/pod/cpuset.cpus
  echo 1 >/sys/fs/cgroup/pod/cpuset.mems
  in_pod() { sh -c 'echo $$ >/sys/fs/cgroup/pod/cgroup.procs && exec "$@"' sh "$@"; }
  check cpuset1-interleave node1 in_pod $ea load --model /tmp/m.gguf --json \
    --arena /dev/shm/c.arena --numa interleave
  rm -f /dev/shm/c.arena
  refused cpuset1-node0 "cpuset's mems are 1" in_pod $ea load --model /tmp/m.gguf \
    --arena /dev/shm/c0.arena --numa node:0
else
  echo "EA-CHECK cpuset FAIL: no cgroup v2 cpuset controller"
fi

# ---- the engines, the arena protocol and the stream tests on the three backings ----------
export EXPERT_ARENA_BIN_DIR=/bin
now() { cut -d' ' -f1 /proc/uptime; }
mkdir -p /mnt/thp
mount -t tmpfs -o size=400m,huge=always tmpfs /mnt/thp || echo "EA-CHECK thp-mount FAIL"
for n in 0 1; do
  echo 80 >/sys/devices/system/node/node$n/hugepages/hugepages-2048kB/nr_hugepages
done
# With a size: a stream producer checks its cap against the filesystem's size, which a
# hugetlbfs mounted without one reports as 0 B.
mount -t hugetlbfs -o pagesize=2M,size=320m none /mnt/huge || echo "EA-CHECK hugetlbfs-mount FAIL"
# The start line of a load on /dev/shm and on tmpfs huge=always, compared on the host with the
# same load under the seccomp profile of this kernel (docs/kernels.md).
for b in shm thp; do
  d=/dev/shm
  [ $b = thp ] && d=/mnt/thp
  out=$($ea load --model /tmp/m.gguf --json --arena $d/s.arena --numa local 2>/tmp/err)
  echo "EA-START $b $(grep 'expert-arena: loaded' /tmp/err | tail -1)"
  echo "EA-JSON $b $out"
  rm -f $d/s.arena
done
# gtest NAME DIR BINARY FILTER: the tests pass with their arenas and segments in DIR.
gtest() {
  name=$1 dir=$2 t=$3 filter=$4
  t0=$(now)
  EXPERT_ARENA_TEST_DIR=$dir /bin/$t --gtest_brief=1 --gtest_filter="$filter" >/tmp/gt 2>&1
  rc=$?
  t1=$(now)
  passed=$(grep -o 'PASSED  \] [0-9]* test' /tmp/gt | grep -o '[0-9]*')
  failed=$(grep '^\[  FAILED  \] [A-Za-z]' /tmp/gt | sed 's/^\[  FAILED  \] //; s/ (.*//' |
    sort -u | tr '\n' ' ')
  if [ $rc -eq 0 ] && [ -n "$passed" ]; then
    echo "EA-CHECK $name PASS $passed tests of $t in $t0-$t1 s of uptime"
  else
    echo "EA-CHECK $name FAIL rc $rc, failed: ${failed:-?}: $(grep -v '^\[' /tmp/gt | tail -4 | tr '\n' ' ')"
  fi
}
# engines NAME DIR: two moe-engines started at once on one arena: one loads, the other
# attaches, the same checksum; on the 2 MiB backings both wholly on 2 MiB pages.
engines() {
  name=$1 dir=$2
  /bin/moe-engine --model /tmp/m.gguf --shared-expert-arena $dir/e.arena --tokens 4 --json \
    >/tmp/e1 2>/tmp/e1.err &
  p1=$!
  /bin/moe-engine --model /tmp/m.gguf --shared-expert-arena $dir/e.arena --tokens 4 --json \
    >/tmp/e2 2>/tmp/e2.err &
  p2=$!
  wait $p1
  r1=$?
  wait $p2
  r2=$?
  $ea rm $dir/e.arena >/dev/null 2>&1
  roles=$(cat /tmp/e1 /tmp/e2 | grep -o '"role":"[a-z]*"' | sort | tr '\n' ' ')
  c1=$(grep -o '"checksum":"[0-9a-f]*"' /tmp/e1)
  c2=$(grep -o '"checksum":"[0-9a-f]*"' /tmp/e2)
  ok=1
  [ $r1 -eq 0 ] && [ $r2 -eq 0 ] || ok=
  [ "$roles" = '"role":"attached" "role":"loaded" ' ] || ok=
  [ -n "$c1" ] && [ "$c1" = "$c2" ] || ok=
  if [ $name != shm ]; then
    for f in /tmp/e1 /tmp/e2; do
      h=$(grep -o '"huge_bytes":[0-9]*' $f | cut -d: -f2)
      m=$(grep -o '"mapped_bytes":[0-9]*' $f | cut -d: -f2)
      [ -n "$h" ] && [ "$h" = "$m" ] && [ "$h" -gt 0 ] || ok=
    done
  fi
  if [ -n "$ok" ]; then
    echo "EA-CHECK $name-two-engines PASS $roles$c1"
  else
    echo "EA-CHECK $name-two-engines FAIL rc $r1 $r2, $roles, $c1 vs $c2: $(tail -2 /tmp/e1.err /tmp/e2.err | tr '\n' ' ')"
  fi
}
protocol='ArenaProtocolTest.SecondEngineWaitsWhileTheFirstLoadsThenAttaches:ArenaProtocolTest.LoaderKilledBeforePublishingLeavesTheFileToTheNextEngine'
streams='StreamProcess.RoundTripThroughAnotherProcess:StreamProcess.SweepRemovesAKilledProducersSegmentsNeverALiveOnes:StreamLease.ADeadConsumersHoldsComeBackALiveOnesStay'
# The engines on every backing; the protocol and stream subsets (tens of seconds each under
# TCG) on one backing a kernel, a different one for each of the three kernels.
case $(cat /proc/sys/kernel/osrelease) in
  5.10.*) tested=shm ;;
  6.1.*) tested=thp ;;
  *) tested=huge ;;
esac
for b in shm thp huge; do
  case $b in
    shm) d=/dev/shm ;;
    thp) d=/mnt/thp ;;
    huge) d=/mnt/huge ;;
  esac
  echo "EA-TIME $b engines from $(now) s of uptime"
  engines $b $d
  [ $b = $tested ] || continue
  gtest $b-arena-protocol $d arena_protocol_test "$protocol"
  gtest $b-stream-process $d stream_process_test "$streams"
done
# A producer's segments on its node (it pins itself to node 1's CPU), node:0, interleave.
gtest stream-numa /dev/shm stream_numa_test '*'
leftover=$(find /dev/shm /mnt/thp /mnt/huge -mindepth 1 | head -3)
[ -z "$leftover" ] || echo "EA-CHECK tests-left-nothing FAIL: $leftover"
echo "EA-DONE"
poweroff -f
EOF
chmod +x "$root/init"
initrd=$work/initrd.cpio
(cd "$root" && find . | "$busybox_bin" cpio -o -H newc >"$initrd" 2>/dev/null)

# ---- boot each kernel --------------------------------------------------------------------
failed=()
for suite in $kernels; do
  if ! vmlinuz=$(fetch_kernel "$suite"); then
    failed+=("$suite: the kernel could not be fetched (apt-get download linux-image-cloud-amd64)")
    continue
  fi
  log=$work/$suite.log
  boot_start=$SECONDS
  timeout "$timeout_s" qemu-system-x86_64 -machine q35 -cpu max -smp 2 -m 2G \
    -object memory-backend-ram,id=m0,size=1G -object memory-backend-ram,id=m1,size=1G \
    -numa node,nodeid=0,cpus=0,memdev=m0 -numa node,nodeid=1,cpus=1,memdev=m1 \
    -kernel "$vmlinuz" -initrd "$initrd" -nographic -no-reboot \
    -append "console=ttyS0 rdinit=/init panic=-1 quiet loglevel=3" >"$log" 2>&1 </dev/null || true
  tr -d '\r' <"$log" | grep -E "^EA-" | sed "s/^/qemu_numa: $suite: /"
  echo "qemu_numa: $suite: boot and checks took $((SECONDS - boot_start)) s"
  if ! grep -q "^EA-DONE" <(tr -d '\r' <"$log"); then
    failed+=("$suite ($(basename "$vmlinuz")): the guest did not finish within ${timeout_s} s; last lines: $(tr -d '\r' <"$log" | tail -5 | tr '\n' ' ')")
  fi
  while read -r line; do
    failed+=("$suite ($(basename "$vmlinuz")): $line")
  done < <(tr -d '\r' <"$log" | grep -E "^EA-CHECK [^ ]+ FAIL" || true)
done

# ---- real kernels against their seccomp profiles -------------------------------------------
# The same load on /dev/shm and on a tmpfs mounted huge=always under tools/kernel-profile's
# linux-5.10 and linux-6.1 on this host, against real 5.10 and 6.1 above: what the kernel
# lacks (feature, answer, fallback, used) and the page counts must agree; timings are not
# compared. Needs root (the mount) and ea-kernel-profile.
compare_profile() {
  local suite=$1 profile=$2 log=$work/$1.log
  [[ -f $log ]] || return 0
  if [[ ! -x $bin/ea-kernel-profile || $(id -u) -ne 0 ]]; then
    echo "qemu_numa: $suite against $profile: not compared (needs root and ea-kernel-profile)"
    return 0
  fi
  local host=$work/host-$profile
  mkdir -p "$host/thp" "$host/model"
  if ! mount -t tmpfs -o size=256m,huge=always,mode=0700 tmpfs "$host/thp"; then
    failed+=("$suite against $profile: could not mount a tmpfs huge=always on $host/thp")
    return 0
  fi
  local shm
  shm=$(mktemp -d /dev/shm/ea-qemu-compare-XXXXXX)
  "$bin/expert-arena" gen-model --format gguf --out "$host/model/m.gguf" --layers 2 --experts 8 \
    --hidden 512 --ffn 1024 --dtype f16 >/dev/null
  local b d
  for b in shm thp; do
    d=$shm
    [[ $b == thp ]] && d=$host/thp
    "$bin/ea-kernel-profile" --profile "$profile" -- "$bin/expert-arena" load \
      --model "$host/model/m.gguf" --json --arena "$d/s.arena" --numa local \
      >"$host/$b.json" 2>"$host/$b.err" || true
    rm -f "$d/s.arena"
    tr -d '\r' <"$log" | sed -n "s/^EA-JSON $b //p" >"$host/$b.guest.json"
    tr -d '\r' <"$log" | sed -n "s/^EA-START $b //p" >"$host/$b.guest.line"
    grep -h 'expert-arena: loaded' "$host/$b.err" | tail -1 >"$host/$b.line" || true
    if ! /usr/bin/python3 - "$host/$b.guest.json" "$host/$b.json" "$suite/$b" "$profile/$b" <<'PY'
import json, sys
def parts(path):
    with open(path) as f:
        j = json.loads(f.read().strip() or "{}")
    missing = sorted("%s %s -> %s%s" % (m["feature"], m["answer"], m["fallback"],
                                         " (used)" if m["used"] else "")
                     for m in j.get("kernel", {}).get("missing", []))
    pages = "%s bytes on 2 MiB pages (data %s bytes)" % (j.get("huge_bytes"), j.get("data_bytes"))
    return missing, pages
real, emulated = parts(sys.argv[1]), parts(sys.argv[2])
same = real == emulated
print("qemu_numa: compare %s (real) and %s (profile): %s" % (
    sys.argv[3], sys.argv[4], "the same" if same else "DIFFERENT"))
for name, (missing, pages) in ((sys.argv[3], real), (sys.argv[4], emulated)):
    print("qemu_numa:   %s lacks: %s; %s" % (name, "; ".join(missing) or "nothing", pages))
sys.exit(0 if same else 1)
PY
    then
      failed+=("$suite: the start line on real $(basename "$(fetch_kernel "$suite")") differs from the $profile profile's on $b")
    fi
    echo "qemu_numa:   real:    $(cat "$host/$b.guest.line")"
    echo "qemu_numa:   profile: $(cat "$host/$b.line")"
  done
  umount "$host/thp"
  rm -rf "$shm"
}
for pair in bullseye:linux-5.10 bookworm:linux-6.1; do
  if [[ " $kernels " == *" ${pair%%:*} "* ]]; then
    compare_profile "${pair%%:*}" "${pair#*:}"
  fi
done

echo "qemu_numa: $((SECONDS - started)) s for kernels: $kernels"
if ((${#failed[@]} > 0)); then
  printf 'qemu_numa: FAIL: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "qemu_numa: PASS"
