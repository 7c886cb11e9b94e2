// StreamProducer: segments, block allocation, publication, reclaim, abort, spill.
//
// Design note. Everything a producer decides is under one mutex (mu): the allocator, the
// block records, the key index and the segment list. Bytes are written outside it. The
// release state of each block lives in its segment (segment_format.h), so consumers release
// without talking to us; we notice on our own thread: every release bumps its segment's
// epoch, and Reserve rescans the published blocks of segments whose epoch moved (cheap), and
// under pressure everything, including reader entries whose process died (their holds are
// cleared). A reserve therefore never waits for an acknowledgement only this thread could
// process. Growth is one segment at a time up to the cap; a mapping never moves. A tensor
// larger than a segment gets a dedicated one-shot segment (never pinned); at the cap a tensor
// spills to a one-shot segment in the spill directory (same format, so consumers read it with
// the same Open), or, in strict mode, waits a bounded time and fails. Keys, dtypes and shapes
// a consumer's Decode would refuse (an empty key, control bytes, too long) are refused before
// anything is reserved, so every descriptor we hand out decodes.
//
// Grow ahead: making a segment costs tens of milliseconds to a second (fallocate, MADV_COLLAPSE
// to 2 MiB pages, populate), so when free space gets low one background thread (`grower`)
// makes the next segment outside the mutex and installs it under the mutex; a reserve that
// needs space meanwhile waits on `grown` (the mutex released) instead of growing itself. The
// grower holds a raw pointer to Impl: ~Impl stops and joins it before anything is torn down.
//
// Leases: a consumer holds an OFD lock on its reader entry of each segment it maps. A reader
// whose lock we can take is gone (dead, or exited without releasing): its holds and the
// shares of the blocks it held are given back (stream::SpendDeadReaderHolds). We check when
// space is short, on Reclaim() and Pending(), and at most every lease_check_seconds from a
// reserve or Stats(), so a dead consumer's blocks come back within that bound of our next call.
//
// Fork (stream/fork_guard.h): the producer belongs to the process that created it. In a
// forked child every method that could reserve, publish, free or abort fails naming the
// fork, and the last reference keeps the memory instead of unlinking the parent's segments.
// The first segment is made by the first reserve, not at creation: a producer that never
// puts commits nothing.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/escape.h"
#include "common/logging.h"
#include "expert_arena/stream.h"
#include "platform/file.h"
#include "platform/memory_copy.h"
#include "platform/numa.h"
#include "platform/ofd_lock.h"
#include "platform/system_info.h"
#include "stream/stream_remote.h"
#include "stream/block_allocator.h"
#include "stream/fork_guard.h"
#include "stream/segment_placement.h"
#include "stream/segment_file.h"

namespace expert_arena {

using stream::BlockSlot;
using stream::BlockState;
using stream::ControlWord;
using stream::SegmentKind;

namespace {

using Clock = std::chrono::steady_clock;

struct BlockRecord {
  bool live = false;
  bool published = false;
  bool aborted = false;  // Abort() while it was being written
  uint64_t offset = 0;   // our own copy: the shared slot is writable by every reader
  uint64_t block_bytes = 0;
  uint64_t generation = 0;
  std::string key;
  size_t published_index = 0;  // position in ProducerSegment::published
  Clock::time_point reserved_at;
};

struct ProducerSegment {
  uint32_t id = 0;
  stream::SegmentFile file;
  std::vector<BlockRecord> blocks;  // one per slot
  std::vector<uint32_t> free_slots;
  std::vector<uint32_t> published;  // slots to look at when the epoch moves
  uint64_t seen_epoch = 0;
  uint32_t live = 0;
  std::string huge_note;  // how the segment got its pages, for the growth log line
};

struct BlockRef {
  uint32_t segment = 0;
  uint32_t slot = 0;
};

std::atomic_ref<uint64_t> Control(BlockSlot& s) { return stream::AtomicWord(s.control); }
std::atomic_ref<uint64_t> Holders(BlockSlot& s) { return stream::AtomicWord(s.holders); }

// Refuses what a consumer's Decode would refuse, before anything is reserved: a key that is
// empty, holds a control byte or is too long (stream::StreamKeyProblem). `what` names the call
// ("stream put"); the message quotes the key escaped.
Status CheckKey(std::string_view what, std::string_view key) {
  if (std::string problem = stream::StreamKeyProblem(key); !problem.empty()) {
    return InvalidArgument(std::string(what) + ": key " + QuoteForMessage(key) + " " + problem);
  }
  return Status::Ok();
}

// Likewise a dtype (stream::DtypeProblem) or a shape a descriptor cannot carry.
Status CheckInfo(std::string_view what, std::string_view key, const TensorInfo& info) {
  if (std::string problem = stream::DtypeProblem(info.dtype); !problem.empty()) {
    return InvalidArgument(std::string(what) + " of key " + QuoteForMessage(key) + ": dtype " +
                           QuoteForMessage(info.dtype) + " " + problem);
  }
  if (info.shape.size() > stream::kMaxDescriptorDims) {
    return InvalidArgument(std::string(what) + " of key " + QuoteForMessage(key) + ": " +
                           std::to_string(info.shape.size()) + " dimensions, more than the " +
                           std::to_string(stream::kMaxDescriptorDims) + " a descriptor carries");
  }
  return Status::Ok();
}

// "60 s", "0.5 s".
std::string FormatSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

std::string RandomHex() {
  std::random_device rd;
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", rd());
  return buf;
}

}  // namespace

struct StreamProducer::Impl : stream::ForkParticipant {
  StreamOptions options;
  pid_t creator_pid = 0;
  uint64_t fork_generation = 0;  // stream::ForkGeneration() at creation
  std::shared_ptr<spdlog::logger> log;
  std::string instance;  // "ea-stream-<logical>-<pid>-<starttime>-<random>"
  uint64_t regular_file_bytes = 0;
  uint64_t cap_bytes = 0;
  uint32_t regular_slots = 0;
  uint32_t copy_threads = 1;       // resolved once: hardware_concurrency() reads /sys each call
  uint64_t non_temporal_from = 0;  // resolved once from the option and the cache size
  stream::SegmentPlacement placement;  // StreamOptions::numa, resolved once at Create

