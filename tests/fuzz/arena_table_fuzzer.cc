// Fuzz target: the arena file's tensor table (format/arena_format.h) behind a fixed header
// that is always well formed, so that every run reaches the table checks: the source and
// tensor entries, their strings, and the name index, read by DecodeHeader (info, verify,
// attach by decoding) and by TableView (attach in place). arena_header_fuzzer.cc fuzzes the
// fixed header itself; here a hostile writer's table is what varies, with every checksum
// recomputed as that writer would.
//
// Input: u8 flags | u8 sources | u8 tensors | u8 alignment log2 | u8 data MiB / 2 |
// u16 string bytes | the table: source entries, tensor entries, strings, and (flag 1) the
// name index slots; zero-extended to what the counts need.
// Flags: 1 the name index comes from the input (else it is built from the entries' names,
// as EncodeHeader builds it, so Find is exercised on the table the input describes); 2 no
// name index (a file written before it); 4 a data region of one byte more than its 2 MiB
// multiple (refused: not a multiple of 2 MiB).
//
// Checks: DecodeHeader and TableView accept the same tables and read the same tensors; an
// accepted table's tensors lie inside the data region with at most kMaxDims dimensions and
// a source each; Find finds a tensor of each name (never another's); an accepted table survives
// EncodeHeader/DecodeHeader unchanged.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string_view>
#include <vector>

#include "format/arena_format.h"
#include "fuzz_util.h"

using namespace expert_arena;
using format::HeaderFixed;
using format::SourceEntry;
using format::TensorEntry;

