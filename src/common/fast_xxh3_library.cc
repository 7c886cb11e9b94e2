// libxxhash itself (Debian's build: SSE2 on x86-64), for CPUs without AVX2 and other
// architectures.
#define EA_XXH3_BUILD_FUNCTION Xxh3LibraryBuild
#define EA_XXH3_BUILD_NAME "sse2"
#include "common/fast_xxh3_build.inc"
