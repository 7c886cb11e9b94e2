#include "source/gguf_reader.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <unordered_set>

#include "common/escape.h"
#include "common/units.h"
#include "format/arena_table.h"
#include "source/header_reader.h"

namespace expert_arena::source {
namespace {

constexpr uint64_t kMaxKeyBytes = 64 * kKiB;
constexpr uint64_t kMaxStringBytes = 1 * kGiB;
constexpr uint64_t kMaxNameBytes = 64 * kKiB;
constexpr uint32_t kMaxGgufDims = 4;  // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;

// The fewest bytes one value of `type` takes in a file, so a count can be checked against the
// bytes left before anything is allocated.
uint64_t MinValueBytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
    case GgufValueType::kString:
      return 8;
    case GgufValueType::kArray:
      return 12;
  }
  return 1;
}

bool KnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kF64); }

class GgufParser {
 public:
  GgufParser(const platform::UniqueFd& fd, uint64_t file_size) : fd_(fd), in_(fd, file_size) {}

  Result<GgufFile> Parse();

 private:
  Status Fail(const std::string& message) { return Corrupt(fd_.path() + ": " + message); }
  // Reads and checks one value. With `keep`, and while the budget lasts, it goes to *out and
  // the result is true; otherwise it is read past (nothing sized by the file is allocated),
  // *out holds nothing of use and the result is false. A kept array may keep fewer elements
  // than its count.
  Result<bool> ReadValue(GgufValueType type, const std::string& what, int depth, GgufValue* out,
                         bool keep);
  // Takes `bytes` of the kept-metadata budget; false (and the budget spent: nothing after is
  // kept, so what is kept is a prefix of the file's metadata) when they do not fit.
  bool Charge(uint64_t bytes) {
    if (bytes > budget_) budget_ = 0;
    if (budget_ == 0) return false;
    budget_ -= bytes;
    return true;
  }

  const platform::UniqueFd& fd_;
  HeaderReader in_;
  uint64_t budget_ = kMetadataBudgetBytes;
};

