#include "format/arena_format.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "common/escape.h"
#include "common/units.h"
#include "format/dtypes.h"

namespace expert_arena::format {
namespace {

// The name index: a power of two of u32 slots, more than twice the tensors (so a probe run
// stays short and an absent name always meets an empty slot).
uint64_t IndexSlots(uint64_t tensors) {
  uint64_t slots = 8;
  while (slots < 2 * tensors + 1) slots *= 2;
  return slots;
}

// Bytes of the table that follows HeaderFixed (entries, strings, name index), or nullopt on
// overflow. The name index starts 8-aligned after the strings.
std::optional<uint64_t> TableBytes(const ArenaTable& table, uint64_t* strings_bytes,
                                   uint64_t* index_offset = nullptr) {
  uint64_t strings = 0;
  // Every string is followed by a NUL (not counted in its length): names and dtypes read in
  // place are C strings too (the C API hands them out).
  for (const SourceRecord& s : table.sources) strings += s.path.size() + 1;
  for (const TensorRecord& t : table.tensors) strings += t.name.size() + t.dtype.size() + 2;
  *strings_bytes = strings;
  uint64_t entries =
      table.sources.size() * sizeof(SourceEntry) + table.tensors.size() * sizeof(TensorEntry);
  uint64_t index = (sizeof(HeaderFixed) + entries + strings + 7) / 8 * 8;
  if (index_offset != nullptr) *index_offset = index;
  return index + IndexSlots(table.tensors.size()) * sizeof(uint32_t);
}

bool RangeInside(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

// count * size <= limit without overflow.
bool ArrayFits(uint64_t offset, uint64_t count, uint64_t size, uint64_t limit) {
  if (count != 0 && size > UINT64_MAX / count) return false;
  return RangeInside(offset, count * size, limit);
}

}  // namespace

uint64_t Checksum(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

uint64_t NameHash(std::string_view name) { return XXH3_64bits(name.data(), name.size()); }

Result<ArenaLayout> ComputeLayout(const ArenaTable& table, uint64_t page_bytes) {
  if (!IsPowerOfTwo(page_bytes) || page_bytes < kHeaderPageBytes) page_bytes = kHeaderPageBytes;
  uint64_t strings = 0;
  auto table_bytes = TableBytes(table, &strings);
  if (!table_bytes) return InvalidArgument("tensor table too large");
  ArenaLayout layout;
  auto header = AlignUp(*table_bytes, kHeaderPageBytes);
  if (!header) return InvalidArgument("tensor table too large");
  layout.header_bytes = *header;
  layout.data_bytes = table.data_bytes;
  if (layout.data_bytes % kHeaderPageBytes != 0) {
    return Internal("data region is not a multiple of 2 MiB (offsets not assigned?)");
  }
  if (layout.data_bytes > UINT64_MAX - layout.header_bytes) {
    return InvalidArgument("arena size overflows");
  }
  auto file = AlignUp(layout.header_bytes + layout.data_bytes, page_bytes);
  if (!file) return InvalidArgument("arena size overflows");
  layout.file_bytes = *file;
  return layout;
}

Status EncodeHeader(const ArenaTable& table, const ArenaLayout& layout, FileState state,
                    uint32_t loader_pid, uint64_t loader_start_ticks, uint64_t created_unix_ns,
                    uint64_t published_unix_ns, std::span<std::byte> header,
                    uint64_t loader_pid_namespace) {
  uint64_t strings_bytes = 0;
  uint64_t index_offset = 0;
  auto table_bytes = TableBytes(table, &strings_bytes, &index_offset);
  if (!table_bytes || *table_bytes > header.size() || header.size() != layout.header_bytes) {
    return Internal("header region too small for the tensor table");
  }
  std::memset(header.data(), 0, header.size());
  HeaderFixed fixed{};
  std::memcpy(fixed.magic, kMagic, sizeof kMagic);
  fixed.version = kFormatVersion;
  fixed.fixed_bytes = sizeof(HeaderFixed);
  fixed.header_bytes = layout.header_bytes;
  fixed.data_bytes = layout.data_bytes;
  fixed.file_bytes = layout.file_bytes;
  fixed.state = static_cast<uint32_t>(state);
  fixed.loader_pid = loader_pid;
  fixed.loader_start_ticks = loader_start_ticks;
  fixed.loader_pid_namespace = loader_pid_namespace;
  fixed.identity_hash = table.identity_hash;
  std::strncpy(fixed.identity_text, table.identity_text.c_str(), kIdentityTextBytes - 1);
  fixed.alignment = table.alignment;
  fixed.source_count = table.sources.size();
  fixed.tensor_count = table.tensors.size();
  fixed.sources_offset = sizeof(HeaderFixed);
  fixed.tensors_offset = fixed.sources_offset + table.sources.size() * sizeof(SourceEntry);
  fixed.strings_offset = fixed.tensors_offset + table.tensors.size() * sizeof(TensorEntry);
  fixed.strings_bytes = strings_bytes;
  fixed.model_bytes_total = table.model_bytes_total;
  fixed.model_tensors_total = table.model_tensors_total;
  fixed.created_unix_ns = created_unix_ns;
  fixed.published_unix_ns = published_unix_ns;
  fixed.source_entry_bytes = sizeof(SourceEntry);
  fixed.tensor_entry_bytes = sizeof(TensorEntry);

  std::byte* base = header.data();
  uint64_t string_cursor = 0;
  auto put_string = [&](const std::string& s) {
    std::memcpy(base + fixed.strings_offset + string_cursor, s.data(), s.size());
    uint64_t at = string_cursor;
    string_cursor += s.size() + 1;  // the header was zeroed: the NUL is there
    return at;
  };
  for (size_t i = 0; i < table.sources.size(); ++i) {
    const SourceRecord& source = table.sources[i];
    SourceEntry entry{};
    entry.path_offset = put_string(source.path);
    entry.path_bytes = static_cast<uint32_t>(source.path.size());
    entry.size = source.size;
    entry.mtime_ns = source.mtime_ns;
    std::memcpy(base + fixed.sources_offset + i * sizeof(SourceEntry), &entry, sizeof entry);
  }
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    const TensorRecord& tensor = table.tensors[i];
    if (tensor.shape.size() > kMaxDims) {
      return InvalidArgument("tensor " + tensor.name + " has more than 8 dimensions");
    }
    TensorEntry entry{};
    entry.name_offset = put_string(tensor.name);
    entry.name_bytes = static_cast<uint32_t>(tensor.name.size());
    entry.dtype_offset = put_string(tensor.dtype);
    entry.dtype_bytes = static_cast<uint32_t>(tensor.dtype.size());
    entry.n_dims = static_cast<uint32_t>(tensor.shape.size());
    std::copy(tensor.shape.begin(), tensor.shape.end(), entry.shape);
    entry.source_index = tensor.source_index;
    entry.source_offset = tensor.source_offset;
    entry.arena_offset = tensor.arena_offset;
    entry.bytes = tensor.bytes;
    entry.checksum = tensor.checksum;
    std::memcpy(base + fixed.tensors_offset + i * sizeof(TensorEntry), &entry, sizeof entry);
  }
  fixed.table_checksum = Checksum(
      {base + fixed.sources_offset, fixed.strings_offset + strings_bytes - fixed.sources_offset});
  // The name index: slot = 1 + tensor index, linear probing from NameHash(name).
  fixed.fingerprint = table.fingerprint;
  fixed.name_index_offset = index_offset;
  fixed.name_index_slots = IndexSlots(table.tensors.size());
  {
    std::vector<uint32_t> slots(fixed.name_index_slots, 0);
    const uint64_t mask = fixed.name_index_slots - 1;
    for (size_t i = 0; i < table.tensors.size(); ++i) {
      uint64_t at = NameHash(table.tensors[i].name) & mask;
      while (slots[at] != 0) at = (at + 1) & mask;
      slots[at] = static_cast<uint32_t>(i + 1);
    }
    std::memcpy(base + index_offset, slots.data(), slots.size() * sizeof(uint32_t));
    fixed.name_index_checksum = Checksum({base + index_offset, slots.size() * sizeof(uint32_t)});
  }
  fixed.header_checksum = 0;
  fixed.header_checksum = XXH3_64bits(&fixed, sizeof fixed);
  std::memcpy(base, &fixed, sizeof fixed);
  return Status::Ok();
}

Status SetBuildState(std::span<std::byte> header, FileState state, uint64_t published_unix_ns,
                     uint32_t build_attempt, std::string_view build_failure) {
  HeaderFixed fixed{};
  if (header.size() < sizeof fixed) return Internal("arena header too short for its build record");
  std::memcpy(&fixed, header.data(), sizeof fixed);
  if (std::memcmp(fixed.magic, kMagic, sizeof kMagic) != 0 || fixed.version != kFormatVersion) {
    return Internal("not an arena header of this format");
  }
  fixed.state = static_cast<uint32_t>(state);
  fixed.published_unix_ns = published_unix_ns;
  fixed.build_attempt = build_attempt;
  // Escaped byte by byte so that the cut never splits an escape; "..." marks a cut.
  std::string text;
  for (size_t i = 0; i < build_failure.size(); ++i) {
    std::string one = EscapeForMessage(build_failure.substr(i, 1));
    if (text.size() + one.size() > kBuildFailureBytes - 3) {
      text += "...";
      break;
    }
    text += one;
  }
  std::memset(fixed.build_failure, 0, sizeof fixed.build_failure);
  std::memcpy(fixed.build_failure, text.data(), text.size());
  fixed.build_failure_bytes = static_cast<uint32_t>(text.size());
  fixed.header_checksum = 0;
  fixed.header_checksum = XXH3_64bits(&fixed, sizeof fixed);
  std::memcpy(header.data(), &fixed, sizeof fixed);
  return Status::Ok();
}

HeaderSummary SummarizeHeader(std::span<const std::byte> bytes) {
  HeaderSummary summary;
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    return summary;
  }
  summary.our_magic = true;
  HeaderFixed fixed{};
  std::memcpy(&fixed, bytes.data(), std::min(bytes.size(), sizeof fixed));
  summary.version = fixed.version;
  summary.state = static_cast<FileState>(fixed.state);
  summary.loader_pid = fixed.loader_pid;
  summary.loader_start_ticks = fixed.loader_start_ticks;
  summary.loader_pid_namespace = fixed.loader_pid_namespace;
  summary.identity_hash = fixed.identity_hash;
  fixed.identity_text[kIdentityTextBytes - 1] = '\0';
  summary.identity_text = fixed.identity_text;
  summary.layout = {fixed.header_bytes, fixed.data_bytes, fixed.file_bytes};
  summary.engine_made = EngineMade(fixed);
  summary.build_attempt = fixed.build_attempt;
  // Written escaped; read as untrusted bytes, so escaped again where it is not printable ASCII
  // (a clean message comes out unchanged, a forged one cannot drive a terminal).
  const std::string_view failure(fixed.build_failure,
                                 std::min<size_t>(fixed.build_failure_bytes, kBuildFailureBytes));
  const bool clean = std::all_of(failure.begin(), failure.end(),
                                 [](char c) { return c >= 0x20 && c < 0x7f; });
  summary.build_failure = clean ? std::string(failure) : EscapeForMessage(failure);
  return summary;
}

bool EngineMade(const HeaderFixed& fixed) {
  return fixed.fingerprint != 0 && fixed.fingerprint == fixed.identity_hash;
}

namespace {

// XXH3 over many small fields, fed in 64 KiB pieces: one update per field would cost more than
// the hashing on a 90,000-tensor table.
class BufferedHash {
 public:
  BufferedHash() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~BufferedHash() { XXH3_freeState(state_); }
  BufferedHash(const BufferedHash&) = delete;
  BufferedHash& operator=(const BufferedHash&) = delete;
  void Bytes(const void* p, size_t n) {
    if (used_ + n > sizeof buffer_) Flush();
    if (n > sizeof buffer_) {
      XXH3_64bits_update(state_, p, n);
      return;
    }
    std::memcpy(buffer_ + used_, p, n);
    used_ += n;
  }
  void U64(uint64_t v) { Bytes(&v, sizeof v); }
  void Str(std::string_view s) {
    U64(s.size());
    Bytes(s.data(), s.size());
  }
  uint64_t Digest() {
    Flush();
    return XXH3_64bits_digest(state_);
  }

