// XXH3-64 for the loader's hashes, the library's own code compiled for AVX-512 or AVX2 when
// the CPU has them.
//
// Debian's libxxhash is an SSE2 build (8-17 GiB/s per core here); the AVX2 code path of the
// same algorithm runs ~1.5x faster, the AVX-512 one ~1.2x faster again on data in L2 (here,
// hot_hash_bench), and on a machine with few cores the hash is what keeps a warm load from
// copy speed. The values are XXH3's, whatever the code path (xxh3 is defined
// by the algorithm, not the instruction set): tests compare with the library's XXH3_64bits.
#pragma once

#include <cstddef>
#include <cstdint>

namespace expert_arena {

// Opaque streaming state.
struct FastXxh3State;

FastXxh3State* FastXxh3Create();
void FastXxh3Free(FastXxh3State* state);
void FastXxh3Reset(FastXxh3State* state);
void FastXxh3Update(FastXxh3State* state, const void* data, size_t bytes);
uint64_t FastXxh3Digest(const FastXxh3State* state);
uint64_t FastXxh3(const void* data, size_t bytes);
// "avx512", "avx2" or "sse2": what the functions above run.
const char* FastXxh3Variant();

}  // namespace expert_arena
