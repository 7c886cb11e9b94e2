#!/usr/bin/env bash
# one_core.sh LIBRARY [CONSUMER...]
# LIBRARY (libexpert_arena.so, what ships) must export only its two version nodes: the C API
# (ea_*, EXPERT_ARENA_0) and the expert_arena namespace (EXPERT_ARENA_INTERNAL), and none of
# the generators, the GGUF / safetensors writers or the test hooks (tools/generators,
# tests/hooks): its fault-injection points are undefined weak references only.
# Each CONSUMER (the Python module, the UCX plugin, the network process, the tools) must link
# LIBRARY dynamically and carry no copy of the core (docs/building.md, "How the pieces link").
set -euo pipefail
lib=$1
shift
status=0
fail() {
  echo "FAIL: $*"
  status=1
}

# Demangled names, without the address, the type letter and the @@VERSION suffix.
defined=$(nm -D --defined-only -C "$lib" | awk '{ $1 = ""; $2 = ""; sub(/^  /, ""); print }' |
  sed 's/@@*[A-Z_0-9]*$//')
grep -q '^ea_arena_open$' <<<"$defined" || fail "$lib: nm -D shows no ea_arena_open (nm broken?)"
grep -q '^expert_arena::remote::ThisCoreIdentity()$' <<<"$defined" ||
  fail "$lib: does not export the internal interface (expert_arena::remote::ThisCoreIdentity)"
shipped_test_code=$(grep -E 'Synthetic|LayoutGguf|ApplyLayoutDefaults|GgufWriter|SafetensorsWriter|WriteSafetensors|WriteTensorFile|FloatToHalf|FloatToBFloat16|FloatToE4M3|test_hooks|expert_arena_fault_' <<<"$defined" || true)
if [[ -n $shipped_test_code ]]; then
  fail "$lib exports generator, writer or test-hook code: $(tr '\n' ' ' <<<"$shipped_test_code")"
else
  echo "ok: $lib exports no generator, writer or test-hook symbol"
fi
weak=$(nm -D "$lib" | awk '$1 == "w" && $2 ~ /^expert_arena_fault_/ { print $2 }' | sort | tr '\n' ' ')
if [[ $weak != "expert_arena_fault_after_remove_opened expert_arena_fault_before_page_piece expert_arena_fault_before_publish expert_arena_fault_plan_made expert_arena_fault_ring_submit " ]]; then
  fail "$lib: the fault-injection points are not five undefined weak references: $weak"
else
  echo "ok: $lib has its fault-injection points as undefined weak references"
fi
# Every defined dynamic symbol is in one of the two version nodes (nothing of spdlog, simdjson,
# xxhash, nlohmann-json or std:: leaves the library unversioned).
other=$(readelf --dyn-syms -W "$lib" |
  awk '$1 ~ /^[0-9]+:$/ && $5 != "LOCAL" && $7 != "UND" && NF >= 8 { print $8 }' |
  grep -v -E '@@?EXPERT_ARENA_(0|INTERNAL)$' | grep -v -E '^EXPERT_ARENA_(0|INTERNAL)$' || true)
if [[ -n $other ]]; then
  fail "$lib exports symbols outside its version nodes: $(head -5 <<<"$other" | tr '\n' ' ')"
else
  echo "ok: $lib exports only EXPERT_ARENA_0 (C API) and EXPERT_ARENA_INTERNAL symbols"
fi
c_outside=$(readelf --dyn-syms -W "$lib" |
  awk '$1 ~ /^[0-9]+:$/ && $7 != "UND" && $8 ~ /@@EXPERT_ARENA_0$/ && $8 !~ /^ea_/ { print $8 }')
[[ -z $c_outside ]] || fail "$lib: EXPERT_ARENA_0 holds more than ea_*: $c_outside"

soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
for f in "$@"; do
  if ! readelf -d "$f" | grep -q "(NEEDED).*\[$soname\]"; then
    fail "$f does not link $soname"
    continue
  fi
  # A static copy of the core would define these (as local symbols, nm without -D).
  copy=$(nm -C "$f" 2>/dev/null | grep -E ' [TtWwDdBb] expert_arena::(remote::ThisCoreIdentity|stream::ForkRegistryAddress|gpu::PinBudgetAddress|platform::Kernel)\(\)$' || true)
  if [[ -n $copy ]]; then
    fail "$f carries a copy of the core: $(tr '\n' ' ' <<<"$copy")"
  else
    echo "ok: $f links $soname and carries no copy of the core"
  fi
done
exit $status
