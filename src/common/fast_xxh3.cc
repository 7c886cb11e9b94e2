#include "common/fast_xxh3.h"

#include "common/fast_xxh3_build.h"

namespace expert_arena {

const Xxh3Build& ChosenXxh3Build() {
  static const Xxh3Build& build = []() -> const Xxh3Build& {
#if defined(EXPERT_ARENA_XXH3_X86_BUILDS)
    if (__builtin_cpu_supports("avx512f")) return Xxh3Avx512Build();
    if (__builtin_cpu_supports("avx2")) return Xxh3Avx2Build();
#endif
    return Xxh3LibraryBuild();
  }();
  return build;
}

FastXxh3State* FastXxh3Create() { return static_cast<FastXxh3State*>(ChosenXxh3Build().create()); }

void FastXxh3Free(FastXxh3State* state) { ChosenXxh3Build().free(state); }

void FastXxh3Reset(FastXxh3State* state) { ChosenXxh3Build().reset(state); }

void FastXxh3Update(FastXxh3State* state, const void* data, size_t bytes) {
  ChosenXxh3Build().update(state, data, bytes);
}

uint64_t FastXxh3Digest(const FastXxh3State* state) { return ChosenXxh3Build().digest(state); }

uint64_t FastXxh3(const void* data, size_t bytes) {
  return ChosenXxh3Build().one_shot(data, bytes);
}

const char* FastXxh3Variant() { return ChosenXxh3Build().name; }

}  // namespace expert_arena
