#include "load/fast_xxh3.h"

#include "load/fast_xxh3_build.h"

namespace expert_arena::load {

namespace {

// The build for this CPU, chosen once.
const Xxh3Build& Chosen() {
  static const Xxh3Build& build = []() -> const Xxh3Build& {
#if defined(EXPERT_ARENA_XXH3_X86_BUILDS)
    if (__builtin_cpu_supports("avx512f")) return Xxh3Avx512Build();
    if (__builtin_cpu_supports("avx2")) return Xxh3Avx2Build();
#endif
    return Xxh3LibraryBuild();
  }();
  return build;
}

}  // namespace

FastXxh3State* FastXxh3Create() { return static_cast<FastXxh3State*>(Chosen().create()); }

void FastXxh3Free(FastXxh3State* state) { Chosen().free(state); }

void FastXxh3Reset(FastXxh3State* state) { Chosen().reset(state); }

void FastXxh3Update(FastXxh3State* state, const void* data, size_t bytes) {
  Chosen().update(state, data, bytes);
}

uint64_t FastXxh3Digest(const FastXxh3State* state) { return Chosen().digest(state); }

uint64_t FastXxh3(const void* data, size_t bytes) { return Chosen().one_shot(data, bytes); }

const char* FastXxh3Variant() { return Chosen().name; }

}  // namespace expert_arena::load
