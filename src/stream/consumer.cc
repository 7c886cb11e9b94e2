// StreamConsumer: maps peers' segments once, hands out zero-copy views, releases them.
//
// Design note. Each mapped segment gets one reader entry (segment_format.h) claimed under an
// OFD lock on byte 1+i of the segment file, so the owner can tell our holds from a dead
// reader's. A view sets our holder bit on its block, then checks the block's control word
// (the owner does the reverse before it frees), so a block is never reused under a view.
// Several views of one block in this process share the bit (counted locally). Releasing
// decrements the block's pending count, clears the bit when our last view goes, and bumps
// the segment's epoch so the owner rescans on its next reserve. A deferred release
// (ReleaseWhen) waits in a list until its predicate says the device copy finished; the
// consumer's own calls poll that list. A segment whose file was unlinked (its owner exited
// or was swept) is unmapped once its views are released; one-shot segments (dedicated,
// spill) are unmapped as soon as their only block is released. Every message that names a
// peer's string (the key) quotes it escaped (common/escape.h); the segment path is ours plus a
// name Decode checked against [A-Za-z0-9_.-].
//
// A mapped segment is also mapped copy-on-write (platform::Mapping::MapFileCopyOnWrite,
// MAP_NORESERVE on hugetlbfs) for the views handed to code that may write through them (the
// Python package), on the first private_bytes() of one of its blocks (a consumer reading
// bytes() only never makes it): a write copies a page privately. When the last view of a
// block in this process that used those bytes is released, its pages there are queued to be
// dropped (MADV_DONTNEED on a private mapping reverts them to the file's), which the next Open
// of the segment does, adjacent ranges merged into one call, before it hands out a view: a
// later block in the same place reads the producer's bytes again. Where the kernel refuses
// that, the mapping is replaced by a fresh one (the old one stays mapped until the segment is
// dropped: live views point into it).
//
// Fork (stream/fork_guard.h): a consumer belongs to the process that created it. In a forked
// child Open fails naming the fork, and releasing or dropping what the child inherited (views,
// deferred releases, the consumer) touches nothing shared: the holds and shares are the
// parent's, and the parent releases them.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/escape.h"
#include "common/logging.h"
#include "expert_arena/stream.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/ofd_lock.h"
#include "platform/system_info.h"
#include "stream/stream_remote.h"
#include "stream/fork_guard.h"
#include "stream/segment_file.h"

namespace expert_arena {

using stream::BlockSlot;
using stream::BlockState;
using stream::ControlWord;
using stream::SegmentKind;

namespace {

using Clock = std::chrono::steady_clock;

// At most this much released remote tensor memory is kept for reuse (StreamConsumer::Impl::pool).
constexpr uint64_t kRemotePoolBytes = 256 * kMiB;

struct PeerSegment {
  stream::SegmentFile file;
  bool spill = false;
  uint32_t reader_index = 0;
  uint64_t views = 0;
  std::unordered_map<uint32_t, uint32_t> held;  // slot -> views of it in this process
  platform::Mapping private_view;  // copy-on-write mapping of the whole file (made lazily)
  std::vector<platform::Mapping> retired_private;   // replaced; views may still point in
  std::unordered_map<uint32_t, bool> private_used;  // slots whose private bytes were handed out
  // [begin, end) page ranges of released blocks whose private pages are still to be dropped:
  // done (merged) before the next Open of this segment hands out a view.
  std::vector<std::pair<uint64_t, uint64_t>> to_discard;
  // private_view registered read-only with the consumer's GPU (device copies from the views
  // are then DMA); declared after the mappings so that it goes first.
  std::unique_ptr<gpu::Registration> private_registration;
  std::vector<std::unique_ptr<gpu::Registration>> retired_registrations;
  bool hugetlbfs = false;

  uint64_t bit() const { return uint64_t{1} << reader_index; }
  bool one_shot() const { return file.kind != SegmentKind::kRegular; }
};

std::atomic_ref<uint64_t> Control(BlockSlot& s) { return stream::AtomicWord(s.control); }
std::atomic_ref<uint64_t> Holders(BlockSlot& s) { return stream::AtomicWord(s.holders); }
uint64_t Relaxed(uint64_t& w) { return stream::AtomicWord(w).load(std::memory_order_relaxed); }

// A tensor fetched from a producer on another host: its bytes in our own memory, and the hold
// its producer keeps for us until we release it (docs/cross-host.md).
struct RemoteView {
  std::shared_ptr<remote::StreamPeer> peer;
  uint64_t hold = 0;
  platform::Mapping memory;
  std::unique_ptr<gpu::Registration> registration;
};

}  // namespace

struct StreamTensor::State {
  std::shared_ptr<StreamConsumer::Impl> consumer;  // null while in the deferred list
  std::unique_ptr<RemoteView> remote;              // set for a tensor of another host
  PeerSegment* segment = nullptr;
  TensorDescriptor descriptor;
  std::span<const std::byte> bytes;
  std::span<std::byte> private_bytes;  // set by the first private_bytes()
  bool private_used = false;           // private_bytes() was called
  std::function<bool()> ready;
};

struct StreamConsumer::Impl : stream::ForkParticipant {
  ConsumerOptions options;
  std::shared_ptr<spdlog::logger> log;
  pid_t pid = 0;
  uint64_t start_time = 0;
  uint64_t fork_generation = 0;  // stream::ForkGeneration() at creation

