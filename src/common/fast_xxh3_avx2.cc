// The AVX2 build of the library's XXH3 (this file alone is compiled with -mavx2).
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#define EA_XXH3_BUILD_FUNCTION Xxh3Avx2Build
#define EA_XXH3_BUILD_NAME "avx2"
#include "common/fast_xxh3_build.inc"
