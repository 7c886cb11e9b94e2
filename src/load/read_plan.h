// How the loader cuts the selected tensors into reads.
//
// Every tensor becomes pieces of at most chunk_bytes (direct_chunk_bytes for uncached ranges
// read with O_DIRECT), in arena order. A piece is read with
// O_DIRECT (straight from the device into the arena) when the source allows direct I/O, the
// piece's file offset, length and arena address meet its alignment, and its pages are not
// already in the page cache (a copy from the cache is faster than the disk). Everything else
// is read buffered: cached ranges, filesystems without O_DIRECT, and the sub-block heads and
// tails of aligned tensors. A tensor whose file offset and arena address disagree modulo the
// device's block (most GGUF and safetensors tensors: their data is 32- or 8-byte aligned) is
// still read with O_DIRECT when uncached, through a bounce buffer: the aligned superset lands
// there and is copied into the arena while hot. That copy is the one a buffered read would
// make from the page cache anyway, without the page cache's insertion and readahead limits.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "format/arena_table.h"
#include "platform/file_cache.h"

namespace expert_arena::load {

struct ReadPiece {
  uint32_t tensor = 0;  // index into table.tensors
  uint32_t source = 0;
  bool direct = false;  // through the O_DIRECT descriptor
  bool bounce = false;  // direct into a bounce buffer, then copied (misaligned)
  bool cached = false;  // its pages were in the page cache when planned
  uint64_t source_offset = 0;
  uint64_t arena_offset = 0;  // from the start of the data region
  uint64_t bytes = 0;
};

struct SourceAccess {
  platform::DirectIoAlignment direct;  // memory == 0: no O_DIRECT for this source
  std::vector<uint8_t> resident;       // mincore bytes, one per page; empty: unknown
  uint64_t page_bytes = 4096;
};

struct ReadPlan {
  std::vector<ReadPiece> pieces;     // tensor by tensor, each tensor's pieces in order
  std::vector<size_t> tensor_first;  // tensor t's pieces: [tensor_first[t], tensor_first[t+1])
  uint64_t total_bytes = 0;
  uint64_t direct_bytes = 0;  // read with O_DIRECT (bounced ones included)
  uint64_t bounce_bytes = 0;  // of which through a bounce buffer
  uint64_t largest_piece = 0;
};

// The aligned file range a bounced piece reads: [first, first + bytes).
struct BounceRange {
  uint64_t first = 0;
  uint64_t bytes = 0;
};
BounceRange BounceRangeOf(const ReadPiece& piece, uint32_t offset_alignment);

// `arena_base` is the address of the data region (direct reads need aligned buffers).
// `direct_chunk_bytes` (at least chunk_bytes): pieces read from the device with O_DIRECT are
// larger than those copied from the page cache. On this project's virtio disk 4 MiB direct
// reads from two threads, interleaved, made 1.0-1.7 GiB/s and 16 MiB ones 2.1-2.25 GiB/s,
// where dd bs=4M on one thread made 1.1-2.3 GB/s (docs/loader.md).
ReadPlan PlanReads(const format::ArenaTable& table, std::span<const SourceAccess> sources,
                   uintptr_t arena_base, uint64_t chunk_bytes, uint64_t direct_chunk_bytes = 0);

}  // namespace expert_arena::load