  std::mutex mu;  // segments, views, holds
  std::map<std::pair<bool, std::string>, std::unique_ptr<PeerSegment>> segments;
  uint64_t pinned_bytes = 0;
  uint64_t dropped = 0;
  Clock::time_point last_unlink_check{};
  std::map<std::string, bool> hugetlbfs_dirs;  // directory -> on hugetlbfs (statfs once)
  std::string boot_id;                         // to tell a descriptor of this host
  std::mutex peers_mu;                         // connections to producers on other hosts
  std::map<std::string, std::shared_ptr<remote::StreamPeer>> peers;
  std::weak_ptr<Impl> self_weak;
  // Remote tensors' memory, kept after their release (never while a view holds it) for the
  // next remote opens of the same rounded size: no fresh mmap and zero-fill faults a round.
  std::mutex pool_mu;
  std::multimap<uint64_t, platform::Mapping> pool;  // by size
  uint64_t pool_bytes = 0;

  std::mutex deferred_mu;
  std::vector<std::unique_ptr<StreamTensor::State>> deferred;

  ~Impl() override;
  // True in a forked child of the process that created this consumer.
  bool Foreign() const { return stream::ForkGeneration() != fork_generation; }
  void LockForFork() override {
    deferred_mu.lock();
    mu.lock();
  }
  void UnlockAfterFork(bool in_child) override {
    if (in_child) {
      // The reader locks belong to the parent's descriptors; ours would keep the parent's
      // entries looking alive after the parent died. The mappings stay (views read them).
      for (auto& [key, seg] : segments) seg->file.fd.Reset();
    }
    mu.unlock();
    deferred_mu.unlock();
  }
  Result<PeerSegment*> MapLocked(bool spill, const std::string& name);
  // Maps `seg` copy-on-write (and registers that mapping read-only with the GPU when the
  // shared one is): on the first private_bytes() of one of its blocks.
  Status MapPrivateLocked(PeerSegment& seg);
  // The private bytes of `state`'s block, mapping its segment privately first if needed.
  Result<std::span<std::byte>> PrivateBytes(StreamTensor::State& state);
  void DropLocked(
      std::map<std::pair<bool, std::string>, std::unique_ptr<PeerSegment>>::iterator it);
  void DropUnlinkedLocked(bool now);
  // Drops this process's private copies of the pages of released blocks (see the note above).
  void DiscardPrivateLocked(PeerSegment& seg);
  // The held count of the block of `state` went to zero: clears our holder bit.
  void Unhold(PeerSegment& seg, const StreamTensor::State& state);
  void Release(StreamTensor::State& state);
  // Gives an opened view's hold back without spending its share (a failed OpenMany).
  void Undo(StreamTensor::State& state);
  uint64_t Poll();
  // True when the descriptor's producer is on another host: another boot id, or its segment
  // is not in our directory (another mount namespace).
  bool IsRemote(const TensorDescriptor& d) const;
  // Fetches descriptors of one producer instance on another host, all requests in flight at
  // once; all or none (on failure *failed is the index of the item that failed).
  Status OpenRemote(std::span<const std::string_view> encoded, std::vector<TensorDescriptor> ds,
                    std::vector<StreamTensor>* out, size_t* failed);
  // Ends a remote tensor's hold: spent (a release) or given back.
  void EndRemote(StreamTensor::State& state, bool spend);
  // Memory for a remote tensor of `bytes` (a multiple of 2 MiB): pooled, else fresh.
  Result<platform::Mapping> RemoteMemory(uint64_t bytes);
};

StreamConsumer::Impl::~Impl() {
  stream::UnregisterForFork(this);
  // Deferred releases left by views that outlived the StreamConsumer handle (the handle's
  // destructor waited for the ones it knew of).
  std::vector<std::unique_ptr<StreamTensor::State>> left;
  {
    std::lock_guard lock(deferred_mu);
    left.swap(deferred);
  }
  for (auto& state : left) Release(*state);
  std::lock_guard lock(mu);
  while (!segments.empty()) DropLocked(segments.begin());
}

Result<PeerSegment*> StreamConsumer::Impl::MapLocked(bool spill, const std::string& name) {
  auto key = std::make_pair(spill, name);
  auto it = segments.find(key);
  if (it != segments.end()) return it->second.get();
  const std::string& dir = spill ? options.spill_directory : options.directory;
  auto opened = stream::OpenSegment(dir, name, options.allow_foreign_owner);
  if (!opened.ok() && opened.status().code() == StatusCode::kNotFound) {
    return NotFound(opened.status().message() +
                    " (the segment is gone: its producer closed the stream or exited, or a "
                    "sweep removed it)");
  }
  EA_ASSIGN_OR_RETURN(stream::SegmentFile file, std::move(opened));
  auto seg = std::make_unique<PeerSegment>();
  seg->file = std::move(file);
  seg->spill = spill;
  auto& view = seg->file.view;
  bool claimed = false;
  for (uint32_t i = 0; i < stream::kMaxReaders && !claimed; ++i) {
    EA_ASSIGN_OR_RETURN(bool taken, platform::TryLockByte(seg->file.fd, stream::kReaderLockBase + i,
                                                          platform::LockMode::kExclusive));
    if (!taken) continue;
    auto owner = stream::AtomicWord(view.readers[i].owner);
    if (owner.load(std::memory_order_acquire) != 0) {
      // A reader that died left this entry: with its byte locked by us nobody else can use
      // the entry, so end its lease (its holds and shares) before taking it over.
      uint64_t released = stream::SpendDeadReaderHolds(view, i);
      log->info("stream consumer: reader pid {} of {} is gone; its {} held blocks released",
                owner.load(), seg->file.path, released);
    }
    stream::AtomicWord(view.readers[i].start_time).store(start_time, std::memory_order_relaxed);
    owner.store(static_cast<uint64_t>(pid), std::memory_order_release);
    seg->reader_index = i;
    claimed = true;
  }
  if (!claimed) {
    return Busy(seg->file.path + ": all " + std::to_string(stream::kMaxReaders) +
                " reader entries are in use by live processes");
  }
  auto hugetlbfs = hugetlbfs_dirs.find(dir);
  if (hugetlbfs == hugetlbfs_dirs.end()) {
    auto fs = platform::StatFilesystem(dir);
    hugetlbfs =
        hugetlbfs_dirs.emplace(dir, fs.ok() && fs->kind == platform::FsKind::kHugetlbfs).first;
  }
  seg->hugetlbfs = hugetlbfs->second;
  if (!seg->one_shot()) {
    // Read-populated: the consumer's first read of each block takes no fault.
    Status s = platform::AdviseRange(seg->file.mapping.data(), seg->file.file_bytes(),
                                     platform::Advice::kPopulateRead, seg->file.path);
    if (!s.ok()) log->debug("{}", s.message());
    if (options.gpu.backend != GpuBackend::kNone) {
      auto reg = gpu::RegisterHostRange(
          seg->file.mapping.bytes(),
          {.device = options.gpu, .pin_budget_bytes = options.pin_budget_bytes, .logger = log});
      if (reg.ok()) {
        seg->file.pinned_bytes = (*reg)->report().registered_bytes;
        pinned_bytes += seg->file.pinned_bytes;
        seg->file.registration = std::move(reg).value();
      } else {
        log->warn("stream consumer: GPU registration of {} failed: {}", seg->file.path,
                  reg.status().message());
      }
    }
  }
  PeerSegment* raw = seg.get();
  segments.emplace(key, std::move(seg));
  return raw;
}

Status StreamConsumer::Impl::MapPrivateLocked(PeerSegment& seg) {
  auto private_view = platform::Mapping::MapFileCopyOnWrite(seg.file.fd, seg.file.file_bytes(),
                                                            kHugePageBytes, seg.hugetlbfs);
  if (!private_view.ok()) {
    return private_view.status().WithContext("stream consumer: the copy-on-write view mapping");
  }
  seg.private_view = std::move(private_view).value();
  if (seg.one_shot()) return Status::Ok();
  // Read-populated, the private mapping maps the file's pages (no copy, no memory).
  Status p = platform::AdviseRange(seg.private_view.data(), seg.private_view.size(),
                                   platform::Advice::kPopulateRead, seg.file.path);
  if (!p.ok()) log->debug("{}", p.message());
  if (seg.file.pinned_bytes > 0) {
    // Read-only, as for the arena's views: pinning with write intent would copy every page of
    // a private mapping. The file's pages are pinned twice, not copied.
    auto private_reg = gpu::RegisterHostRange(seg.private_view.bytes(),
                                              {.device = options.gpu,
                                               .pin_budget_bytes = options.pin_budget_bytes,
                                               .read_only = true,
                                               .logger = log});
    if (private_reg.ok() && (*private_reg)->report().registered_bytes > 0) {
      seg.private_registration = std::move(private_reg).value();
    } else {
      log->warn(
          "stream consumer: the copy-on-write view mapping of {} is not registered with {} "
          "({}): device copies from the Python views are staged",
          seg.file.path, options.gpu.ToString(),
          private_reg.ok() ? (*private_reg)->report().note : private_reg.status().message());
    }
  }
  return Status::Ok();
}

Result<std::span<std::byte>> StreamConsumer::Impl::PrivateBytes(StreamTensor::State& state) {
  std::lock_guard lock(mu);
  if (state.private_bytes.data() == nullptr) {
    PeerSegment& seg = *state.segment;
    if (seg.private_view.data() == nullptr) {
      // In a forked child the inherited descriptor is closed: only what the parent mapped.
      if (Foreign()) {
        return InvalidArgument("stream private_bytes: " +
                               stream::ForkedMessage("StreamConsumer", pid));
      }
      EA_RETURN_IF_ERROR(MapPrivateLocked(seg));
    }
    state.private_bytes = {seg.private_view.data() + state.descriptor.offset,
                           state.descriptor.length};
  }
  state.private_used = true;
  return state.private_bytes;
}

void StreamConsumer::Impl::DropLocked(
    std::map<std::pair<bool, std::string>, std::unique_ptr<PeerSegment>>::iterator it) {
  PeerSegment& seg = *it->second;
  // Holds never released (a view leaked) must not outlive our entry: nobody could clear them.
  for (auto& [slot, count] : seg.held) {
    Holders(seg.file.view.slots[slot]).fetch_and(~seg.bit(), std::memory_order_seq_cst);
  }
  if (!seg.held.empty()) seg.file.view.epoch().fetch_add(1, std::memory_order_release);
  // Give our entry back before the fd (and our lock byte) goes.
  stream::AtomicWord(seg.file.view.readers[seg.reader_index].owner)
      .store(0, std::memory_order_release);
  pinned_bytes -= seg.file.pinned_bytes;
  segments.erase(it);
}

void StreamConsumer::Impl::DropUnlinkedLocked(bool now) {
  auto t = Clock::now();
  if (!now && t - last_unlink_check < std::chrono::milliseconds(200)) return;
  last_unlink_check = t;
  for (auto it = segments.begin(); it != segments.end();) {
    auto next = std::next(it);
    if (it->second->views == 0 && !stream::PathStillNames(it->second->file)) {
      log->debug("stream consumer: {} was unlinked; unmapped", it->second->file.path);
      DropLocked(it);
      ++dropped;
    }
    it = next;
  }
}

void StreamConsumer::Impl::DiscardPrivateLocked(PeerSegment& seg) {
  if (seg.to_discard.empty()) return;
  auto& ranges = seg.to_discard;
  std::sort(ranges.begin(), ranges.end());
  size_t merged = 0;
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first <= ranges[merged].second) {
      ranges[merged].second = std::max(ranges[merged].second, ranges[i].second);
    } else {
      ranges[++merged] = ranges[i];
    }
  }
  ranges.resize(merged + 1);
  Status s = Status::Ok();
  for (const auto& [begin, end] : ranges) {
    s = platform::AdviseRange(seg.private_view.data() + begin, end - begin,
                              platform::Advice::kDontNeed, seg.file.path);
    if (!s.ok()) break;
  }
  ranges.clear();
  if (s.ok()) return;
  // A fresh mapping instead; the old one stays until the segment goes (views point into it).
  auto fresh = platform::Mapping::MapFileCopyOnWrite(seg.file.fd, seg.file.file_bytes(),
                                                     kHugePageBytes, seg.hugetlbfs);
  if (!fresh.ok()) {
    log->warn(
        "stream consumer: {}; {}: later views of this segment may read bytes written "
        "through an earlier one in this process",
        s.message(), fresh.status().message());
    return;
  }
  // The registration stays with the old mapping (live views); the fresh one is not pinned.
  seg.retired_registrations.push_back(std::move(seg.private_registration));
  seg.retired_private.push_back(std::move(seg.private_view));
  seg.private_view = std::move(fresh).value();
}