  std::mutex mu;
  stream::BlockAllocator allocator;
  std::map<uint32_t, std::unique_ptr<ProducerSegment>> segments;
  std::unordered_map<std::string, std::vector<BlockRef>> keys;
  uint32_t next_id = 0;
  std::atomic<uint64_t> next_seq{0};  // segment file names; the grower takes them unlocked
  uint64_t file_bytes_used = 0;       // regular + dedicated segment files (spills are outside)
  uint64_t pinned_bytes = 0;
  uint64_t live_blocks = 0;
  uint64_t dedicated_segments = 0;
  uint64_t spill_files = 0;
  uint64_t spills = 0;
  uint64_t fragmentation_failures = 0;
  uint64_t reclaimed = 0;
  uint64_t dead_readers = 0;
  uint64_t grown_ahead = 0;
  // Why the kernel refused the placement (auto only: first touch then), from the first
  // segment it was refused for; "" while it was applied.
  std::string numa_refused;
  Clock::time_point last_lease_check;
  // The fragmentation warning's rate limit: when it was last logged, failures since then.
  Clock::time_point last_fragmentation_warning;
  uint64_t fragmentation_unlogged = 0;
  // Grow ahead (see the design note): `growing` while the grower makes a segment, whose file
  // bytes count against the cap already (`growing_bytes`); `stopping` from ~Impl on.
  bool growing = false;
  bool stopping = false;
  uint64_t growing_bytes = 0;
  // File bytes of dedicated segments a reserve is making with mu released (against the cap).
  uint64_t making_bytes = 0;
  // Segments removed under mu, destroyed (unmapped, closed: their pages freed, milliseconds
  // for a large one) by Lock once mu is released.
  std::vector<std::unique_ptr<ProducerSegment>> retired;
  std::condition_variable grown;
  std::thread grower;
  // Across hosts (StreamOptions::listen): the stream server, and what descriptors carry.
  std::unique_ptr<remote::StreamServer> server;
  std::string boot_id;

  ~Impl() override;
  // mu, held for the scope; the segments removed meanwhile are destroyed after it is released.
  class Lock {
   public:
    explicit Lock(Impl& impl) : impl_(impl), lock_(impl.mu) {}
    ~Lock() {
      std::vector<std::unique_ptr<ProducerSegment>> dead;
      dead.swap(impl_.retired);
      lock_.unlock();
    }
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    std::unique_lock<std::mutex>& unique() { return lock_; }

