#include "stream/segment_format.h"

#include "common/escape.h"

namespace expert_arena::stream {

std::string ValidateHeader(const SegmentHeader& h, uint64_t file_bytes) {
  if (std::memcmp(h.magic, kSegmentMagic, sizeof kSegmentMagic) != 0) {
    return "not a stream segment (bad magic)";
  }
  if (h.version != kSegmentVersion) {
    return "stream segment format version " + std::to_string(h.version) + ", this build reads " +
           std::to_string(kSegmentVersion);
  }
  if (h.header_struct_bytes != sizeof(SegmentHeader) || h.slot_bytes != sizeof(BlockSlot) ||
      h.reader_entry_bytes != sizeof(ReaderEntry)) {
    return "stream segment with unexpected structure sizes";
  }
  if (h.file_bytes != file_bytes) {
    return "header says " + std::to_string(h.file_bytes) + " bytes but the file has " +
           std::to_string(file_bytes);
  }
  if (h.readers_offset != kReadersOffset || h.slots_offset != kSlotsOffset ||
      h.reader_entries != kMaxReaders) {
    return "stream segment with an unexpected table layout";
  }
  if (h.slot_count == 0 || h.slot_count > kMaxSlots) {
    return "block table of " + std::to_string(h.slot_count) + " entries (1.." +
           std::to_string(kMaxSlots) + " expected)";
  }
  if (h.data_offset % kHugePageBytes != 0 ||
      h.data_offset < kSlotsOffset + uint64_t{h.slot_count} * sizeof(BlockSlot) ||
      h.data_offset > file_bytes || h.data_bytes > file_bytes - h.data_offset) {
    return "data region [" + std::to_string(h.data_offset) + ", +" + std::to_string(h.data_bytes) +
           ") outside the file of " + std::to_string(file_bytes) + " bytes";
  }
  if (h.kind > static_cast<uint32_t>(SegmentKind::kSpill)) return "unknown segment kind";
  // The logical name is printed by `expert-arena info` and sweeps: a NUL-terminated string
  // without control bytes, as every producer writes it (1-48 of [A-Za-z0-9_.]).
  const size_t name_bytes = strnlen(h.logical_name, sizeof h.logical_name);
  if (name_bytes == sizeof h.logical_name) return "logical name not NUL-terminated";
  const std::string_view name(h.logical_name, name_bytes);
  if (std::string problem = ControlByteProblem(name); !problem.empty()) {
    return "logical name " + QuoteForMessage(name) + " holds " + problem;
  }
  return "";
}

std::string ValidateBlockReference(uint64_t slot, uint64_t offset, uint64_t length,
                                   uint32_t slot_count, uint64_t data_offset, uint64_t file_bytes) {
  if (slot >= slot_count) {
    return "block " + std::to_string(slot) + " past the " + std::to_string(slot_count) + " blocks";
  }
  if (offset < data_offset || offset > file_bytes || length > file_bytes - offset) {
    return "bytes [" + std::to_string(offset) + ", +" + std::to_string(length) +
           ") outside the data region [" + std::to_string(data_offset) + ", " +
           std::to_string(file_bytes) + ")";
  }
  return "";
}

static std::string TextProblem(std::string_view text) {
  if (std::string problem = ControlByteProblem(text); !problem.empty()) return "holds " + problem;
  if (text.size() > kMaxDescriptorText) {
    return "is " + std::to_string(text.size()) + " bytes, more than the " +
           std::to_string(kMaxDescriptorText) + " a descriptor carries";
  }
  return "";
}

std::string StreamKeyProblem(std::string_view key) {
  if (key.empty()) return "is empty";
  return TextProblem(key);
}

std::string DtypeProblem(std::string_view dtype) { return TextProblem(dtype); }

static bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

bool IsValidSegmentName(std::string_view name) {
  if (name.size() <= kSegmentPrefix.size() || name.size() > 200) return false;
  if (name.substr(0, kSegmentPrefix.size()) != kSegmentPrefix) return false;
  if (name.find("..") != std::string_view::npos) return false;
  for (char c : name) {
    if (!IsNameChar(c)) return false;
  }
  return true;
}

bool IsValidLogicalName(std::string_view name) {
  // The name becomes part of every segment file name, which consumers check against
  // IsValidSegmentName: the same characters, and no "..". Nothing parses a segment name by its
  // dashes (owners come from the header), so '-' is as safe as '_'.
  if (name.empty() || name.size() > 48) return false;
  if (name.find("..") != std::string_view::npos) return false;
  for (char c : name) {
    if (!IsNameChar(c)) return false;
  }
  return true;
}

uint64_t SpendDeadReaderHolds(const SegmentView& view, uint32_t entry) {
  const uint64_t bit = uint64_t{1} << entry;
  uint64_t released = 0;
  for (uint32_t i = 0; i < view.slot_count; ++i) {
    BlockSlot& s = view.slots[i];
    auto holders = AtomicWord(s.holders);
    if ((holders.load(std::memory_order_seq_cst) & bit) == 0) continue;
    // The share first, then the bit: the owner frees a block only when both say so, and a
    // reader releases in the other order (bit, then share), so a reader that died between
    // its two steps is never charged twice.
    auto control = AtomicWord(s.control);
    uint64_t c = control.load(std::memory_order_seq_cst);
    while (ControlWord::State(c) == BlockState::kPublished && ControlWord::Pending(c) > 0) {
      uint64_t less = ControlWord::Make(BlockState::kPublished, ControlWord::Pending(c) - 1,
                                        ControlWord::Generation(c));
      if (control.compare_exchange_weak(c, less, std::memory_order_seq_cst)) {
        ++released;
        break;
      }
    }
    holders.fetch_and(~bit, std::memory_order_seq_cst);
  }
  view.epoch().fetch_add(1, std::memory_order_release);
  return released;
}

}  // namespace expert_arena::stream
