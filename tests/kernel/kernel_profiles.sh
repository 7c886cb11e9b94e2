#!/usr/bin/env bash
# The kernel floor (docs/kernels.md): a focused set of tests under each profile of
# tools/kernel-profile (linux-4.18, linux-5.15, docker, podman), on /dev/shm, on a
# tmpfs mounted huge=always and on hugetlbfs (and, for the kernels without MADV_COLLAPSE, on a
# tmpfs mounted huge=advise), each asserting what the start line and --json say:
#   - kernel_features_test: the probes see what the profile answers;
#   - two moe-engines, one loading and one attaching: the same checksum, and each start line
#     naming what the kernel lacked (and, on the 2 MiB backings, the whole arena on 2 MiB
#     pages);
#   - the multi-process arena protocol tests (a subset: waiting, a killed loader, eight
#     engines at once, a restart that reads nothing) and the multi-process stream tests;
#   - the Python arena and stream tests (a subset), with arenas and stream segments in the
#     backing's directory.
# Mounts are made here and removed on exit (with vm.nr_hugepages restored), under the lock the
# C++ tests' ScopedMount takes. Needs root and ea-kernel-profile (libseccomp): without them it
# skips, and fails in CI.
#
#   tests/kernel/kernel_profiles.sh [BUILD_DIR]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
bin=$build/bin
runner=$bin/ea-kernel-profile
started=$SECONDS

skip() {
  if [[ "${CI:-}" == "true" ]]; then
    echo "kernel_profiles: FAIL (CI): $*" >&2
    exit 1
  fi
  echo "kernel_profiles: SKIP: $*"
  exit 0
}
fail() {
  echo "kernel_profiles: FAIL: $*" >&2
  exit 1
}

[[ -x $runner ]] || skip "$runner not built (libseccomp-dev missing)"
[[ $(id -u) -eq 0 ]] || skip "needs root to mount tmpfs and hugetlbfs"
for t in moe-engine expert-arena kernel_features_test arena_protocol_test stream_process_test; do
  [[ -x $bin/$t ]] || fail "$bin/$t not built"
done

exec 9>/tmp/expert-arena-test-system.lock
flock 9
work=$(mktemp -d /tmp/ea-kernel-profiles-XXXXXX)
# /dev/shm itself, in a private directory of it (removed on exit).
shm=$(mktemp -d /dev/shm/ea-kernel-profiles-XXXXXX)
nr=/proc/sys/vm/nr_hugepages
saved_nr=$(cat $nr)
mounts=()
cleanup() {
  for m in "${mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
  echo "$saved_nr" >$nr 2>/dev/null || true
  rm -rf "$work" "$shm"
}
trap cleanup EXIT

mkdir -p "$work/shm" "$work/thp" "$work/advise" "$work/hugetlb" "$work/model"
mount -t tmpfs -o size=512m,huge=always,mode=0700 tmpfs "$work/thp" && mounts+=("$work/thp")
mount -t tmpfs -o size=512m,huge=advise,mode=0700 tmpfs "$work/advise" && mounts+=("$work/advise")
echo $((saved_nr + 160)) >$nr
[[ $(cat $nr) -ge $((saved_nr + 160)) ]] || skip "the kernel gave fewer than 160 huge pages"
# Surplus pages another process still uses became persistent ones: grow by what they took.
pool=/sys/kernel/mm/hugepages/hugepages-2048kB
short=$((160 - $(cat $pool/free_hugepages) + $(cat $pool/resv_hugepages)))
if ((short > 0)); then
  echo $(($(cat $nr) + short)) >$nr
  (($(cat $pool/free_hugepages) - $(cat $pool/resv_hugepages) >= 160)) ||
    skip "fewer than 160 huge pages stay free"
fi
mount -t hugetlbfs -o pagesize=2M,size=320m,mode=0700 hugetlbfs "$work/hugetlb" &&
  mounts+=("$work/hugetlb")

model=$work/model/m.gguf
$bin/expert-arena gen-model --format gguf --out "$model" --layers 2 --experts 8 --hidden 512 \
  --ffn 1024 --dtype f16 >/dev/null

# check_json FILE PYTHON-EXPRESSION MESSAGE: the expression over j (the parsed --json) holds.
check_json() {
  /usr/bin/python3 - "$1" "$2" "$3" <<'EOF' || exit 1
import json, sys
j = json.load(open(sys.argv[1]))
if not eval(sys.argv[2]):
    sys.stderr.write("kernel_profiles: FAIL: %s\n  %s\n  kernel: %s\n  huge: %s of %s (%s)\n" % (
        sys.argv[3], sys.argv[2], j.get("kernel"), j.get("huge_bytes"), j.get("mapped_bytes"),
        j.get("huge_note")))
    sys.exit(1)
EOF
}

