// The fingerprint of a model's planning inputs: what PlanModel reads (the bytes of a
// safetensors index, and of each source file: its path, size, modification time and the raw
// bytes of its header) and what it is asked (the files as given, their format, the selection, the
// alignment). Equal fingerprints mean PlanModel would build the same table, so an engine
// whose arena records its fingerprint attaches without planning: it hashes the raw bytes
// (tens of MB at memory speed) where a plan parses them (seconds at 90,000 tensors).
//
// The loader's fingerprint is made from the very bytes its readers parsed (their hashes ride
// along in the plan) and the sizes and times recorded after reading them, so a file changed
// while it was planned gives a fingerprint no later engine can match. Only safetensors models
// (single files, shards, an index) are fingerprinted; GGUF and raw files plan fast (a few
// tensors a layer) and keep the identity check.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace expert_arena::source {

// A bump whenever PlanModel would build another table from the same inputs (selection rules,
// offsets, dtype names): arenas of older builds then take the planning path.
inline constexpr uint64_t kPlanRevision = 1;

// What the hash of one input is made of (the same function on both sides).
uint64_t HashSafetensorsHeader(uint64_t header_length, const void* text);
uint64_t HashIndexBytes(const void* bytes, uint64_t size);

// One given file, resolved (a directory stands for its index) and classified.
struct FingerprintFile {
  std::string path;  // absolute
  bool index = false;
  uint64_t index_hash = 0;  // HashIndexBytes of an index, 0 otherwise
};

// Combines the inputs; `source_hashes[i]` is HashSafetensorsHeader of sources[i].
uint64_t CombineFingerprint(const ModelSpec& spec, std::span<const FingerprintFile> files,
                            std::span<const format::SourceRecord> sources,
                            std::span<const uint64_t> source_hashes);

// True when every file of spec is safetensors (a file, a shard, an index), read from the first
// bytes of each: the models PlanModel fingerprints.
Result<bool> HasFingerprint(const ModelSpec& spec);

struct FingerprintCheck {
  uint64_t fingerprint = 0;  // 0: a source's size or time differs from its record, or a
                             // header or the index could not be read as such
  uint64_t bytes_read = 0;   // index and header bytes read
  std::string mismatch;      // why 0, for the log
};

// The fingerprint of spec's model whose sources an arena recorded (in its table order), from
// the raw bytes now on disk; nothing is parsed.
Result<FingerprintCheck> FingerprintFromSources(const ModelSpec& spec,
                                                std::span<const format::SourceRecord> sources);

}  // namespace expert_arena::source
