#include "source/safetensors_reader.h"

#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string_view>

#include "common/escape.h"
#include "common/name_map.h"
#include "format/arena_table.h"
#include "source/header_reader.h"
#include "source/model_fingerprint.h"

namespace expert_arena::source {
namespace {

// Headers are parsed with simdjson's DOM parser: a DeepSeek-V3-sized model has 18 MB of shard
// headers and an 8 MB index, which a general-purpose JSON library takes about a second to
// build maps of (docs/scale.md). The text is read into a buffer with simdjson's padding.
namespace sj = simdjson;

// A header or index text with the padding simdjson reads past its end.
std::string PaddedText(uint64_t bytes) {
  return std::string(static_cast<size_t>(bytes) + sj::SIMDJSON_PADDING, '\0');
}

Status Fail(const std::string& path, const std::string& message) {
  return Corrupt(path + ": " + message);
}

Result<sj::dom::object> ParseJson(sj::dom::parser& parser, const std::string& text,
                                  uint64_t length, const std::string& path, const char* what) {
  sj::dom::element root;
  if (parser.parse(text.data(), static_cast<size_t>(length), false).get(root) != sj::SUCCESS) {
    return Fail(path, std::string(what) + " is not valid JSON");
  }
  sj::dom::object object;
  if (root.get_object().get(object) != sj::SUCCESS) {
    return Fail(path, std::string(what) + " is not a JSON object");
  }
  return object;
}

// A JSON array of unsigned integers (non-negative, integral).
bool ReadU64Array(sj::dom::element value, std::vector<uint64_t>* out) {
  sj::dom::array array;
  if (value.get_array().get(array) != sj::SUCCESS) return false;
  out->clear();
  for (sj::dom::element v : array) {
    uint64_t n = 0;
    if (v.get_uint64().get(n) != sj::SUCCESS) return false;
    out->push_back(n);
  }
  return true;
}

Status ParseTensor(const std::string& path, std::string_view key, sj::dom::element entry,
                   uint64_t data_bytes, SafetensorsTensorInfo* out) {
  if (std::string problem = format::TensorNameProblem(key); !problem.empty()) {
    return Fail(path, "a tensor key: " + problem);
  }
  std::string name(key);
  const std::string what = "tensor " + name;
  sj::dom::object object;
  if (entry.get_object().get(object) != sj::SUCCESS) {
    return Fail(path, what + ": entry is not an object");
  }
  // The fields this reader uses, each at most once (a repeated one is refused, not guessed).
  std::optional<sj::dom::element> dtype, shape, offsets;
  for (sj::dom::key_value_pair field : object) {
    std::optional<sj::dom::element>* slot = field.key == "dtype"          ? &dtype
                                            : field.key == "shape"        ? &shape
                                            : field.key == "data_offsets" ? &offsets
                                                                          : nullptr;
    if (slot == nullptr) continue;
    if (slot->has_value()) {
      return Fail(path, what + ": " + std::string(field.key) + " appears twice");
    }
    *slot = field.value;
  }
  std::string_view dtype_text;
  if (!dtype || dtype->get_string().get(dtype_text) != sj::SUCCESS) {
    return Fail(path, what + ": no dtype string");
  }
  if (!shape || !ReadU64Array(*shape, &out->shape)) {
    return Fail(path, what + ": shape is not an array of non-negative integers");
  }
  std::vector<uint64_t> range;
  if (!offsets || !ReadU64Array(*offsets, &range) || range.size() != 2) {
    return Fail(path, what + ": data_offsets is not a pair of non-negative integers");
  }
  out->name = std::move(name);
  out->dtype = std::string(dtype_text);
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
  std::string text = PaddedText(file.header_bytes);
  EA_RETURN_IF_ERROR(in.Read(text.data(), file.header_bytes, "the safetensors header"));
  file.header_bytes_read = in.bytes_read();
  file.header_hash = HashSafetensorsHeader(file.header_bytes, text.data());
  file.data_offset = 8 + file.header_bytes;
  const uint64_t data_bytes = file_size - file.data_offset;
  sj::dom::parser parser;
  EA_ASSIGN_OR_RETURN(sj::dom::object json, ParseJson(parser, text, file.header_bytes, file.path,
                                                      "the safetensors header"));

  file.tensors.reserve(json.size());
  bool seen_metadata = false;
  for (sj::dom::key_value_pair it : json) {
    if (it.key == "__metadata__") {
      sj::dom::object metadata;
      if (seen_metadata) return Fail(file.path, "__metadata__ appears twice");
      seen_metadata = true;
      if (it.value.get_object().get(metadata) != sj::SUCCESS) {
        return Fail(file.path, "__metadata__ is not an object");
      }
      for (sj::dom::key_value_pair m : metadata) {
        std::string_view value;
        if (m.value.get_string().get(value) != sj::SUCCESS) {
          return Fail(file.path, "__metadata__ " + EscapeForMessage(m.key) + " is not a string");
        }
        file.metadata[std::string(m.key)] = std::string(value);
      }
      continue;
    }
    SafetensorsTensorInfo info;
    EA_RETURN_IF_ERROR(ParseTensor(file.path, it.key, it.value, data_bytes, &info));
    info.absolute_offset = file.data_offset + info.begin;
    file.tensors.push_back(std::move(info));
  }
  {
    // A name given twice is refused (which entry would be meant?).
    NameMap<char> names(file.tensors.size());
    for (const SafetensorsTensorInfo& t : file.tensors) {
      if (!names.Insert(t.name).second) {
        return Fail(file.path, "tensor " + t.name + " appears twice in the header");
      }
    }
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
  std::string text = PaddedText(st.size);
  EA_RETURN_IF_ERROR(
      platform::ReadFull(fd, 0, {reinterpret_cast<std::byte*>(text.data()), st.size}));
  SafetensorsIndex index;
  index.path = path;
  index.bytes_read = st.size;
  index.content_hash = HashIndexBytes(text.data(), st.size);
  sj::dom::parser parser;
  EA_ASSIGN_OR_RETURN(sj::dom::object json, ParseJson(parser, text, st.size, path, "the index"));
  std::optional<sj::dom::object> map;
  for (sj::dom::key_value_pair field : json) {
    if (field.key != "weight_map") continue;
    sj::dom::object object;
    if (map || field.value.get_object().get(object) != sj::SUCCESS) {
      return Fail(path, "no weight_map object (or more than one)");
    }
    map = object;
  }
  if (!map) return Fail(path, "no weight_map object");
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  // Shards in order of first mention; few distinct ones, each name met thousands of times.
  std::map<std::string, uint32_t, std::less<>> shard_of;  // name -> index into shards
  NameMap<char> keys(map->size());                        // views into the parser's strings
  for (sj::dom::key_value_pair it : *map) {
    // The keys are tensor names, held to the rule of the shards' own names (and quoted below).
    if (std::string problem = format::TensorNameProblem(it.key); !problem.empty()) {
      return Fail(path, "a weight_map key: " + problem);
    }
    std::string key(it.key);
    std::string_view shard;
    if (it.value.get_string().get(shard) != sj::SUCCESS) {
      return Fail(path, "weight_map " + key + " is not a file name");
    }
    auto known = shard_of.find(shard);
    if (known == shard_of.end()) {
      if (!PlainFileName(std::string(shard))) {
        return Fail(path, "weight_map " + key + " names " + EscapeForMessage(std::string(shard)) +
                              ", not a file name in the index's directory");
      }
      std::string joined = (dir / std::string(shard)).string();
      known = shard_of.emplace(std::string(shard), static_cast<uint32_t>(index.shards.size())).first;
      index.shards.push_back(joined);
    }
    if (!keys.Insert(it.key).second) return Fail(path, "weight_map " + key + " appears twice");
    index.weight_map.push_back({std::move(key), known->second});
  }
  if (index.shards.empty()) return Fail(path, "weight_map names no shard");
  // Shards in name order (the loader reads them in this order); entries follow their shard.
  std::vector<uint32_t> order(index.shards.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return index.shards[a] < index.shards[b]; });
  std::vector<uint32_t> rank(order.size());
  std::vector<std::string> sorted(order.size());
  for (uint32_t i = 0; i < order.size(); ++i) {
    rank[order[i]] = i;
    sorted[i] = std::move(index.shards[order[i]]);
  }
  index.shards = std::move(sorted);
  for (SafetensorsIndex::Entry& entry : index.weight_map) entry.shard = rank[entry.shard];
  return index;
}

Result<std::vector<SafetensorsFile>> ReadShardedSafetensors(const SafetensorsIndex& index) {
  std::vector<SafetensorsFile> shards;
  shards.reserve(index.shards.size());
  for (const std::string& shard : index.shards) {
    auto file = ReadSafetensors(shard);
    if (!file.ok()) return file.status().WithContext(index.path);
    shards.push_back(std::move(*file));
  }
  // Which shard holds each name. A name held by two shards (refused later, when the model is
  // planned) is checked against each shard's own names.
  size_t count = 0;
  for (const SafetensorsFile& shard : shards) count += shard.tensors.size();
  NameMap<uint32_t> holder(count);
  bool held_twice = false;
  for (uint32_t s = 0; s < shards.size(); ++s) {
    for (const SafetensorsTensorInfo& t : shards[s].tensors) {
      held_twice |= !holder.Insert(t.name, s).second;
    }
  }
  std::vector<NameMap<char>> names;  // per shard, only when a name is held twice
  if (held_twice) {
    for (const SafetensorsFile& shard : shards) {
      names.emplace_back(shard.tensors.size());
      for (const SafetensorsTensorInfo& t : shard.tensors) names.back().Insert(t.name);
    }
  }
  auto holds = [&](uint32_t s, const std::string& name) {
    if (held_twice) return names[s].Contains(name);
    const uint32_t* found = holder.Find(name);
    return found != nullptr && *found == s;
  };
  for (const SafetensorsIndex::Entry& entry : index.weight_map) {
    if (!holds(entry.shard, entry.name)) {
      return Corrupt(index.path + ": tensor " + entry.name + " is mapped to " +
                     index.shards[entry.shard] + ", which does not hold it");
    }
  }
  return shards;
}

}  // namespace expert_arena::source