Result<bool> GgufParser::ReadValue(GgufValueType type, const std::string& what, int depth,
                                   GgufValue* out, bool keep) {
  out->type = type;
  switch (type) {
    case GgufValueType::kU8: {
      EA_ASSIGN_OR_RETURN(out->u, in_.Scalar<uint8_t>(what));
      return keep;
    }
    case GgufValueType::kI8: {
      EA_ASSIGN_OR_RETURN(out->i, in_.Scalar<int8_t>(what));
      return keep;
    }
    case GgufValueType::kU16: {
      EA_ASSIGN_OR_RETURN(out->u, in_.Scalar<uint16_t>(what));
      return keep;
    }
    case GgufValueType::kI16: {
      EA_ASSIGN_OR_RETURN(out->i, in_.Scalar<int16_t>(what));
      return keep;
    }
    case GgufValueType::kU32: {
      EA_ASSIGN_OR_RETURN(out->u, in_.Scalar<uint32_t>(what));
      return keep;
    }
    case GgufValueType::kI32: {
      EA_ASSIGN_OR_RETURN(out->i, in_.Scalar<int32_t>(what));
      return keep;
    }
    case GgufValueType::kU64: {
      EA_ASSIGN_OR_RETURN(out->u, in_.Scalar<uint64_t>(what));
      return keep;
    }
    case GgufValueType::kI64: {
      EA_ASSIGN_OR_RETURN(out->i, in_.Scalar<int64_t>(what));
      return keep;
    }
    case GgufValueType::kF32: {
      EA_ASSIGN_OR_RETURN(out->f, in_.Scalar<float>(what));
      return keep;
    }
    case GgufValueType::kF64: {
      EA_ASSIGN_OR_RETURN(out->f, in_.Scalar<double>(what));
      return keep;
    }
    case GgufValueType::kBool: {
      EA_ASSIGN_OR_RETURN(uint8_t b, in_.Scalar<uint8_t>(what));
      if (b > 1) return Fail(what + ": bool value " + std::to_string(b) + " is neither 0 nor 1");
      out->u = b;
      return keep;
    }
    case GgufValueType::kString: {
      EA_ASSIGN_OR_RETURN(uint64_t length, in_.StringLength(kMaxStringBytes, what));
      if (!keep || !Charge(length)) {
        EA_RETURN_IF_ERROR(in_.Skip(length, what));
        return false;
      }
      out->str.resize(static_cast<size_t>(length));
      EA_RETURN_IF_ERROR(in_.Read(out->str.data(), length, what));
      return true;
    }
    case GgufValueType::kArray: {
      if (depth >= kMaxArrayDepth) return Fail(what + ": arrays nested too deep");
      EA_ASSIGN_OR_RETURN(uint32_t element_type, in_.Scalar<uint32_t>(what + " element type"));
      if (!KnownValueType(element_type)) {
        return Fail(what + ": unknown array element type " + std::to_string(element_type));
      }
      out->element_type = static_cast<GgufValueType>(element_type);
      EA_ASSIGN_OR_RETURN(out->count, in_.Scalar<uint64_t>(what + " element count"));
      uint64_t min_each = MinValueBytes(out->element_type);
      if (out->count > in_.remaining() / min_each) {
        return Fail(what + ": array claims " + std::to_string(out->count) + " elements of " +
                    GgufValueTypeName(out->element_type) + " but only " +
                    std::to_string(in_.remaining()) + " bytes are left in the file");
      }
      // Elements are kept while they fit (each charged its GgufValue before it is read), up
      // to kMaxKeptArrayElements; the rest are read past.
      uint64_t kept = 0;
      if (keep) {
        const uint64_t fit = std::min({out->count, kMaxKeptArrayElements,
                                       budget_ / sizeof(GgufValue)});
        out->elements.reserve(static_cast<size_t>(fit));
        while (kept < fit && Charge(sizeof(GgufValue))) {
          out->elements.emplace_back();
          EA_ASSIGN_OR_RETURN(bool whole, ReadValue(out->element_type, what, depth + 1,
                                                    &out->elements.back(), true));
          ++kept;
          if (!whole) {
            out->elements.pop_back();
            break;
          }
        }
      }
      uint64_t rest = out->count - kept;
      if (rest == 0) return keep;
      if (out->element_type != GgufValueType::kString &&
          out->element_type != GgufValueType::kArray && out->element_type != GgufValueType::kBool) {
        EA_RETURN_IF_ERROR(in_.Skip(rest * min_each, what));  // <= remaining: checked above
        return keep;
      }
      GgufValue scratch;  // holds no more than a scalar: nothing is kept in it
      for (uint64_t k = 0; k < rest; ++k) {
        EA_RETURN_IF_ERROR(ReadValue(out->element_type, what, depth + 1, &scratch, false).status());
      }
      return keep;
    }
  }
  return Fail(what + ": unknown value type");
}

