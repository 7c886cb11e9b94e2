#include "load/readers.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/units.h"
#include "platform/mapping.h"
#include "platform/memory_copy.h"

namespace expert_arena::load {

void ReadJob::Prepare() {
  claimed.reset(new std::atomic<uint8_t>[plan->pieces.size()]);
  for (size_t i = 0; i < plan->pieces.size(); ++i) claimed[i].store(0, std::memory_order_relaxed);
}

bool ReadJob::Hot(size_t index) const {
  const ReadPiece& piece = plan->pieces[index];
  return piece.cached && !piece.direct && mapped[piece.source] != nullptr;
}

size_t ReadJob::TakePiece(size_t& run_next) {
  const size_t index = ClaimPiece(run_next);
  if (index == kNone || ready_front == nullptr) return index;
  const ReadPiece& piece = plan->pieces[index];
  return WaitReady(piece.arena_offset + piece.bytes) ? index : kNone;
}

bool ReadJob::WaitReady(uint64_t end) {
  if (ready_front == nullptr) return true;
  end += ready_base;
  if (ready_front->ready() >= end) return true;
  const auto start = std::chrono::steady_clock::now();
  Status ready = ready_front->WaitFor(end);
  ready_wait_nanos.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count(),
      std::memory_order_relaxed);
  if (ready.ok()) return true;
  Fail(ready);
  return false;
}

size_t ReadJob::ClaimPiece(size_t& run_next) {
  const size_t n = plan->pieces.size();
  if (run_next != kNone) {
    const size_t own = run_next;
    run_next = kNone;
    if (claimed[own].exchange(1) == 0) return own;
  }
  for (;;) {
    const size_t index = next_piece.fetch_add(1);
    if (index >= n) break;
    if (claimed[index].exchange(1) != 0) continue;  // taken by the worker whose run it is
    if (Hot(index)) {
      // A run of hot pieces starts here: move next_piece past it, so that the other workers
      // start other tensors instead of taking this tensor's pieces (which they could not hash
      // while hot: a tensor's hash is sequential).
      const uint32_t tensor = plan->pieces[index].tensor;
      size_t end = index + 1;
      while (end < n && plan->pieces[end].tensor == tensor && Hot(end)) ++end;
      size_t at = next_piece.load();
      while (at < end && !next_piece.compare_exchange_weak(at, end)) {
      }
    }
    // A batch of tiny tensors (BatchEnd) is left to this worker the same way.
    const size_t end = BatchEnd(index);
    if (end > index + 1) {
      size_t at = next_piece.load();
      while (at < end && !next_piece.compare_exchange_weak(at, end)) {
      }
    }
    return index;
  }
  // Nothing left in plan order: steal from the back of the runs still being read.
  for (size_t index = n; index-- > 0;) {
    if (claimed[index].load(std::memory_order_relaxed) == 0 && claimed[index].exchange(1) == 0) {
      return index;
    }
  }
  return kNone;
}

size_t ReadJob::BatchEnd(size_t index) const {
  const std::vector<ReadPiece>& pieces = plan->pieces;
  const bool hot = Hot(index);
  auto tiny_whole = [&](size_t k) {
    const uint32_t t = pieces[k].tensor;
    return pieces[k].bytes <= kBatchPieceBytes &&
           plan->tensor_first[t + 1] - plan->tensor_first[t] == 1 && Hot(k) == hot;
  };
  if (!tiny_whole(index)) return index + 1;
  const ReadPiece& first = pieces[index];
  uint64_t file_end = first.source_offset + first.bytes;
  size_t end = index + 1;
  const size_t limit = std::min(pieces.size(), index + kBatchPieces);
  while (end < limit) {
    const ReadPiece& next = pieces[end];
    if (next.source != first.source || next.source_offset < file_end ||
        next.source_offset - file_end > kBatchGapBytes ||
        next.source_offset + next.bytes - first.source_offset > hot_block_bytes ||
        !tiny_whole(end)) {
      break;
    }
    file_end = next.source_offset + next.bytes;
    ++end;
  }
  return end;
}

std::vector<size_t> ReadJob::ClaimBatch(size_t index, size_t end) {
  // A worker that took one of the batch's pieces before ClaimPiece moved next_piece past the
  // batch handles that one itself.
  std::vector<size_t> batch;
  batch.reserve(end - index);
  batch.push_back(index);
  for (size_t k = index + 1; k < end; ++k) {
    if (claimed[k].load(std::memory_order_relaxed) == 0 && claimed[k].exchange(1) == 0) {
      batch.push_back(k);
    }
  }
  return batch;
}

