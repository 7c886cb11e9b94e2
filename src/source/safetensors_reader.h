// safetensors headers, single files and sharded models.
//
//   u64 N (little-endian) | N bytes of JSON | data
//   JSON: {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..],
//          "data_offsets": [begin, end]}, ...}
//
// Offsets are relative to the data (byte 8 + N). A sharded model has a
// model.safetensors.index.json whose "weight_map" names, for every tensor, the shard file (in
// the index's directory) that holds it. Only headers are read; sizes, offsets and counts are
// checked against the real file sizes before use (header at most 100 MiB like the reference
// implementation, tensors inside the data, no overlaps, end - begin equal to the dtype's size
// times the shape), and every error names the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "expert_arena/status.h"
#include "platform/file.h"
#include "format/dtypes.h"

namespace expert_arena::source {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull * 1024 * 1024;
inline constexpr uint64_t kMaxSafetensorsIndexBytes = 64ull * 1024 * 1024;
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";

struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;            // as written: "F32", "BF16", "F8_E4M3", ...
  std::vector<uint64_t> shape;  // as written
  uint64_t begin = 0;           // data_offsets, relative to the data
  uint64_t end = 0;
  uint64_t absolute_offset = 0;  // in the file
  uint64_t bytes = 0;
};

struct SafetensorsFile {
  std::string path;
  uint64_t file_size = 0;
  uint64_t header_bytes = 0;  // N
  uint64_t data_offset = 0;   // 8 + N
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensorInfo> tensors;  // in order of data offset
  uint64_t header_bytes_read = 0;
  uint64_t header_hash = 0;  // HashSafetensorsHeader of the bytes parsed (model_fingerprint.h)
};

// True when the first bytes look like a safetensors header: a u64 length that fits the file
// followed by '{'. `head` is the start of the file (at least 9 bytes to say yes).
bool LooksLikeSafetensors(const std::byte* head, size_t head_bytes, uint64_t file_size);

Result<SafetensorsFile> ReadSafetensors(const std::string& path);
Result<SafetensorsFile> ReadSafetensors(const platform::UniqueFd& fd, uint64_t file_size);

struct SafetensorsIndex {
  std::string path;
  std::vector<std::string> shards;                // absolute or as joined with the index dir
  struct Entry {
    std::string name;
    uint32_t shard = 0;  // index into `shards`
  };
  std::vector<Entry> weight_map;  // every tensor and its shard, in the index's order
  uint64_t bytes_read = 0;
  uint64_t content_hash = 0;  // HashIndexBytes of the bytes parsed (model_fingerprint.h)
};

// Reads model.safetensors.index.json: shard names must be plain file names in the index's
// directory (no '/', no ".."), so a hostile index cannot point elsewhere.
Result<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path);

// Reads every shard of an index and checks that each tensor of the weight map is in the shard
// the index names.
Result<std::vector<SafetensorsFile>> ReadShardedSafetensors(const SafetensorsIndex& index);

}  // namespace expert_arena::source