   private:
    Impl& impl_;
    std::unique_lock<std::mutex> lock_;
  };
  // True in a forked child of the process that created this producer.
  bool Foreign() const { return stream::ForkGeneration() != fork_generation; }
  Status CheckProcess(std::string_view what) const {
    if (!Foreign()) return Status::Ok();
    return InvalidArgument(std::string(what) + ": " +
                           stream::ForkedMessage("StreamProducer", creator_pid));
  }
  void LockForFork() override { mu.lock(); }
  void UnlockAfterFork(bool in_child) override {
    if (in_child) {
      // Our owner locks stay with the parent's descriptors; ours would make the parent's
      // segments look alive to a sweep after the parent died. The mappings stay.
      for (auto& [id, seg] : segments) seg->file.fd.Reset();
    }
    mu.unlock();
  }
  // Dead readers' leases, when lease_check_seconds passed since the last check (under mu).
  void MaybeCheckLeases();
  // Makes a segment file (create, allocate, 2 MiB pages, populate, GPU registration); needs
  // no lock (the grower runs it unlocked). InstallSegment (under mu) makes it allocatable.
  Result<std::unique_ptr<ProducerSegment>> MakeSegment(SegmentKind kind, uint64_t data_bytes);
  ProducerSegment* InstallSegment(std::unique_ptr<ProducerSegment> seg, bool ahead);
  // Makes a segment with `lock` (on mu) released, so that every other Put, Abort and release
  // goes on while the file is allocated, collapsed, populated and registered, then installs
  // it. A regular segment is made as the grower makes one (`growing`: others wait for it
  // instead of making another); a dedicated one counts against the cap meanwhile.
  Result<ProducerSegment*> AddSegmentUnlocked(std::unique_lock<std::mutex>& lock,
                                              SegmentKind kind, uint64_t data_bytes);
  void MaybeGrowAhead(uint64_t last_reserve);
  void GrowAhead();
  void WarnFragmentation(std::string_view key, uint64_t need);
  void RemoveSegment(uint32_t id);
  Result<Reservation> ReserveLocked(std::unique_lock<std::mutex>& lock, std::string_view key,
                                    uint64_t bytes);
  Reservation MakeReservation(ProducerSegment& seg, uint32_t slot, uint64_t offset,
                              uint64_t block_bytes, uint64_t length, std::string_view key);
  void FreeBlock(ProducerSegment& seg, uint32_t slot);
  bool TryReclaim(ProducerSegment& seg, uint32_t slot);
  void ReclaimMoved();
  void ReclaimAll();
  void ClearDeadReaders(ProducerSegment& seg);
  void Unpublish(ProducerSegment& seg, uint32_t slot);
  StreamStats StatsLocked() const;
  std::shared_ptr<Impl> self() { return self_weak.lock(); }
  std::weak_ptr<Impl> self_weak;
};

struct Reservation::State {
  std::shared_ptr<StreamProducer::Impl> producer;
  uint32_t segment = 0;
  uint32_t slot = 0;
  uint64_t generation = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::span<std::byte> bytes;
  std::string key;
  std::string segment_name;
  bool spilled = false;
  bool done = false;
};

// ---- segments ------------------------------------------------------------------------------

Result<std::unique_ptr<ProducerSegment>> StreamProducer::Impl::MakeSegment(SegmentKind kind,
                                                                           uint64_t data_bytes) {
  bool spill = kind == SegmentKind::kSpill;
  stream::CreateSegmentParams p;
  p.directory = spill ? options.spill_directory : options.directory;
  p.kind = kind;
  p.data_bytes = data_bytes;
  p.slot_count = kind == SegmentKind::kRegular ? regular_slots : 1;
  p.logical_name = options.logical_name;
  // One-shot segments are not worth a collapse; spill files live on a plain filesystem.
  p.huge = kind == SegmentKind::kRegular ? options.huge : HugePages::kOff;
  p.populate = !spill;
  // Spill files live on a plain filesystem, whose page cache no policy places.
  p.placement = spill ? nullptr : &placement.pages;
  auto seg = std::make_unique<ProducerSegment>();
  Result<stream::SegmentFile> file = Busy("not tried");
  for (int attempt = 0; attempt < 8; ++attempt) {
    p.name = instance + "-" + std::to_string(next_seq.fetch_add(1));
    file = stream::CreateSegment(p, *log, &seg->huge_note);
    if (file.ok() || file.status().code() != StatusCode::kBusy) break;
  }
  if (!file.ok()) return file.status();
  seg->file = std::move(file).value();
  uint32_t slots = seg->file.view.slot_count;
  seg->blocks.resize(slots);
  seg->free_slots.reserve(slots);
  for (uint32_t s = slots; s-- > 0;) seg->free_slots.push_back(s);
  if (kind == SegmentKind::kRegular && options.gpu.backend != GpuBackend::kNone) {
    auto reg = gpu::RegisterHostRange(
        seg->file.mapping.bytes(),
        {.device = options.gpu, .pin_budget_bytes = options.pin_budget_bytes, .logger = log});
    if (reg.ok()) {
      seg->file.pinned_bytes = (*reg)->report().registered_bytes;
      seg->file.registration = std::move(reg).value();
    } else {
      log->warn("stream {}: GPU registration of {} failed: {}", instance, seg->file.name,
                reg.status().message());
    }
  }
  return seg;
}

ProducerSegment* StreamProducer::Impl::InstallSegment(std::unique_ptr<ProducerSegment> seg,
                                                      bool ahead) {
  seg->id = next_id++;
  const SegmentKind kind = seg->file.kind;
  pinned_bytes += seg->file.pinned_bytes;
  if (!seg->file.numa_note.empty() && numa_refused.empty()) {
    numa_refused = seg->file.numa_note;
    log->warn("stream {}: segment {} on {}", instance, seg->file.name, numa_refused);
  }
  if (kind == SegmentKind::kRegular) {
    uint64_t data_bytes = seg->file.header().data_bytes;
    allocator.AddSegment(seg->id, seg->file.header().data_offset, data_bytes);
    if (ahead) ++grown_ahead;
    log->info("stream {}: segment {} ({}){}{}; {} segments, {} free, largest free block {}",
              instance, seg->file.name, FormatBytes(data_bytes),
              seg->huge_note.empty() ? "" : "; " + seg->huge_note, ahead ? "; grown ahead" : "",
              segments.size() + 1, FormatBytes(allocator.free_bytes()),
              FormatBytes(allocator.largest_free_block()));
  }
  if (kind != SegmentKind::kSpill) file_bytes_used += seg->file.file_bytes();
  if (kind == SegmentKind::kDedicated) ++dedicated_segments;
  if (kind == SegmentKind::kSpill) ++spill_files;
  ProducerSegment* raw = seg.get();
  segments.emplace(raw->id, std::move(seg));
  return raw;
}

Result<ProducerSegment*> StreamProducer::Impl::AddSegmentUnlocked(
    std::unique_lock<std::mutex>& lock, SegmentKind kind, uint64_t data_bytes) {
  const uint64_t file_bytes = stream::SegmentFileBytes(data_bytes);
  if (kind == SegmentKind::kRegular) {
    growing = true;
    growing_bytes = file_bytes;
  } else if (kind == SegmentKind::kDedicated) {
    making_bytes += file_bytes;
  }
  lock.unlock();
  auto seg = MakeSegment(kind, data_bytes);
  lock.lock();
  if (kind == SegmentKind::kRegular) {
    growing = false;
    growing_bytes = 0;
    grown.notify_all();
  } else if (kind == SegmentKind::kDedicated) {
    making_bytes -= file_bytes;
  }
  if (!seg.ok()) return seg.status();
  return InstallSegment(std::move(seg).value(), /*ahead=*/false);
}

// Under mu, after a reserve of `last_reserve` bytes from the allocator.
void StreamProducer::Impl::MaybeGrowAhead(uint64_t last_reserve) {
  if (!options.grow_ahead || growing || stopping) return;
  if (allocator.free_bytes() >= options.segment_bytes / 4 + last_reserve) return;
  if (file_bytes_used + making_bytes + regular_file_bytes > cap_bytes) return;
  growing = true;
  growing_bytes = regular_file_bytes;
  // The previous grower has left the mutex for good once it cleared `growing`.
  if (grower.joinable()) grower.join();
  grower = std::thread([this] { GrowAhead(); });
}

void StreamProducer::Impl::GrowAhead() {
  auto seg = MakeSegment(SegmentKind::kRegular, options.segment_bytes);
  std::lock_guard lock(mu);
  growing = false;
  growing_bytes = 0;
  if (seg.ok() && stopping) {
    (void)platform::UnlinkPath((*seg)->file.path);  // never installed: ~Impl would not see it
  } else if (seg.ok()) {
    InstallSegment(std::move(seg).value(), /*ahead=*/true);
  } else {
    // The reserve that needs space grows itself (and reports the error) as without grow-ahead.
    log->warn("stream {}: growing ahead failed: {}", instance, seg.status().message());
  }
  grown.notify_all();
}

void StreamProducer::Impl::RemoveSegment(uint32_t id) {
  auto it = segments.find(id);
  if (it == segments.end()) return;
  ProducerSegment& seg = *it->second;
  if (seg.file.kind != SegmentKind::kSpill) file_bytes_used -= seg.file.file_bytes();
  if (seg.file.kind == SegmentKind::kDedicated) --dedicated_segments;
  if (seg.file.kind == SegmentKind::kSpill) --spill_files;
  pinned_bytes -= seg.file.pinned_bytes;
  Status s = platform::UnlinkPath(seg.file.path);
  if (!s.ok()) log->warn("stream {}: {}", instance, s.message());
  retired.push_back(std::move(it->second));
  segments.erase(it);
}

StreamProducer::Impl::~Impl() {
  stream::UnregisterForFork(this);
  server.reset();  // ends remote holds (their shares spent) while the segments still exist
  {
    std::lock_guard lock(mu);
    stopping = true;
  }
  if (grower.joinable()) grower.join();  // it installs nothing once `stopping` is set
  std::lock_guard lock(mu);
  // A consumer that still maps a segment refuses a stale descriptor naming the close.
  for (auto& [id, seg] : segments) seg->file.view.closed().store(1, std::memory_order_release);
  while (!segments.empty()) RemoveSegment(segments.begin()->first);
}

// ---- blocks --------------------------------------------------------------------------------

Reservation StreamProducer::Impl::MakeReservation(ProducerSegment& seg, uint32_t slot,
                                                  uint64_t offset, uint64_t block_bytes,
                                                  uint64_t length, std::string_view key) {
  BlockSlot& s = seg.file.view.slots[slot];
  BlockRecord& rec = seg.blocks[slot];
  uint64_t generation = stream::AtomicWord(s.generation).load(std::memory_order_relaxed) + 1;
  // Relaxed stores: readers look at these only after they saw the control word below.
  stream::AtomicWord(s.generation).store(generation, std::memory_order_relaxed);
  stream::AtomicWord(s.offset).store(offset, std::memory_order_relaxed);
  stream::AtomicWord(s.length).store(length, std::memory_order_relaxed);
  Holders(s).store(0, std::memory_order_relaxed);
  Control(s).store(ControlWord::Make(BlockState::kWriting, 0, generation),
                   std::memory_order_release);
  rec = BlockRecord{.live = true,
                    .offset = offset,
                    .block_bytes = block_bytes,
                    .generation = generation,
                    .key = std::string(key),
                    .reserved_at = Clock::now()};
  ++seg.live;
  ++live_blocks;
  keys[rec.key].push_back({seg.id, slot});
  auto state = std::make_unique<Reservation::State>();
  state->producer = self();
  state->segment = seg.id;
  state->slot = slot;
  state->generation = generation;
  state->offset = offset;
  state->length = length;
  state->bytes = {seg.file.mapping.data() + offset, length};
  state->key = rec.key;
  state->segment_name = seg.file.name;
  state->spilled = seg.file.kind == SegmentKind::kSpill;
  return Reservation(std::move(state));
}

void StreamProducer::Impl::Unpublish(ProducerSegment& seg, uint32_t slot) {
  BlockRecord& rec = seg.blocks[slot];
  if (!rec.published) return;
  size_t i = rec.published_index;
  uint32_t last = seg.published.back();
  seg.published[i] = last;
  seg.blocks[last].published_index = i;
  seg.published.pop_back();
  rec.published = false;
}

void StreamProducer::Impl::FreeBlock(ProducerSegment& seg, uint32_t slot) {
  BlockRecord& rec = seg.blocks[slot];
  BlockSlot& s = seg.file.view.slots[slot];
  Unpublish(seg, slot);
  auto kit = keys.find(rec.key);
  if (kit != keys.end()) {
    auto& refs = kit->second;
    for (size_t i = 0; i < refs.size(); ++i) {
      if (refs[i].segment == seg.id && refs[i].slot == slot) {
        refs[i] = refs.back();
        refs.pop_back();
        break;
      }
    }
    if (refs.empty()) keys.erase(kit);
  }
  Control(s).store(ControlWord::Make(BlockState::kFree, 0, rec.generation),
                   std::memory_order_release);
  --seg.live;
  --live_blocks;
  ++reclaimed;
  if (seg.file.kind == SegmentKind::kRegular) {
    allocator.Free({seg.id, rec.offset, rec.block_bytes});
    seg.free_slots.push_back(slot);
    rec = BlockRecord{.generation = rec.generation};
  } else {
    RemoveSegment(seg.id);  // one-shot: the file goes with its block
  }
}

// Frees the block when every reader released it (or its key was aborted) and no reader
// holds it now. Returns true when freed; `seg` may be gone then (one-shot segments).
bool StreamProducer::Impl::TryReclaim(ProducerSegment& seg, uint32_t slot) {
  BlockSlot& s = seg.file.view.slots[slot];
  uint64_t c = Control(s).load(std::memory_order_seq_cst);
  BlockState st = ControlWord::State(c);
  bool done =
      (st == BlockState::kPublished && ControlWord::Pending(c) == 0) || st == BlockState::kAborted;
  if (!done) return false;
  uint64_t reclaiming = ControlWord::Make(BlockState::kReclaiming, 0, ControlWord::Generation(c));
  if (!Control(s).compare_exchange_strong(c, reclaiming, std::memory_order_seq_cst)) return false;
  if (Holders(s).load(std::memory_order_seq_cst) != 0) {
    // A reader holds it (or is checking it right now): put the state back, try later.
    Control(s).store(c, std::memory_order_seq_cst);
    return false;
  }
  FreeBlock(seg, slot);
  return true;
}

void StreamProducer::Impl::ReclaimMoved() {
  std::vector<uint32_t> ids;
  for (auto& [id, seg] : segments) {
    uint64_t epoch = seg->file.view.epoch().load(std::memory_order_acquire);
    if (epoch != seg->seen_epoch && !seg->published.empty()) ids.push_back(id);
  }
  for (uint32_t id : ids) {
    auto it = segments.find(id);
    if (it == segments.end()) continue;
    ProducerSegment* seg = it->second.get();
    seg->seen_epoch = seg->file.view.epoch().load(std::memory_order_acquire);
    bool one_shot = seg->file.kind != SegmentKind::kRegular;
    // Walk a copy: reclaiming edits the list (and may remove a one-shot segment).
    std::vector<uint32_t> slots = seg->published;
    for (uint32_t slot : slots) {
      if (TryReclaim(*seg, slot) && one_shot) break;
    }
  }
}

void StreamProducer::Impl::ClearDeadReaders(ProducerSegment& seg) {
  for (uint32_t i = 0; i < stream::kMaxReaders; ++i) {
    auto owner = stream::AtomicWord(seg.file.view.readers[i].owner);
    if (owner.load(std::memory_order_acquire) == 0) continue;
    auto taken = platform::TryLockByte(seg.file.fd, stream::kReaderLockBase + i,
                                       platform::LockMode::kExclusive);
    if (!taken.ok() || !*taken) continue;  // the reader is alive (it holds its byte)
    // The reader is gone: its process lost its lock. While we hold the byte nobody can take
    // the entry, so ending its lease and freeing the entry cannot race a new reader.
    uint64_t released = stream::SpendDeadReaderHolds(seg.file.view, i);
    log->info("stream {}: reader pid {} of {} is gone; its {} held blocks were released", instance,
              owner.load(), seg.file.name, released);
    owner.store(0, std::memory_order_release);
    (void)platform::UnlockByte(seg.file.fd, stream::kReaderLockBase + i);
    ++dead_readers;
  }
}

void StreamProducer::Impl::MaybeCheckLeases() {
  const auto now = Clock::now();
  if (now - last_lease_check <
      std::chrono::duration<double>(std::max(0.0, options.lease_check_seconds))) {
    return;
  }
  last_lease_check = now;
  for (auto& [id, seg] : segments) ClearDeadReaders(*seg);  // epochs move: ReclaimMoved frees
}

void StreamProducer::Impl::ReclaimAll() {
  std::vector<uint32_t> ids;
  for (auto& [id, seg] : segments) ids.push_back(id);
  for (uint32_t id : ids) {
    auto it = segments.find(id);
    if (it == segments.end()) continue;
    ProducerSegment* seg = it->second.get();
    ClearDeadReaders(*seg);
    seg->seen_epoch = seg->file.view.epoch().load(std::memory_order_acquire);
    bool one_shot = seg->file.kind != SegmentKind::kRegular;
    std::vector<uint32_t> slots = seg->published;
    for (uint32_t slot : slots) {
      if (TryReclaim(*seg, slot) && one_shot) break;
    }
  }
}

void StreamProducer::Impl::WarnFragmentation(std::string_view key, uint64_t need) {
  ++fragmentation_failures;
  ++fragmentation_unlogged;
  const auto now = Clock::now();
  const auto interval = std::chrono::duration<double>(options.warning_interval_seconds);
  if (fragmentation_failures > 1 && now - last_fragmentation_warning < interval) return;
  std::string earlier;
  if (fragmentation_unlogged > 1) {
    earlier = "; " + std::to_string(fragmentation_unlogged - 1) + " more since the last warning";
  }
  log->warn(
      "stream {}: reserve of {} for key {} failed while {} is free (largest free block {}, {} "
      "free blocks): fragmentation ({} so far{})",
      instance, FormatBytes(need), key, FormatBytes(allocator.free_bytes()),
      FormatBytes(allocator.largest_free_block()), allocator.free_block_count(),
      fragmentation_failures, earlier);
  last_fragmentation_warning = now;
  fragmentation_unlogged = 0;
}

Result<Reservation> StreamProducer::Impl::ReserveLocked(std::unique_lock<std::mutex>& lock,
                                                        std::string_view key, uint64_t bytes) {
  const uint64_t align = options.block_alignment;
  auto rounded = AlignUp(std::max<uint64_t>(bytes, 1), align);
  if (!rounded) return InvalidArgument("stream reserve: " + std::to_string(bytes) + " bytes");
  const uint64_t need = *rounded;
  MaybeCheckLeases();
  ReclaimMoved();
  const bool oversized = need > options.segment_bytes;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(
                                           std::max(0.0, options.strict_wait_seconds) * 1000));
  bool reclaimed_all = false;
  for (;;) {
    if (!oversized) {
      if (auto block = allocator.Reserve(need)) {
        ProducerSegment& seg = *segments.at(block->segment);
        if (!seg.free_slots.empty()) {
          uint32_t slot = seg.free_slots.back();
          seg.free_slots.pop_back();
          MaybeGrowAhead(need);
          return MakeReservation(seg, slot, block->offset, need, bytes, key);
        }
        allocator.Free(*block);  // the block table is full: treat the segment as full
      }
    }
    if (!reclaimed_all) {
      ReclaimAll();
      reclaimed_all = true;
      continue;
    }
    if (!oversized && growing) {
      // The grower is making the next segment: wait for it (the mutex released, so other
      // threads reserve, publish and free meanwhile) rather than make another one.
      grown.wait(lock, [&] { return !growing; });
      reclaimed_all = false;
      continue;
    }
    if (!oversized && allocator.free_bytes() >= need) WarnFragmentation(key, need);
    uint64_t data_bytes = oversized ? *AlignUp(need, kHugePageBytes) : options.segment_bytes;
    uint64_t file_bytes = stream::SegmentFileBytes(data_bytes);
    if (file_bytes_used + growing_bytes + making_bytes + file_bytes <= cap_bytes) {
      auto seg = AddSegmentUnlocked(
          lock, oversized ? SegmentKind::kDedicated : SegmentKind::kRegular, data_bytes);
      if (seg.ok()) {
        if (oversized) {
          (*seg)->free_slots.pop_back();
          return MakeReservation(**seg, 0, (*seg)->file.header().data_offset, need, bytes, key);
        }
        continue;  // the allocator has the new segment now
      }
      if (seg.status().code() != StatusCode::kNoSpace) return seg.status();
      log->warn("stream {}: cannot grow: {}", instance, seg.status().message());
    }
    // At the cap.
    if (options.strict) {
      if (Clock::now() >= deadline) {
        return NoSpace("stream " + instance + ": cannot reserve " + FormatBytes(need) +
                       " for key " + std::string(key) + ": " + std::to_string(segments.size()) +
                       " segments at the cap of " + FormatBytes(cap_bytes) + " are full (" +
                       FormatBytes(allocator.free_bytes()) + " free, largest block " +
                       FormatBytes(allocator.largest_free_block()) + ") after waiting " +
                       std::to_string(options.strict_wait_seconds) +
                       " s for readers (strict mode)");
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      lock.lock();
      reclaimed_all = false;
      continue;
    }
    EA_ASSIGN_OR_RETURN(ProducerSegment * spill,
                        AddSegmentUnlocked(lock, SegmentKind::kSpill,
                                           *AlignUp(need, kHugePageBytes)));
    ++spills;
    // Once a warning (a spill is slower and writes to the spill directory's disk); then
    // counted in Stats().spills, each one at debug level.
    if (spills == 1) {
      log->warn(
          "stream {}: at the cap of {}: spilled {} for key {} to {} (disk); later spills are "
          "counted in stats' spills and logged at debug level",
          instance, FormatBytes(cap_bytes), FormatBytes(need), key, spill->file.path);
    } else {
      log->debug("stream {}: spilled {} for key {} to {} ({} spills so far)", instance,
                 FormatBytes(need), key, spill->file.path, spills);
    }
    spill->free_slots.pop_back();
    return MakeReservation(*spill, 0, spill->file.header().data_offset, need, bytes, key);
  }
}

StreamStats StreamProducer::Impl::StatsLocked() const {
  StreamStats s;
  s.total_bytes = allocator.total_bytes();
  s.free_bytes = allocator.free_bytes();
  s.largest_free_block = allocator.largest_free_block();
  for (auto& [id, seg] : segments) {
    if (seg->file.kind == SegmentKind::kDedicated) s.total_bytes += seg->file.header().data_bytes;
    if (seg->file.kind != SegmentKind::kSpill) ++s.segments;
  }
  s.dedicated_segments = dedicated_segments;
  s.live_blocks = live_blocks;
  s.pinned_bytes = pinned_bytes;
  s.spills = spills;
  s.spill_files = spill_files;
  s.fragmentation_failures = fragmentation_failures;
  s.reclaimed_blocks = reclaimed;
  s.dead_readers_cleared = dead_readers;
  s.segments_grown_ahead = grown_ahead;
  s.numa = placement.description;
  if (!numa_refused.empty()) s.numa += "; " + numa_refused;
  s.numa_node = placement.node;
  return s;  // the remote counts are added by Stats(), outside the lock
}

// ---- StreamProducer ------------------------------------------------------------------------

Result<StreamProducer> StreamProducer::Create(const StreamOptions& options) {
  // In a forked child the last reference keeps the memory instead (stream/fork_guard.h).
  std::shared_ptr<Impl> impl(new Impl, [](Impl* p) {
    if (p->Foreign()) {
      stream::KeepForever(p);
    } else {
      delete p;
    }
  });
  impl->self_weak = impl;
  impl->fork_generation = stream::ForkGeneration();
  impl->creator_pid = platform::CurrentPid();
  impl->options = options;
  impl->log = ResolveLogger(options.logger);
  const auto& o = impl->options;
  if (!stream::IsValidLogicalName(o.logical_name)) {
    return InvalidArgument(
        "stream logical name \"" + o.logical_name +
        "\": use 1-48 characters of [A-Za-z0-9_.-], without \"..\" (it is part of "
        "every segment file name)");
  }
  if (o.segment_bytes == 0 || o.segment_bytes % kHugePageBytes != 0) {
    return InvalidArgument("stream segment size " + std::to_string(o.segment_bytes) +
                           " bytes: must be a positive multiple of 2 MiB");
  }
  if (!IsPowerOfTwo(o.block_alignment) || o.block_alignment < 64 ||
      o.block_alignment > kHugePageBytes) {
    return InvalidArgument("stream block alignment " + std::to_string(o.block_alignment) +
                           ": must be a power of two from 64 B to 2 MiB");
  }
  if (o.max_segments == 0) return InvalidArgument("stream max_segments must be at least 1");
  // A typo in the device is refused here, as Arena::Open does, not found at the first segment.
  if (auto device = ParseGpuDevice(o.gpu.ToString()); !device.ok()) {
    return device.status().WithContext("stream producer gpu");
  }
  // Auto: a quarter of the cores, at most 4 (measured: on a busy 2-core machine a second
  // copy thread made a 64 MiB put slower, 11.6 ms vs 7.9 ms).
  impl->copy_threads = o.copy_threads != 0
                           ? o.copy_threads
                           : std::clamp<uint32_t>(std::thread::hardware_concurrency() / 4, 1, 4);
  // Auto: a quarter of the last-level cache. Measured on this VM (32 MiB L3): streaming
  // stores put 8 MiB in 220-245 us instead of 327 us and a reader copying it out right after
  // lost nothing; at 4 MiB and below the reader's copy got slower (the bytes were no longer in
  // the cache) by about what the put gained. See docs/streaming.md.
  if (o.non_temporal_copy_from != 0) {
    impl->non_temporal_from = o.non_temporal_copy_from;
  } else {
    uint64_t cache = platform::LastLevelCacheBytes();
    impl->non_temporal_from = cache != 0 ? std::max<uint64_t>(cache / 4, kMiB) : 8 * kMiB;
  }
  if (!(o.warning_interval_seconds >= 0)) {
    return InvalidArgument("stream warning interval " + std::to_string(o.warning_interval_seconds) +
                           " s: must be 0 or more");
  }
  if (!(o.lease_check_seconds >= 0)) {
    return InvalidArgument("stream lease check interval " +
                           std::to_string(o.lease_check_seconds) + " s: must be 0 or more");
  }
  impl->regular_file_bytes = stream::SegmentFileBytes(o.segment_bytes);
  impl->cap_bytes = impl->regular_file_bytes * o.max_segments;
  impl->regular_slots = static_cast<uint32_t>(
      std::min<uint64_t>(o.segment_bytes / o.block_alignment, stream::kMaxSlots));

  auto dir = platform::StatPath(o.directory);
  if (!dir.ok()) return dir.status().WithContext("stream directory");
  EA_ASSIGN_OR_RETURN(auto fs, platform::StatFilesystem(o.directory));
  if (impl->cap_bytes > fs.total_bytes) {
    // A hugetlbfs without size= holds what its pool does.
    std::string sized_by;
    if (fs.pool_sized) {
      sized_by.append(", mounted without size=: its pool ");
      sized_by.append(platform::HugetlbPoolName(fs.block_bytes));
    }
    return NoSpace("stream directory " + o.directory + " (" + platform::FsKindName(fs.kind) +
                   sized_by + ") holds " + FormatBytes(fs.total_bytes) +
                   " but the stream may use " +
                   std::to_string(o.max_segments) + " segments x " +
                   FormatBytes(impl->regular_file_bytes) + " = " + FormatBytes(impl->cap_bytes) +
                   "; lower max_segments or segment size, or enlarge the filesystem" +
                   (fs.pool_sized ? std::string(" or its pool") : std::string()));
  }
  if (impl->cap_bytes > fs.available_bytes) {
    impl->log->warn(
        "stream directory {}: {} free now, less than the cap of {} ({} x {}); "
        "past what is free the stream spills",
        o.directory, FormatBytes(fs.available_bytes), FormatBytes(impl->cap_bytes), o.max_segments,
        FormatBytes(impl->regular_file_bytes));
  }
  EA_RETURN_IF_ERROR(platform::MakeDirectories(o.spill_directory, 0700));
  // Resolved on the creating thread: its CPU affinity is the producer's node.
  EA_ASSIGN_OR_RETURN(impl->placement, stream::ResolveSegmentPlacement(o.numa, o.numa_node));
  if (impl->placement.pages.policy != platform::MemPolicy::kDefault &&
      fs.kind == platform::FsKind::kOther) {
    if (impl->placement.pages.required) {
      return InvalidArgument("stream directory " + o.directory + " is not on tmpfs or " +
                             "hugetlbfs: numa " + impl->placement.pages.asked +
                             " cannot place a disk file's page cache");
    }
    impl->placement.pages = {};
    impl->placement.node = -1;
    impl->placement.description =
        "local (first touch: " + o.directory + " is not on tmpfs or hugetlbfs)";
  }

  uint64_t swept = 0;
  if (o.sweep_at_start) {
    for (const std::string& d : {o.directory, o.spill_directory}) {
      auto report = SweepStreamDirectory(d);
      if (!report.ok()) {
        impl->log->warn("stream sweep of {}: {}", d, report.status().message());
        continue;
      }
      swept += report->removed.size();
      for (const auto& p : report->removed) impl->log->info("stream sweep: removed {}", p);
      for (const auto& n : report->notes) impl->log->debug("stream sweep: {}", n);
    }
  }

  pid_t pid = platform::CurrentPid();
  auto start = platform::ProcessStartTime(pid);
  impl->instance = std::string(stream::kSegmentPrefix) + o.logical_name + "-" +
                   std::to_string(pid) + "-" + std::to_string(start.ok() ? *start : 0) + "-" +
                   RandomHex();
  // The first segment comes with the first reserve: a producer that never puts commits
  // nothing (and spends no time on 2 MiB pages).
  if (!o.listen.empty()) {
    remote::StreamServerOptions so;
    so.listen = o.listen;
    so.token = o.listen_token;
    so.allow_no_token = o.listen_allow_no_token;
    so.lease_seconds = o.remote_lease_seconds;
    so.directory = o.directory;
    so.spill_directory = o.spill_directory;
    so.segment_prefix = impl->instance + "-";
    so.logger = impl->log;
    auto server = remote::StartStreamServer(so);
    if (!server.ok()) return server.status().WithContext("stream listen " + o.listen);
    impl->server = std::move(server).value();
    impl->boot_id = platform::BootId();
  } else if (!o.listen_token.empty()) {
    return InvalidArgument("stream listen_token given without listen (ADDR:PORT)");
  }
  EA_RETURN_IF_ERROR(stream::RegisterForFork(impl.get()));
  impl->log->info(
      "stream {}: {} on {} ({} free), segments of {} up to {} ({}), spill to {}{}{}{}; numa: {}",
                  impl->instance, o.directory, platform::FsKindName(fs.kind),
                  FormatBytes(fs.available_bytes), FormatBytes(o.segment_bytes), o.max_segments,
                  FormatBytes(impl->cap_bytes), o.spill_directory,
                  o.strict ? " (strict: no spill)" : "",
                  swept ? "; swept " + std::to_string(swept) + " dead segments" : "",
                  impl->server ? "; serving other hosts on " + impl->server->address() +
                                     (o.listen_token.empty() ? "" : " (token)") + ", lease " +
                                     FormatSeconds(o.remote_lease_seconds)
                               : "",
      impl->placement.description);
  return StreamProducer(std::move(impl));
}

StreamProducer::StreamProducer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
StreamProducer::StreamProducer(StreamProducer&&) noexcept = default;
StreamProducer& StreamProducer::operator=(StreamProducer&&) noexcept = default;
StreamProducer::~StreamProducer() = default;

Result<Reservation> StreamProducer::Reserve(std::string_view key, uint64_t bytes) {
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream reserve"));
  EA_RETURN_IF_ERROR(CheckKey("stream reserve", key));
  Impl::Lock lock(*impl_);
  return impl_->ReserveLocked(lock.unique(), key, bytes);
}

namespace {

// One piece of a put: streaming stores from `non_temporal_from` bytes of the whole tensor on.
void CopyPiece(std::byte* to, const std::byte* from, uint64_t bytes, bool non_temporal) {
  if (non_temporal) {
    platform::CopyNonTemporal(to, from, bytes);
  } else {
    std::memcpy(to, from, bytes);
  }
}

// The copy of a put, split across `threads` threads for large tensors (pieces of whole 2 MiB
// pages).
void CopyParallel(std::byte* to, const std::byte* from, uint64_t bytes, uint32_t threads,
                  uint64_t non_temporal_from) {
  constexpr uint64_t kParallelFrom = 8 * kMiB;
  const bool non_temporal = bytes >= non_temporal_from;
  if (bytes < kParallelFrom || threads <= 1) {
    CopyPiece(to, from, bytes, non_temporal);
    return;
  }
  uint64_t piece = *AlignUp((bytes + threads - 1) / threads, kHugePageBytes);
  std::vector<std::thread> pool;
  for (uint64_t at = piece; at < bytes; at += piece) {
    uint64_t n = std::min(piece, bytes - at);
    pool.emplace_back([=] { CopyPiece(to + at, from + at, n, non_temporal); });
  }
  CopyPiece(to, from, std::min(piece, bytes), non_temporal);
  for (auto& t : pool) t.join();
}

}  // namespace

Result<std::string> StreamProducer::Put(std::string_view key, std::span<const std::byte> bytes,
                                        const TensorInfo& info, uint32_t readers) {
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream put"));
  EA_RETURN_IF_ERROR(CheckKey("stream put", key));
  EA_RETURN_IF_ERROR(CheckInfo("stream put", key, info));
  EA_ASSIGN_OR_RETURN(Reservation r, Reserve(key, bytes.size()));
  if (!bytes.empty()) {
    CopyParallel(r.bytes().data(), bytes.data(), bytes.size(), impl_->copy_threads,
                 impl_->non_temporal_from);
  }
  return r.Publish(info, readers);
}

Result<uint64_t> StreamProducer::Abort(std::string_view key) {
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream abort"));
  // Transfers in flight end refused. Told before the lock is taken: it is a message to the
  // network process, and no call of this producer waits on that process.
  if (impl_->server) impl_->server->Aborted(key);
  Impl::Lock lock(*impl_);
  auto it = impl_->keys.find(std::string(key));  // exact ownership: never a prefix
  if (it == impl_->keys.end()) return uint64_t{0};
  std::vector<BlockRef> refs = it->second;
  uint64_t marked = 0;
  for (const BlockRef& ref : refs) {
    auto sit = impl_->segments.find(ref.segment);
    if (sit == impl_->segments.end()) continue;
    ProducerSegment& seg = *sit->second;
    BlockRecord& rec = seg.blocks[ref.slot];
    if (!rec.live) continue;
    ++marked;
    if (!rec.published) {
      rec.aborted = true;  // Publish refuses it and gives the space back
      continue;
    }
    BlockSlot& s = seg.file.view.slots[ref.slot];
    uint64_t c = Control(s).load(std::memory_order_seq_cst);
    while (ControlWord::State(c) == BlockState::kPublished) {
      uint64_t aborted = ControlWord::Make(BlockState::kAborted, 0, ControlWord::Generation(c));
      if (Control(s).compare_exchange_weak(c, aborted, std::memory_order_seq_cst)) break;
    }
    impl_->TryReclaim(seg, ref.slot);  // now, when nobody holds it
  }
  return marked;
}

Status StreamProducer::Reclaim() {
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream reclaim"));
  Impl::Lock lock(*impl_);
  impl_->ReclaimAll();
  return Status::Ok();
}

Status StreamProducer::CheckProcess() const { return impl_->CheckProcess("stream stats"); }

Result<StreamStats> StreamProducer::Stats() {
  // In a forked child the figures would be the parent's, inherited: refused like every call.
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream stats"));
  StreamStats s;
  {
    Impl::Lock lock(*impl_);
    impl_->MaybeCheckLeases();
    impl_->ReclaimMoved();
    s = impl_->StatsLocked();
  }
  // The network process' counts, asked for without the producer's lock: a stopped or hung
  // process delays this call by its bounded wait, never a Put or Open of another thread.
  if (impl_->server) {
    const remote::DoorCounters c = impl_->server->counters();
    s.remote_admitted = c.admitted;
    s.remote_refused = c.refused;
    s.remote_timed_out = c.timed_out;
    s.remote_dropped = c.dropped;
    s.remote_auth_failed = c.auth_failed;
    s.remote_restarts = impl_->server->restarts();
  }
  return s;
}

Result<std::vector<PendingBlock>> StreamProducer::Pending() {
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream pending"));
  // First: expired leases end (their shares spent) and the blocks they held free below.
  std::vector<remote::RemoteHold> remote_holds;
  if (impl_->server) remote_holds = impl_->server->Holds();
  Impl::Lock lock(*impl_);
  impl_->ReclaimAll();
  impl_->last_lease_check = Clock::now();
  const auto now = Clock::now();
  std::vector<PendingBlock> out;
  for (auto& [id, seg] : impl_->segments) {
    for (uint32_t slot = 0; slot < seg->blocks.size(); ++slot) {
      const BlockRecord& rec = seg->blocks[slot];
      if (!rec.live) continue;
      BlockSlot& s = seg->file.view.slots[slot];
      uint64_t c = Control(s).load(std::memory_order_seq_cst);
      PendingBlock p;
      p.key = rec.key;
      p.state = !rec.published                                                 ? "writing"
                : ControlWord::State(c) == BlockState::kAborted || rec.aborted ? "aborted"
                                                                               : "published";
      p.age_seconds = std::chrono::duration<double>(now - rec.reserved_at).count();
      p.readers_left =
          ControlWord::State(c) == BlockState::kPublished ? ControlWord::Pending(c) : 0;
      p.holders = static_cast<uint32_t>(std::popcount(Holders(s).load(std::memory_order_seq_cst)));
      p.bytes = stream::AtomicWord(s.length).load(std::memory_order_relaxed);
      p.segment = seg->file.name;
      p.spilled = seg->file.kind == SegmentKind::kSpill;
      for (const remote::RemoteHold& h : remote_holds)
        if (h.slot == slot && h.segment == seg->file.name) ++p.remote_holders;
      out.push_back(std::move(p));
    }
  }
  std::sort(out.begin(), out.end(), [](const PendingBlock& a, const PendingBlock& b) {
    return a.age_seconds > b.age_seconds;
  });
  return out;
}

std::vector<std::string> StreamProducer::SegmentPaths() {
  Impl::Lock lock(*impl_);
  std::vector<std::string> out;
  for (auto& [id, seg] : impl_->segments) out.push_back(seg->file.path);
  return out;
}

std::vector<NumaNodeBytes> StreamProducer::SegmentNodeBytes() {
  std::vector<const void*> starts;
  {
    Impl::Lock lock(*impl_);
    for (auto& [id, seg] : impl_->segments) {
      if (seg->file.kind != SegmentKind::kSpill) starts.push_back(seg->file.mapping.data());
    }
  }
  // Read unlocked: a segment removed meanwhile has no line any more and adds nothing.
  std::vector<NumaNodeBytes> out;
  for (int node : platform::MemoryNodes()) out.push_back({node, 0});
  for (const auto& [node, bytes] : platform::MappingsBytesPerNode(starts)) {
    const int wanted = node;  // clang 14 cannot capture a structured binding
    auto it = std::find_if(out.begin(), out.end(),
                           [wanted](const NumaNodeBytes& n) { return n.node == wanted; });
    if (it == out.end()) {
      out.push_back({node, bytes});
    } else {
      it->bytes = bytes;
    }
  }
  return out;
}

const std::string& StreamProducer::instance_name() const { return impl_->instance; }

std::string StreamProducer::remote_address() const {
  return impl_->server ? impl_->server->address() : std::string();
}

// ---- Reservation ---------------------------------------------------------------------------

Reservation::Reservation(std::unique_ptr<State> state) : state_(std::move(state)) {}
Reservation::Reservation(Reservation&&) noexcept = default;
Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    GiveBack();
    state_ = std::move(other.state_);
  }
  return *this;
}