Result<GgufFile> GgufParser::Parse() {
  GgufFile file;
  file.path = fd_.path();
  file.file_size = in_.file_size();
  char magic[4];
  EA_RETURN_IF_ERROR(in_.Read(magic, 4, "the GGUF magic"));
  if (std::memcmp(magic, kGgufMagic, 4) != 0) return Fail("not a GGUF file (bad magic)");
  EA_ASSIGN_OR_RETURN(file.version, in_.Scalar<uint32_t>("the GGUF version"));
  if (file.version == 1) return Unsupported(file.path + ": GGUF version 1 is not supported");
  if (file.version != 2 && file.version != 3) {
    if ((file.version & 0xffff) == 0 && (file.version >> 16) <= 3) {
      return Unsupported(file.path + ": big-endian GGUF files are not supported");
    }
    return Unsupported(file.path + ": GGUF version " + std::to_string(file.version) +
                       " is not supported (2 and 3 are)");
  }
  EA_ASSIGN_OR_RETURN(uint64_t tensor_count, in_.Scalar<uint64_t>("the tensor count"));
  EA_ASSIGN_OR_RETURN(uint64_t kv_count, in_.Scalar<uint64_t>("the metadata count"));
  // Each key-value pair takes at least 13 bytes, each tensor info at least 24.
  if (kv_count > in_.remaining() / 13) {
    return Fail("header claims " + std::to_string(kv_count) +
                " metadata entries, more than the file can hold");
  }
  if (tensor_count > in_.remaining() / 24) {
    return Fail("header claims " + std::to_string(tensor_count) +
                " tensors, more than the file can hold");
  }

  // Keys kept: a duplicate of a kept key is refused wherever it appears (up to 256 bytes long;
  // Find would return one of two values); duplicates among entries not kept are never looked
  // up.
  std::unordered_set<std::string> keys;
  for (uint64_t k = 0; k < kv_count; ++k) {
    std::string where = "metadata entry " + std::to_string(k);
    EA_ASSIGN_OR_RETURN(uint64_t key_bytes,
                        in_.StringLength(kMaxKeyBytes, "the key of " + where));
    // A key is charged twice (the entry and the set of keys) with their nodes' overhead.
    const bool alignment = key_bytes == std::strlen("general.alignment");
    const bool keep = Charge(2 * key_bytes + 2 * sizeof(GgufValue)) || alignment;
    std::string key;
    if (keep) {
      key.resize(static_cast<size_t>(key_bytes));
      EA_RETURN_IF_ERROR(in_.Read(key.data(), key_bytes, "the key of " + where));
    } else {
      // Read a prefix only: enough to name the entry in a message.
      constexpr uint64_t kShownKeyBytes = 256;
      key.resize(static_cast<size_t>(std::min(key_bytes, kShownKeyBytes)));
      EA_RETURN_IF_ERROR(in_.Read(key.data(), key.size(), "the key of " + where));
      EA_RETURN_IF_ERROR(in_.Skip(key_bytes - key.size(), "the key of " + where));
    }
    // The key is the file's: escaped (and cut short) wherever a message shows it.
    const std::string shown = QuoteForMessage(key);
    EA_ASSIGN_OR_RETURN(uint32_t type, in_.Scalar<uint32_t>("the type of metadata " + shown));
    if (!KnownValueType(type)) {
      return Fail("metadata " + shown + ": unknown value type " + std::to_string(type));
    }
    // general.alignment places the data: kept whatever the budget (a u32; the check below
    // refuses any other type).
    const bool always = alignment && key == "general.alignment";
    GgufValue value;
    EA_ASSIGN_OR_RETURN(bool kept, ReadValue(static_cast<GgufValueType>(type),
                                             "metadata " + shown, 0, &value,
                                             always || (keep && budget_ > 0)));
    if (key_bytes == key.size() && keys.contains(key)) {
      return Fail("metadata key " + shown + " appears twice");
    }
    if (!kept && !always) {
      ++file.metadata_not_kept;
      continue;
    }
    keys.insert(key);
    file.metadata.emplace_back(std::move(key), std::move(value));
  }
  if (const GgufValue* alignment = file.Find("general.alignment")) {
    if (alignment->type != GgufValueType::kU32) {
      return Fail(std::string("general.alignment has type ") + GgufValueTypeName(alignment->type) +
                  ", expected u32");
    }
    if (!IsPowerOfTwo(alignment->u)) {
      return Fail("general.alignment " + std::to_string(alignment->u) + " is not a power of two");
    }
    file.alignment = alignment->u;
  }

  std::unordered_set<std::string> names;
  file.tensors.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t t = 0; t < tensor_count; ++t) {
    GgufTensorInfo info;
    EA_ASSIGN_OR_RETURN(info.name,
                        in_.String(kMaxNameBytes, "the name of tensor " + std::to_string(t)));
    if (std::string problem = format::TensorNameProblem(info.name); !problem.empty()) {
      return Fail("tensor " + std::to_string(t) + ": " + problem);
    }
    const std::string what = "tensor " + info.name;
    EA_ASSIGN_OR_RETURN(uint32_t n_dims, in_.Scalar<uint32_t>("the dimension count of " + what));
    if (n_dims > kMaxGgufDims) {
      return Fail(what + ": " + std::to_string(n_dims) + " dimensions (at most " +
                  std::to_string(kMaxGgufDims) + ")");
    }
    info.ne.resize(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      EA_ASSIGN_OR_RETURN(info.ne[d], in_.Scalar<uint64_t>("the shape of " + what));
      if (info.ne[d] > static_cast<uint64_t>(INT64_MAX)) {
        return Fail(what + ": dimension " + std::to_string(d) + " is " +
                    std::to_string(info.ne[d]) + " (negative as int64)");
      }
    }
    EA_ASSIGN_OR_RETURN(info.type_id, in_.Scalar<uint32_t>("the type of " + what));
    EA_ASSIGN_OR_RETURN(info.offset, in_.Scalar<uint64_t>("the offset of " + what));
    info.type = FindGgmlType(info.type_id);
    if (info.type == nullptr) {
      return Unsupported(file.path + ": " + what + ": unknown ggml type id " +
                         std::to_string(info.type_id));
    }
    std::string why;
    auto bytes = GgmlTensorBytes(*info.type, info.ne, &why);
    if (!bytes) return Fail(what + ": " + why);
    info.bytes = *bytes;
    if (!names.insert(info.name).second) return Fail(what + " appears twice");
    file.tensors.push_back(std::move(info));
  }

  auto data_offset = AlignUp(in_.position(), file.alignment);
  if (!data_offset || *data_offset > file.file_size) {
    return Fail("data section would start at " + std::to_string(in_.position()) + " aligned to " +
                std::to_string(file.alignment) + ", past the end of the " +
                std::to_string(file.file_size) + "-byte file");
  }
  file.data_offset = *data_offset;
  const uint64_t data_bytes = file.file_size - file.data_offset;
  for (GgufTensorInfo& info : file.tensors) {
    if (info.offset % file.alignment != 0) {
      return Fail("tensor " + info.name + ": offset " + std::to_string(info.offset) +
                  " is not a multiple of the alignment " + std::to_string(file.alignment));
    }
    if (!RangeWithin(info.offset, info.bytes, data_bytes)) {
      // Almost always a download or a copy cut short, rarely a bad header: the message says
      // which size the table asks for, so the two can be told apart.
      uint64_t needed = 0;
      for (const GgufTensorInfo& t : file.tensors) {
        if (t.offset <= UINT64_MAX - t.bytes &&
            t.offset + t.bytes <= UINT64_MAX - file.data_offset) {
          needed = std::max(needed, file.data_offset + t.offset + t.bytes);
        }
      }
      return Fail("truncated: the file has " + std::to_string(file.file_size) +
                  " bytes but its tensor table needs " + std::to_string(needed) +
                  " (tensor " + info.name + ": " + std::to_string(info.bytes) +
                  " bytes at data offset " + std::to_string(info.offset) +
                  " run past the end of the file, whose data section holds " +
                  std::to_string(data_bytes) + " bytes); a download or copy was cut short: "
                  "fetch or copy the file again");
    }
    info.absolute_offset = file.data_offset + info.offset;
  }
  std::vector<size_t> order(file.tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return file.tensors[a].offset < file.tensors[b].offset; });
  // Compare each tensor with the last non-empty one before it, not with its neighbour in
  // the order: an empty tensor between two overlapping ones must not hide the overlap.
  const GgufTensorInfo* prev = nullptr;
  for (size_t k : order) {
    const GgufTensorInfo& cur = file.tensors[k];
    if (cur.bytes == 0) continue;
    if (prev != nullptr && prev->offset + prev->bytes > cur.offset) {
      return Fail("tensor " + cur.name + " (data offset " + std::to_string(cur.offset) +
                  ") overlaps tensor " + prev->name + " (data offset " +
                  std::to_string(prev->offset) + ", " + std::to_string(prev->bytes) + " bytes)");
    }
    prev = &cur;
  }
  file.header_bytes_read = in_.bytes_read();
  return file;
}

}  // namespace

const char* GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kU8:
      return "u8";
    case GgufValueType::kI8:
      return "i8";
    case GgufValueType::kU16:
      return "u16";
    case GgufValueType::kI16:
      return "i16";
    case GgufValueType::kU32:
      return "u32";
    case GgufValueType::kI32:
      return "i32";
    case GgufValueType::kF32:
      return "f32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kU64:
      return "u64";
    case GgufValueType::kI64:
      return "i64";
    case GgufValueType::kF64:
      return "f64";
  }
  return "unknown";
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  for (const auto& [k, v] : metadata) {
    if (k == key) return &v;
  }
  return nullptr;
}

Result<GgufFile> ReadGguf(const platform::UniqueFd& fd, uint64_t file_size) {
  GgufParser parser(fd, file_size);
  return parser.Parse();
}

Result<GgufFile> ReadGguf(const std::string& path) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(path, {.no_follow = false}));
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  if (!st.regular) return InvalidArgument(path + ": not a regular file");
  return ReadGguf(fd, st.size);
}

}  // namespace expert_arena::source
