#include "format/arena_table.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>

#include "common/escape.h"
#include "common/units.h"

namespace expert_arena::format {

namespace {

// True when no byte of `text` is below 0x20 or 0x7f, eight bytes at a time (an attach checks
// every name of a 90,000-tensor table). A maybe is decided by ControlByteProblem.
bool Printable(std::string_view text) {
  constexpr uint64_t kOnes = 0x0101010101010101ull, kHigh = 0x8080808080808080ull;
  size_t i = 0;
  for (; i + 8 <= text.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, text.data() + i, 8);
    uint64_t below = (w - 0x20 * kOnes) & ~w & kHigh;
    uint64_t del = w ^ (0x7f * kOnes);
    if ((below | ((del - kOnes) & ~del & kHigh)) != 0) return false;
  }
  for (; i < text.size(); ++i) {
    auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) return false;
  }
  return true;
}

}  // namespace

std::string TensorNameProblem(std::string_view name) {
  if (name.empty()) return "the name is empty";
  if (Printable(name)) return "";
  if (std::string problem = ControlByteProblem(name); !problem.empty()) {
    return "the name holds " + problem;
  }
  return "";
}

uint64_t TensorAlignment(uint64_t alignment, uint64_t bytes) {
  if (bytes >= alignment) return alignment;
  return std::min(alignment, std::max(kPackedAlignment, std::bit_ceil(bytes)));
}

Status AssignArenaOffsets(ArenaTable& table) {
  if (!IsPowerOfTwo(table.alignment) || table.alignment > kHugePageBytes) {
    return InvalidArgument("tensor alignment must be a power of two up to 2 MiB, got " +
                           std::to_string(table.alignment));
  }
  uint64_t cursor = 0;
  for (TensorRecord& tensor : table.tensors) {
    auto offset = AlignUp(cursor, TensorAlignment(table.alignment, tensor.bytes));
    if (!offset || tensor.bytes > UINT64_MAX - *offset) {
      return InvalidArgument("arena size overflows at tensor " + tensor.name);
    }
    tensor.arena_offset = *offset;
    cursor = *offset + tensor.bytes;
  }
  auto data = AlignUp(cursor, kHugePageBytes);
  if (!data) return InvalidArgument("arena size overflows");
  // An arena always has at least one data page, so a mapping of it is never empty.
  table.data_bytes = *data == 0 ? kHugePageBytes : *data;
  return Status::Ok();
}

void ComputeIdentity(ArenaTable& table) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  auto add = [&](const void* p, size_t n) { XXH3_64bits_update(state, p, n); };
  auto add_u64 = [&](uint64_t v) { add(&v, sizeof v); };
  auto add_str = [&](const std::string& s) {
    add_u64(s.size());
    add(s.data(), s.size());
  };
  add_u64(table.sources.size());
  for (const SourceRecord& source : table.sources) {
    add_str(source.path);
    add_u64(source.size);
    add_u64(static_cast<uint64_t>(source.mtime_ns));
  }
  add_u64(table.alignment);
  add_u64(table.data_bytes);
  add_u64(table.tensors.size());
  for (const TensorRecord& tensor : table.tensors) {
    add_str(tensor.name);
    add_str(tensor.dtype);
    add_u64(tensor.shape.size());
    for (uint64_t dim : tensor.shape) add_u64(dim);
    add_u64(tensor.source_index);
    add_u64(tensor.source_offset);
    add_u64(tensor.arena_offset);
    add_u64(tensor.bytes);
  }
  table.identity_hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  if (table.identity_text.empty()) {
    std::string text;
    for (size_t i = 0; i < table.sources.size(); ++i) {
      if (i > 0) text += ", ";
      if (i == 3) {
        text += "... (" + std::to_string(table.sources.size()) + " files)";
        break;
      }
      text += table.sources[i].path;
    }
    char tail[128];
    std::snprintf(tail, sizeof tail, " [%zu tensors, %s, id %016llx]", table.tensors.size(),
                  FormatBytes(table.data_bytes).c_str(),
                  static_cast<unsigned long long>(table.identity_hash));
    table.identity_text = text + tail;
  }
}

}  // namespace expert_arena::format