void ReadJob::ReadBatch(size_t index, size_t end, std::vector<std::byte>& buffer) {
  const std::vector<size_t> batch = ClaimBatch(index, end);
  const ReadPiece& first = plan->pieces[index];
  const ReadPiece& last = plan->pieces[batch.back()];
  const uint64_t span = last.source_offset + last.bytes - first.source_offset;
  if (buffer.size() < span) buffer.resize(span);
  Status s = platform::ReadFull(*buffered[first.source], first.source_offset,
                                std::span(buffer).first(span));
  if (!s.ok()) return Fail(s);
  if (!WaitReady(last.arena_offset + last.bytes)) return;
  for (size_t k : batch) {
    const ReadPiece& p = plan->pieces[k];
    std::memcpy(data.data() + p.arena_offset,
                buffer.data() + (p.source_offset - first.source_offset), p.bytes);
    hasher->HashWhole(k);
    bytes_done.fetch_add(p.bytes, std::memory_order_relaxed);
    if (p.direct) batched_direct_bytes.fetch_add(p.bytes, std::memory_order_relaxed);
    if (p.bounce) batched_bounce_bytes.fetch_add(p.bytes, std::memory_order_relaxed);
  }
}

// Pieces from this size on are copied with streaming stores (CopyHot), in blocks of
// kStreamingBlockBytes: one group of the copy's four pages, whose source lines are still in
// L1 when the block is hashed (a warm 2 GiB fill: 0.133 s against 0.142 s in 128 KiB blocks,
// load_bench on the development VM, 2026-12-05).
constexpr uint64_t kStreamingCopyBytes = 1 * kMiB;
constexpr uint64_t kStreamingBlockBytes = 16 * kKiB;

void ReadJob::CopyHot(size_t index, size_t& run_next) {
  const ReadPiece& piece = plan->pieces[index];
  const size_t batch_end = BatchEnd(index);
  if (batch_end > index + 1) {
    const std::vector<size_t> batch = ClaimBatch(index, batch_end);
    const ReadPiece& last = plan->pieces[batch.back()];
    if (!WaitReady(last.arena_offset + last.bytes)) return;
    const std::byte* base = mapped[piece.source];
    const uintptr_t page = platform::BasePageSize();
    const uintptr_t first = reinterpret_cast<uintptr_t>(base + piece.source_offset) / page * page;
    const uintptr_t end = reinterpret_cast<uintptr_t>(base + last.source_offset + last.bytes);
    const bool faulted_in = platform::FaultInChecked(reinterpret_cast<void*>(first), end - first,
                                                     buffered[piece.source]->path())
                                .ok();
    for (size_t k : batch) {
      const ReadPiece& p = plan->pieces[k];
      if (!faulted_in) {
        // Truncated since planned: the reads report the short file by name (see below).
        Status s = FinishPiece(p, 0);
        if (!s.ok()) return Fail(s);
        PieceDone(k);
        continue;
      }
      std::memcpy(data.data() + p.arena_offset, base + p.source_offset, p.bytes);
      hasher->HashWhole(k);
      bytes_done.fetch_add(p.bytes, std::memory_order_relaxed);
    }
    return;
  }
  const std::byte* from = mapped[piece.source] + piece.source_offset;
  std::byte* to = data.data() + piece.arena_offset;
  // Fault the piece's source pages in first: if the file was truncated since it was planned
  // the populate fails (EFAULT) where the copy would raise SIGBUS, and a read then reports
  // the short file by name. What remains is a truncation during this one piece's copy.
  const uintptr_t page = platform::BasePageSize();
  const uintptr_t first = reinterpret_cast<uintptr_t>(from) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(from) + piece.bytes;
  // Without MADV_POPULATE_READ (before 5.14) there is no guard: the piece is read instead.
  if (!platform::FaultInChecked(reinterpret_cast<void*>(first), end - first,
                                buffered[piece.source]->path())
           .ok()) {
    Status s = FinishPiece(piece, 0);
    if (!s.ok()) return Fail(s);
    PieceDone(index);
    return;
  }
  // A piece larger than a few blocks goes to the arena with streaming stores: nobody in this
  // process reads it again, and an ordinary store reads every destination line first, which
  // glibc's memcpy keeps doing up to its non-temporal threshold (384 MiB on the development
  // VM). Each block is hashed from the source, which the copy has just brought into the cache
  // (the destination is not there after streaming stores): the same bytes, read once from
  // memory. (A model file rewritten during the load can then differ from its checksum, which
  // `verify` names; with the destination hashed, a torn copy would have passed.) A warm 2 GiB
  // fill took 0.19 s with memcpy and the destination hashed, 0.13 s now, of which the copy is
  // as fast as glibc's 1 GiB memcpy and the rest the hash (docs/scale.md).
  const bool streaming = piece.bytes >= kStreamingCopyBytes;
  auto copy = [&](std::byte* dst, const std::byte* src, size_t bytes) {
    if (streaming) {
      platform::CopyNonTemporal(dst, src, bytes);
    } else {
      std::memcpy(dst, src, bytes);
    }
  };
  if (hasher->BeginPiece(index)) {
    const uint64_t block = streaming ? kStreamingBlockBytes : hot_block_bytes;
    for (uint64_t at = 0; at < piece.bytes; at += block) {
      const size_t bytes = std::min(block, piece.bytes - at);
      copy(to + at, from + at, bytes);
      hasher->HashBlock(index, streaming ? from + at : to + at, bytes);
    }
    bytes_done.fetch_add(piece.bytes, std::memory_order_relaxed);
    hasher->EndPiece(index);
  } else {
    copy(to, from, piece.bytes);
    PieceDone(index);
  }
  const size_t next = index + 1;
  if (next < plan->pieces.size() && plan->pieces[next].tensor == piece.tensor && Hot(next)) {
    run_next = next;
  }
}