Reservation::~Reservation() { GiveBack(); }

void Reservation::GiveBack() noexcept {
  if (!state_ || state_->done) return;
  auto& p = *state_->producer;
  if (p.Foreign()) return;  // the parent's reservation: the parent gives it back
  StreamProducer::Impl::Lock lock(p);
  auto it = p.segments.find(state_->segment);
  if (it == p.segments.end()) return;
  BlockRecord& rec = it->second->blocks[state_->slot];
  if (rec.live && rec.generation == state_->generation) p.FreeBlock(*it->second, state_->slot);
}

std::span<std::byte> Reservation::bytes() const { return state_->bytes; }
bool Reservation::spilled() const { return state_->spilled; }

namespace {

// Publishes `st`'s block for `readers` releases (p.mu held; readers and info checked) and
// fills `d`. Fails with kBusy, the space given back, when the key was aborted meanwhile.
Status PublishLocked(StreamProducer::Impl& p, Reservation::State& st, const TensorInfo& info,
                     uint32_t readers, TensorDescriptor& d) {
  auto it = p.segments.find(st.segment);
  if (it == p.segments.end()) return Internal("stream publish: segment gone");
  ProducerSegment& seg = *it->second;
  BlockRecord& rec = seg.blocks[st.slot];
  if (rec.aborted) {
    st.done = true;
    p.FreeBlock(seg, st.slot);
    return Busy("stream publish: key " + QuoteForMessage(st.key) +
                " was aborted while its tensor was written; the space was given back");
  }
  rec.published = true;
  rec.published_index = seg.published.size();
  seg.published.push_back(st.slot);
  BlockSlot& s = seg.file.view.slots[st.slot];
  // Release: the bytes written before this store are visible to a reader that sees it.
  Control(s).store(ControlWord::Make(BlockState::kPublished, readers, st.generation),
                   std::memory_order_seq_cst);
  st.done = true;
  d.segment = st.segment_name;
  d.spilled = st.spilled;
  d.slot = st.slot;
  d.generation = st.generation;
  d.offset = st.offset;
  d.length = st.length;
  d.dtype = info.dtype;
  d.shape = info.shape;
  d.key = st.key;
  if (p.server) {
    d.remote = p.server->address();
    d.producer_instance = p.server->instance_id();
    d.boot_id = p.boot_id;
  }
  return Status::Ok();
}

Status CheckReaders(uint32_t readers) {
  if (readers == 0 || readers > stream::kMaxPending) {
    return InvalidArgument("stream publish: readers " + std::to_string(readers) + " outside 1.." +
                           std::to_string(stream::kMaxPending));
  }
  return Status::Ok();
}

}  // namespace

