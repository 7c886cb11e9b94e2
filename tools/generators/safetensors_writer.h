// A small safetensors writer (single files, and the index of a sharded model). gen-model
// writes its models with it; tests build edge and hostile files with it (explicit offsets, a
// wrong header length).
//
// Thread-safety: none; build and write from one thread.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "expert_arena/status.h"
#include "generators/tensor_file_writer.h"
#include "source/safetensors_reader.h"

namespace expert_arena::source {

class SafetensorsWriter {
 public:
  void AddMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Places a tensor right after the previous one. Fails on an unknown dtype or a bad shape.
  Status AddTensor(const std::string& name, const std::string& dtype, std::vector<uint64_t> shape);
  // Appends an entry exactly as given (data_offsets [begin, end)): for damaged files in tests.
  void AddTensorInfo(std::string name, std::string dtype, std::vector<uint64_t> shape,
                     uint64_t begin, uint64_t end);

  // Written instead of the real header length (damaged files).
  std::optional<uint64_t> header_length_override;

  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  // The JSON header (tensors in the order added).
  std::string HeaderJson() const;
  // u64 length + JSON padded with spaces to a multiple of 8, as the reference writer does.
  std::vector<std::byte> EncodeHeader() const;
  uint64_t data_offset() const { return EncodeHeader().size(); }
  uint64_t file_bytes() const { return data_offset() + data_end_; }
  Status WriteFile(const std::string& path, const TensorFiller& fill) const;

 private:
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensorInfo> tensors_;
  uint64_t data_end_ = 0;
};

// Writes model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": {...}}.
Status WriteSafetensorsIndex(const std::string& path, uint64_t total_size,
                             const std::map<std::string, std::string>& weight_map);

}  // namespace expert_arena::source
