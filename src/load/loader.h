// Moving tensor bytes from the model's files into the arena's data region, and computing
// each tensor's checksum on the way.
//
// Thread-safety: LoadTensors runs its own worker threads and returns when every byte is in
// place (or on the first error, after the workers stopped).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace spdlog {
class logger;
}

namespace expert_arena::load {

struct LoadRequest {
  std::span<std::byte> data;      // the arena's data region, writable
  std::string reader = "auto";    // "auto", "io_uring", "pread"
  bool progress = false;          // a progress line on stderr when it is a terminal
  spdlog::logger* logger = nullptr;
};

struct LoadResult {
  uint64_t bytes_read = 0;
  double seconds = 0;
  std::string reader;
};

// Reads every tensor of `table` from its source into data[arena_offset, +bytes) and sets its
// checksum. The sources are checked first: a file that changed size since it was planned is
// an error naming it.
Result<LoadResult> LoadTensors(const LoadRequest& request, format::ArenaTable& table);

// Recomputes checksums of tensors already in `data` in parallel; returns the index of the
// first tensor whose checksum differs, or -1.
int64_t FirstBadChecksum(std::span<const std::byte> data, const format::ArenaTable& table);

// Fills each tensor's checksum from `data` in parallel.
void ComputeChecksums(std::span<const std::byte> data, format::ArenaTable& table);

}  // namespace expert_arena::load
