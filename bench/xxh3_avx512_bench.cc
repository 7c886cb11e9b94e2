// The AVX-512 build of the library's XXH3 (this file alone is compiled with -mavx512f), for
// hot_hash_bench only.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX512
#include <xxhash.h>

namespace hot_hash_bench::avx512 {

void* Create() { return XXH3_createState(); }
void Free(void* s) { XXH3_freeState(static_cast<XXH3_state_t*>(s)); }
void Reset(void* s) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(s)); }
void Update(void* s, const void* data, size_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(s), data, bytes);
}
unsigned long long Digest(const void* s) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(s));
}

}  // namespace hot_hash_bench::avx512