void StreamConsumer::Impl::Unhold(PeerSegment& seg, const StreamTensor::State& state) {
  const uint32_t slot = state.descriptor.slot;
  seg.held.erase(slot);
  Holders(seg.file.view.slots[slot]).fetch_and(~seg.bit(), std::memory_order_seq_cst);
  auto used = seg.private_used.find(slot);
  if (used != seg.private_used.end()) {
    seg.private_used.erase(used);
    if (!seg.one_shot()) {  // a one-shot segment is unmapped with its only block
      const uint64_t page = seg.hugetlbfs ? kHugePageBytes : platform::BasePageSize();
      const uint64_t offset = state.descriptor.offset;
      const uint64_t end = std::min<uint64_t>(
          (offset + state.descriptor.length + page - 1) / page * page, seg.private_view.size());
      if (end > offset / page * page) seg.to_discard.emplace_back(offset / page * page, end);
    }
  }
}

void StreamConsumer::Impl::EndRemote(StreamTensor::State& state, bool spend) {
  std::unique_ptr<RemoteView> view = std::move(state.remote);
  state.bytes = {};
  state.private_bytes = {};
  if (Foreign()) return;  // a forked child's copy: dropped, never pooled
  view->peer->Release(view->hold, spend);
  view->registration.reset();  // before the memory
  const uint64_t size = view->memory.size();
  std::lock_guard lock(pool_mu);
  if (pool_bytes + size > kRemotePoolBytes) return;  // unmapped with the view
  pool_bytes += size;
  pool.emplace(size, std::move(view->memory));
}