# engines PROFILE BACKING DIR: one moe-engine loads, a second attaches; same checksum; the
# start lines and --json say what the profile lacks.
engines() {
  local p=$1 b=$2 dir=$3 arena=$3/engines.arena
  local out=$work/$p-$b
  $runner --profile "$p" -- $bin/moe-engine --model "$model" --shared-expert-arena "$arena" \
    --tokens 4 --json >"$out.load.json" 2>"$out.load.err" || {
    cat "$out.load.err"
    fail "$p/$b: the loading engine failed"
  }
  $runner --profile "$p" -- $bin/moe-engine --model "$model" --shared-expert-arena "$arena" \
    --tokens 4 --json >"$out.attach.json" 2>"$out.attach.err" || {
    cat "$out.attach.err"
    fail "$p/$b: the attaching engine failed"
  }
  $bin/expert-arena rm "$arena" >/dev/null
  check_json "$out.load.json" 'j["role"] == "loaded"' "$p/$b: first engine loads"
  check_json "$out.attach.json" 'j["role"] == "attached"' "$p/$b: second engine attaches"
  local c1 c2
  c1=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["checksum"])' "$out.load.json")
  c2=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["checksum"])' "$out.attach.json")
  [[ -n $c1 && $c1 == "$c2" ]] || fail "$p/$b: checksums differ: $c1 vs $c2"
  local line
  line=$(grep -h "expert-arena: loaded" "$out.load.err" || true)
  [[ -n $line ]] || fail "$p/$b: no start line from the loader"
  # What each profile lacks, in the start line and in --json.
  case $p in
    linux-4.18)
      [[ $line == *"lacks (or a seccomp filter refuses) MADV_POPULATE_READ/WRITE (5.14, EINVAL: pages touched from threads"* ]] ||
        fail "$p/$b: start line does not name the missing MADV_POPULATE: $line"
      [[ $line == *"io_uring (5.6, ENOSYS: pread)"* ]] || fail "$p/$b: no io_uring in: $line"
      check_json "$out.load.json" 'j["reader"] == "pread"' "$p/$b: reads with pread" ;;
    linux-5.15)
      [[ $line != *"MADV_POPULATE"* ]] || fail "$p/$b: 5.15 has MADV_POPULATE: $line" ;;
    docker)
      [[ $line == *"io_uring (5.6, EPERM: pread)"* ]] || fail "$p/$b: no io_uring EPERM: $line" ;;
    podman)
      [[ $line == *"io_uring (5.6, ENOSYS: pread)"* ]] || fail "$p/$b: no io_uring ENOSYS: $line" ;;
  esac
  case $p in
    linux-*)
      check_json "$out.attach.json" \
        'any(m["feature"] == "PAGEMAP_SCAN" and m["answer"] == "ENOTTY" and m["used"] for m in j["kernel"]["missing"])' \
        "$p/$b: the attacher read its 2 MiB share from smaps" ;;
    *)
      check_json "$out.attach.json" 'j["kernel"]["note"] == ""' "$p/$b: the attacher missed nothing" ;;
  esac
  # The backings that give 2 MiB pages by themselves do on every kernel; /dev/shm without
  # MADV_COLLAPSE says why not and how to fix it.
  case $b in
    thp | hugetlb)
      for f in "$out.load.json" "$out.attach.json"; do
        check_json "$f" 'j["huge_bytes"] == j["mapped_bytes"] > 0' "$p/$b: wholly on 2 MiB pages"
      done ;;
    advise)
      # The data; the header's first 2 MiB already holds a 4 KiB page (the stub header the
      # loader writes before it maps the file), and only MADV_COLLAPSE could mend that.
      check_json "$out.load.json" 'j["huge_bytes"] >= j["data_bytes"] > 0' \
        "$p/$b: MADV_HUGEPAGE before the first touch gives the data 2 MiB pages"
      check_json "$out.attach.json" 'j["huge_bytes"] >= j["data_bytes"] > 0' \
        "$p/$b: the attacher maps the data on 2 MiB pages" ;;
    shm)
      if [[ $p == linux-4.18 || $p == linux-5.15 ]]; then
        [[ $line == *"lacks MADV_COLLAPSE (6.1+; EINVAL) and this tmpfs is mounted huge=never"*"huge=advise"*"hugetlbfs"* ]] ||
          fail "$p/$b: start line does not say why /dev/shm stays on 4 KiB pages: $line"
        check_json "$out.load.json" 'j["huge_bytes"] == 0' "$p/$b: 4 KiB pages without MADV_COLLAPSE"
      fi ;;
  esac
  echo "  $p/$b: engines loaded and attached, checksum $c1"
}

