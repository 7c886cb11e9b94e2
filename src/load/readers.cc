#include "load/readers.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/units.h"
#include "platform/mapping.h"

namespace expert_arena::load {

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

// A cached piece is copied by the kernel during submit: keeping few in flight leaves the
// copied bytes in the CPU cache for the hash. Uncached pieces wait on the device: many.
constexpr unsigned kCachedInFlight = 2;
// Bounced pieces hold a buffer each while in flight.
constexpr unsigned kBouncedInFlight = 8;

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

void UringWorker(ReadJob& job, platform::IoRing& ring, unsigned queue_depth) {
  const ReadPlan& plan = *job.plan;
  BouncePool bounces(job.bounce_buffer_bytes, kBouncedInFlight);
  std::vector<std::pair<size_t, std::byte*>> bounced;  // in flight: piece -> buffer
  unsigned in_flight = 0;
  bool exhausted = false;
  for (;;) {
    bool queued = false;
    while (!exhausted && !job.failed.load(std::memory_order_relaxed)) {
      size_t next = job.next_piece.load(std::memory_order_relaxed);
      if (next >= plan.pieces.size()) {
        exhausted = true;
        break;
      }
      const ReadPiece& peek = plan.pieces[next];
      unsigned limit = peek.cached ? kCachedInFlight : queue_depth;
      if (in_flight >= limit) break;
      if (peek.bounce && bounced.size() >= kBouncedInFlight) break;
      size_t index = job.next_piece.fetch_add(1);
      if (index >= plan.pieces.size()) {
        exhausted = true;
        break;
      }
      const ReadPiece& piece = plan.pieces[index];
      std::byte* buffer = job.data.data() + piece.arena_offset;
      uint64_t offset = piece.source_offset;
      uint64_t bytes = piece.bytes;
      bool bounce = piece.bounce;
      if (bounce) {
        std::byte* b = bounces.Take();
        if (b == nullptr) {
          // No bounce buffer (all busy after another thread took our peeked piece, or no
          // memory): read this one here, buffered.
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
    }
    if (queued) {
      Status s = ring.Submit();
      if (!s.ok()) return job.Fail(s);  // nothing of this batch reached the kernel
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

void PreadWorker(ReadJob& job) {
  const ReadPlan& plan = *job.plan;
  BouncePool bounces(job.bounce_buffer_bytes, 1);
  for (;;) {
    if (job.failed.load(std::memory_order_relaxed)) return;
    size_t index = job.next_piece.fetch_add(1);
    if (index >= plan.pieces.size()) return;
    const ReadPiece& piece = plan.pieces[index];
    Status s;
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
