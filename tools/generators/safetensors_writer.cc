#include "generators/safetensors_writer.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

namespace expert_arena::source {

Status SafetensorsWriter::AddTensor(const std::string& name, const std::string& dtype,
                                    std::vector<uint64_t> shape) {
  const SafetensorsDtype* type = FindSafetensorsDtype(dtype);
  if (type == nullptr) return InvalidArgument("tensor " + name + ": unknown dtype " + dtype);
  std::string why;
  auto bytes = SafetensorsTensorBytes(*type, shape, &why);
  if (!bytes) return InvalidArgument("tensor " + name + ": " + why);
  if (*bytes > UINT64_MAX - data_end_) return InvalidArgument("tensor " + name + ": too large");
  AddTensorInfo(name, dtype, std::move(shape), data_end_, data_end_ + *bytes);
  return Status::Ok();
}

void SafetensorsWriter::AddTensorInfo(std::string name, std::string dtype,
                                      std::vector<uint64_t> shape, uint64_t begin, uint64_t end) {
  SafetensorsTensorInfo info;
  info.name = std::move(name);
  info.dtype = std::move(dtype);
  info.shape = std::move(shape);
  info.begin = begin;
  info.end = end;
  info.bytes = end >= begin ? end - begin : 0;
  data_end_ = std::max(data_end_, end);
  tensors_.push_back(std::move(info));
}

std::string SafetensorsWriter::HeaderJson() const {
  // Written by hand: an ordered JSON object inserts in linear time per key, and a model may
  // have tens of thousands of tensors.
  auto quote = [](const std::string& s) { return nlohmann::json(s).dump(); };
  std::string out = "{";
  bool first = true;
  if (!metadata_.empty()) {
    out += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata_) {
      if (out.back() != '{') out += ",";
      out += quote(k) + ":" + quote(v);
    }
    out += "}";
    first = false;
  }
  for (const SafetensorsTensorInfo& t : tensors_) {
    if (!first) out += ",";
    first = false;
    out += quote(t.name) + ":{\"dtype\":" + quote(t.dtype) + ",\"shape\":[";
    // Appended piece by piece: `"," + std::to_string(...)` makes g++ 12 at -O2/-O3 report a
    // bogus -Wrestrict inside std::string (GCC PR 105651).
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (d) out += ',';
      out += std::to_string(t.shape[d]);
    }
    out += "],\"data_offsets\":[";
    out += std::to_string(t.begin);
    out += ',';
    out += std::to_string(t.end);
    out += "]}";
  }
  return out + "}";
}

std::vector<std::byte> SafetensorsWriter::EncodeHeader() const {
  std::string text = HeaderJson();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  uint64_t length = header_length_override.value_or(text.size());
  std::vector<std::byte> out(8 + text.size());
  std::memcpy(out.data(), &length, 8);
  std::memcpy(out.data() + 8, text.data(), text.size());
  return out;
}

Status SafetensorsWriter::WriteFile(const std::string& path, const TensorFiller& fill) const {
  std::vector<std::byte> header = EncodeHeader();
  std::vector<TensorPlacement> placements;
  placements.reserve(tensors_.size());
  for (const SafetensorsTensorInfo& t : tensors_) {
    const SafetensorsDtype* type = FindSafetensorsDtype(t.dtype);
    uint64_t granule = type != nullptr ? std::max<uint64_t>(type->bits / 8, 1) : 1;
    placements.push_back({header.size() + t.begin, t.bytes, granule});
  }
  return WriteTensorFile(path, header, placements, header.size() + data_end_, fill);
}

Status WriteSafetensorsIndex(const std::string& path, uint64_t total_size,
                             const std::map<std::string, std::string>& weight_map) {
  nlohmann::ordered_json json;
  json["metadata"] = {{"total_size", total_size}};
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (const auto& [name, file] : weight_map) map[name] = file;
  json["weight_map"] = map;
  std::string text = json.dump(2) + "\n";
  std::span<const std::byte> bytes{reinterpret_cast<const std::byte*>(text.data()), text.size()};
  return WriteTensorFile(path, bytes, {}, bytes.size(), nullptr);
}

}  // namespace expert_arena::source
