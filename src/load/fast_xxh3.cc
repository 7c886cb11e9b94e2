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

namespace avx512 {
void* Create();
void Free(void* s);
void Reset(void* s);
void Update(void* s, const void* data, size_t bytes);
unsigned long long Digest(const void* s);
unsigned long long OneShot(const void* data, size_t bytes);
}  // namespace avx512

namespace {

// One build of the library's XXH3 code, chosen once for the CPU.
struct Variant {
  const char* name;
  void* (*create)();
  void (*free)(void*);
  void (*reset)(void*);
  void (*update)(void*, const void*, size_t);
  unsigned long long (*digest)(const void*);
  unsigned long long (*one_shot)(const void*, size_t);
};

const Variant& Chosen() {
  static const Variant variant = [] {
    if (__builtin_cpu_supports("avx512f")) {
      return Variant{"avx512",       avx512::Create, avx512::Free,   avx512::Reset,
                     avx512::Update, avx512::Digest, avx512::OneShot};
    }
    if (__builtin_cpu_supports("avx2")) {
      return Variant{"avx2",       avx2::Create, avx2::Free,   avx2::Reset,
                     avx2::Update, avx2::Digest, avx2::OneShot};
    }
    return Variant{"sse2",
                   [] { return static_cast<void*>(XXH3_createState()); },
                   [](void* s) { XXH3_freeState(static_cast<XXH3_state_t*>(s)); },
                   [](void* s) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(s)); },
                   [](void* s, const void* data, size_t bytes) {
                     XXH3_64bits_update(static_cast<XXH3_state_t*>(s), data, bytes);
                   },
                   [](const void* s) -> unsigned long long {
                     return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(s));
                   },
                   [](const void* data, size_t bytes) -> unsigned long long {
                     return XXH3_64bits(data, bytes);
                   }};
  }();
  return variant;
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