protocol_filter='ArenaProtocolTest.SecondEngineWaitsWhileTheFirstLoadsThenAttaches:ArenaProtocolTest.RestartAttachesWithoutReadingTheModel:ArenaProtocolTest.LoaderKilledBeforePublishingLeavesTheFileToTheNextEngine:ArenaProtocolTest.EightEnginesAtOnceOnAFreshFileLoadOnce'
# The three Python-peer variants of the batch test take 7 s each; the C++-peer one crosses
# processes the same way in 3 s.
python_filter='open_loads_then_attach or report_says_what_the_kernel_lacked or views_equal_the_model or a_view_outlives_close or busy_when_another or (test_stream and not py-)'
have_python=1
PYTHONPATH=$build/python /usr/bin/python3 -c 'import expert_arena' 2>/dev/null || have_python=0
((have_python)) || [[ "${CI:-}" != "true" ]] || fail "the Python package is not built in $build/python"

# 5.10 and 6.1 are not emulated here: the next step (tests/kernel/qemu_numa.sh) boots Debian's
# real 5.10 and 6.1 and runs the engines on these backings there, and compares what they lack
# with the linux-5.10 and linux-6.1 profiles.
for p in linux-4.18 linux-5.15 docker podman; do
  echo "== profile $p"
  $runner --profile "$p" -- $bin/kernel_features_test --gtest_brief=1 >"$work/$p.features.log" 2>&1 || {
    cat "$work/$p.features.log"
    fail "$p: kernel_features_test"
  }
  backings=(shm thp hugetlb)
  [[ $p == linux-4.18 || $p == linux-5.15 ]] && backings+=(advise)
  for b in "${backings[@]}"; do
    case $b in
      shm) dir=$shm ;;
      *) dir=$work/$b ;;
    esac
    engines "$p" "$b" "$dir"
    # The engines above are what huge=advise is here for.
    [[ $b == advise ]] && continue
    EXPERT_ARENA_TEST_DIR=$dir EXPERT_ARENA_BIN_DIR=$PWD/$bin $runner --profile "$p" -- \
      $bin/arena_protocol_test --gtest_brief=1 --gtest_filter="$protocol_filter" \
      >"$work/$p-$b.protocol.log" 2>&1 || {
      cat "$work/$p-$b.protocol.log"
      fail "$p/$b: arena_protocol_test"
    }
    echo "  $p/$b: arena protocol tests passed ($((SECONDS - started)) s)"
    # Stream segments use the same page backing: the multi-process stream tests too.
    EXPERT_ARENA_TEST_DIR=$dir EXPERT_ARENA_BIN_DIR=$PWD/$bin $runner --profile "$p" -- \
      $bin/stream_process_test --gtest_brief=1 \
      >"$work/$p-$b.stream.log" 2>&1 || {
      cat "$work/$p-$b.stream.log"
      fail "$p/$b: stream_process_test"
    }
    echo "  $p/$b: stream process tests passed"
    # The Python arena and stream tests on every backing under every profile.
    if ((have_python)); then
      EXPERT_ARENA_TEST_DIR=$dir EXPERT_ARENA_BUILD_DIR=$build PYTHONPATH=$build/python \
        $runner --profile "$p" -- /usr/bin/python3 -m pytest -q -p no:cacheprovider \
        tests/python/test_arena.py tests/python/test_stream.py -k "$python_filter" \
        >"$work/$p-$b.python.log" 2>&1 || {
        cat "$work/$p-$b.python.log"
        fail "$p/$b: Python arena and stream tests"
      }
      echo "  $p/$b: Python $(tail -1 "$work/$p-$b.python.log")"
    fi
  done
done
leftover=$(find "$shm" "$work/thp" "$work/advise" "$work/hugetlb" -mindepth 1 2>/dev/null | head -5)
[[ -z $leftover ]] || fail "files left behind: $leftover"
echo "kernel_profiles: passed in $((SECONDS - started)) s"
