#include "source/safetensors_reader.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_set>

#include "common/escape.h"
#include "format/arena_table.h"
#include "source/header_reader.h"
#include "source/model_fingerprint.h"

namespace expert_arena::source {
namespace {

using Json = nlohmann::json;

Status Fail(const std::string& path, const std::string& message) {
  return Corrupt(path + ": " + message);
}

Result<Json> ParseJson(const std::string& text, const std::string& path, const char* what) {
  Json json = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Fail(path, std::string(what) + " is not valid JSON");
  if (!json.is_object()) return Fail(path, std::string(what) + " is not a JSON object");
  return json;
}

// A JSON array of unsigned integers (non-negative, integral).
bool ReadU64Array(const Json& value, std::vector<uint64_t>* out) {
  if (!value.is_array()) return false;
  out->clear();
  for (const Json& v : value) {
    if (!v.is_number_unsigned()) return false;
    out->push_back(v.get<uint64_t>());
  }
  return true;
}

Status ParseTensor(const std::string& path, const std::string& name, const Json& entry,
                   uint64_t data_bytes, SafetensorsTensorInfo* out) {
  if (std::string problem = format::TensorNameProblem(name); !problem.empty()) {
    return Fail(path, "a tensor key: " + problem);
  }
  const std::string what = "tensor " + name;
  if (!entry.is_object()) return Fail(path, what + ": entry is not an object");
  auto dtype = entry.find("dtype");
  auto shape = entry.find("shape");
  auto offsets = entry.find("data_offsets");
  if (dtype == entry.end() || !dtype->is_string()) return Fail(path, what + ": no dtype string");
  if (shape == entry.end() || !ReadU64Array(*shape, &out->shape)) {
    return Fail(path, what + ": shape is not an array of non-negative integers");
  }
  std::vector<uint64_t> range;
  if (offsets == entry.end() || !ReadU64Array(*offsets, &range) || range.size() != 2) {
    return Fail(path, what + ": data_offsets is not a pair of non-negative integers");
  }
  out->name = name;
  out->dtype = dtype->get<std::string>();
  const SafetensorsDtype* type = FindSafetensorsDtype(out->dtype);
  if (type == nullptr) {
    return Unsupported(path + ": " + what + ": unknown dtype " + EscapeForMessage(out->dtype));
  }
  if (out->shape.size() > 8) {
    return Fail(path, what + ": " + std::to_string(out->shape.size()) + " dimensions (at most 8)");
  }
  std::string why;
  auto bytes = SafetensorsTensorBytes(*type, out->shape, &why);
  if (!bytes) return Fail(path, what + ": " + why);
  out->bytes = *bytes;
  out->begin = range[0];
  out->end = range[1];
  if (out->begin > out->end) {
    return Fail(path, what + ": data_offsets [" + std::to_string(out->begin) + ", " +
                          std::to_string(out->end) + "] run backwards");
  }
  if (out->end - out->begin != out->bytes) {
    return Fail(path, what + ": data_offsets span " + std::to_string(out->end - out->begin) +
                          " bytes but " + out->dtype + " of this shape takes " +
                          std::to_string(out->bytes));
  }
  if (out->end > data_bytes) {
    return Fail(path, what + ": data_offsets end " + std::to_string(out->end) +
                          " is past the end of the data (" + std::to_string(data_bytes) +
                          " bytes)");
  }
  return Status::Ok();
}

// A shard name: one file in the index's directory, without control bytes (the name reaches
// paths and so every message about the shard).
bool PlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         ControlByteProblem(name).empty();
}

}  // namespace

bool LooksLikeSafetensors(const std::byte* head, size_t head_bytes, uint64_t file_size) {
  if (head_bytes < 9 || file_size < 10) return false;
  uint64_t n;
  std::memcpy(&n, head, 8);
  return n >= 2 && n <= file_size - 8 && n <= kMaxSafetensorsHeaderBytes &&
         static_cast<char>(head[8]) == '{';
}

