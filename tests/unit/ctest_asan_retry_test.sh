#!/usr/bin/env bash
# ctest_asan_retry_test.sh SOURCE_DIR
#
# scripts/ctest-asan.sh reruns the ASan tests only when each failed test passed and then
# LeakSanitizer's own tracer crashed at its exit: its classifier must say "retry" for that
# and "fail" for every other failure, a real leak or test failure above all.
set -euo pipefail
script="$1/scripts/ctest-asan.sh"
dir=$(mktemp -d -t ctest-asan-retry.XXXXXX)
trap 'rm -rf "$dir"' EXIT

# A failed test's block as ctest --output-on-failure prints it: BODY lines after the status.
block() {  # NUMBER NAME BODY...
  local n=$1 name=$2
  shift 2
  echo "        Start $n: $name"
  echo "$n/9 Test #$n: $name ....................***Failed    0.41 sec"
  printf '%s\n' "$@"
}
passed_block() {
  echo "        Start $1: $2"
  echo "$1/9 Test #$1: $2 ....................   Passed    0.20 sec"
}
tracer=("[ RUN      ] A.B" "[       OK ] A.B (335 ms)" "[  PASSED  ] 1 test."
  "Tracer caught signal 11: addr=0x560 pc=0x7f51e6ce80f0 sp=0x7f51dd6fcd10"
  "==6080==LeakSanitizer has encountered a fatal error.")
leak=("[  PASSED  ] 1 test." "==7==ERROR: LeakSanitizer: detected memory leaks"
  "SUMMARY: AddressSanitizer: 64 byte(s) leaked in 1 allocation(s).")
failed=("[  FAILED  ] 1 test, listed below:" "${tracer[@]:3}")
half=("[  PASSED  ] 1 test." "Tracer caught signal 11: addr=0x0 pc=0x1 sp=0x2")
other_signal=("[  PASSED  ] 1 test." "Tracer caught signal 7: addr=0x0 pc=0x1 sp=0x2"
  "==9==LeakSanitizer has encountered a fatal error.")
footer() { echo "89% tests passed, $1 tests failed out of 9"; }

expect() {  # WANT NAME: the classifier's answer for $dir/NAME.log
  local got
  got=$("$script" --classify "$dir/$2.log")
  if [[ "$got" != "$1" ]]; then
    echo "FAIL: $2: classified '$got', want '$1'"
    exit 1
  fi
  echo "ok: $2 -> $got"
}

{ passed_block 1 P.One; block 2 A.B "${tracer[@]}"; passed_block 3 P.Two; footer 1; } \
  >"$dir/tracer_crash.log"
expect retry tracer_crash
{ block 2 A.B "${tracer[@]}"; block 5 C.D "${tracer[@]}"; footer 2; } >"$dir/two_crashes.log"
expect retry two_crashes
{ block 2 A.B "${leak[@]}"; footer 1; } >"$dir/leak.log"
expect fail leak
{ block 2 A.B "${failed[@]}"; footer 1; } >"$dir/test_failed.log"
expect fail test_failed
{ block 2 A.B "${half[@]}"; footer 1; } >"$dir/half_signature.log"
expect fail half_signature
{ block 2 A.B "${other_signal[@]}"; footer 1; } >"$dir/other_signal.log"
expect fail other_signal
{ block 2 A.B "${tracer[@]}"; block 4 E.F "${leak[@]}"; footer 2; } >"$dir/mixed.log"
expect fail mixed
{ block 2 A.B "[ RUN      ] A.B" "${tracer[@]:3}"; footer 1; } >"$dir/crashed_mid_test.log"
expect fail crashed_mid_test
{ block 2 A.B "[  PASSED  ] 1 test." "runtime error: signed integer overflow" \
    "${tracer[@]:3}"; footer 1; } >"$dir/ubsan.log"
expect fail ubsan
{ passed_block 1 P.One; echo "100% tests passed, 0 tests failed out of 9"; } >"$dir/none.log"
expect fail none