Result<platform::Mapping> StreamConsumer::Impl::RemoteMemory(uint64_t bytes) {
  {
    std::lock_guard lock(pool_mu);
    auto it = pool.find(bytes);
    if (it != pool.end()) {
      platform::Mapping memory = std::move(it->second);
      pool.erase(it);
      pool_bytes -= bytes;
      return memory;
    }
  }
  const bool huge = bytes % kHugePageBytes == 0;  // OpenRemote rounds small tensors to base pages
  EA_ASSIGN_OR_RETURN(platform::Mapping memory,
                      platform::Mapping::MapAnonymous(
                          bytes, huge ? kHugePageBytes : platform::BasePageSize()));
  // Transparent huge pages in "madvise" mode too; where the kernel refuses, 4 KiB pages.
  if (huge) {
    (void)platform::AdviseRange(memory.data(), bytes, platform::Advice::kHugePage,
                                "remote tensor memory");
  }
  return memory;
}

bool StreamConsumer::Impl::IsRemote(const TensorDescriptor& d) const {
  if (d.remote.empty()) return false;
  if (d.boot_id.empty() || d.boot_id != boot_id) return true;
  const std::string& dir = d.spilled ? options.spill_directory : options.directory;
  return !platform::StatPath(dir + "/" + d.segment).ok();
}

