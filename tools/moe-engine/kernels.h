// The arithmetic of moe-engine: weight dtypes, row decoding and matrix-vector products that
// read the weights straight from arena views (no copy, no conversion pass over the model).
//
// Every product sums in one fixed order (eight interleaved partial sums, then a fixed
// reduction), so the same weights and inputs give bit-identical results in every process:
// an engine that loaded the arena, one that attached to it and one on a private arena.
//
// Thread-safety: all functions are pure; Matrix only points at memory the caller keeps alive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace expert_arena::moe {

enum class Dtype { kF32, kF16, kBF16, kQ8_0 };

// "f32"/"F32", "f16"/"F16", "bf16"/"BF16", "q8_0" (GGUF names are lowercase, safetensors
// names uppercase); nullopt for anything else.
std::optional<Dtype> ParseDtype(std::string_view name);
const char* DtypeName(Dtype dtype);

// ggml's q8_0 block: an f16 scale d and 32 int8 quants; value = d * q.
inline constexpr uint64_t kQ8_0BlockValues = 32;
inline constexpr uint64_t kQ8_0BlockBytes = 2 + kQ8_0BlockValues;

// Bytes of one row of `cols` values, or nullopt when `cols` cannot be stored in that dtype
// (q8_0 needs a multiple of 32) or the size overflows.
std::optional<uint64_t> RowBytes(Dtype dtype, uint64_t cols);

float HalfToFloat(uint16_t h);
inline float Bf16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// A row-major matrix of `rows` rows of `cols` values, each row `row_bytes` long.
struct Matrix {
  const std::byte* data = nullptr;
  Dtype dtype = Dtype::kF32;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t row_bytes = 0;
};

// Decodes row `row` of `m` into out[0, m.cols).
void DecodeRow(const Matrix& m, uint64_t row, float* out);

// y[r] = sum_c m[r][c] * x[c] for every row; x has m.cols values, y has m.rows.
void MatVec(const Matrix& m, const float* x, float* y);

// The dot product MatVec uses, exposed for tests: sum of a[i]*b[i] in the fixed order.
float Dot(const float* a, const float* b, uint64_t n);

// x * sigmoid(x).
float Silu(float x);

}  // namespace expert_arena::moe