void ReadJob::Fail(const Status& s) {
  std::lock_guard lock(mu);
  if (first_error.ok()) first_error = s;
  failed.store(true);
}

Status ReadJob::FinishPiece(const ReadPiece& piece, uint64_t done) {
  if (done >= piece.bytes) return Status::Ok();
  return platform::ReadFull(*buffered[piece.source], piece.source_offset + done,
                            data.subspan(piece.arena_offset + done, piece.bytes - done));
}

void ReadJob::PieceDone(size_t index) {
  bytes_done.fetch_add(plan->pieces[index].bytes, std::memory_order_relaxed);
  hasher->PieceArrived(index);
}

Status ReadJob::Complete(size_t index, int64_t result, const std::byte* bounce) {
  const ReadPiece& piece = plan->pieces[index];
  if (result < 0) {
    int err = static_cast<int>(-result);
    if (!piece.direct || err != EINVAL) {
      return ErrnoStatus(err, "read", buffered[piece.source]->path());
    }
    // The device refused this direct read after all: read it buffered.
    direct_fallbacks.fetch_add(1, std::memory_order_relaxed);
    EA_RETURN_IF_ERROR(FinishPiece(piece, 0));
    PieceDone(index);
    return Status::Ok();
  }
  uint64_t done = static_cast<uint64_t>(result);
  if (piece.bounce) {
    // The read covered the aligned superset; the piece starts `skip` bytes into it.
    const BounceRange range = BounceRangeOf(piece, direct_alignment[piece.source]);
    const uint64_t skip = piece.source_offset - range.first;
    done = done > skip ? std::min(done - skip, piece.bytes) : 0;
    std::memcpy(data.data() + piece.arena_offset, bounce + skip, done);
  }
  EA_RETURN_IF_ERROR(FinishPiece(piece, done));
  PieceDone(index);
  return Status::Ok();
}

namespace {

// Buffered reads of cached pieces in flight per ring (where the source is not mapped).
constexpr unsigned kCachedInFlight = 2;
// Bounced pieces hold a buffer each while in flight (a direct piece is up to 16 MiB: 64 MiB
// of buffers per reader thread).
constexpr unsigned kBouncedInFlight = 4;

// Bounce buffers of one thread, allocated the first time one is needed.
class BouncePool {
 public:
  BouncePool(uint64_t buffer_bytes, unsigned count) : buffer_bytes_(buffer_bytes), count_(count) {}