Status StreamConsumer::Impl::OpenRemote(std::span<const std::string_view> encoded,
                                        std::vector<TensorDescriptor> ds,
                                        std::vector<StreamTensor>* out, size_t* failed) {
  const size_t n = ds.size();
  *failed = 0;
  // With a token, a descriptor must carry the producer's MAC: one rewritten on its way (another
  // address, another block) is refused before anything connects anywhere.
  if (!options.remote_token.empty()) {
    for (size_t i = 0; i < n; ++i) {
      if (!TensorDescriptor::MacMatches(encoded[i], options.remote_token)) {
        *failed = i;
        return PermissionDenied("stream open of key " + QuoteForMessage(ds[i].key) +
                                ": the descriptor's MAC does not hold for remote_token (it was "
                                "rewritten on its way, or made by a producer with another "
                                "token); refused, nothing connected");
      }
    }
  }
  std::vector<std::unique_ptr<RemoteView>> views(n);
  std::vector<std::span<std::byte>> into(n);
  for (size_t i = 0; i < n; ++i) {
    views[i] = std::make_unique<RemoteView>();
    // Our own memory on 2 MiB pages where the kernel gives them, like a segment's data; a
    // tensor under 1 MiB on base pages (a huge page each held 32x the memory of a 64 KiB one).
    const uint64_t length = std::max<uint64_t>(ds[i].length, 1);
    const std::optional<uint64_t> rounded = AlignUp(
        length, length < kHugePageBytes / 2 ? platform::BasePageSize() : kHugePageBytes);
    if (!rounded) {
      *failed = i;
      return InvalidArgument("stream open of key " + QuoteForMessage(ds[i].key) +
                             ": the descriptor's length of " + std::to_string(ds[i].length) +
                             " bytes is more than memory can hold");
    }
    auto memory = RemoteMemory(*rounded);
    if (!memory.ok()) {
      *failed = i;
      return memory.status().WithContext("stream open of key " + QuoteForMessage(ds[i].key));
    }
    views[i]->memory = std::move(memory).value();
    into[i] = {views[i]->memory.data(), ds[i].length};
  }
  const TensorDescriptor& d = ds[0];  // every one of the same producer instance
  // A cached connection whose producer went away since (it restarted on the same address)
  // fails only when used, or reached another instance than the descriptor's: then one fresh
  // connection is tried.
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<remote::StreamPeer> peer;
    bool cached = false;
    {
      std::lock_guard lock(peers_mu);
      auto it = peers.find(d.remote);
      // Another instance there now: this connection reached a producer that is gone.
      if (it != peers.end() && it->second->alive() &&
          it->second->instance_id() == d.producer_instance) {
        peer = it->second;
        cached = true;
      }
    }
    if (!peer) {
      remote::StreamPeerOptions po;
      po.address = d.remote;
      po.token = options.remote_token;
      po.allow_no_token = options.remote_allow_no_token;
      po.timeout_seconds = options.remote_timeout_seconds;
      po.logger = log;
      auto connected = remote::ConnectStreamPeer(po);
      if (!connected.ok()) {
        return connected.status().WithContext("stream open of key " + QuoteForMessage(d.key));
      }
      peer = *connected;
      std::lock_guard lock(peers_mu);
      peers[d.remote] = peer;
    }
    std::vector<Result<uint64_t>> holds = peer->FetchMany(encoded, d.producer_instance, into);
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; ++i)
      if (!holds[i].ok()) bad = i;
    if (bad == n) {
      for (size_t i = 0; i < n; ++i) {
        views[i]->peer = peer;
        views[i]->hold = *holds[i];
      }
      break;
    }
    // All or none: the holds that were served go back unspent.
    for (size_t i = 0; i < n; ++i)
      if (holds[i].ok()) peer->Release(*holds[i], false);
    const Status& why = holds[bad].status();
    if (!cached || attempt > 0 || peer->alive() || why.code() != StatusCode::kIoError) {
      *failed = bad;
      return why.WithContext("stream open of key " + QuoteForMessage(ds[bad].key));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    RemoteView& view = *views[i];
    if (options.gpu.backend != GpuBackend::kNone) {
      auto reg = gpu::RegisterHostRange(
          view.memory.bytes(),
          {.device = options.gpu, .pin_budget_bytes = options.pin_budget_bytes, .logger = log});
      if (reg.ok()) {
        view.registration = std::move(reg).value();
      } else {
        log->warn("stream consumer: GPU registration of the remote view of key {} failed: {}",
                  QuoteForMessage(ds[i].key), reg.status().message());
      }
    }
    auto state = std::make_unique<StreamTensor::State>();
    state->consumer = self_weak.lock();
    state->bytes = into[i];
    state->private_bytes = into[i];
    state->descriptor = std::move(ds[i]);
    state->remote = std::move(views[i]);
    out->push_back(StreamTensor(std::move(state)));
  }
  return Status::Ok();
}

