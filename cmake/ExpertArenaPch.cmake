# Precompiled headers for the build's own targets: spdlog (with fmt), nlohmann-json, GoogleTest,
# CLI11 and pybind11 take seconds to parse in every file that includes them, more than many of
# our files take to compile (docs/building.md, "CI time"). A header is precompiled once per
# target kind and reused; the code compiled is the same. A file must still include what it
# uses: the ThreadSanitizer preset (a CI step: the library, the CLI and the threaded tests) sets
# EXPERT_ARENA_PCH=OFF, which fails on a missing include that a precompiled header would hide.
option(EXPERT_ARENA_PCH "Precompile the third-party headers our files include most" ON)

# The standard headers most of our files include.
set(EXPERT_ARENA_PCH_STD <algorithm> <atomic> <chrono> <cstdint> <cstring> <functional>
    <map> <memory> <mutex> <optional> <span> <string> <string_view> <thread> <vector>)

# expert_arena_pch(TARGET header...): TARGET precompiles the standard set and these headers.
function(expert_arena_pch target)
  if(EXPERT_ARENA_PCH)
    # (C++ targets only: a C file in TARGET would be given these headers too.)
    target_precompile_headers(${target} PRIVATE ${EXPERT_ARENA_PCH_STD} ${ARGN})
  endif()
endfunction()

# expert_arena_pch_reuse(TARGET FROM): TARGET uses FROM's precompiled header (the same compile
# options: a test uses the test library's).
function(expert_arena_pch_reuse target from)
  if(EXPERT_ARENA_PCH)
    target_precompile_headers(${target} REUSE_FROM ${from})
  endif()
endfunction()