 private:
  void Flush() {
    XXH3_64bits_update(state_, buffer_, used_);
    used_ = 0;
  }
  XXH3_state_t* state_;
  size_t used_ = 0;
  char buffer_[64 * 1024];
};

}  // namespace

// The same fields, in the same order, as ComputeIdentity (arena_table.cc).
uint64_t StoredTableIdentity(std::span<const std::byte> region, const HeaderFixed& fixed) {
  const std::byte* base = region.data();
  const char* strings = reinterpret_cast<const char*>(base + fixed.strings_offset);
  auto hash = std::make_unique<BufferedHash>();
  hash->U64(fixed.source_count);
  for (uint64_t i = 0; i < fixed.source_count; ++i) {
    SourceEntry entry{};
    std::memcpy(&entry, base + fixed.sources_offset + i * sizeof entry, sizeof entry);
    hash->Str({strings + entry.path_offset, entry.path_bytes});
    hash->U64(entry.size);
    hash->U64(static_cast<uint64_t>(entry.mtime_ns));
  }
  hash->U64(fixed.alignment);
  hash->U64(fixed.data_bytes);
  hash->U64(fixed.tensor_count);
  for (uint64_t i = 0; i < fixed.tensor_count; ++i) {
    TensorEntry entry{};
    std::memcpy(&entry, base + fixed.tensors_offset + i * sizeof entry, sizeof entry);
    hash->Str({strings + entry.name_offset, entry.name_bytes});
    hash->Str({strings + entry.dtype_offset, entry.dtype_bytes});
    const uint32_t dims = std::min(entry.n_dims, kMaxDims);
    hash->U64(dims);
    for (uint32_t d = 0; d < dims; ++d) hash->U64(entry.shape[d]);
    hash->U64(entry.source_index);
    hash->U64(entry.source_offset);
    hash->U64(entry.arena_offset);
    hash->U64(entry.bytes);
  }
  return hash->Digest();
}

namespace {

// Why a model's tensor of `dtype` and `shape` cannot be `bytes` long, or "" when it is: the
// dtype must be a GGUF type (lowercase ggml name), a safetensors dtype, or the raw format's
// "u8", and its size for the shape the tensor's bytes.
// A table holds few distinct dtypes: the last one found is looked up again first.
struct DtypeCache {
  std::string_view name;
  const source::GgmlType* ggml = nullptr;
  const source::SafetensorsDtype* safetensors = nullptr;
};

std::string ModelDtypeProblem(std::string_view dtype, std::span<const uint64_t> shape,
                              uint64_t bytes, DtypeCache& cache) {
  if (dtype != cache.name || (cache.ggml == nullptr && cache.safetensors == nullptr)) {
    cache.name = dtype;
    cache.ggml = source::FindGgmlTypeByName(dtype);
    cache.safetensors = cache.ggml == nullptr ? source::FindSafetensorsDtype(dtype) : nullptr;
  }
  std::optional<uint64_t> expected;
  std::string why;
  if (cache.ggml != nullptr) {
    expected = source::GgmlTensorBytes(*cache.ggml, shape, &why);
  } else if (cache.safetensors != nullptr) {
    expected = source::SafetensorsTensorBytes(*cache.safetensors, shape, &why);
  } else if (dtype == "u8") {  // the raw format: a file's bytes as one tensor
    if (shape.size() == 1) expected = shape[0];
  } else {
    return "dtype " + QuoteForMessage(dtype) + " is not a GGUF, safetensors or raw type";
  }
  if (!expected) {
    return "dtype " + std::string(dtype) + " does not fit its shape" +
           (why.empty() ? std::string() : " (" + why + ")");
  }
  if (*expected != bytes) {
    return std::to_string(bytes) + " bytes, but " + std::string(dtype) + " of its shape takes " +
           std::to_string(*expected);
  }
  return "";
}

// What the table says about the data, checked against itself once every entry is known to lie
// inside the header region and its data inside the data region (ValidateHeader's checks):
// the checksums only prove that whoever wrote the file computed them. `fixed` is validated.
Status ValidateTableContents(std::span<const std::byte> region, const HeaderFixed& fixed,
                             const std::string& path) {
  const std::byte* base = region.data();
  const char* strings = reinterpret_cast<const char*>(base + fixed.strings_offset);
  const bool engine_made = EngineMade(fixed);
  if (!IsPowerOfTwo(fixed.alignment) || fixed.alignment > kHugePageBytes) {
    return Corrupt(path + ": tensor alignment " + std::to_string(fixed.alignment) +
                   " is not a power of two up to 2 MiB");
  }
  auto entry_at = [&](uint64_t i) {
    TensorEntry entry{};
    std::memcpy(&entry, base + fixed.tensors_offset + i * sizeof entry, sizeof entry);
    return entry;
  };
  auto name_of = [&](const TensorEntry& entry) {
    return std::string(strings + entry.name_offset, entry.name_bytes);
  };
  auto overlap = [&](const TensorEntry& before, const TensorEntry& after) {
    return Corrupt(path + ": tensors " + name_of(before) + " (data offset " +
                   std::to_string(before.arena_offset) + ", " + std::to_string(before.bytes) +
                   " bytes) and " + name_of(after) + " (data offset " +
                   std::to_string(after.arena_offset) + ") overlap");
  };
  DtypeCache dtypes;
  // Writers give offsets in table order, so the overlap check is one pass against the tensor
  // before; a table out of that order is sorted by offset below.
  bool in_order = true;
  uint64_t last = 0;  // the last tensor with bytes, when `any`
  bool any = false;
  for (uint64_t i = 0; i < fixed.tensor_count; ++i) {
    const TensorEntry entry = entry_at(i);
    std::string_view dtype(strings + entry.dtype_offset, entry.dtype_bytes);
    std::string problem;
    if (engine_made) {
      if (dtype.empty() || dtype.size() > 32 || !ControlByteProblem(dtype).empty()) {
        problem = "dtype " + QuoteForMessage(dtype) + " is not 1 to 32 printable bytes";
      }
    } else {
      problem = ModelDtypeProblem(dtype, {entry.shape, entry.n_dims}, entry.bytes, dtypes);
    }
    if (!problem.empty()) return Corrupt(path + ": tensor " + name_of(entry) + ": " + problem);
    // Every writer aligns a tensor to at least TensorAlignment (an engine may ask for more).
    const uint64_t alignment = TensorAlignment(fixed.alignment, entry.bytes);
    if (entry.arena_offset % alignment != 0) {
      return Corrupt(path + ": tensor " + name_of(entry) + " at data offset " +
                     std::to_string(entry.arena_offset) + " is not aligned to " +
                     std::to_string(alignment) + " bytes");
    }
    if (entry.bytes == 0 || !in_order) continue;
    if (any) {
      const TensorEntry before = entry_at(last);
      if (entry.arena_offset < before.arena_offset) {
        in_order = false;
        continue;
      }
      // Ranges lie inside the data region (checked): no overflow.
      if (before.arena_offset + before.bytes > entry.arena_offset) return overlap(before, entry);
    }
    last = i;
    any = true;
  }
  if (!in_order) {
    // Two tensors over the same bytes would hand one tensor's bytes out as the other's.
    std::vector<std::pair<uint64_t, uint32_t>> ranges;  // (offset, index) of tensors with bytes
    ranges.reserve(fixed.tensor_count);
    for (uint64_t i = 0; i < fixed.tensor_count; ++i) {
      const TensorEntry entry = entry_at(i);
      if (entry.bytes > 0) ranges.emplace_back(entry.arena_offset, static_cast<uint32_t>(i));
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 1; k < ranges.size(); ++k) {
      const TensorEntry before = entry_at(ranges[k - 1].second);
      const TensorEntry after = entry_at(ranges[k].second);
      if (before.arena_offset + before.bytes > after.arena_offset) return overlap(before, after);
    }
  }
  if (!engine_made) {
    const uint64_t recomputed = StoredTableIdentity(region, fixed);
    if (recomputed != fixed.identity_hash) {
      char hex[64];
      std::snprintf(hex, sizeof hex, "%016llx, its table hashes to %016llx",
                    static_cast<unsigned long long>(fixed.identity_hash),
                    static_cast<unsigned long long>(recomputed));
      return Corrupt(path + ": identity hash mismatch: the header says " + hex +
                     " (the table was changed after it was made)");
    }
  }
  return Status::Ok();
}

// Every check DecodeHeader makes, without building a table: the fixed header against the real
// size, every array and string inside the header region, both checksums, every entry, and the
// name index when there is one. On success *out is the fixed header.
Status ValidateHeader(std::span<const std::byte> region, uint64_t file_size,
                      const std::string& path, HeaderFixed* out) {
  if (region.size() < sizeof(HeaderFixed)) {
    return Corrupt(path + ": " + std::to_string(file_size) +
                   " bytes is too short for an arena header");
  }
  HeaderFixed fixed{};
  std::memcpy(&fixed, region.data(), sizeof fixed);
  if (std::memcmp(fixed.magic, kMagic, sizeof kMagic) != 0) {
    return Corrupt(path + ": not an expert-arena file (bad magic)");
  }
  if (fixed.version != kFormatVersion) {
    return Corrupt(path + ": arena format version " + std::to_string(fixed.version) +
                   ", this build reads version " + std::to_string(kFormatVersion));
  }
  uint64_t stored_checksum = fixed.header_checksum;
  fixed.header_checksum = 0;
  if (XXH3_64bits(&fixed, sizeof fixed) != stored_checksum) {
    return Corrupt(path + ": header checksum mismatch (corrupted header)");
  }
  fixed.header_checksum = stored_checksum;
  fixed.identity_text[kIdentityTextBytes - 1] = '\0';
  if (fixed.fixed_bytes != sizeof(HeaderFixed) || fixed.source_entry_bytes != sizeof(SourceEntry) ||
      fixed.tensor_entry_bytes != sizeof(TensorEntry)) {
    return Corrupt(path + ": header record sizes do not match this build");
  }
  if (fixed.header_bytes == 0 || fixed.header_bytes % kHeaderPageBytes != 0) {
    return Corrupt(path + ": header size " + std::to_string(fixed.header_bytes) +
                   " is not a multiple of 2 MiB");
  }
  if (fixed.data_bytes % kHeaderPageBytes != 0) {
    return Corrupt(path + ": data size " + std::to_string(fixed.data_bytes) +
                   " is not a multiple of 2 MiB");
  }
  if (!RangeInside(fixed.header_bytes, fixed.data_bytes, fixed.file_bytes) ||
      fixed.file_bytes != file_size) {
    return Corrupt(path + ": header says " + std::to_string(fixed.header_bytes) + " + " +
                   std::to_string(fixed.data_bytes) + " bytes in a " +
                   std::to_string(fixed.file_bytes) + "-byte file, but the file has " +
                   std::to_string(file_size) + " bytes");
  }
  if (region.size() < fixed.header_bytes) {
    return Corrupt(path + ": header region incomplete");
  }
  const uint64_t limit = fixed.header_bytes;
  if (fixed.sources_offset < sizeof(HeaderFixed) || fixed.sources_offset % 8 != 0 ||
      fixed.tensors_offset % 8 != 0 ||
      !ArrayFits(fixed.sources_offset, fixed.source_count, sizeof(SourceEntry), limit) ||
      !ArrayFits(fixed.tensors_offset, fixed.tensor_count, sizeof(TensorEntry), limit) ||
      !RangeInside(fixed.strings_offset, fixed.strings_bytes, limit) ||
      fixed.strings_offset < fixed.sources_offset) {
    return Corrupt(path + ": tensor table (" + std::to_string(fixed.tensor_count) +
                   " tensors) points outside the " + std::to_string(limit) + "-byte header region");
  }
  const std::byte* base = region.data();
  uint64_t table_span = fixed.strings_offset + fixed.strings_bytes - fixed.sources_offset;
  if (Checksum({base + fixed.sources_offset, table_span}) != fixed.table_checksum) {
    return Corrupt(path + ": tensor table checksum mismatch (corrupted table)");
  }
  for (uint64_t i = 0; i < fixed.source_count; ++i) {
    SourceEntry entry{};
    std::memcpy(&entry, base + fixed.sources_offset + i * sizeof entry, sizeof entry);
    if (!RangeInside(entry.path_offset, entry.path_bytes, fixed.strings_bytes)) {
      return Corrupt(path + ": source " + std::to_string(i) + " name points past the strings");
    }
  }
  for (uint64_t i = 0; i < fixed.tensor_count; ++i) {
    TensorEntry entry{};
    std::memcpy(&entry, base + fixed.tensors_offset + i * sizeof entry, sizeof entry);
    if (!RangeInside(entry.name_offset, entry.name_bytes, fixed.strings_bytes) ||
        !RangeInside(entry.dtype_offset, entry.dtype_bytes, fixed.strings_bytes)) {
      return Corrupt(path + ": tensor " + std::to_string(i) + " name points past the strings");
    }
    std::string_view name(reinterpret_cast<const char*>(base + fixed.strings_offset) +
                              entry.name_offset,
                          entry.name_bytes);
    if (std::string problem = TensorNameProblem(name); !problem.empty()) {
      return Corrupt(path + ": tensor " + std::to_string(i) + ": " + problem);
    }
    if (fixed.name_index_slots != 0) {
      // Files with a name index end every name and dtype with a NUL (read in place as C
      // strings).
      const char* strings = reinterpret_cast<const char*>(base + fixed.strings_offset);
      if (entry.name_offset + entry.name_bytes >= fixed.strings_bytes ||
          entry.dtype_offset + entry.dtype_bytes >= fixed.strings_bytes ||
          strings[entry.name_offset + entry.name_bytes] != '\0' ||
          strings[entry.dtype_offset + entry.dtype_bytes] != '\0') {
        return Corrupt(path + ": tensor " + std::to_string(i) +
                       ": name or dtype not NUL-terminated");
      }
    }
    if (entry.n_dims > kMaxDims) {
      return Corrupt(path + ": tensor " + std::string(name) + " has " +
                     std::to_string(entry.n_dims) + " dimensions");
    }
    if (!RangeInside(entry.arena_offset, entry.bytes, fixed.data_bytes)) {
      return Corrupt(path + ": tensor " + std::string(name) + " (offset " +
                     std::to_string(entry.arena_offset) + ", " + std::to_string(entry.bytes) +
                     " bytes) lies past the end of the " + std::to_string(fixed.data_bytes) +
                     "-byte data region");
    }
    if (entry.source_index >= fixed.source_count) {
      return Corrupt(path + ": tensor " + std::string(name) + " names source " +
                     std::to_string(entry.source_index) + " of " +
                     std::to_string(fixed.source_count));
    }
  }
  if (fixed.name_index_slots != 0) {
    const uint64_t slots = fixed.name_index_slots;
    if (!IsPowerOfTwo(slots) || slots <= fixed.tensor_count || fixed.name_index_offset % 8 != 0 ||
        fixed.name_index_offset < fixed.strings_offset + fixed.strings_bytes ||
        !ArrayFits(fixed.name_index_offset, slots, sizeof(uint32_t), limit)) {
      return Corrupt(path + ": name index (" + std::to_string(slots) +
                     " slots) is malformed or points outside the header region");
    }
    std::span<const std::byte> index(base + fixed.name_index_offset, slots * sizeof(uint32_t));
    if (Checksum(index) != fixed.name_index_checksum) {
      return Corrupt(path + ": name index checksum mismatch (corrupted index)");
    }
  }
  EA_RETURN_IF_ERROR(ValidateTableContents(region, fixed, path));
  *out = fixed;
  return Status::Ok();
}

// The table's scalars as the fixed header records them (no sources, no tensors).
ArenaTable TableScalars(const HeaderFixed& fixed) {
  ArenaTable table;
  table.alignment = fixed.alignment;
  table.data_bytes = fixed.data_bytes;
  table.identity_hash = fixed.identity_hash;
  table.identity_text = fixed.identity_text;
  table.model_bytes_total = fixed.model_bytes_total;
  table.model_tensors_total = fixed.model_tensors_total;
  table.fingerprint = fixed.fingerprint;
  return table;
}

}  // namespace

Status DecodeHeader(std::span<const std::byte> region, uint64_t file_size, const std::string& path,
                    ArenaTable* table, HeaderSummary* summary) {
  HeaderFixed fixed{};
  EA_RETURN_IF_ERROR(ValidateHeader(region, file_size, path, &fixed));
  if (summary != nullptr) *summary = SummarizeHeader(region);
  if (table == nullptr) return Status::Ok();
  const std::byte* base = region.data();
  auto get_string = [&](uint64_t offset, uint64_t bytes, std::string* out) {
    out->assign(reinterpret_cast<const char*>(base + fixed.strings_offset + offset), bytes);
  };
  ArenaTable decoded = TableScalars(fixed);
  decoded.sources.resize(fixed.source_count);
  for (uint64_t i = 0; i < fixed.source_count; ++i) {
    SourceEntry entry{};
    std::memcpy(&entry, base + fixed.sources_offset + i * sizeof entry, sizeof entry);
    SourceRecord& source = decoded.sources[i];
    get_string(entry.path_offset, entry.path_bytes, &source.path);
    source.size = entry.size;
    source.mtime_ns = entry.mtime_ns;
  }
  decoded.tensors.resize(fixed.tensor_count);
  for (uint64_t i = 0; i < fixed.tensor_count; ++i) {
    TensorEntry entry{};
    std::memcpy(&entry, base + fixed.tensors_offset + i * sizeof entry, sizeof entry);
    TensorRecord& tensor = decoded.tensors[i];
    get_string(entry.name_offset, entry.name_bytes, &tensor.name);
    get_string(entry.dtype_offset, entry.dtype_bytes, &tensor.dtype);
    tensor.shape.assign(entry.shape, entry.shape + entry.n_dims);
    tensor.source_index = entry.source_index;
    tensor.source_offset = entry.source_offset;
    tensor.arena_offset = entry.arena_offset;
    tensor.bytes = entry.bytes;
    tensor.checksum = entry.checksum;
  }
  *table = std::move(decoded);
  return Status::Ok();
}

Result<TableView> TableView::Open(std::span<const std::byte> region, uint64_t file_size,
                                  const std::string& path) {
  if (reinterpret_cast<uintptr_t>(region.data()) % 8 != 0) {
    return Internal(path + ": header region not 8-byte aligned in memory");
  }
  TableView view;
  EA_RETURN_IF_ERROR(ValidateHeader(region, file_size, path, &view.fixed_));
  view.base_ = region.data();
  if (view.fixed_.name_index_slots != 0) {
    view.slots_ = reinterpret_cast<const uint32_t*>(view.base_ + view.fixed_.name_index_offset);
  }
  return view;
}

std::string_view TableView::String(uint64_t offset, uint64_t bytes) const {
  if (!RangeInside(offset, bytes, fixed_.strings_bytes)) return {};
  return {reinterpret_cast<const char*>(base_ + fixed_.strings_offset + offset),
          static_cast<size_t>(bytes)};
}

TensorEntry TableView::entry(size_t index) const {
  TensorEntry entry{};
  std::memcpy(&entry, base_ + fixed_.tensors_offset + index * sizeof entry, sizeof entry);
  return entry;
}

std::string_view TableView::name(size_t index) const {
  TensorEntry e = entry(index);
  return String(e.name_offset, e.name_bytes);
}

std::string_view TableView::dtype(size_t index) const {
  TensorEntry e = entry(index);
  return String(e.dtype_offset, e.dtype_bytes);
}

std::span<const uint64_t> TableView::shape(size_t index) const {
  const auto* e =
      reinterpret_cast<const TensorEntry*>(base_ + fixed_.tensors_offset + index * sizeof(TensorEntry));
  return {e->shape, std::min<size_t>(e->n_dims, kMaxDims)};
}

SourceRecord TableView::source(size_t index) const {
  SourceEntry entry{};
  std::memcpy(&entry, base_ + fixed_.sources_offset + index * sizeof entry, sizeof entry);
  return {std::string(String(entry.path_offset, entry.path_bytes)), entry.size, entry.mtime_ns};
}

std::optional<size_t> TableView::Find(std::string_view wanted) const {
  if (slots_ == nullptr) return std::nullopt;
  const uint64_t mask = fixed_.name_index_slots - 1;
  uint64_t at = NameHash(wanted) & mask;
  for (uint64_t probes = 0; probes < fixed_.name_index_slots; ++probes) {
    uint32_t slot = slots_[at];
    if (slot == 0 || slot > fixed_.tensor_count) return std::nullopt;
    if (name(slot - 1) == wanted) return slot - 1;
    at = (at + 1) & mask;
  }
  return std::nullopt;
}

ArenaTable TableView::Summary() const { return TableScalars(fixed_); }

}  // namespace expert_arena::format
