// The contents of an arena's tensor table, independent of how it is stored: which source
// files the model came from, which tensors were selected, where each one lives in the
// arena's data region, and the model identity that decides whether a file can be reused.
//
// The model readers (src/source) produce an ArenaTable; the arena file format
// (arena_format.h) stores and validates it; the arena (src/arena) hands out views of it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::format {

inline constexpr uint32_t kMaxDims = 8;

struct SourceRecord {
  std::string path;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
};

struct TensorRecord {
  std::string name;
  std::string dtype;            // "f32", "q8_0", "BF16", ... as the source format names it
  std::vector<uint64_t> shape;  // at most kMaxDims
  uint32_t source_index = 0;    // into ArenaTable::sources
  uint64_t source_offset = 0;   // absolute byte offset in that source file
  uint64_t arena_offset = 0;    // from the start of the data region
  uint64_t bytes = 0;
  uint64_t checksum = 0;  // xxh3-64 of the bytes, filled in by the loader
};

struct ArenaTable {
  std::vector<SourceRecord> sources;
  std::vector<TensorRecord> tensors;
  uint64_t alignment = 4096;  // of every arena_offset
  uint64_t data_bytes = 0;    // the data region: a multiple of 2 MiB
  uint64_t identity_hash = 0;
  std::string identity_text;       // human-readable: names the model in messages
  uint64_t model_bytes_total = 0;  // all tensor bytes in the sources, selected or not
  uint64_t model_tensors_total = 0;
  // Of the planning inputs (source/model_fingerprint.h), 0 when there is none: lets an engine
  // decide "this arena holds my model" without planning. Not part of the identity.
  uint64_t fingerprint = 0;
};

// Why `name` cannot name a tensor, or "" when it can: it must not be empty (Find() looks
// tensors up by name) nor hold a control byte (below 0x20, or 0x7f), because every message
// and `info` line that names a tensor prints it, and a name read from a hostile model or
// arena file must not drive the operator's terminal. The problem never quotes the name.
std::string TensorNameProblem(std::string_view name);

// A tensor smaller than the alignment is aligned to the smallest power of two that holds it,
// at least kPackedAlignment (a cache line): the weight_scale_inv tensors beside FP8 weights
// (4 bytes to a few KiB) would otherwise take a 4 KiB page each, and a tiny tensor still
// never straddles a boundary it would not straddle at the full alignment.
inline constexpr uint64_t kPackedAlignment = 64;
uint64_t TensorAlignment(uint64_t alignment, uint64_t bytes);

// Gives every tensor an arena offset aligned to TensorAlignment(table.alignment, its bytes),
// in table order, and sets data_bytes (rounded up to 2 MiB). Fails on overflow or a bad
// alignment.
Status AssignArenaOffsets(ArenaTable& table);

// Sets identity_hash from the sources (paths, sizes, modification times) and the table
// (names, dtypes, shapes, offsets, sizes; not checksums, which only a load can know), and
// identity_text when it is empty. A changed model file is a different identity.
void ComputeIdentity(ArenaTable& table);

}  // namespace expert_arena::format
