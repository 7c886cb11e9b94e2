// GGUF v2 and v3 (little-endian) headers: metadata, tensor infos, alignment, data section.
//
//   magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//   kv_count x (string key, u32 value type, value)
//   tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
//   padding to general.alignment (default 32) | data section
//
// A string is a u64 length and that many bytes. A tensor's bytes start at data_offset +
// offset. Only the header is read; every count, length and offset is checked against the
// real file size, so a damaged file is an error naming the file (and the tensor), never an
// out-of-bounds read. Tensors must lie inside the file and must not overlap.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "expert_arena/status.h"
#include "platform/file.h"
#include "format/dtypes.h"

namespace expert_arena::source {

inline constexpr char kGgufMagic[4] = {'G', 'G', 'U', 'F'};

enum class GgufValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* GgufValueTypeName(GgufValueType type);

// One metadata value. Scalars use the field of their kind; arrays keep their element type,
// their count in the file and (up to kMaxKeptArrayElements of, and within the metadata
// budget) their first elements.
struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  uint64_t u = 0;                                   // kU8..kU64 and kBool
  int64_t i = 0;                                    // kI8..kI64
  double f = 0;                                     // kF32, kF64
  std::string str;                                  // kString
  GgufValueType element_type = GgufValueType::kU8;  // kArray
  uint64_t count = 0;                               // kArray: elements in the file
  std::vector<GgufValue> elements;                  // kArray: the first ones kept
};
inline constexpr uint64_t kMaxKeptArrayElements = 1u << 16;
// The memory the kept metadata may take: sizeof(GgufValue) per value kept, plus its string
// bytes and its key's. A real model's metadata (a tokenizer's three arrays of up to
// kMaxKeptArrayElements values, a few dozen scalars) takes about 25 MiB; a file's metadata
// can hold 100 values per KiB (nested u8 arrays), which kept whole would cost 100 times the
// file's bytes. Past the budget, entries are read and checked as usual but not kept (an array
// keeps the elements that fitted), and GgufFile::metadata_not_kept counts them.
inline constexpr uint64_t kMetadataBudgetBytes = 32ull << 20;

struct GgufTensorInfo {
  std::string name;
  uint32_t type_id = 0;
  const GgmlType* type = nullptr;
  std::vector<uint64_t> ne;      // ggml order: ne[0] varies fastest
  uint64_t offset = 0;           // relative to the data section
  uint64_t absolute_offset = 0;  // in the file
  uint64_t bytes = 0;
};

struct GgufFile {
  std::string path;
  uint32_t version = 0;
  uint64_t file_size = 0;
  uint64_t alignment = 32;
  uint64_t data_offset = 0;                                 // start of the data section
  std::vector<std::pair<std::string, GgufValue>> metadata;  // in file order
  // Entries read and checked but not kept: past kMetadataBudgetBytes. general.alignment, which
  // places the data, is always kept.
  uint64_t metadata_not_kept = 0;
  std::vector<GgufTensorInfo> tensors;                      // in file order
  uint64_t header_bytes_read = 0;

  const GgufValue* Find(const std::string& key) const;
};

// Reads and validates the header of the GGUF file at `path`.
Result<GgufFile> ReadGguf(const std::string& path);
// The same on an open descriptor whose size is `file_size`; fd.path() names it in messages.
Result<GgufFile> ReadGguf(const platform::UniqueFd& fd, uint64_t file_size);

}  // namespace expert_arena::source
