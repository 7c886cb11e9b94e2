// The AVX-512 build of the library's XXH3 (this file alone is compiled with -mavx512f).
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX512
#define EA_XXH3_BUILD_FUNCTION Xxh3Avx512Build
#define EA_XXH3_BUILD_NAME "avx512"
#include "common/fast_xxh3_build.inc"