void StreamConsumer::Impl::Release(StreamTensor::State& state) {
  if (state.remote) return EndRemote(state, true);
  if (Foreign()) {
    state.segment = nullptr;  // the parent's hold: the parent releases it
    return;
  }
  std::lock_guard lock(mu);
  PeerSegment& seg = *state.segment;
  BlockSlot& s = seg.file.view.slots[state.descriptor.slot];
  // The bit before the share (the reverse of stream::SpendDeadReaderHolds): a process that
  // dies between the two steps leaves a share unspent (the key's abort frees it), never one
  // spent twice.
  if (state.private_used) seg.private_used[state.descriptor.slot] = true;
  auto held = seg.held.find(state.descriptor.slot);
  if (held != seg.held.end() && --held->second == 0) Unhold(seg, state);
  uint64_t c = Control(s).load(std::memory_order_seq_cst);
  while (ControlWord::State(c) == BlockState::kPublished &&
         ControlWord::Generation(c) == static_cast<uint32_t>(state.descriptor.generation) &&
         ControlWord::Pending(c) > 0) {
    uint64_t less = ControlWord::Make(BlockState::kPublished, ControlWord::Pending(c) - 1,
                                      ControlWord::Generation(c));
    if (Control(s).compare_exchange_weak(c, less, std::memory_order_seq_cst)) break;
  }
  seg.file.view.epoch().fetch_add(1, std::memory_order_release);
  state.segment = nullptr;
  if (--seg.views == 0 && seg.one_shot()) {
    DropLocked(segments.find({seg.spill, seg.file.name}));
  }
}

void StreamConsumer::Impl::Undo(StreamTensor::State& state) {
  if (state.remote) return EndRemote(state, false);
  if (Foreign()) {
    state.segment = nullptr;
    return;
  }
  std::lock_guard lock(mu);
  PeerSegment& seg = *state.segment;
  if (state.private_used) seg.private_used[state.descriptor.slot] = true;
  auto held = seg.held.find(state.descriptor.slot);
  if (held != seg.held.end() && --held->second == 0) {
    Unhold(seg, state);
    // The owner may be waiting for the last holder of an aborted block.
    seg.file.view.epoch().fetch_add(1, std::memory_order_release);
  }
  state.segment = nullptr;
  if (--seg.views == 0 && seg.one_shot()) {
    DropLocked(segments.find({seg.spill, seg.file.name}));
  }
}

uint64_t StreamConsumer::Impl::Poll() {
  if (Foreign()) return 0;  // the parent's deferred releases: the parent retires them
  std::vector<std::unique_ptr<StreamTensor::State>> waiting;
  {
    std::lock_guard lock(deferred_mu);
    waiting.swap(deferred);
  }
  std::vector<std::unique_ptr<StreamTensor::State>> still;
  for (auto& state : waiting) {
    if (state->ready && !state->ready()) {
      still.push_back(std::move(state));
    } else {
      Release(*state);
    }
  }
  std::lock_guard lock(deferred_mu);
  for (auto& state : still) deferred.push_back(std::move(state));
  return deferred.size();
}

// ---- StreamConsumer ------------------------------------------------------------------------

Result<StreamConsumer> StreamConsumer::Create(const ConsumerOptions& options) {
  // In a forked child the last reference keeps the memory instead (stream/fork_guard.h).
  std::shared_ptr<Impl> impl(new Impl, [](Impl* p) {
    if (p->Foreign()) {
      stream::KeepForever(p);
    } else {
      delete p;
    }
  });
  impl->fork_generation = stream::ForkGeneration();
  if (auto device = ParseGpuDevice(options.gpu.ToString()); !device.ok()) {
    return device.status().WithContext("stream consumer gpu");
  }
  impl->options = options;
  impl->log = ResolveLogger(options.logger);
  impl->pid = platform::CurrentPid();
  auto start = platform::ProcessStartTime(impl->pid);
  impl->start_time = start.ok() ? *start : 0;
  impl->boot_id = platform::BootId();
  impl->self_weak = impl;
  auto dir = platform::StatPath(options.directory);
  if (!dir.ok()) return dir.status().WithContext("stream consumer directory");
  EA_RETURN_IF_ERROR(stream::RegisterForFork(impl.get()));
  return StreamConsumer(std::move(impl));
}