  // A free buffer, or null when all are in use (or memory could not be had).
  std::byte* Take() {
    if (!mapping_.data() && buffer_bytes_ > 0) {
      uint64_t each = (buffer_bytes_ + 4095) / 4096 * 4096;
      auto mapping = platform::Mapping::MapAnonymous(each * count_, kHugePageBytes);
      if (!mapping.ok()) return nullptr;
      // 2 MiB pages where THP allows: fewer pages to pin for every O_DIRECT read into them.
      (void)platform::AdviseRange(mapping->data(), mapping->size(), platform::Advice::kHugePage,
                                  "bounce buffers");
      mapping_ = std::move(*mapping);
      for (unsigned i = 0; i < count_; ++i) free_.push_back(mapping_.data() + i * each);
    }
    if (free_.empty()) return nullptr;
    std::byte* b = free_.back();
    free_.pop_back();
    return b;
  }
  void Give(std::byte* b) { free_.push_back(b); }

 private:
  uint64_t buffer_bytes_;
  unsigned count_;
  platform::Mapping mapping_;
  std::vector<std::byte*> free_;
};

// The completion of the cancel request that DrainRing queues (piece indexes are below it).
constexpr uint64_t kCancelTag = ~uint64_t{0};

// Returns only when the kernel holds nothing of `ring` that writes into the arena or into a
// bounce buffer: the caller unmaps both (and may unlink the arena) as soon as the readers
// return. `in_flight` reads were queued and not completed; those the kernel took are
// cancelled where they can be and waited for, and what it did not take (a failed submit) is
// submitted with the cancel (then cancelled or completed like the others) or, if that submit
// fails too, stays queued and dies with the ring, never read.
void DrainRing(platform::IoRing& ring, unsigned in_flight) {
  if (in_flight == 0) return;
  unsigned expected = in_flight;
  if (ring.QueueCancelAll(kCancelTag)) ++expected;
  (void)ring.Submit();  // its failure leaves the queue in Queued(): nothing to wait for
  expected -= std::min(expected, ring.Queued());
  while (expected > 0) {
    // A wait that fails (the ring is unusable, never a transient error: WaitOne retries
    // those) cannot be recovered from; the kernel completes the reads with the ring.
    if (!ring.WaitOne().ok()) return;
    --expected;
  }
}

// The reads of one thread until the job is done or failed; `in_flight`: what is left in the
// kernel when it returns early (an error), for DrainRing.
void RunRing(ReadJob& job, platform::IoRing& ring, unsigned queue_depth, BouncePool& bounces,
             unsigned& in_flight) {
  const ReadPlan& plan = *job.plan;
  std::vector<std::pair<size_t, std::byte*>> bounced;  // in flight: piece -> buffer
  std::vector<std::byte> batch_buffer;                 // for ReadBatch
  bool exhausted = false;
  size_t run_next = ReadJob::kNone;
  for (;;) {
    bool queued = false;
    while (!exhausted && !job.failed.load(std::memory_order_relaxed)) {
      if (in_flight >= queue_depth || bounced.size() >= kBouncedInFlight) break;
      const size_t index = job.TakePiece(run_next);
      if (index == ReadJob::kNone) {
        exhausted = true;
        break;
      }
      const ReadPiece& piece = plan.pieces[index];
      if (job.Hot(index)) {
        job.CopyHot(index, run_next);
        // Let reads in flight complete between hot pieces.
        if (in_flight > 0) break;
        continue;
      }
      if (const size_t end = job.BatchEnd(index); end > index + 1) {
        job.ReadBatch(index, end, batch_buffer);
        if (in_flight > 0) break;
        continue;
      }
      std::byte* buffer = job.data.data() + piece.arena_offset;
      uint64_t offset = piece.source_offset;
      uint64_t bytes = piece.bytes;
      bool bounce = piece.bounce;
      if (bounce) {
        std::byte* b = bounces.Take();
        if (b == nullptr) {
          // No bounce buffer (no memory): read this one here, buffered.
          Status s = job.FinishPiece(piece, 0);
          if (!s.ok()) return job.Fail(s);
          job.PieceDone(index);
          continue;
        }
        const BounceRange range = BounceRangeOf(piece, job.direct_alignment[piece.source]);
        buffer = b;
        offset = range.first;
        bytes = range.bytes;
        bounced.emplace_back(index, b);
      }
      const platform::UniqueFd* fd =
          piece.direct ? job.direct[piece.source] : job.buffered[piece.source];
      if (!ring.QueueRead(fd->get(), buffer, static_cast<uint32_t>(bytes), offset, index)) {
        // The ring is full (it never should be: in_flight stays below its size).
        if (bounce) {
          bounces.Give(bounced.back().second);
          bounced.pop_back();
        }
        Status s = job.FinishPiece(piece, 0);
        if (!s.ok()) return job.Fail(s);
        job.PieceDone(index);
        continue;
      }
      ++in_flight;
      queued = true;
      // A buffered read of cached data is copied by the kernel during submit: keeping few in
      // flight leaves the copy in the CPU cache for the hash.
      if (piece.cached && in_flight >= kCachedInFlight) break;
    }
    if (queued) {
      Status s = ring.Submit();
      if (!s.ok()) return job.Fail(s);  // earlier batches are in flight: the caller drains
    }
    if (in_flight == 0) return;
    auto completion = ring.WaitOne();
    if (!completion.ok()) return job.Fail(completion.status());
    --in_flight;
    const size_t index = completion->user_data;
    std::byte* bounce = nullptr;
    for (size_t k = 0; k < bounced.size(); ++k) {
      if (bounced[k].first == index) {
        bounce = bounced[k].second;
        bounced[k] = bounced.back();
        bounced.pop_back();
        break;
      }
    }
    Status s = job.Complete(index, completion->result, bounce);
    if (bounce != nullptr) bounces.Give(bounce);
    // On failure keep draining: the kernel still writes into the arena for what is in flight.
    if (!s.ok()) job.Fail(s);
  }
}

void UringWorker(ReadJob& job, platform::IoRing& ring, unsigned queue_depth) {
  // Declared before the reads: the bounce buffers outlive every read into them.
  BouncePool bounces(job.bounce_buffer_bytes, kBouncedInFlight);
  unsigned in_flight = 0;
  RunRing(job, ring, queue_depth, bounces, in_flight);
  DrainRing(ring, in_flight);
}

void PreadWorker(ReadJob& job) {
  const ReadPlan& plan = *job.plan;
  BouncePool bounces(job.bounce_buffer_bytes, 1);
  std::vector<std::byte> batch_buffer;  // for ReadBatch
  size_t run_next = ReadJob::kNone;
  for (;;) {
    if (job.failed.load(std::memory_order_relaxed)) return;
    const size_t index = job.TakePiece(run_next);
    if (index == ReadJob::kNone) return;
    const ReadPiece& piece = plan.pieces[index];
    Status s;
    if (job.Hot(index)) {
      job.CopyHot(index, run_next);
      continue;
    }
    if (const size_t end = job.BatchEnd(index); end > index + 1) {
      job.ReadBatch(index, end, batch_buffer);
      continue;
    }
    if (piece.direct) {
      std::byte* buffer = job.data.data() + piece.arena_offset;
      uint64_t offset = piece.source_offset;
      uint64_t bytes = piece.bytes;
      std::byte* bounce = piece.bounce ? bounces.Take() : nullptr;
      if (piece.bounce && bounce == nullptr) {
        s = job.FinishPiece(piece, 0);
        if (!s.ok()) return job.Fail(s);
        job.PieceDone(index);
        continue;
      }
      if (bounce != nullptr) {
        const BounceRange range = BounceRangeOf(piece, job.direct_alignment[piece.source]);
        buffer = bounce;
        offset = range.first;
        bytes = range.bytes;
      }
      auto got = platform::ReadSome(*job.direct[piece.source], offset,
                                    {buffer, static_cast<size_t>(bytes)});
      int64_t result = got.ok() ? static_cast<int64_t>(*got) : -EINVAL;
      s = job.Complete(index, result, bounce);
      if (bounce != nullptr) bounces.Give(bounce);
    } else {
      s = job.FinishPiece(piece, 0);
      if (s.ok()) job.PieceDone(index);
    }
    if (!s.ok()) return job.Fail(s);
  }
}

}  // namespace

Status RunUringReaders(ReadJob& job, std::vector<platform::IoRing>& rings, unsigned queue_depth) {
  std::vector<std::thread> threads;
  for (size_t i = 1; i < rings.size(); ++i) {
    threads.emplace_back(
        [&job, &rings, i, queue_depth] { UringWorker(job, rings[i], queue_depth); });
  }
  UringWorker(job, rings[0], queue_depth);
  for (auto& t : threads) t.join();
  return job.first_error;
}

Status RunPreadReaders(ReadJob& job, unsigned count) {
  std::vector<std::thread> threads;
  for (unsigned i = 1; i < count; ++i) threads.emplace_back([&job] { PreadWorker(job); });
  PreadWorker(job);
  for (auto& t : threads) t.join();
  return job.first_error;
}

}  // namespace expert_arena::load