namespace {

constexpr size_t kPrefixBytes = 7;

bool Inside(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

// The name index EncodeHeader writes for these entries (slot = 1 + tensor index, linear
// probing from NameHash); entries whose name lies outside the strings are left out (the
// decoder refuses them first).
void BuildNameIndex(std::vector<std::byte>& region, const HeaderFixed& fixed) {
  const uint64_t mask = fixed.name_index_slots - 1;
  std::vector<uint32_t> slots(fixed.name_index_slots, 0);
  for (uint64_t i = 0; i < fixed.tensor_count; ++i) {
    TensorEntry e;
    std::memcpy(&e, region.data() + fixed.tensors_offset + i * sizeof e, sizeof e);
    if (!Inside(e.name_offset, e.name_bytes, fixed.strings_bytes)) continue;
    std::string_view name(reinterpret_cast<const char*>(region.data()) + fixed.strings_offset +
                              e.name_offset,
                          e.name_bytes);
    uint64_t at = format::NameHash(name) & mask;
    while (slots[at] != 0) at = (at + 1) & mask;
    slots[at] = static_cast<uint32_t>(i + 1);
  }
  std::memcpy(region.data() + fixed.name_index_offset, slots.data(),
              slots.size() * sizeof(uint32_t));
}

void CheckRoundTrip(const format::ArenaTable& table) {
  auto layout = format::ComputeLayout(table, format::kHeaderPageBytes);
  if (!layout.ok() || layout->header_bytes > format::kHeaderPageBytes) return;
  std::vector<std::byte> region(layout->header_bytes);
  FUZZ_CHECK(format::EncodeHeader(table, *layout, format::FileState::kPublished, 1, 2, 3, 4, region)
                 .ok());
  format::ArenaTable again;
  Status status = format::DecodeHeader(region, layout->file_bytes, "again", &again, nullptr);
  if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
  FUZZ_CHECK(status.ok());
  FUZZ_CHECK(again.sources.size() == table.sources.size());
  FUZZ_CHECK(again.tensors.size() == table.tensors.size());
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    const format::TensorRecord& a = table.tensors[i];
    const format::TensorRecord& b = again.tensors[i];
    FUZZ_CHECK(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape);
    FUZZ_CHECK(a.arena_offset == b.arena_offset && a.bytes == b.bytes);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kPrefixBytes) return 0;
  const uint8_t flags = data[0];
  HeaderFixed fixed{};
  std::memcpy(fixed.magic, format::kMagic, sizeof format::kMagic);
  fixed.version = format::kFormatVersion;
  fixed.fixed_bytes = sizeof(HeaderFixed);
  fixed.header_bytes = format::kHeaderPageBytes;
  fixed.data_bytes = (uint64_t{data[4]} + 1) * format::kHeaderPageBytes + ((flags & 4) ? 1 : 0);
  fixed.file_bytes = fixed.header_bytes + fixed.data_bytes;
  fixed.state = static_cast<uint32_t>(format::FileState::kPublished);
  fixed.loader_pid = 1;
  std::memcpy(fixed.identity_text, "fuzz table", 10);
  fixed.alignment = uint64_t{1} << (data[3] % 24);
  fixed.source_count = data[1] % 16;
  fixed.tensor_count = data[2] % 64;
  fixed.source_entry_bytes = sizeof(SourceEntry);
  fixed.tensor_entry_bytes = sizeof(TensorEntry);
  fixed.sources_offset = sizeof(HeaderFixed);
  fixed.tensors_offset = fixed.sources_offset + fixed.source_count * sizeof(SourceEntry);
  fixed.strings_offset = fixed.tensors_offset + fixed.tensor_count * sizeof(TensorEntry);
  uint16_t strings_bytes = 0;
  std::memcpy(&strings_bytes, data + 5, 2);
  fixed.strings_bytes = strings_bytes;
  const uint64_t strings_end = fixed.strings_offset + fixed.strings_bytes;
  if ((flags & 2) == 0) {
    uint64_t slots = 8;
    while (slots < 2 * fixed.tensor_count + 1) slots *= 2;
    fixed.name_index_offset = (strings_end + 7) / 8 * 8;
    fixed.name_index_slots = slots;
  }
  const uint64_t table_end = fixed.name_index_slots != 0
                                 ? fixed.name_index_offset + fixed.name_index_slots * 4
                                 : strings_end;

  std::vector<std::byte> region(format::kHeaderPageBytes);
  const std::span<const std::byte> input = fuzz::Bytes(data + kPrefixBytes, size - kPrefixBytes);
  const uint64_t input_end = (flags & 1) ? table_end : strings_end;
  std::copy_n(input.begin(), std::min<uint64_t>(input.size(), input_end - fixed.sources_offset),
              region.begin() + static_cast<std::ptrdiff_t>(fixed.sources_offset));
  if (fixed.name_index_slots != 0 && (flags & 1) == 0) BuildNameIndex(region, fixed);
  fixed.table_checksum =
      XXH3_64bits(region.data() + fixed.sources_offset, strings_end - fixed.sources_offset);
  if (fixed.name_index_slots != 0) {
    fixed.name_index_checksum =
        XXH3_64bits(region.data() + fixed.name_index_offset, fixed.name_index_slots * 4);
  }
  fixed.header_checksum = 0;
  fixed.header_checksum = XXH3_64bits(&fixed, sizeof fixed);
  std::memcpy(region.data(), &fixed, sizeof fixed);

  format::ArenaTable table;
  format::HeaderSummary summary;
  Status status = format::DecodeHeader(region, fixed.file_bytes, "fuzz-table", &table, &summary);
  auto view = format::TableView::Open(region, fixed.file_bytes, "fuzz-table");
  if (!status.ok()) {
    fuzz::CheckRefusal(status);
    FUZZ_CHECK(!view.ok());
    return 0;
  }
  FUZZ_CHECK(view.ok());
  FUZZ_CHECK(view->tensor_count() == table.tensors.size());
  FUZZ_CHECK(view->source_count() == table.sources.size());
  FUZZ_CHECK(view->in_place() == (fixed.name_index_slots != 0));
  FUZZ_CHECK(table.data_bytes == fixed.data_bytes);
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    const format::TensorRecord& t = table.tensors[i];
    FUZZ_CHECK(Inside(t.arena_offset, t.bytes, table.data_bytes));
    FUZZ_CHECK(t.shape.size() <= format::kMaxDims);
    FUZZ_CHECK(t.source_index < std::max<size_t>(table.sources.size(), 1));
    FUZZ_CHECK(view->dtype(i) == t.dtype);
    FUZZ_CHECK(view->entry(i).arena_offset == t.arena_offset);
    FUZZ_CHECK(view->entry(i).bytes == t.bytes);
    if (!view->in_place()) continue;
    FUZZ_CHECK(view->name(i) == t.name);
    // An index built from the entries finds every name; one from the input, when accepted,
    // never finds a wrong one.
    auto found = view->Find(t.name);
    if ((flags & 1) == 0) FUZZ_CHECK(found.has_value());
    if (found) FUZZ_CHECK(view->name(*found) == t.name);
  }
  for (size_t i = 0; i < table.sources.size(); ++i) {
    FUZZ_CHECK(view->source(i).path == table.sources[i].path);
  }
  CheckRoundTrip(table);
  return 0;
}
