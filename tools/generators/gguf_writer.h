// A small GGUF v2/v3 writer: metadata of every value type, tensor infos, padding, and tensor
// data streamed from a filler. gen-model writes its models with it, and tests build edge and
// hostile files with it (explicit offsets, wrong counts, unknown type ids).
//
// Thread-safety: none; build and write from one thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "expert_arena/status.h"
#include "generators/tensor_file_writer.h"
#include "source/gguf_reader.h"

namespace expert_arena::source {

class GgufWriter {
 public:
  explicit GgufWriter(uint32_t version = 3) : version_(version) {}

  // The data alignment; also written as general.alignment (u32) unless told not to.
  void SetAlignment(uint32_t alignment, bool write_key = true);

  void Add(const std::string& key, GgufValue value);
  void AddString(const std::string& key, std::string value);
  void AddU32(const std::string& key, uint32_t value);
  void AddU64(const std::string& key, uint64_t value);
  void AddI32(const std::string& key, int32_t value);
  void AddF32(const std::string& key, float value);
  void AddBool(const std::string& key, bool value);
  static GgufValue Scalar(GgufValueType type, uint64_t u, int64_t i = 0, double f = 0);
  static GgufValue String(std::string value);
  static GgufValue Array(GgufValueType element_type, std::vector<GgufValue> elements);

  // Places a tensor at the next aligned offset of the data section. Fails when the shape
  // does not fit the type's blocks.
  Status AddTensor(const std::string& name, const GgmlType& type, std::vector<uint64_t> ne);
  // Appends a tensor info exactly as given (offset relative to the data section, `bytes` used
  // only to place data): for damaged files in tests.
  void AddTensorInfo(std::string name, uint32_t type_id, std::vector<uint64_t> ne, uint64_t offset,
                     uint64_t bytes);

  // Counts written instead of the real ones (damaged files).
  std::optional<uint64_t> tensor_count_override;
  std::optional<uint64_t> kv_count_override;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  uint64_t alignment() const { return alignment_; }
  // Where the data section starts (the header padded to the alignment).
  uint64_t data_offset() const;
  // data_offset() + the end of the last tensor.
  uint64_t file_bytes() const;

  // The header region [0, data_offset()).
  std::vector<std::byte> EncodeHeader() const;
  // Writes the whole file; tensor data comes from `fill` (tensor index as in tensors()).
  Status WriteFile(const std::string& path, const TensorFiller& fill) const;

 private:
  uint32_t version_;
  uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  uint64_t data_cursor_ = 0;
};

}  // namespace expert_arena::source
