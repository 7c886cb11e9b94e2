// Moving tensor bytes from the model's files into the arena's data region, and computing
// each tensor's checksum on the way.
//
// The reader is io_uring (liburing) when the kernel allows a ring, else a pread thread pool;
// "auto" picks io_uring and falls back (logging why), "io_uring" or "pread" force one. Both
// read the same plan (read_plan.h): pieces of up to chunk_bytes straight into the arena, with
// O_DIRECT for pieces not in the page cache (through a bounce buffer when the file offset is
// misaligned for the device), buffered where O_DIRECT is unavailable. Pieces already in the
// page cache are copied by the reader threads from a read-only mapping of the source, and
// hashed block by block as they are copied (hot_copy). Each tensor's xxh3-64 is computed by
// the reader threads as its pieces arrive (tensor_hasher.h).
//
// The mapping's price: a source truncated by someone else while it is being loaded raises
// SIGBUS in the process (a read would have returned short), as with any mapped file; the
// arena's own shared file carries the same risk. hot_copy = false avoids the mapping.
//
// Thread-safety: LoadTensors runs its own worker threads and returns when every byte is in
// place (or on the first error, after the workers stopped).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "expert_arena/status.h"
#include "format/arena_table.h"

namespace spdlog {
class logger;
}

namespace expert_arena {
class ReadyFront;
}

namespace expert_arena::load {

struct LoadRequest {
  std::span<std::byte> data;    // the arena's data region, writable
  std::string reader = "auto";  // "auto", "io_uring", "pread"
  bool progress = false;        // a progress line on stderr when it is a terminal
  spdlog::logger* logger = nullptr;
  bool logger_is_engines = false;  // progress goes through `logger`, not redrawn on stderr
  // Tuning (0: the default). Reads of up to chunk_bytes (4 MiB), direct_chunk_bytes (16 MiB)
  // for uncached ranges read with O_DIRECT; queue_depth reads in flight per io_uring thread
  // for uncached data; `threads` readers (default: one per CPU, 2 to 8).
  uint64_t chunk_bytes = 0;
  uint64_t direct_chunk_bytes = 0;
  unsigned queue_depth = 0;
  unsigned threads = 0;
  bool direct_io = true;  // O_DIRECT where the source and alignment allow it
  // Pieces in the page cache are copied from a read-only mapping of the source in blocks of
  // hot_block_bytes (0: 128 KiB; 16 KiB for pieces of 1 MiB and more, which are streamed),
  // each hashed right after it is copied, while it is in L1/L2 (readers.h). false: they are
  // read with the reader and hashed afterwards.
  bool hot_copy = true;
  uint64_t hot_block_bytes = 0;
  // When set, the data region's pages are still being made (allocated, put on 2 MiB pages,
  // populated) front to back while the load runs: a piece is written (read into, copied
  // into) only once the front covers ready_base + its end. ready_base is the data region's
  // offset in the front's coordinates (the arena file's header bytes). A front that fails
  // fails the load with its error.
  const ReadyFront* ready_front = nullptr;
  uint64_t ready_base = 0;
  // With ready_front, where the filler paces the pages (ArenaFiller::PagesAsWritten): lets
  // the pages of [0, end) of the front's coordinates be made; they are made only once asked.
  std::function<void(uint64_t)> permit_pages;
  // Tests only: runs once after the sources are opened and the reads planned, before any
  // read (e.g. to truncate a source under the loader).
  std::function<void()> after_plan_for_testing;
};

struct LoadResult {
  uint64_t bytes_read = 0;
  uint64_t direct_bytes = 0;  // of which read with O_DIRECT
  uint64_t bounce_bytes = 0;  // of which through bounce buffers (misaligned in the file)
  uint64_t hot_bytes = 0;     // copied from a mapping of the page cache, hashed while hot
  double seconds = 0;
  double ready_wait_seconds = 0;  // summed over the readers: waiting for ready_front
  std::string reader;             // "io_uring" or "pread"
  std::string note;               // why io_uring was not used, when "auto" fell back to pread
};

// Reads every tensor of `table` from its source into data[arena_offset, +bytes) and sets its
// checksum. The sources are checked first: a file that changed size since it was planned, or
// a tensor outside its file or the data region, is an error naming it. reader "io_uring" fails
// with kUnsupported (saying why) where rings are not allowed.
Result<LoadResult> LoadTensors(const LoadRequest& request, format::ArenaTable& table);

// Recomputes checksums of tensors already in `data` in parallel; returns the index of the
// first tensor whose checksum differs, or -1.
int64_t FirstBadChecksum(std::span<const std::byte> data, const format::ArenaTable& table);

// Fills each tensor's checksum from `data` in parallel.
void ComputeChecksums(std::span<const std::byte> data, format::ArenaTable& table);

}  // namespace expert_arena::load
