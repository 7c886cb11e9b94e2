#include "format/dtypes.h"

#include <array>

namespace expert_arena::source {
namespace {

// Block sizes from ggml's type traits (sizeof(block_*) in ggml-common.h). tests/llamacpp
// checks every id against the real libggml-base (ggml_type_name, ggml_blck_size,
// ggml_type_size) from the @node-llama-cpp/linux-x64 npm package.
constexpr std::array<GgmlType, 35> kGgmlTypes = {{
    {0, "f32", 1, 4},
    {1, "f16", 1, 2},
    {2, "q4_0", 32, 18},
    {3, "q4_1", 32, 20},
    // 4 (q4_2) and 5 (q4_3) were removed from ggml.
    {6, "q5_0", 32, 22},
    {7, "q5_1", 32, 24},
    {8, "q8_0", 32, 34},
    {9, "q8_1", 32, 36},
    {10, "q2_k", 256, 84},
    {11, "q3_k", 256, 110},
    {12, "q4_k", 256, 144},
    {13, "q5_k", 256, 176},
    {14, "q6_k", 256, 210},
    {15, "q8_k", 256, 292},
    {16, "iq2_xxs", 256, 66},
    {17, "iq2_xs", 256, 74},
    {18, "iq3_xxs", 256, 98},
    {19, "iq1_s", 256, 50},
    {20, "iq4_nl", 32, 18},
    {21, "iq3_s", 256, 110},
    {22, "iq2_s", 256, 82},
    {23, "iq4_xs", 256, 136},
    {24, "i8", 1, 1},
    {25, "i16", 1, 2},
    {26, "i32", 1, 4},
    {27, "i64", 1, 8},
    {28, "f64", 1, 8},
    {29, "iq1_m", 256, 56},
    {30, "bf16", 1, 2},
    // 31..33 (q4_0_4_4, q4_0_4_8, q4_0_8_8) were removed from GGUF files.
    {34, "tq1_0", 256, 54},
    {35, "tq2_0", 256, 66},
    // 36..38 (iq4_nl_4_4, _4_8, _8_8) were removed.
    {39, "mxfp4", 32, 17},
    {40, "nvfp4", 64, 36},
    {41, "q1_0", 128, 18},  // block_q1_0: f16 scale + 128 sign bits
    {42, "q2_0", 64, 18},   // block_q2_0: f16 scale + 64 2-bit values
}};

constexpr std::array<SafetensorsDtype, 20> kSafetensorsDtypes = {{
    {"BOOL", 8},    {"U8", 8},   {"I8", 8},   {"F8_E5M2", 8}, {"F8_E4M3", 8},
    {"F8_E8M0", 8}, {"I16", 16}, {"U16", 16}, {"F16", 16},    {"BF16", 16},
    {"I32", 32},    {"U32", 32}, {"F32", 32}, {"F64", 64},    {"I64", 64},
    {"U64", 64},    {"C64", 64}, {"F4", 4},   {"F6_E2M3", 6}, {"F6_E3M2", 6},
}};

std::optional<uint64_t> ElementCount(std::span<const uint64_t> shape, std::string* why) {
  uint64_t n = 1;
  for (uint64_t dim : shape) {
    auto next = CheckedMul(n, dim);
    if (!next) {
      if (why) *why = "element count overflows 64 bits";
      return std::nullopt;
    }
    n = *next;
  }
  return n;
}

}  // namespace

const GgmlType* FindGgmlType(uint32_t id) {
  for (const GgmlType& t : kGgmlTypes) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

const GgmlType* FindGgmlTypeByName(std::string_view name) {
  for (const GgmlType& t : kGgmlTypes) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

std::span<const GgmlType> AllGgmlTypes() { return kGgmlTypes; }

std::optional<uint64_t> GgmlTensorBytes(const GgmlType& type, std::span<const uint64_t> ne,
                                        std::string* why) {
  uint64_t ne0 = ne.empty() ? 1 : ne[0];
  if (ne0 % type.block_elems != 0) {
    if (why) {
      *why = "ne[0] = " + std::to_string(ne0) + " is not a multiple of the " + type.name +
             " block size " + std::to_string(type.block_elems);
    }
    return std::nullopt;
  }
  auto elems = ElementCount(ne, why);
  if (!elems) return std::nullopt;
  auto bytes = CheckedMul(*elems / type.block_elems, type.block_bytes);
  if (!bytes && why) *why = "byte size overflows 64 bits";
  return bytes;
}

const SafetensorsDtype* FindSafetensorsDtype(std::string_view name) {
  for (const SafetensorsDtype& d : kSafetensorsDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::span<const SafetensorsDtype> AllSafetensorsDtypes() { return kSafetensorsDtypes; }

std::optional<uint64_t> SafetensorsTensorBytes(const SafetensorsDtype& dtype,
                                               std::span<const uint64_t> shape, std::string* why) {
  auto elems = ElementCount(shape, why);
  if (!elems) return std::nullopt;
  auto bits = CheckedMul(*elems, dtype.bits);
  if (!bits) {
    if (why) *why = "byte size overflows 64 bits";
    return std::nullopt;
  }
  if (*bits % 8 != 0) {
    if (why) {
      *why = std::to_string(*elems) + " elements of " + dtype.name + " do not fill whole bytes";
    }
    return std::nullopt;
  }
  return *bits / 8;
}

}  // namespace expert_arena::source
