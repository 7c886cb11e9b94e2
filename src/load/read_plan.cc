#include "load/read_plan.h"

#include <algorithm>

namespace expert_arena::load {
namespace {

// Whether at least half of the pages of [offset, offset + bytes) are in the page cache.
bool MostlyCached(const SourceAccess& access, uint64_t offset, uint64_t bytes) {
  if (access.resident.empty() || bytes == 0) return false;
  const uint64_t page = access.page_bytes;
  uint64_t first = offset / page;
  uint64_t last = std::min<uint64_t>((offset + bytes - 1) / page, access.resident.size() - 1);
  if (first > last) return false;
  uint64_t cached = 0;
  for (uint64_t p = first; p <= last; ++p) cached += access.resident[p] & 1;
  return cached * 2 >= last - first + 1;
}

}  // namespace

ReadPlan PlanReads(const format::ArenaTable& table, std::span<const SourceAccess> sources,
                   uintptr_t arena_base, uint64_t chunk_bytes, uint64_t direct_chunk_bytes) {
  direct_chunk_bytes = std::max(direct_chunk_bytes, chunk_bytes);
  ReadPlan plan;
  plan.tensor_first.reserve(table.tensors.size() + 1);
  auto add = [&](uint32_t t, const format::TensorRecord& tensor, const SourceAccess& access,
                 uint64_t from, uint64_t to, bool may_direct, bool bounce = false) {
    // [from, to) are offsets inside the tensor.
    for (uint64_t at = from; at < to;) {
      uint64_t bytes = std::min(chunk_bytes, to - at);
      bool cached = MostlyCached(access, tensor.source_offset + at, bytes);
      if (may_direct && !cached && direct_chunk_bytes > bytes) {
        // Reads from the device go in larger pieces: see direct_chunk_bytes in read_plan.h.
        uint64_t wide = std::min(direct_chunk_bytes, to - at);
        if (!MostlyCached(access, tensor.source_offset + at, wide)) bytes = wide;
      }
      ReadPiece piece;
      piece.tensor = t;
      piece.source = tensor.source_index;
      piece.source_offset = tensor.source_offset + at;
      piece.arena_offset = tensor.arena_offset + at;
      piece.bytes = bytes;
      piece.cached = cached;
      piece.direct = may_direct && !piece.cached;
      piece.bounce = piece.direct && bounce;
      plan.total_bytes += bytes;
      plan.largest_piece = std::max(plan.largest_piece, bytes);
      if (piece.direct) plan.direct_bytes += bytes;
      if (piece.bounce) plan.bounce_bytes += bytes;
      plan.pieces.push_back(piece);
      at += bytes;
    }
  };
  for (uint32_t t = 0; t < table.tensors.size(); ++t) {
    plan.tensor_first.push_back(plan.pieces.size());
    const format::TensorRecord& tensor = table.tensors[t];
    const SourceAccess& access = sources[tensor.source_index];
    const uint64_t n = tensor.bytes;
    const uint64_t align = access.direct.offset;
    if (access.direct.memory == 0 || align == 0) {
      add(t, tensor, access, 0, n, false);
      continue;
    }
    // The aligned body [body_from, body_to) of the tensor, as offsets inside it.
    const uint64_t s = tensor.source_offset;
    const uint64_t body_from = (align - s % align) % align;
    const uint64_t body_to = (s + n) / align * align - s;
    const uintptr_t body_address = arena_base + tensor.arena_offset + body_from;
    if (n < align || body_from >= body_to || body_address % access.direct.memory != 0) {
      add(t, tensor, access, 0, n, true, /*bounce=*/true);
      continue;
    }
    // Direct chunks stay multiples of the alignment.
    const uint64_t saved_chunk = chunk_bytes, saved_direct = direct_chunk_bytes;
    chunk_bytes = std::max<uint64_t>(chunk_bytes / align * align, align);
    direct_chunk_bytes = std::max<uint64_t>(direct_chunk_bytes / align * align, align);
    add(t, tensor, access, 0, body_from, false);
    add(t, tensor, access, body_from, body_to, true);
    add(t, tensor, access, body_to, n, false);
    chunk_bytes = saved_chunk;
    direct_chunk_bytes = saved_direct;
  }
  plan.tensor_first.push_back(plan.pieces.size());
  return plan;
}

BounceRange BounceRangeOf(const ReadPiece& piece, uint32_t offset_alignment) {
  const uint64_t a = std::max<uint32_t>(offset_alignment, 1);
  BounceRange range;
  range.first = piece.source_offset / a * a;
  const uint64_t end = (piece.source_offset + piece.bytes + a - 1) / a * a;
  range.bytes = end - range.first;
  return range;
}

}  // namespace expert_arena::load
