// One build of the library's XXH3 code, compiled with its own vector instruction flags, as a
// table of functions (fast_xxh3.cc picks one for the CPU). Each build lives in its own
// translation unit (fast_xxh3_<name>.cc, made from fast_xxh3_build.inc) so that no inline
// function compiled for AVX2 or AVX-512 can be picked by the linker for another file.
#pragma once

#include <cstddef>

namespace expert_arena {

struct Xxh3Build {
  const char* name;
  void* (*create)();
  void (*free)(void*);
  void (*reset)(void*);
  void (*update)(void*, const void*, size_t);
  unsigned long long (*digest)(const void*);
  unsigned long long (*one_shot)(const void*, size_t);
};

// The build FastXxh3* run on this CPU (fast_xxh3.h), chosen once.
const Xxh3Build& ChosenXxh3Build();

// libxxhash as Debian builds it (SSE2 on x86-64), called through its shared library.
const Xxh3Build& Xxh3LibraryBuild();
// x86-64 only (built and called where EXPERT_ARENA_XXH3_X86_BUILDS is defined).
const Xxh3Build& Xxh3Avx2Build();    // fast_xxh3_avx2.cc, -mavx2
const Xxh3Build& Xxh3Avx512Build();  // fast_xxh3_avx512.cc, -mavx512f

}  // namespace expert_arena