Result<SafetensorsFile> ReadSafetensors(const platform::UniqueFd& fd, uint64_t file_size) {
  SafetensorsFile file;
  file.path = fd.path();
  file.file_size = file_size;
  HeaderReader in(fd, file_size);
  EA_ASSIGN_OR_RETURN(file.header_bytes, in.Scalar<uint64_t>("the safetensors header length"));
  if (file.header_bytes > kMaxSafetensorsHeaderBytes) {
    return Fail(file.path, "header length " + std::to_string(file.header_bytes) +
                               " exceeds the 100 MiB limit");
  }
  if (file.header_bytes > in.remaining()) {
    return Fail(file.path, "header length " + std::to_string(file.header_bytes) +
                               " runs past the end of the " + std::to_string(file_size) +
                               "-byte file");
  }
  std::string text(static_cast<size_t>(file.header_bytes), '\0');
  EA_RETURN_IF_ERROR(in.Read(text.data(), text.size(), "the safetensors header"));
  file.header_bytes_read = in.bytes_read();
  file.header_hash = HashSafetensorsHeader(file.header_bytes, text.data());
  file.data_offset = 8 + file.header_bytes;
  const uint64_t data_bytes = file_size - file.data_offset;
  EA_ASSIGN_OR_RETURN(Json json, ParseJson(text, file.path, "the safetensors header"));

  file.tensors.reserve(json.size());
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Fail(file.path, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Fail(file.path, "__metadata__ " + EscapeForMessage(m.key()) + " is not a string");
        }
        file.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsTensorInfo info;
    EA_RETURN_IF_ERROR(ParseTensor(file.path, it.key(), *it, data_bytes, &info));
    info.absolute_offset = file.data_offset + info.begin;
    file.tensors.push_back(std::move(info));
  }
  std::sort(file.tensors.begin(), file.tensors.end(),
            [](const SafetensorsTensorInfo& a, const SafetensorsTensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // Compare each tensor with the last non-empty one before it, not with its neighbour in
  // the order: an empty tensor between two overlapping ones must not hide the overlap.
  const SafetensorsTensorInfo* prev = nullptr;
  for (const SafetensorsTensorInfo& cur : file.tensors) {
    if (cur.bytes == 0) continue;
    if (prev != nullptr && prev->end > cur.begin) {
      return Fail(file.path, "tensor " + cur.name + " (data_offsets [" + std::to_string(cur.begin) +
                                 ", " + std::to_string(cur.end) + "]) overlaps tensor " +
                                 prev->name + " ([" + std::to_string(prev->begin) + ", " +
                                 std::to_string(prev->end) + "])");
    }
    prev = &cur;
  }
  return file;
}

Result<SafetensorsFile> ReadSafetensors(const std::string& path) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(path, {.no_follow = false}));
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  if (!st.regular) return InvalidArgument(path + ": not a regular file");
  return ReadSafetensors(fd, st.size);
}

Result<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(path, {.no_follow = false}));
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  if (!st.regular) return InvalidArgument(path + ": not a regular file");
  if (st.size > kMaxSafetensorsIndexBytes) {
    return Fail(path, "index of " + std::to_string(st.size) + " bytes exceeds the 64 MiB limit");
  }
  std::string text(static_cast<size_t>(st.size), '\0');
  EA_RETURN_IF_ERROR(
      platform::ReadFull(fd, 0, {reinterpret_cast<std::byte*>(text.data()), text.size()}));
  SafetensorsIndex index;
  index.path = path;
  index.bytes_read = st.size;
  index.content_hash = HashIndexBytes(text.data(), text.size());
  EA_ASSIGN_OR_RETURN(Json json, ParseJson(text, path, "the index"));
  auto map = json.find("weight_map");
  if (map == json.end() || !map->is_object()) return Fail(path, "no weight_map object");
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  for (auto it = map->begin(); it != map->end(); ++it) {
    // The keys are tensor names, held to the rule of the shards' own names (and quoted below).
    if (std::string problem = format::TensorNameProblem(it.key()); !problem.empty()) {
      return Fail(path, "a weight_map key: " + problem);
    }
    if (!it->is_string()) return Fail(path, "weight_map " + it.key() + " is not a file name");
    std::string shard = it->get<std::string>();
    if (!PlainFileName(shard)) {
      return Fail(path, "weight_map " + it.key() + " names " + EscapeForMessage(shard) +
                            ", not a file name in the index's directory");
    }
    std::string joined = (dir / shard).string();
    index.weight_map[it.key()] = joined;
    if (std::find(index.shards.begin(), index.shards.end(), joined) == index.shards.end()) {
      index.shards.push_back(joined);
    }
  }
  if (index.shards.empty()) return Fail(path, "weight_map names no shard");
  std::sort(index.shards.begin(), index.shards.end());
  return index;
}

Result<std::vector<SafetensorsFile>> ReadShardedSafetensors(const SafetensorsIndex& index) {
  std::vector<SafetensorsFile> shards;
  std::map<std::string, size_t> by_path;
  for (const std::string& shard : index.shards) {
    auto file = ReadSafetensors(shard);
    if (!file.ok()) return file.status().WithContext(index.path);
    by_path[shard] = shards.size();
    shards.push_back(std::move(*file));
  }
  std::vector<std::unordered_set<std::string_view>> names(shards.size());
  for (size_t s = 0; s < shards.size(); ++s) {
    for (const SafetensorsTensorInfo& t : shards[s].tensors) names[s].insert(t.name);
  }
  for (const auto& [name, shard] : index.weight_map) {
    if (!names[by_path.at(shard)].contains(name)) {
      return Corrupt(index.path + ": tensor " + name + " is mapped to " + shard +
                     ", which does not hold it");
    }
  }
  return shards;
}

}  // namespace expert_arena::source
