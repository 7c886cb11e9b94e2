#include "kernels.h"

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace expert_arena::moe {
namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i] >= 'A' && a[i] <= 'Z' ? static_cast<char>(a[i] - 'A' + 'a') : a[i];
    char y = b[i] >= 'A' && b[i] <= 'Z' ? static_cast<char>(b[i] - 'A' + 'a') : b[i];
    if (x != y) return false;
  }
  return true;
}

float HalfToFloatSlow(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {
      // Subnormal half: normalise into a float exponent.
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mantissa & 0x3ffu) << 13;
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | mantissa << 13;  // inf or NaN
  } else {
    bits = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 256 KiB, built once: decoding f16 weights is a table look-up on the hot path.
const std::array<float, 65536>& HalfTable() {
  static const auto* table = [] {
    auto* t = new std::array<float, 65536>;
    for (uint32_t i = 0; i < 65536; ++i) (*t)[i] = HalfToFloatSlow(static_cast<uint16_t>(i));
    return t;
  }();
  return *table;
}

uint16_t Load16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);  // little-endian hosts only, as ggml and safetensors are
  return v;
}

#if defined(__x86_64__)
// F16C converts eight halves per instruction, exactly as the table does (every half is a
// float), so the two paths give the same bits; the table serves CPUs without F16C.
__attribute__((target("avx,f16c"))) void DecodeHalvesF16c(const std::byte* p, uint64_t n,
                                                          float* out) {
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  const auto& table = HalfTable();
  for (; i < n; ++i) out[i] = table[Load16(p + 2 * i)];
}

bool HaveF16c() {
  // F16C is CPUID.1:ECX bit 29, read directly: __builtin_cpu_supports("f16c") is GCC-only
  // (clang 14 refuses the name). "avx" also checks that the OS saves the YMM registers.
  static const bool have = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d) != 0 &&
           (c & bit_F16C) != 0;
  }();
  return have;
}
#endif

}  // namespace

std::optional<Dtype> ParseDtype(std::string_view name) {
  if (EqualsIgnoreCase(name, "f32")) return Dtype::kF32;
  if (EqualsIgnoreCase(name, "f16")) return Dtype::kF16;
  if (EqualsIgnoreCase(name, "bf16")) return Dtype::kBF16;
  if (EqualsIgnoreCase(name, "q8_0")) return Dtype::kQ8_0;
  return std::nullopt;
}

const char* DtypeName(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return "f32";
    case Dtype::kF16:
      return "f16";
    case Dtype::kBF16:
      return "bf16";
    case Dtype::kQ8_0:
      return "q8_0";
  }
  return "unknown";
}

std::optional<uint64_t> RowBytes(Dtype dtype, uint64_t cols) {
  uint64_t unit = 0;
  uint64_t per_unit = 1;
  switch (dtype) {
    case Dtype::kF32:
      unit = 4;
      break;
    case Dtype::kF16:
    case Dtype::kBF16:
      unit = 2;
      break;
    case Dtype::kQ8_0:
      if (cols % kQ8_0BlockValues != 0) return std::nullopt;
      unit = kQ8_0BlockBytes;
      per_unit = kQ8_0BlockValues;
      break;
  }
  uint64_t units = cols / per_unit;
  if (units > UINT64_MAX / unit) return std::nullopt;
  return units * unit;
}

float HalfToFloat(uint16_t h) { return HalfTable()[h]; }

void DecodeRow(const Matrix& m, uint64_t row, float* out) {
  const std::byte* p = m.data + row * m.row_bytes;
  switch (m.dtype) {
    case Dtype::kF32:
      std::memcpy(out, p, m.cols * sizeof(float));
      return;
    case Dtype::kF16: {
#if defined(__x86_64__)
      if (HaveF16c()) {
        DecodeHalvesF16c(p, m.cols, out);
        return;
      }
#endif
      const auto& table = HalfTable();
      for (uint64_t c = 0; c < m.cols; ++c) out[c] = table[Load16(p + 2 * c)];
      return;
    }
    case Dtype::kBF16:
      for (uint64_t c = 0; c < m.cols; ++c) out[c] = Bf16ToFloat(Load16(p + 2 * c));
      return;
    case Dtype::kQ8_0: {
      const auto& table = HalfTable();
      for (uint64_t b = 0; b < m.cols / kQ8_0BlockValues; ++b) {
        const std::byte* block = p + b * kQ8_0BlockBytes;
        float d = table[Load16(block)];
        const auto* q = reinterpret_cast<const int8_t*>(block + 2);
        for (uint64_t j = 0; j < kQ8_0BlockValues; ++j) {
          out[b * kQ8_0BlockValues + j] = d * static_cast<float>(q[j]);
        }
      }
      return;
    }
  }
}

float Dot(const float* a, const float* b, uint64_t n) {
  // Eight independent partial sums let the compiler use vector registers without
  // -ffast-math, and fix the summation order so every process gets the same bits.
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) s[k] += a[i + k] * b[i + k];
  }
  for (; i < n; ++i) s[i % 8] += a[i] * b[i];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

void MatVec(const Matrix& m, const float* x, float* y) {
  // Decoding a row into a small buffer and then taking a plain float dot product keeps one
  // summation order for every dtype; q8_0 values are exactly d*q, as ggml defines them.
  thread_local std::vector<float> row;
  if (m.dtype == Dtype::kF32 && reinterpret_cast<uintptr_t>(m.data) % alignof(float) == 0 &&
      m.row_bytes % alignof(float) == 0) {
    for (uint64_t r = 0; r < m.rows; ++r) {
      y[r] = Dot(reinterpret_cast<const float*>(m.data + r * m.row_bytes), x, m.cols);
    }
    return;
  }
  row.resize(m.cols);
  for (uint64_t r = 0; r < m.rows; ++r) {
    DecodeRow(m, r, row.data());
    y[r] = Dot(row.data(), x, m.cols);
  }
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace expert_arena::moe
