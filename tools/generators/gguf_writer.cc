#include "generators/gguf_writer.h"

#include <algorithm>
#include <cstring>

#include "common/units.h"

namespace expert_arena::source {
namespace {

template <typename T>
void Put(std::vector<std::byte>& out, T value) {
  const auto* p = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

void PutString(std::vector<std::byte>& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

void PutValue(std::vector<std::byte>& out, const GgufValue& v) {
  switch (v.type) {
    case GgufValueType::kU8:
      Put<uint8_t>(out, static_cast<uint8_t>(v.u));
      break;
    case GgufValueType::kI8:
      Put<int8_t>(out, static_cast<int8_t>(v.i));
      break;
    case GgufValueType::kU16:
      Put<uint16_t>(out, static_cast<uint16_t>(v.u));
      break;
    case GgufValueType::kI16:
      Put<int16_t>(out, static_cast<int16_t>(v.i));
      break;
    case GgufValueType::kU32:
      Put<uint32_t>(out, static_cast<uint32_t>(v.u));
      break;
    case GgufValueType::kI32:
      Put<int32_t>(out, static_cast<int32_t>(v.i));
      break;
    case GgufValueType::kF32:
      Put<float>(out, static_cast<float>(v.f));
      break;
    case GgufValueType::kBool:
      Put<uint8_t>(out, static_cast<uint8_t>(v.u));
      break;
    case GgufValueType::kString:
      PutString(out, v.str);
      break;
    case GgufValueType::kU64:
      Put<uint64_t>(out, v.u);
      break;
    case GgufValueType::kI64:
      Put<int64_t>(out, v.i);
      break;
    case GgufValueType::kF64:
      Put<double>(out, v.f);
      break;
    case GgufValueType::kArray:
      Put<uint32_t>(out, static_cast<uint32_t>(v.element_type));
      Put<uint64_t>(out, v.elements.size());
      for (const GgufValue& e : v.elements) PutValue(out, e);
      break;
  }
}

}  // namespace

void GgufWriter::SetAlignment(uint32_t alignment, bool write_key) {
  alignment_ = alignment;
  if (write_key) AddU32("general.alignment", alignment);
}

void GgufWriter::Add(const std::string& key, GgufValue value) {
  metadata_.emplace_back(key, std::move(value));
}
void GgufWriter::AddString(const std::string& key, std::string value) {
  Add(key, String(std::move(value)));
}
void GgufWriter::AddU32(const std::string& key, uint32_t value) {
  Add(key, Scalar(GgufValueType::kU32, value));
}
void GgufWriter::AddU64(const std::string& key, uint64_t value) {
  Add(key, Scalar(GgufValueType::kU64, value));
}
void GgufWriter::AddI32(const std::string& key, int32_t value) {
  Add(key, Scalar(GgufValueType::kI32, 0, value));
}
void GgufWriter::AddF32(const std::string& key, float value) {
  Add(key, Scalar(GgufValueType::kF32, 0, 0, value));
}
void GgufWriter::AddBool(const std::string& key, bool value) {
  Add(key, Scalar(GgufValueType::kBool, value ? 1 : 0));
}

GgufValue GgufWriter::Scalar(GgufValueType type, uint64_t u, int64_t i, double f) {
  GgufValue v;
  v.type = type;
  v.u = u;
  v.i = i;
  v.f = f;
  return v;
}

GgufValue GgufWriter::String(std::string value) {
  GgufValue v;
  v.type = GgufValueType::kString;
  v.str = std::move(value);
  return v;
}

GgufValue GgufWriter::Array(GgufValueType element_type, std::vector<GgufValue> elements) {
  GgufValue v;
  v.type = GgufValueType::kArray;
  v.element_type = element_type;
  v.count = elements.size();
  v.elements = std::move(elements);
  return v;
}

Status GgufWriter::AddTensor(const std::string& name, const GgmlType& type,
                             std::vector<uint64_t> ne) {
  std::string why;
  auto bytes = GgmlTensorBytes(type, ne, &why);
  if (!bytes) return InvalidArgument("tensor " + name + ": " + why);
  auto offset = AlignUp(data_cursor_, alignment_);
  if (!offset || *bytes > UINT64_MAX - *offset) {
    return InvalidArgument("tensor " + name + ": the file would exceed 2^64 bytes");
  }
  AddTensorInfo(name, type.id, std::move(ne), *offset, *bytes);
  return Status::Ok();
}

void GgufWriter::AddTensorInfo(std::string name, uint32_t type_id, std::vector<uint64_t> ne,
                               uint64_t offset, uint64_t bytes) {
  GgufTensorInfo info;
  info.name = std::move(name);
  info.type_id = type_id;
  info.type = FindGgmlType(type_id);
  info.ne = std::move(ne);
  info.offset = offset;
  info.bytes = bytes;
  data_cursor_ = std::max(data_cursor_, offset + bytes);
  tensors_.push_back(std::move(info));
}

std::vector<std::byte> GgufWriter::EncodeHeader() const {
  std::vector<std::byte> out;
  // Reserved before the first insert: besides saving reallocations, it keeps g++ 12 at -O3
  // from reporting a bogus -Wstringop-overflow inside std::vector::insert into an empty
  // vector (GCC PR 106199).
  out.reserve(4096);
  const auto* magic = reinterpret_cast<const std::byte*>(kGgufMagic);
  out.insert(out.end(), magic, magic + 4);
  Put<uint32_t>(out, version_);
  Put<uint64_t>(out, tensor_count_override.value_or(tensors_.size()));
  Put<uint64_t>(out, kv_count_override.value_or(metadata_.size()));
  for (const auto& [key, value] : metadata_) {
    PutString(out, key);
    Put<uint32_t>(out, static_cast<uint32_t>(value.type));
    PutValue(out, value);
  }
  for (const GgufTensorInfo& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
    for (uint64_t d : t.ne) Put<uint64_t>(out, d);
    Put<uint32_t>(out, t.type_id);
    Put<uint64_t>(out, t.offset);
  }
  out.resize(*AlignUp(out.size(), alignment_));
  return out;
}

uint64_t GgufWriter::data_offset() const { return EncodeHeader().size(); }

uint64_t GgufWriter::file_bytes() const { return data_offset() + data_cursor_; }

Status GgufWriter::WriteFile(const std::string& path, const TensorFiller& fill) const {
  std::vector<std::byte> header = EncodeHeader();
  std::vector<TensorPlacement> placements;
  placements.reserve(tensors_.size());
  for (const GgufTensorInfo& t : tensors_) {
    placements.push_back(
        {header.size() + t.offset, t.bytes, t.type != nullptr ? t.type->block_bytes : 1});
  }
  return WriteTensorFile(path, header, placements, header.size() + data_cursor_, fill);
}

}  // namespace expert_arena::source
