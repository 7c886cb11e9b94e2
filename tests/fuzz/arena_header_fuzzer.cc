// Fuzz target: the arena file header (format/arena_format.h) as `expert-arena info`, verify and
// attach read it from a file another process wrote: SummarizeHeader on the first bytes, then
// DecodeHeader on the header region against the real file size.
//
// Input: u8 flags | u64 file size | the file's first bytes (zero-extended to the file size, as
// a sparse file reads). Flag 1 recomputes both checksums before decoding, as a hostile writer
// would, so the fuzzer gets past them to the table checks; flag 2 takes the file size from
// the header's own file_bytes field.
//
// Checks: an accepted header's regions lie inside the file, every tensor inside the data
// region, and the decoded table survives EncodeHeader/DecodeHeader unchanged. TableView (the
// in-place reader attach uses) accepts exactly what DecodeHeader accepts, reads the same
// tensors, and its name index finds every name of a table it wrote.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "format/arena_format.h"
#include "fuzz_util.h"

using namespace expert_arena;
using format::HeaderFixed;

namespace {

// The header region is read whole; keep it small enough for many runs per second.
constexpr uint64_t kMaxRegionBytes = 8 * format::kHeaderPageBytes;

bool Inside(uint64_t offset, uint64_t length, uint64_t limit) {
  return offset <= limit && length <= limit - offset;
}

void FixChecksums(std::vector<std::byte>& region) {
  if (region.size() < sizeof(HeaderFixed)) return;
  HeaderFixed fixed;
  std::memcpy(&fixed, region.data(), sizeof fixed);
  if (fixed.strings_offset >= fixed.sources_offset &&
      Inside(fixed.strings_offset, fixed.strings_bytes, region.size())) {
    uint64_t span = fixed.strings_offset + fixed.strings_bytes - fixed.sources_offset;
    fixed.table_checksum = XXH3_64bits(region.data() + fixed.sources_offset, span);
  }
  if (fixed.name_index_slots != 0 && fixed.name_index_slots < region.size() / 4 &&
      Inside(fixed.name_index_offset, fixed.name_index_slots * 4, region.size())) {
    fixed.name_index_checksum =
        XXH3_64bits(region.data() + fixed.name_index_offset, fixed.name_index_slots * 4);
  }
  fixed.header_checksum = 0;
  fixed.header_checksum = XXH3_64bits(&fixed, sizeof fixed);
  std::memcpy(region.data(), &fixed, sizeof fixed);
}

void CheckRoundTrip(const format::ArenaTable& table) {
  auto layout = format::ComputeLayout(table, format::kHeaderPageBytes);
  if (!layout.ok() || layout->header_bytes > kMaxRegionBytes) return;
  std::vector<std::byte> region(layout->header_bytes);
  Status encoded =
      format::EncodeHeader(table, *layout, format::FileState::kPublished, 1, 2, 3, 4, region);
  FUZZ_CHECK(encoded.ok());
  format::ArenaTable again;
  Status status = format::DecodeHeader(region, layout->file_bytes, "again", &again, nullptr);
  if (!status.ok()) std::fprintf(stderr, "%s\n", status.ToString().c_str());
  FUZZ_CHECK(status.ok());
  FUZZ_CHECK(again.sources.size() == table.sources.size());
  FUZZ_CHECK(again.tensors.size() == table.tensors.size());
  for (size_t i = 0; i < table.sources.size(); ++i) {
    FUZZ_CHECK(again.sources[i].path == table.sources[i].path);
    FUZZ_CHECK(again.sources[i].size == table.sources[i].size);
  }
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    const format::TensorRecord& a = table.tensors[i];
    const format::TensorRecord& b = again.tensors[i];
    FUZZ_CHECK(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape);
    FUZZ_CHECK(a.source_index == b.source_index && a.source_offset == b.source_offset);
    FUZZ_CHECK(a.arena_offset == b.arena_offset && a.bytes == b.bytes && a.checksum == b.checksum);
  }
  auto view = format::TableView::Open(region, layout->file_bytes, "again");
  FUZZ_CHECK(view.ok() && view->in_place() && view->tensor_count() == table.tensors.size());
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    auto found = view->Find(table.tensors[i].name);
    FUZZ_CHECK(found.has_value() && view->name(*found) == table.tensors[i].name);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 9) return 0;
  const uint8_t flags = data[0];
  uint64_t file_size = 0;
  std::memcpy(&file_size, data + 1, 8);
  std::span<const std::byte> head = fuzz::Bytes(data + 9, size - 9);
  if (flags & 2) {
    HeaderFixed fixed{};
    std::memcpy(&fixed, head.data(), std::min(head.size(), sizeof fixed));
    file_size = fixed.file_bytes;
  }
  // `info` and attach summarize the first min(file size, sizeof HeaderFixed) bytes.
  std::vector<std::byte> first(std::min<uint64_t>(file_size, sizeof(HeaderFixed)));
  std::copy_n(head.begin(), std::min(first.size(), head.size()), first.begin());
  format::HeaderSummary summary = format::SummarizeHeader(first);
  if (!summary.our_magic) FUZZ_CHECK(summary.layout.header_bytes == 0);
  FUZZ_CHECK(summary.identity_text.size() < format::kIdentityTextBytes);

  // Then the region the header claims, or the first 2 MiB when that claim is unusable.
  uint64_t region_bytes = summary.layout.header_bytes;
  if (region_bytes == 0 || region_bytes > file_size) {
    region_bytes = std::min<uint64_t>(file_size, format::kHeaderPageBytes);
  }
  if (region_bytes > kMaxRegionBytes) return 0;
  std::vector<std::byte> region(region_bytes);
  std::copy_n(head.begin(), std::min<uint64_t>(region.size(), head.size()), region.begin());
  if (flags & 1) FixChecksums(region);

  format::ArenaTable table;
  format::HeaderSummary decoded_summary;
  Status status = format::DecodeHeader(region, file_size, "fuzz-arena", &table, &decoded_summary);
  if (!status.ok()) {
    fuzz::CheckRefusal(status);
    FUZZ_CHECK(!format::TableView::Open(region, file_size, "fuzz-arena").ok());
    return 0;
  }
  // The in-place reader agrees with the decoder.
  auto view = format::TableView::Open(region, file_size, "fuzz-arena");
  FUZZ_CHECK(view.ok());
  FUZZ_CHECK(view->tensor_count() == table.tensors.size());
  for (size_t i = 0; i < table.tensors.size(); ++i) {
    FUZZ_CHECK(view->dtype(i) == table.tensors[i].dtype);
    FUZZ_CHECK(view->entry(i).arena_offset == table.tensors[i].arena_offset);
    if (!view->in_place()) continue;
    FUZZ_CHECK(view->name(i) == table.tensors[i].name);
    auto found = view->Find(table.tensors[i].name);
    if (found) FUZZ_CHECK(view->name(*found) == table.tensors[i].name);
  }
  const format::ArenaLayout& layout = decoded_summary.layout;
  FUZZ_CHECK(decoded_summary.our_magic);
  FUZZ_CHECK(layout.file_bytes == file_size);
  FUZZ_CHECK(layout.header_bytes <= region.size());
  FUZZ_CHECK(Inside(layout.header_bytes, layout.data_bytes, file_size));
  FUZZ_CHECK(table.data_bytes == layout.data_bytes);
  for (const format::TensorRecord& t : table.tensors) {
    FUZZ_CHECK(Inside(t.arena_offset, t.bytes, table.data_bytes));
    FUZZ_CHECK(t.shape.size() <= format::kMaxDims);
    FUZZ_CHECK(t.source_index < std::max<size_t>(table.sources.size(), 1));
  }
  CheckRoundTrip(table);
  return 0;
}
