#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer (the "fuzz" preset: clang, ASan, UBSan) and fuzzes
# each one for a bounded time, one target per core at a time, starting from a copy of the checked-in
# seed corpus (the repository is not modified). Exit status 1 on any crash, leak, UB, timeout
# or out-of-memory; the input that caused it is kept under build-fuzz/fuzz-artifacts/ and its
# path printed.
#
#   tests/fuzz/run_fuzz.sh [SECONDS_PER_TARGET]     (default 20)
#   EA_FUZZ_TARGETS="gguf descriptor" tests/fuzz/run_fuzz.sh 60
#
# Without clang++ and libFuzzer (Debian: clang libclang-rt-14-dev) it says so and exits 0,
# except in CI (CI=true), where that is a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=${1:-20}
jobs=${EXPERT_ARENA_JOBS:-2}
read -r -a targets <<<"${EA_FUZZ_TARGETS:-gguf safetensors safetensors_index safetensors_sharded arena_header arena_table descriptor segment_header front_door front_door_client descriptor_signed}"

# libFuzzer present? Link an empty target (the linker's temporaries go and come back).
if ! command -v clang++ >/dev/null ||
   ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
     clang++ -fsanitize=fuzzer -x c++ - -o /dev/null 2>/dev/null; then
  if [[ "${CI:-}" == "true" ]]; then
    echo "run_fuzz: clang++ with libFuzzer is missing (install clang libclang-rt-14-dev)" >&2
    exit 1
  fi
  echo "run_fuzz: skipped: no clang++ with libFuzzer (Debian: clang libclang-rt-14-dev)"
  exit 0
fi

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j"$jobs"

work=$(mktemp -d "${TMPDIR:-/tmp}/ea-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
artifacts=build-fuzz/fuzz-artifacts
# One target per core at a time (EXPERT_ARENA_JOBS): each still gets SECONDS of its own.
fuzz_one() {
  local target=$1 corpus=$work/$1 log=$work/$1.log status=0
  mkdir -p "$corpus" "$artifacts/$target"
  cp tests/fuzz/corpus/"$target"/* "$corpus"/
  # detect_leaks: a reader that leaks on some input fails like a crash. -timeout: a hang.
  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    nice build-fuzz/bin/fuzz_"$target" -max_total_time="$seconds" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/$target/" \
      "$corpus" >"$log" 2>&1 || status=$?
  echo "$status" >"$work/$target.status"
}
report_one() {
  local target=$1 log=$work/$1.log status
  status=$(cat "$work/$target.status")
  local done_line runs cov
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' <<<"$done_line" || true)
  if ((status != 0)); then
    failed=1
    echo "fuzz_$target: FAILED (exit $status); last lines of its log:"
    tail -n 40 "$log"
    grep -E 'Test unit written to|artifact' "$log" | sed 's/^/  input: /' || true
  else
    echo "fuzz_$target: ok, ${seconds} s, ${runs:-?} runs ($(( ${runs:-0} / seconds ))/s), ${cov:-cov ?}," \
         "corpus $(ls "$work/$target" | wc -l) inputs"
  fi
}
running=0
for target in "${targets[@]}"; do
  if ((running >= jobs)); then
    wait -n
    running=$((running - 1))
  fi
  fuzz_one "$target" &
  running=$((running + 1))
done
wait
failed=0
for target in "${targets[@]}"; do report_one "$target"; done
if ((failed)); then
  echo "run_fuzz: failures; crashing inputs are under $artifacts/ (add minimized ones to" \
       "tests/fuzz/corpus/<target>/ with a regression test)" >&2
  exit 1
fi
echo "run_fuzz: all ${#targets[@]} targets ran ${seconds} s each without a failure"