StreamConsumer::StreamConsumer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
StreamConsumer::StreamConsumer(StreamConsumer&&) noexcept = default;
StreamConsumer& StreamConsumer::operator=(StreamConsumer&& other) noexcept {
  if (this != &other) {
    Drain();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

StreamConsumer::~StreamConsumer() { Drain(); }

void StreamConsumer::Drain() noexcept {
  if (!impl_ || impl_->Foreign()) return;
  // Deferred releases wait for their device copies; a copy that never finishes must not keep
  // the process from exiting forever, so after a bound the holds are given back regardless.
  auto deadline = Clock::now() + std::chrono::seconds(30);
  while (impl_->Poll() > 0) {
    if (Clock::now() > deadline) {
      impl_->log->warn(
          "stream consumer: deferred releases still not ready after 30 s; "
          "releasing them");
      std::lock_guard lock(impl_->deferred_mu);
      for (auto& state : impl_->deferred) state->ready = nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<StreamTensor> StreamConsumer::Open(std::string_view encoded) {
  if (impl_->Foreign()) {
    return InvalidArgument("stream open: " + stream::ForkedMessage("StreamConsumer", impl_->pid));
  }
  EA_ASSIGN_OR_RETURN(TensorDescriptor d, TensorDescriptor::Decode(encoded));
  impl_->Poll();
  if (impl_->IsRemote(d)) {
    std::vector<StreamTensor> out;
    std::vector<TensorDescriptor> ds;
    ds.push_back(std::move(d));
    size_t failed = 0;
    std::string_view one[] = {encoded};
    EA_RETURN_IF_ERROR(impl_->OpenRemote(one, std::move(ds), &out, &failed));
    return std::move(out[0]);
  }
  std::lock_guard lock(impl_->mu);
  impl_->DropUnlinkedLocked(false);
  EA_ASSIGN_OR_RETURN(PeerSegment * seg, impl_->MapLocked(d.spilled, d.segment));
  impl_->DiscardPrivateLocked(*seg);
  const auto& h = seg->file.header();
  const std::string where = seg->file.path + " block " + std::to_string(d.slot);
  std::string bad = stream::ValidateBlockReference(
      d.slot, d.offset, d.length, seg->file.view.slot_count, h.data_offset, seg->file.file_bytes());
  if (!bad.empty()) {
    return InvalidArgument("tensor descriptor refused: " + bad + " of " + seg->file.path);
  }
  BlockSlot& s = seg->file.view.slots[d.slot];
  uint32_t& local = seg->held[d.slot];
  if (local == 0) Holders(s).fetch_or(seg->bit(), std::memory_order_seq_cst);
  uint64_t c = Control(s).load(std::memory_order_seq_cst);
  std::string refusal;
  BlockState st = ControlWord::State(c);
  const uint64_t closed = seg->file.view.closed().load(std::memory_order_acquire);
  if (closed != 0) {
    refusal = "its producer (pid " + std::to_string(h.owner_pid) +
              ") closed the stream; the descriptor is stale";
  } else if (st == BlockState::kAborted) {
    refusal = "its key " + QuoteForMessage(d.key) + " was aborted";
  } else if (st != BlockState::kPublished) {
    refusal = std::string("the block is ") + stream::BlockStateName(st) +
              " (released by every reader, aborted with no reader holding it, or never published)";
  } else if (ControlWord::Generation(c) != static_cast<uint32_t>(d.generation) ||
             Relaxed(s.generation) != d.generation) {
    refusal =
        "the block was reused (a stale descriptor: released by every reader or aborted before)";
  } else if (ControlWord::Pending(c) == 0) {
    refusal = "every reader already released it";
  } else if (Relaxed(s.offset) != d.offset || Relaxed(s.length) != d.length) {
    refusal = "offset or length differ from the block's";
  }
  if (!refusal.empty()) {
    if (local == 0) {
      Holders(s).fetch_and(~seg->bit(), std::memory_order_seq_cst);
      seg->held.erase(d.slot);
      seg->file.view.epoch().fetch_add(1, std::memory_order_release);
    }
    bool unused = seg->views == 0 && seg->one_shot();
    if (unused) impl_->DropLocked(impl_->segments.find({seg->spill, seg->file.name}));
    return Busy("stream open " + where + " for key " + QuoteForMessage(d.key) + ": " + refusal);
  }
  ++local;
  ++seg->views;
  auto state = std::make_unique<StreamTensor::State>();
  state->consumer = impl_;
  state->segment = seg;
  state->bytes = {seg->file.mapping.data() + d.offset, d.length};
  state->descriptor = std::move(d);
  return StreamTensor(std::move(state));
}

Result<std::vector<StreamTensor>> StreamConsumer::OpenMany(
    std::span<const std::string_view> descriptors) {
  // Descriptors of one producer on another host: fetched as one batch (every request in
  // flight at once), all or none like the loop below.
  if (descriptors.size() >= 2 && !impl_->Foreign()) {
    std::vector<TensorDescriptor> ds;
    for (std::string_view e : descriptors) {
      auto d = TensorDescriptor::Decode(e);
      if (!d.ok() || !impl_->IsRemote(*d) ||
          (!ds.empty() && (d->remote != ds[0].remote ||
                           d->producer_instance != ds[0].producer_instance))) {
        ds.clear();
        break;
      }
      ds.push_back(std::move(d).value());
    }
    if (!ds.empty()) {
      impl_->Poll();
      std::vector<StreamTensor> opened;
      size_t failed = 0;
      Status s = impl_->OpenRemote(descriptors, std::move(ds), &opened, &failed);
      if (s.ok()) return opened;
      return Status(s.code(), "stream open_many: item " + std::to_string(failed) + " of " +
                                  std::to_string(descriptors.size()) + ": " + s.message() +
                                  (descriptors.size() > 1
                                       ? " (the other items were given back unread: each "
                                         "descriptor opens again)"
                                       : ""));
    }
  }
  std::vector<StreamTensor> opened;
  opened.reserve(descriptors.size());
  for (size_t i = 0; i < descriptors.size(); ++i) {
    Result<StreamTensor> t = Open(descriptors[i]);
    if (!t.ok()) {
      // Undo, newest first: holds go back, no share is spent, every descriptor opens again.
      while (!opened.empty()) {
        StreamTensor& last = opened.back();
        auto state = std::move(last.state_);
        auto consumer = std::move(state->consumer);
        consumer->Undo(*state);
        opened.pop_back();
      }
      return Status(t.status().code(),
                    "stream open_many: item " + std::to_string(i) + " of " +
                        std::to_string(descriptors.size()) + ": " + t.status().message() +
                        (i > 0 ? " (the items opened before it were given back unread: each "
                                 "descriptor opens again)"
                               : ""));
    }
    opened.push_back(std::move(t).value());
  }
  return opened;
}

uint64_t StreamConsumer::PollReleases() {
  if (impl_->Foreign()) return 0;
  uint64_t left = impl_->Poll();
  std::lock_guard lock(impl_->mu);
  impl_->DropUnlinkedLocked(true);
  return left;
}

ConsumerStats StreamConsumer::Stats() {
  ConsumerStats s;
  {
    std::lock_guard lock(impl_->deferred_mu);
    s.deferred_releases = impl_->deferred.size();
  }
  std::lock_guard lock(impl_->mu);
  for (auto& [key, seg] : impl_->segments) {
    ++s.mapped_segments;
    s.mapped_bytes += seg->file.file_bytes();
    s.open_views += seg->views;
  }
  s.pinned_bytes = impl_->pinned_bytes;
  s.dropped_segments = impl_->dropped;
  return s;
}

// ---- StreamTensor --------------------------------------------------------------------------

StreamTensor::StreamTensor(std::unique_ptr<State> state) : state_(std::move(state)) {}
StreamTensor::StreamTensor(StreamTensor&&) noexcept = default;
StreamTensor& StreamTensor::operator=(StreamTensor&& other) noexcept {
  if (this != &other) {
    Release();
    state_ = std::move(other.state_);
  }
  return *this;
}
StreamTensor::~StreamTensor() { Release(); }

std::span<const std::byte> StreamTensor::bytes() const {
  return state_ ? state_->bytes : std::span<const std::byte>();
}
Result<std::span<std::byte>> StreamTensor::private_bytes() const {
  if (!state_ || state_->consumer == nullptr) {
    return InvalidArgument("stream private_bytes: the tensor was released");
  }
  return state_->consumer->PrivateBytes(*state_);
}
const TensorDescriptor& StreamTensor::descriptor() const {
  static const TensorDescriptor kReleased;
  return state_ ? state_->descriptor : kReleased;
}

void StreamTensor::Release() {
  if (!state_) return;
  auto consumer = std::move(state_->consumer);
  consumer->Release(*state_);
  state_.reset();
}

void StreamTensor::GiveBack() {
  if (!state_) return;
  auto consumer = std::move(state_->consumer);
  consumer->Undo(*state_);
  state_.reset();
}

bool StreamTensor::remote() const { return state_ && state_->remote != nullptr; }

void StreamTensor::ReleaseAfter(CopyEvent copied) {
  auto event = std::make_shared<CopyEvent>(std::move(copied));
  ReleaseWhen([event] {
    auto ready = event->Ready();
    return !ready.ok() || *ready;
  });
}

void StreamTensor::ReleaseWhen(std::function<bool()> ready) {
  if (!state_) return;
  if (!ready || ready()) {
    Release();
    return;
  }
  auto consumer = std::move(state_->consumer);  // the list lives in the consumer: no cycle
  state_->ready = std::move(ready);
  std::lock_guard lock(consumer->deferred_mu);
  consumer->deferred.push_back(std::move(state_));
}

}  // namespace expert_arena
