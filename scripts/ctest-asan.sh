#!/usr/bin/env bash
# Runs the AddressSanitizer build's tests (ctest --preset asan, leaks checked) and reruns,
# once, the tests whose only failure was LeakSanitizer's own tracer dying at exit.
#
# LeakSanitizer checks for leaks at a process's exit by stopping every thread from a tracer
# process; that tracer sometimes crashes itself ("Tracer caught signal 11 ... LeakSanitizer
# has encountered a fatal error", about one exit in several hundred elsewhere:
# google/sanitizers#1353) after the test passed and before any leak is looked for. A run is
# retried only when every failed test's output has that signature, the test's own
# "[  PASSED  ]" line, and no sanitizer report; anything else fails as it is. The rerun's
# result is final.
#
#   scripts/ctest-asan.sh [CTEST ARGS...]
#   scripts/ctest-asan.sh --classify LOG   prints "retry" or "fail" for a ctest log
set -euo pipefail
cd "$(dirname "$0")/.."

# Reads ctest --output-on-failure output; prints "retry" when there is at least one failed
# test and each one's block is a tracer crash after a passing test, else "fail".
classify() {
  awk '
    function close_block() {
      if (in_failed) {
        failed++
        if (tracer && fatal && passed && !report) retriable++
      }
      in_failed = 0
    }
    /^ *[0-9]+\/[0-9]+ Test +#[0-9]+: / {
      close_block()
      if ($0 ~ /\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout|Not Run/) {
        in_failed = 1; tracer = fatal = passed = report = 0
      }
      next
    }
    /^ +Start +[0-9]+: / { close_block(); next }
    /^[0-9]+% tests passed/ { close_block(); next }
    in_failed && /Tracer caught signal 11/ { tracer = 1 }
    in_failed && /LeakSanitizer has encountered a fatal error/ { fatal = 1 }
    in_failed && /^\[  PASSED  \] / { passed = 1 }
    in_failed && /^\[  FAILED  \]|ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:|SUMMARY: / {
      report = 1
    }
    END {
      close_block()
      print (failed > 0 && retriable == failed) ? "retry" : "fail"
    }' "$1"
}

if [[ "${1:-}" == "--classify" ]]; then
  classify "$2"
  exit 0
fi

log=$(mktemp -t expert-arena-ctest-asan.XXXXXX)
trap 'rm -f "$log"' EXIT
# (Not LSAN_OPTIONS=log_threads=1, which would name the thread the tracer died on: it writes
# into every process's output, and tests read their children's.)
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
rc=0
ctest --preset asan "$@" 2>&1 | tee "$log" || rc=$?
((rc == 0)) && exit 0
if [[ "$(classify "$log")" != retry ]]; then
  exit "$rc"
fi
echo "ctest-asan: every failed test passed and then LeakSanitizer's tracer crashed at its exit" \
  "(google/sanitizers#1353); rerunning those once"
ctest --preset asan --rerun-failed "$@"