Result<std::string> Reservation::Publish(const TensorInfo& info, uint32_t readers) {
  if (!state_ || state_->done) return InvalidArgument("stream publish: reservation already used");
  EA_RETURN_IF_ERROR(state_->producer->CheckProcess("stream publish"));
  EA_RETURN_IF_ERROR(CheckReaders(readers));
  // Before the block is published: the caller may fix `info` and publish again.
  EA_RETURN_IF_ERROR(CheckInfo("stream publish", state_->key, info));
  auto& p = *state_->producer;
  TensorDescriptor d;
  {
    StreamProducer::Impl::Lock lock(p);
    EA_RETURN_IF_ERROR(PublishLocked(p, *state_, info, readers, d));
  }
  // A listening producer with a token signs what it hands out (its server checks the MAC).
  return d.Encode(p.server ? std::string_view(p.options.listen_token) : std::string_view());
}

Result<std::vector<std::string>> StreamProducer::PutMany(std::span<const PutItem> items,
                                                         uint32_t readers) {
  EA_RETURN_IF_ERROR(impl_->CheckProcess("stream put_many"));
  EA_RETURN_IF_ERROR(CheckReaders(readers));
  auto item_error = [&](size_t i, const Status& s) {
    return Status(s.code(), "stream put_many: item " + std::to_string(i) + " of " +
                                std::to_string(items.size()) + ": " + s.message() +
                                (i > 0 ? " (nothing of the batch was published)" : ""));
  };
  for (size_t i = 0; i < items.size(); ++i) {
    Status s = CheckKey("stream put", items[i].key);
    if (s.ok()) s = CheckInfo("stream put", items[i].key, items[i].info);
    if (!s.ok()) return item_error(i, s);
  }
  // Dropped unpublished on any failure below: each gives its space back.
  std::vector<Reservation> held;
  held.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    Result<Reservation> r = Reserve(items[i].key, items[i].bytes.size());
    if (!r.ok()) return item_error(i, r.status());
    if (!items[i].bytes.empty()) {
      CopyParallel(r->bytes().data(), items[i].bytes.data(), items[i].bytes.size(),
                   impl_->copy_threads, impl_->non_temporal_from);
    }
    held.push_back(std::move(r).value());
  }
  std::vector<TensorDescriptor> published(items.size());
  {
    Impl::Lock lock(*impl_);
    // An abort of one key while the batch was written refuses the whole batch.
    for (size_t i = 0; i < items.size(); ++i) {
      Reservation::State& st = *held[i].state_;
      auto it = impl_->segments.find(st.segment);
      if (it != impl_->segments.end() && it->second->blocks[st.slot].aborted) {
        for (Reservation& r : held) {
          Reservation::State& other = *r.state_;
          auto it = impl_->segments.find(other.segment);
          if (it != impl_->segments.end()) impl_->FreeBlock(*it->second, other.slot);
          other.done = true;
        }
        return item_error(i, Busy("stream publish: key " + QuoteForMessage(st.key) +
                                  " was aborted while its tensor was written; the space of "
                                  "the whole batch was given back"));
      }
    }
    for (size_t i = 0; i < items.size(); ++i) {
      Status s = PublishLocked(*impl_, *held[i].state_, items[i].info, readers, published[i]);
      if (!s.ok()) return item_error(i, s);  // not reached: aborts were checked above
    }
  }
  std::vector<std::string> out;
  out.reserve(items.size());
  const std::string_view key =
      impl_->server ? std::string_view(impl_->options.listen_token) : std::string_view();
  for (const TensorDescriptor& d : published) out.push_back(d.Encode(key));
  return out;
}

}  // namespace expert_arena
