#include "load/fast_xxh3.h"

#include <xxhash.h>

namespace expert_arena::load {

namespace avx2 {
void* Create();
void Free(void* s);
void Reset(void* s);
void Update(void* s, const void* data, size_t bytes);
unsigned long long Digest(const void* s);
unsigned long long OneShot(const void* data, size_t bytes);
}  // namespace avx2

namespace {

bool UseAvx2() {
  static const bool use = __builtin_cpu_supports("avx2");
  return use;
}

}  // namespace

FastXxh3State* FastXxh3Create() {
  return static_cast<FastXxh3State*>(UseAvx2() ? avx2::Create()
                                               : static_cast<void*>(XXH3_createState()));
}

void FastXxh3Free(FastXxh3State* state) {
  if (UseAvx2()) {
    avx2::Free(state);
  } else {
    XXH3_freeState(reinterpret_cast<XXH3_state_t*>(state));
  }
}

void FastXxh3Reset(FastXxh3State* state) {
  if (UseAvx2()) {
    avx2::Reset(state);
  } else {
    XXH3_64bits_reset(reinterpret_cast<XXH3_state_t*>(state));
  }
}

void FastXxh3Update(FastXxh3State* state, const void* data, size_t bytes) {
  if (UseAvx2()) {
    avx2::Update(state, data, bytes);
  } else {
    XXH3_64bits_update(reinterpret_cast<XXH3_state_t*>(state), data, bytes);
  }
}

uint64_t FastXxh3Digest(const FastXxh3State* state) {
  return UseAvx2() ? avx2::Digest(state)
                   : XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state));
}

uint64_t FastXxh3(const void* data, size_t bytes) {
  return UseAvx2() ? avx2::OneShot(data, bytes) : XXH3_64bits(data, bytes);
}

const char* FastXxh3Variant() { return UseAvx2() ? "avx2" : "sse2"; }

}  // namespace expert_arena::load
