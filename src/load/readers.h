// The two readers of a ReadPlan (io_uring and a pread pool) and what they share. Internal to
// src/load.
#pragma once

#include <atomic>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "expert_arena/status.h"
#include "load/read_plan.h"
#include "load/tensor_hasher.h"
#include "platform/file.h"
#include "platform/io_ring.h"

namespace expert_arena::load {

// One run of a reader: the plan, where bytes go, the descriptors, and the shared progress.
// Workers take pieces in plan order from next_piece; the first error stops them all.
struct ReadJob {
  const ReadPlan* plan = nullptr;
  std::span<std::byte> data;
  std::vector<const platform::UniqueFd*> buffered;  // per source
  std::vector<const platform::UniqueFd*> direct;    // per source; null: no O_DIRECT
  std::vector<uint32_t> direct_alignment;           // per source: O_DIRECT offset alignment
  uint64_t bounce_buffer_bytes = 0;                 // enough for any bounced piece
  TensorHasher* hasher = nullptr;
  std::atomic<size_t> next_piece{0};
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<uint64_t> direct_fallbacks{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first_error;

  void Fail(const Status& s);
  // Reads what a read left undone ([done, bytes) of the piece) with pread on the buffered
  // descriptor; used for short reads and for direct reads the device refused.
  Status FinishPiece(const ReadPiece& piece, uint64_t done);
  // A read of piece `index` returned `result` (bytes, or -errno); `bounce` is the buffer it
  // read into when it was bounced. Copies bounced bytes into place, redoes refused direct
  // reads and finishes short ones buffered, then marks the piece done.
  Status Complete(size_t index, int64_t result, const std::byte* bounce);
  // A piece is completely in place: count it and let its tensor's hash advance.
  void PieceDone(size_t index);
};

// io_uring readers, one ring (already created) per thread.
Status RunUringReaders(ReadJob& job, std::vector<platform::IoRing>& rings, unsigned queue_depth);
// pread readers.
Status RunPreadReaders(ReadJob& job, unsigned threads);

}  // namespace expert_arena::load
