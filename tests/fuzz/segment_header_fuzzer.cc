// Fuzz target: the stream segment header check (stream::ValidateHeader in
// src/stream/segment_format.cc), which consumers (OpenSegment), `expert-arena info` and sweeps
// (InspectSegment) apply to a segment file that another process wrote.
//
// Then, on an accepted header, the check a consumer applies to a peer's descriptor before it
// touches the block (stream::ValidateBlockReference, in StreamConsumer::Open).
//
// Input: u64 file size | SegmentHeader (256 bytes) | u64 slot | u64 offset | u64 length, each
// part zero-extended when the input is shorter.
//
// Checks: for an accepted header, everything those readers then compute from it stays inside
// the file: the reader table and block table they read, and the data region, which starts
// after the block table; its logical name (printed by `info` and sweeps) is NUL-terminated
// and holds no control byte, and a refusal's message holds none either; an accepted block
// reference names a slot of the table and bytes of the data region.
#include <algorithm>
#include <cstring>
#include <string_view>

#include "common/escape.h"
#include "fuzz_util.h"
#include "stream/segment_format.h"

using namespace expert_arena;
using stream::SegmentHeader;

namespace {

bool Inside(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t file_bytes = 0;
  std::memcpy(&file_bytes, data, 8);
  SegmentHeader header{};
  std::memcpy(&header, data + 8, std::min(size - 8, sizeof header));
  std::string why = stream::ValidateHeader(header, file_bytes);
  if (!why.empty()) {
    fuzz::CheckRefusal(Corrupt(why));
    FUZZ_CHECK(ControlByteProblem(why).empty());
    return 0;
  }
  FUZZ_CHECK(header.file_bytes == file_bytes);
  const size_t name_bytes = strnlen(header.logical_name, sizeof header.logical_name);
  FUZZ_CHECK(name_bytes < sizeof header.logical_name);
  FUZZ_CHECK(ControlByteProblem(std::string_view(header.logical_name, name_bytes)).empty());
  // InspectSegment reads kMaxReaders entries at readers_offset and slot_count slots at
  // slots_offset; SegmentView::Of points into the mapping there.
  FUZZ_CHECK(Inside(header.readers_offset,
                    uint64_t{stream::kMaxReaders} * sizeof(stream::ReaderEntry), file_bytes));
  FUZZ_CHECK(header.slot_count >= 1 && header.slot_count <= stream::kMaxSlots);
  const uint64_t slots_bytes = uint64_t{header.slot_count} * sizeof(stream::BlockSlot);
  FUZZ_CHECK(Inside(header.slots_offset, slots_bytes, file_bytes));
  // The tables lie in the header region, before the data.
  FUZZ_CHECK(header.readers_offset + stream::kMaxReaders * sizeof(stream::ReaderEntry) <=
             header.slots_offset);
  FUZZ_CHECK(header.slots_offset + slots_bytes <= header.data_offset);
  FUZZ_CHECK(header.data_offset % kHugePageBytes == 0);
  FUZZ_CHECK(Inside(header.data_offset, header.data_bytes, file_bytes));
  FUZZ_CHECK(header.kind <= static_cast<uint32_t>(stream::SegmentKind::kSpill));

  uint64_t reference[3] = {};  // slot, offset, length
  const size_t at = 8 + sizeof header;
  if (size > at) std::memcpy(reference, data + at, std::min(size - at, sizeof reference));
  const auto [slot, offset, length] = reference;
  why = stream::ValidateBlockReference(slot, offset, length, header.slot_count, header.data_offset,
                                       file_bytes);
  if (!why.empty()) {
    fuzz::CheckRefusal(InvalidArgument(why));
    return 0;
  }
  FUZZ_CHECK(slot < header.slot_count);
  FUZZ_CHECK(offset >= header.data_offset && Inside(offset, length, file_bytes));
  return 0;
}
