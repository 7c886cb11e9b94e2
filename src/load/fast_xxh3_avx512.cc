// The AVX-512 build of XXH3 (this file alone is compiled with -mavx512f; it includes nothing but
// xxhash.h, so no inline function compiled for AVX-512 can be picked for other files).
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX512
#include <xxhash.h>

namespace expert_arena::load::avx512 {

void* Create() { return XXH3_createState(); }
void Free(void* s) { XXH3_freeState(static_cast<XXH3_state_t*>(s)); }
void Reset(void* s) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(s)); }
void Update(void* s, const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(s), data, bytes);
}
unsigned long long Digest(const void* s) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(s));
}
unsigned long long OneShot(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

}  // namespace expert_arena::load::avx512
