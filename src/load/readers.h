// The two readers of a ReadPlan (io_uring and a pread pool) and what they share. Internal to
// src/load.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/ready_front.h"
#include "expert_arena/status.h"
#include "load/read_plan.h"
#include "load/tensor_hasher.h"
#include "platform/file.h"
#include "platform/io_ring.h"

namespace expert_arena::load {

// One run of a reader: the plan, where bytes go, the descriptors, and the shared progress.
// Workers take pieces in plan order from next_piece (each piece is claimed exactly once
// through its `claimed` flag); the first error stops them all.
//
// Hot pieces (in the page cache, of a source that is mapped) are copied by the CPU from the
// mapping in blocks of hot_block_bytes, each block hashed right after it is copied while it
// is still in L1/L2 (TensorHasher::BeginPiece): copy and hash cost about what the copy alone
// costs, where a read followed by a hash of the piece reads every byte from memory twice.
// Since a tensor's hash is sequential, a worker that starts a tensor's run of hot pieces
// moves next_piece past it and keeps the run for itself; the other workers take other
// tensors, and only when nothing is left do they take (steal) unclaimed pieces of runs in
// progress, which are then hashed after the copy like any read.
struct ReadJob {
  const ReadPlan* plan = nullptr;
  std::span<std::byte> data;
  std::vector<const platform::UniqueFd*> buffered;  // per source
  std::vector<const platform::UniqueFd*> direct;    // per source; null: no O_DIRECT
  std::vector<uint32_t> direct_alignment;           // per source: O_DIRECT offset alignment
  uint64_t bounce_buffer_bytes = 0;                 // enough for any bounced piece
  TensorHasher* hasher = nullptr;
  std::vector<const std::byte*> mapped;  // per source: its whole file mapped; null: none
  uint64_t hot_block_bytes = 128 * 1024;
  // Pages still being made front to back (null: all ready): a piece is written only once the
  // front covers ready_base + its end (loader.h).
  const ReadyFront* ready_front = nullptr;
  uint64_t ready_base = 0;
  std::atomic<uint64_t> ready_wait_nanos{0};        // summed over the workers
  std::unique_ptr<std::atomic<uint8_t>[]> claimed;  // per piece
  std::atomic<size_t> next_piece{0};
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<uint64_t> direct_fallbacks{0};
  // Bytes of pieces planned direct (and bounced) that ReadBatch read buffered instead.
  std::atomic<uint64_t> batched_direct_bytes{0};
  std::atomic<uint64_t> batched_bounce_bytes{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status first_error;

  static constexpr size_t kNone = ~size_t{0};

  // Sizes `claimed` for the plan; call once before the workers start.
  void Prepare();
  // Whether piece `index` is copied from the source's mapping.
  bool Hot(size_t index) const;
  // The next piece for a worker: `run_next` (the next piece of the worker's own run of hot
  // pieces, kNone if none) when still unclaimed, else the next in plan order, else a piece
  // stolen from another worker's run; kNone when every piece is claimed. Returns only when the
  // piece's pages are ready (ready_front); kNone after failing the job when they never will be.
  size_t TakePiece(size_t& run_next);
  // The pieces of the batch [index, end) this worker gets: index (already claimed) and those
  // of the rest it claims now.
  std::vector<size_t> ClaimBatch(size_t index, size_t end);
  // TakePiece without waiting for the pages.
  size_t ClaimPiece(size_t& run_next);
  // Waits until the arena's pages up to data offset `end` are made (ready_front); false after
  // failing the job when they never will be.
  bool WaitReady(uint64_t end);
  // Copies hot piece `index` from the mapping, hashing it on the way when its tensor's hash
  // has reached it, and marks it done; sets run_next to the tensor's following piece when
  // that one is hot too. A tiny tensor starts a batch (BatchEnd): the following tiny tensors
  // still unclaimed are claimed and copied with it, their source pages faulted in by one
  // madvise and each hashed right after its copy.
  void CopyHot(size_t index, size_t& run_next);
  // The end of the batch that piece `index` starts: index + 1, or more when it and the pieces
  // after it are whole tiny tensors (one piece each, at most kBatchPieceBytes) of the same
  // source, all hot or all read, each starting at most kBatchGapBytes after the previous one
  // ends in the file, spanning at most hot_block_bytes of it and kBatchPieces pieces.
  size_t BatchEnd(size_t index) const;
  // Reads the batch [index, end) of tiny tensors that are not hot with one pread of the file
  // range they span (buffered: a few KiB to hot_block_bytes, read ahead by the page cache)
  // into `buffer`, then copies each into place and hashes it. Claims the batch's other pieces
  // still unclaimed; `index` is claimed by the caller.
  void ReadBatch(size_t index, size_t end, std::vector<std::byte>& buffer);
  static constexpr uint64_t kBatchPieceBytes = 16 * 1024;
  static constexpr uint64_t kBatchGapBytes = 4096;
  static constexpr size_t kBatchPieces = 4096;

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
