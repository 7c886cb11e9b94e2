// Element types of the model formats: the ggml type table (GGUF) and the safetensors dtypes,
// with the sizes needed to turn a shape into a byte count.
//
// The ggml ids are those of ggml/include/ggml.h (ids of removed types stay unused); a GGUF
// tensor of a type not listed here is refused with its id rather than guessed at.
//
// Below the model readers, in format/: the arena file's table is checked against the same
// types (a dtype an arena records must be one of them). The names stay in namespace source,
// where the readers and generators use them.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace expert_arena::source {

struct GgmlType {
  uint32_t id;
  const char* name;      // lowercase ggml name: "f32", "q8_0", "q4_k", "iq2_xxs", ...
  uint32_t block_elems;  // elements per block (1 for plain types)
  uint32_t block_bytes;  // bytes per block
};

// The entry for a ggml type id, or null when the id is unknown or removed.
const GgmlType* FindGgmlType(uint32_t id);
// By lowercase name ("q8_0", "bf16"), or null.
const GgmlType* FindGgmlTypeByName(std::string_view name);
// Every known type, for tests.
std::span<const GgmlType> AllGgmlTypes();

// Bytes of a tensor of `type` with dimensions `ne` (ggml order, ne[0] varies fastest).
// Fails (with a reason) when ne[0] is not a multiple of the block size or the size overflows.
std::optional<uint64_t> GgmlTensorBytes(const GgmlType& type, std::span<const uint64_t> ne,
                                        std::string* why);

struct SafetensorsDtype {
  const char* name;  // as written in the header: "F32", "BF16", "F8_E4M3", "BOOL", ...
  uint32_t bits;     // per element (4 and 6 for the sub-byte float formats)
};

const SafetensorsDtype* FindSafetensorsDtype(std::string_view name);
std::span<const SafetensorsDtype> AllSafetensorsDtypes();

// Bytes of a tensor of `dtype` with `shape`; fails on overflow or a shape whose bits do not
// fill whole bytes.
std::optional<uint64_t> SafetensorsTensorBytes(const SafetensorsDtype& dtype,
                                               std::span<const uint64_t> shape, std::string* why);

// Overflow-checked helpers used by every reader.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}
// offset + length <= limit, without overflow.
inline bool RangeWithin(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

}  // namespace expert_arena::source
