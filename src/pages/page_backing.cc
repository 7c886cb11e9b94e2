#include "pages/page_backing.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "common/fault_points.h"
#include "common/units.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

namespace expert_arena::pages {

PageSource PageSourceFor(platform::FsKind kind, const std::string& tmpfs_huge) {
  if (kind == platform::FsKind::kHugetlbfs) return PageSource::kHugetlbfs;
  if (kind == platform::FsKind::kOther) return PageSource::kOtherFs;
  if (tmpfs_huge == "always" || tmpfs_huge == "within_size" ||
      platform::Kernel().shmem_enabled == "force") {
    return PageSource::kTmpfsHuge;
  }
  // shmem_enabled (other than force and deny) rules only the kernel's internal tmpfs (SysV
  // shm, memfd, shared anonymous memory): a mounted tmpfs follows its own huge= option.
  if (tmpfs_huge == "advise" && platform::Kernel().shmem_enabled != "deny") {
    return PageSource::kTmpfsAdvise;
  }
  return PageSource::kTmpfs;
}

namespace {

// Why a tmpfs arena stays on 4 KiB pages on a kernel without MADV_COLLAPSE, and the fixes.
std::string NoCollapseNote() {
  const platform::KernelFeatures& k = platform::Kernel();
  return "2 MiB pages not made: kernel " + k.release + " lacks MADV_COLLAPSE (6.1+; " +
         k.get(platform::KernelFeature::kCollapse).answer +
         ") and this tmpfs is mounted huge=never (shmem_enabled=" + k.shmem_enabled +
         "); for 2 MiB pages mount it huge=advise (mount -o remount,huge=advise /dev/shm) or "
         "huge=always, use a tmpfs mounted huge=always, or hugetlbfs";
}

}  // namespace

HugeDecision DecideHugePages(HugePages mode, PageSource source, uint64_t bytes,
                             uint64_t free_blocks, bool can_collapse) {
  HugeDecision d;
  if (source == PageSource::kHugetlbfs) {
    d.note = "hugetlbfs: huge pages reserved by the filesystem";
    return d;
  }
  if (source == PageSource::kOtherFs) {
    // A file on a disk filesystem is its page cache: MADV_COLLAPSE refuses a file open for
    // writing there (EINVAL), and its pages are written back to the device anyway.
    d.note = "2 MiB pages not asked for: not on tmpfs or hugetlbfs";
    return d;
  }
  if (source == PageSource::kTmpfsHuge) {
    // The filesystem allocates 2 MiB pages at fallocate. MADV_COLLAPSE is never run on them:
    // on kernel 6.18 a collapse of a range already on huge folios makes later writes through
    // the mapping vanish from the file (tests/arena/arena_backing_test.cc would catch it).
    d.note = "tmpfs huge=always: 2 MiB pages from the filesystem";
    return d;
  }
  if (!can_collapse && mode != HugePages::kOff) {
    platform::CountFallback(platform::KernelFeature::kCollapse, 0, bytes);
  }
  if (source == PageSource::kTmpfs && !can_collapse && mode != HugePages::kOff) {
    d.note = NoCollapseNote();
    return d;
  }
  uint64_t free_bytes = free_blocks * kHugePageBytes;
  std::string free_text =
      FormatBytes(free_bytes) + " free in 2 MiB blocks for " + FormatBytes(bytes);
  if (!can_collapse) free_text += "; no MADV_COLLAPSE: MADV_HUGEPAGE before the first touch";
  switch (mode) {
    case HugePages::kOff:
      d.note = "2 MiB pages not asked for (--huge off)";
      return d;
    case HugePages::kOn:
      d.ask = true;
      d.note = "2 MiB pages asked for (--huge on; " + free_text + ")";
      return d;
    case HugePages::kAuto:
      d.ask = free_bytes >= bytes / 2;
      d.note = d.ask ? "2 MiB pages asked for (" + free_text + ")"
                     : "2 MiB pages not asked for: only " + free_text +
                           ", less than half; --huge on forces it";
      return d;
  }
  return d;
}

namespace {

// The first write of each 2 MiB of [data+offset, +length): MADV_POPULATE_WRITE of one base page
// (an error, not a SIGBUS, where the filesystem is full), or a touch without it.
Status TouchEachHugePage(std::byte* data, uint64_t offset, uint64_t length,
                         const std::string& what) {
  const uint64_t page = platform::BasePageSize();
  for (uint64_t at = offset; at < offset + length; at += kHugePageBytes) {
    EA_RETURN_IF_ERROR(
        platform::AdviseRange(data + at, page, platform::Advice::kPopulateWrite, what));
  }
  return Status::Ok();
}

// MADV_COLLAPSE of [start, start+length). Under an interleave policy one call per 2 MiB: each
// block's 2 MiB page then lands on the node of its own seed page (SeedPageOffset), where one
// call over a 64 MiB piece put every block on the first node (Debian's 6.1 under QEMU with two
// nodes, tests/kernel/qemu_numa.sh). A call per block costs a syscall per 2 MiB.
Status CollapseRange(std::byte* start, uint64_t length, const std::string& what,
                     unsigned interleave_nodes) {
  if (interleave_nodes <= 1) {
    return platform::AdviseRange(start, length, platform::Advice::kCollapse, what);
  }
  Status first = Status::Ok();
  for (uint64_t at = 0; at < length; at += kHugePageBytes) {
    Status s = platform::AdviseRange(start + at, std::min(kHugePageBytes, length - at),
                                     platform::Advice::kCollapse, what);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

}  // namespace

uint64_t SeedPageOffset(uint64_t at, unsigned interleave_nodes, uint64_t base_page) {
  if (interleave_nodes <= 1 || base_page == 0) return at;
  const uint64_t n = interleave_nodes;
  const uint64_t block = at / kHugePageBytes;
  const uint64_t first_index = at / base_page;
  const uint64_t k = (block % n + n - first_index % n) % n;
  return at + std::min<uint64_t>(k, kHugePageBytes / base_page - 1) * base_page;
}

Result<double> CollapseParallel(std::byte* data, uint64_t bytes, const std::string& what,
                                bool populate_first, unsigned threads,
                                const platform::UniqueFd* allocate, unsigned interleave_nodes) {
  auto start = std::chrono::steady_clock::now();
  const bool can_collapse = platform::Kernel().has(platform::KernelFeature::kCollapse);
  constexpr uint64_t kPiece = 64 * kMiB;
  size_t pieces = (bytes + kPiece - 1) / kPiece;
  unsigned workers =
      threads != 0 ? threads : std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 8);
  workers = std::min<size_t>(workers, std::max<size_t>(pieces, 1));
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first_error;
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < pieces;) {
        uint64_t offset = i * kPiece;
        uint64_t length = std::min(kPiece, bytes - offset);
        Status s = Status::Ok();
        if (allocate != nullptr && !can_collapse) {
          // No MADV_COLLAPSE: the first write of each 2 MiB, under MADV_HUGEPAGE, is what
          // makes a 2 MiB page on a tmpfs mounted huge=advise (fallocate would make 4 KiB
          // ones).
          s = TouchEachHugePage(data, offset, length, what);
        } else if (allocate != nullptr) {
          // One small page per 2 MiB (the one holding its first byte) is enough: the
          // collapse fills the holes with zeroes while it builds the 2 MiB page, ten times
          // faster here than copying 512 freshly allocated 4 KiB pages (bench/collapse_bench).
          const uint64_t page = platform::BasePageSize();
          for (uint64_t at = offset; s.ok() && at < offset + length; at += kHugePageBytes) {
            s = platform::AllocateRange(*allocate, SeedPageOffset(at, interleave_nodes, page), 1);
          }
        }
        if (s.ok() && populate_first) {
          s = platform::AdviseRange(data + offset, length, platform::Advice::kPopulateWrite, what);
        }
        if (s.ok() && can_collapse) {
          s = CollapseRange(data + offset, length, what, interleave_nodes);
        }
        if (!s.ok() && s.code() == StatusCode::kBusy) {
          // EAGAIN: the kernel could not take a lock or a page right now; one retry.
          s = CollapseRange(data + offset, length, what, interleave_nodes);
        }
        if (!s.ok()) {
          std::lock_guard lock(mu);
          if (first_error.ok()) {
            first_error =
                s.WithContext("bytes " + std::to_string(offset) + "+" + std::to_string(length));
          }
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  if (!first_error.ok()) return first_error;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string SlowCollapseHint(double seconds, uint64_t bytes) {
  // 0.05-0.1 s/GiB is the cost with free 2 MiB blocks at hand (bench/collapse_bench). Far
  // more means the kernel had to compact, or, in a VM, that the host had taken the free
  // blocks back (free page reporting) and faults them in again: an operator can avoid both
  // with a hugetlbfs pool, which stays reserved.
  constexpr double kSlowSecondsPerGiB = 0.5;
  const double per_gib = seconds / (static_cast<double>(bytes) / kGiB);
  if (bytes < kGiB || per_gib < kSlowSecondsPerGiB) return "";
  char buf[224];
  std::snprintf(buf, sizeof buf,
                " (%.2f s/GiB: slow; free memory was fragmented or handed back to a "
                "hypervisor; an arena on hugetlbfs keeps reserved 2 MiB pages)",
                per_gib);
  return buf;
}

HugeDecision ApplyHugePages(HugePages mode, PageSource source, std::byte* data, uint64_t bytes,
                            const std::string& what, double* collapse_seconds,
                            const platform::UniqueFd* allocate, unsigned interleave_nodes) {
  uint64_t free_blocks = 0;
  auto blocks = platform::FreeHugeBlocks();
  if (blocks.ok()) free_blocks = *blocks;
  HugeDecision d = DecideHugePages(mode, source, bytes, free_blocks);
  if (!d.ask) return d;
  Status advise = platform::AdviseRange(data, bytes, platform::Advice::kHugePage, what);
  if (!advise.ok()) d.note += "; " + advise.message();
  // Collapse while the pages are still empty, piece by piece on every core. Anonymous memory
  // has no pages until it is faulted in, so it is faulted in first (piece by piece, in the
  // same workers). MADV_COLLAPSE refuses (EINVAL) a file range not allocated yet; then fault
  // in and collapse again (that copies, so it is the second choice).
  const bool anonymous = source == PageSource::kAnonymous;
  auto collapsed = CollapseParallel(data, bytes, what, /*populate_first=*/anonymous, 0, allocate,
                                    interleave_nodes);
  if (!collapsed.ok() && !anonymous && collapsed.status().code() == StatusCode::kInvalidArgument) {
    collapsed = CollapseParallel(data, bytes, what, /*populate_first=*/true, 0, allocate,
                                 interleave_nodes);
  }
  if (collapsed.ok()) {
    *collapse_seconds = *collapsed;
    d.note += (platform::Kernel().has(platform::KernelFeature::kCollapse)
                   ? "; MADV_COLLAPSE "
                   : "; MADV_HUGEPAGE and a first touch per 2 MiB ") +
              FormatDuration(*collapsed);
    d.note += SlowCollapseHint(*collapsed, bytes);
  } else {
    d.note +=
        "; MADV_COLLAPSE failed, part may stay on 4 KiB pages: " + collapsed.status().message();
  }
  return d;
}

namespace {
constexpr uint64_t kBackgroundPiece = 64 * kMiB;
// Paced pieces run this far ahead of what the writer asked for: every worker busy while it
// copies (one piece at a time made the pages half as fast on two cores), at the cost of this
// much more memory at the build's peak.
constexpr uint64_t kPacedAhead = 4 * kBackgroundPiece;
static_assert(kPacedAhead + kBackgroundPiece == kPacedPagesAheadBytes);
}  // namespace

bool PagesInPieces(HugePages mode, PageSource source, uint64_t bytes, uint64_t available_bytes) {
  return (source == PageSource::kTmpfs || source == PageSource::kTmpfsAdvise) &&
         mode != HugePages::kOff && available_bytes >= bytes;
}

BackgroundPages::BackgroundPages(const platform::UniqueFd* fd, std::byte* data, uint64_t bytes,
                                 std::string what, bool collapse, unsigned threads,
                                 unsigned interleave_nodes, bool paced)
    : fd_(fd),
      data_(data),
      bytes_(bytes),
      what_(std::move(what)),
      collapse_(collapse),
      interleave_nodes_(interleave_nodes),
      paced_(paced),
      start_(std::chrono::steady_clock::now()) {
  const size_t pieces = (bytes + kBackgroundPiece - 1) / kBackgroundPiece;
  done_.assign(pieces, 0);
  unsigned count =
      threads != 0 ? threads : std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 8);
  count = std::min<size_t>(count, std::max<size_t>(pieces, 1));
  if (pieces == 0) {
    front_.Advance(bytes_);
    return;
  }
  for (unsigned w = 0; w < count; ++w) workers_.emplace_back([this] { Work(); });
}

BackgroundPages::~BackgroundPages() {
  {
    std::lock_guard lock(mu_);
    stop_.store(true);
  }
  permit_cv_.notify_all();
  for (auto& t : workers_) t.join();
  front_.Fail(Internal(what_ + ": making its pages was stopped"));
}

Status BackgroundPages::MakePiece(uint64_t offset, uint64_t length) {
  std::byte* piece = data_ + offset;
  if (fd_ == nullptr) {
    // Anonymous memory: nothing to collapse until it is faulted in; what faulting left on
    // 4 KiB pages (no compaction on the fault path when THP defrag is off) is collapsed.
    EA_RETURN_IF_ERROR(
        platform::AdviseRange(piece, length, platform::Advice::kPopulateWrite, what_));
    if (!collapse_ || !platform::Kernel().has(platform::KernelFeature::kCollapse)) {
      return Status::Ok();  // without MADV_COLLAPSE: what MADV_HUGEPAGE gave at the fault
    }
    Status c = platform::AdviseRange(piece, length, platform::Advice::kCollapse, what_);
    if (!c.ok() && c.code() == StatusCode::kBusy) {
      c = platform::AdviseRange(piece, length, platform::Advice::kCollapse, what_);
    }
    NoteCollapseProblem(c, offset, length);
    return Status::Ok();
  }
  if (collapse_ && !platform::Kernel().has(platform::KernelFeature::kCollapse)) {
    // No MADV_COLLAPSE: the first write of each 2 MiB under MADV_HUGEPAGE (see
    // CollapseParallel).
    EA_RETURN_IF_ERROR(TouchEachHugePage(data_, offset, length, what_));
  } else if (collapse_) {
    Status s = Status::Ok();
    // One small page per 2 MiB: see CollapseParallel.
    const uint64_t page = platform::BasePageSize();
    for (uint64_t at = offset; s.ok() && at < offset + length; at += kHugePageBytes) {
      s = platform::AllocateRange(*fd_, SeedPageOffset(at, interleave_nodes_, page), 1);
    }
    if (!s.ok()) return s;  // fatal: the filesystem is full or failing
    Status c = CollapseRange(piece, length, what_, interleave_nodes_);
    if (!c.ok() && (c.code() == StatusCode::kBusy || c.code() == StatusCode::kInvalidArgument)) {
      // EAGAIN: one retry. EINVAL: fault the piece in and collapse it (that copies).
      if (c.code() == StatusCode::kInvalidArgument) {
        EA_RETURN_IF_ERROR(platform::AllocateRange(*fd_, offset, length));
        EA_RETURN_IF_ERROR(
            platform::AdviseRange(piece, length, platform::Advice::kPopulateWrite, what_));
      }
      c = CollapseRange(piece, length, what_, interleave_nodes_);
    }
    NoteCollapseProblem(c, offset, length);
  }
  // Every byte of the piece is allocated before any is written through the mapping.
  EA_RETURN_IF_ERROR(platform::AllocateRange(*fd_, offset, length));
  return platform::AdviseRange(piece, length, platform::Advice::kPopulateWrite, what_);
}

void BackgroundPages::NoteCollapseProblem(const Status& c, uint64_t offset, uint64_t length) {
  if (c.ok()) return;
  std::lock_guard lock(mu_);
  if (collapse_problem_.ok()) {
    collapse_problem_ =
        c.WithContext("bytes " + std::to_string(offset) + "+" + std::to_string(length));
  }
}

std::string BackgroundPages::Note(std::chrono::steady_clock::time_point load_done) const {
  if (!collapse_) return "";
  if (!collapse_problem_.ok()) {
    return "; MADV_COLLAPSE failed, part may stay on 4 KiB pages: " + collapse_problem_.message();
  }
  const double tail =
      std::max(0.0, std::chrono::duration<double>(load_done - finished_at_).count());
  const std::string how = platform::Kernel().has(platform::KernelFeature::kCollapse)
                              ? "; MADV_COLLAPSE "
                              : "; MADV_HUGEPAGE and a first touch per 2 MiB ";
  if (paced_) {
    return how + FormatDuration(seconds_) + " as the engine wrote" +
           SlowCollapseHint(seconds_, bytes_);
  }
  return how + FormatDuration(seconds_) + " alongside the load, which ended " +
         FormatDuration(tail) + " after it" + SlowCollapseHint(seconds_, bytes_);
}

void BackgroundPages::Permit(uint64_t end) {
  {
    std::lock_guard lock(mu_);
    if (end <= permitted_) return;
    permitted_ = end;
  }
  permit_cv_.notify_all();
}

void BackgroundPages::Work() {
  for (size_t i; !stop_.load() && (i = next_.fetch_add(1)) < done_.size();) {
    const uint64_t offset = i * kBackgroundPiece;
    const uint64_t length = std::min(kBackgroundPiece, bytes_ - offset);
    if (paced_) {
      std::unique_lock lock(mu_);
      permit_cv_.wait(lock, [&] { return stop_.load() || permitted_ + kPacedAhead > offset; });
      if (stop_.load()) return;
    }
    fault_points::BeforePagePiece(i);
    if (paced_) {
      std::lock_guard lock(mu_);
      if (active_++ == 0) active_since_ = std::chrono::steady_clock::now();
    }
    Status s = MakePiece(offset, length);
    std::lock_guard lock(mu_);
    if (paced_ && --active_ == 0) {
      busy_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - active_since_).count();
    }
    if (!s.ok()) {
      if (fatal_.ok()) {
        fatal_ = s.WithContext("bytes " + std::to_string(offset) + "+" + std::to_string(length));
      }
      front_.Fail(fatal_);
      stop_.store(true);
      permit_cv_.notify_all();
      return;
    }
    done_[i] = 1;
    while (done_prefix_ < done_.size() && done_[done_prefix_] != 0) ++done_prefix_;
    if (done_prefix_ == done_.size()) {
      finished_at_ = std::chrono::steady_clock::now();
      seconds_ = paced_ ? busy_seconds_
                        : std::chrono::duration<double>(finished_at_ - start_).count();
    }
    front_.Advance(std::min(bytes_, done_prefix_ * kBackgroundPiece));
  }
}

Status BackgroundPages::Finish() {
  Permit(bytes_);
  for (auto& t : workers_) t.join();
  workers_.clear();
  std::lock_guard lock(mu_);
  if (!fatal_.ok()) return fatal_;
  if (done_prefix_ != done_.size()) return Internal(what_ + ": making its pages was stopped");
  return Status::Ok();
}

Status BackedFile::FinishPages() {
  if (pages == nullptr) return Status::Ok();
  // Called when the load is done: how long after the last page it ended is what the pages
  // did not hide.
  const auto load_done = std::chrono::steady_clock::now();
  EA_RETURN_IF_ERROR(pages->Finish());
  collapse_seconds = pages->seconds();
  huge.note += pages->Note(load_done);
  pages.reset();
  return Status::Ok();
}

Result<BackedFile> AllocateAndMap(const platform::UniqueFd& fd, uint64_t bytes, uint64_t alignment,
                                  HugePages mode, PageSource source, uint64_t available_bytes,
                                  const std::string& what, bool pages_in_background,
                                  const PagePlacement* placement, bool paced,
                                  bool collapse_after_fill) {
  const bool allocate_in_pieces = PagesInPieces(mode, source, bytes, available_bytes);
  const bool tmpfs = source == PageSource::kTmpfs || source == PageSource::kTmpfsAdvise ||
                     source == PageSource::kTmpfsHuge;
  bool place = placement != nullptr && placement->policy != platform::MemPolicy::kDefault;
  std::string numa_note;
  // A policy the kernel refused: fatal when asked for by name, first touch for "auto".
  auto refused = [&](const Status& s) -> Status {
    if (placement->required) return s.WithContext("--numa " + placement->asked);
    numa_note = "first touch (--numa auto: " + s.message() + ")";
    place = false;
    return Status::Ok();
  };
  if (place && !tmpfs && source != PageSource::kHugetlbfs) {
    EA_RETURN_IF_ERROR(refused(InvalidArgument(
        what + " is not on tmpfs or hugetlbfs: its pages are a disk file's page cache, which no "
               "shared policy places")));
  }
  const bool bind_tmpfs = place && tmpfs;
  if (place && source == PageSource::kHugetlbfs) {
    // hugetlbfs has no shared policy (mbind sets only the mapping's own): fallocate, which makes
    // every page of the file here and now, draws them from the per-node pools under this
    // thread's policy, restored afterwards.
    Status set = platform::SetThreadPolicy(placement->policy, placement->nodes, what);
    if (!set.ok()) {
      EA_RETURN_IF_ERROR(refused(set));
      EA_RETURN_IF_ERROR(platform::AllocateFile(fd, bytes));
    } else {
      Status allocated = platform::AllocateFile(fd, bytes);
      Status restored = platform::RestoreThreadPolicy(what);
      EA_RETURN_IF_ERROR(allocated);
      EA_RETURN_IF_ERROR(restored);
    }
  } else if (source == PageSource::kHugetlbfs) {
    // No policy to apply: sized only. The shared mapping below reserves every page of the file
    // from the pool and the mount's size= (an mmap that fails with ENOMEM, which is kNoSpace,
    // when either is short: never a SIGBUS later), and the populate that follows makes and
    // zeroes the pages on every populating thread, where fallocate zeroes them all on this one
    // under the inode's lock (0.22 s of a 0.41 s warm 2 GiB load, 2026-12-04).
    EA_RETURN_IF_ERROR(platform::ExtendFile(fd, bytes));
  } else {
    // On tmpfs with a policy: sized only, the pages are made once the policy is set below.
    EA_RETURN_IF_ERROR(allocate_in_pieces || bind_tmpfs ? platform::ExtendFile(fd, bytes)
                                                        : platform::AllocateFile(fd, bytes));
  }
  BackedFile file;
  EA_ASSIGN_OR_RETURN(file.mapping, platform::Mapping::MapFile(fd, bytes, true, alignment));
  unsigned interleave_nodes = 1;
  if (bind_tmpfs) {
    // No page of the file exists yet: the shared policy rules every page made from now on, by
    // fallocate, a collapse or a fault, in this process or any other.
    Status bound = platform::BindRange(file.mapping.data(), bytes, placement->policy,
                                       placement->nodes, what);
    if (!bound.ok()) {
      EA_RETURN_IF_ERROR(refused(bound));
    } else if (placement->policy == platform::MemPolicy::kInterleave) {
      interleave_nodes = static_cast<unsigned>(placement->nodes.size());
    }
    if (!allocate_in_pieces) EA_RETURN_IF_ERROR(platform::AllocateFile(fd, bytes));
  }
  file.numa_note = numa_note;
  if (allocate_in_pieces && pages_in_background) {
    uint64_t free_blocks = 0;
    auto blocks = platform::FreeHugeBlocks();
    if (blocks.ok()) free_blocks = *blocks;
    file.huge = DecideHugePages(mode, source, bytes, free_blocks);
    if (file.huge.ask || paced) {
      if (file.huge.ask) {
        Status advise =
            platform::AdviseRange(file.mapping.data(), bytes, platform::Advice::kHugePage, what);
        if (!advise.ok()) file.huge.note += "; " + advise.message();
      }
      // Paced without 2 MiB pages: the pieces are allocated on 4 KiB pages as asked for.
      // Collapsed after the fill: the same, and a LateCollapse once written. Not under an
      // interleave policy: a collapse of written small pages puts each 2 MiB page on one node
      // of its choosing, where the seeded collapse follows the policy (SeedPageOffset).
      file.collapse_after_fill = paced && collapse_after_fill && file.huge.ask &&
                                 interleave_nodes == 1 &&
                                 platform::Kernel().has(platform::KernelFeature::kCollapse);
      if (file.collapse_after_fill) {
        file.huge.note += "; MADV_COLLAPSE after the build, in the background at nice 19 (the "
                          "engine writes into 4 KiB pages)";
      }
      file.pages = std::make_unique<BackgroundPages>(
          &fd, file.mapping.data(), bytes, what,
          /*collapse=*/file.huge.ask && !file.collapse_after_fill, 0, interleave_nodes, paced);
      return file;
    }
    EA_RETURN_IF_ERROR(platform::AllocateFile(fd, bytes));
    return file;
  }
  file.huge = ApplyHugePages(mode, source, file.mapping.data(), bytes, what, &file.collapse_seconds,
                             allocate_in_pieces ? &fd : nullptr, interleave_nodes);
  // A no-op where the collapse allocated; 4 KiB pages where it did not (not asked for, or a
  // piece failed). Before any byte is written through the mapping.
  if (allocate_in_pieces) EA_RETURN_IF_ERROR(platform::AllocateFile(fd, bytes));
  return file;
}

LateCollapse::LateCollapse(std::byte* data, uint64_t bytes, std::string what,
                           std::function<void(const std::string&)> warn)
    : data_(data),
      bytes_(bytes),
      what_(std::move(what)),
      warn_(std::move(warn)),
      owner_(platform::CurrentPid()) {
  thread_ = std::thread([this] { Work(); });
}

LateCollapse::~LateCollapse() {
  {
    std::lock_guard lock(mu_);
    stop_.store(true);
  }
  stop_cv_.notify_all();
  if (!thread_.joinable()) return;
  // A forked child has the parent's thread object but not its thread (glibc reclaimed its
  // stack at the fork): nothing to wait for, and a join would free that stack again.
  if (platform::CurrentPid() == owner_) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

bool LateCollapse::StoppedWithin(std::chrono::milliseconds wait) {
  std::unique_lock lock(mu_);
  return stop_cv_.wait_for(lock, wait, [this] { return stop_.load(); });
}

void LateCollapse::Work() {
  platform::LowerThreadPriority(19);
  // One 2 MiB page per call: the kernel collapses each on its own anyway, and a destructor
  // (the engine closing the arena, or exiting) waits for one page at most.
  constexpr uint64_t kPiece = kHugePageBytes;
  // A piece the kernel calls busy (EAGAIN: a page of it locked, off the LRU or referenced
  // elsewhere, as for seconds after another engine exits) is tried again after 1, 2, 4 and
  // 8 s, then left on 4 KiB pages.
  constexpr int kPasses = 5;
  std::vector<uint64_t> pending;
  for (uint64_t at = 0; at < bytes_; at += kPiece) pending.push_back(at);
  // The pieces made before the views were seen: mapped there at the end.
  std::vector<uint64_t> before_views;
  Status first = Status::Ok();
  Status busy = Status::Ok();
  uint64_t failed_bytes = 0;  // left on 4 KiB pages by a failure other than busy
  for (int pass = 0; pass < kPasses && !pending.empty(); ++pass) {
    if (pass > 0 && StoppedWithin(std::chrono::milliseconds(1000 << (pass - 1)))) break;
    std::vector<uint64_t> again;
    for (uint64_t at : pending) {
      if (stop_.load()) break;
      const uint64_t length = std::min(kPiece, bytes_ - at);
      Status c = platform::AdviseRange(data_ + at, length, platform::Advice::kCollapse, what_);
      // The collapse maps the new page here; an engine reads through another mapping of the
      // file (Python's views), where the arena's own left the page tables so that RSS counts
      // the arena once. The next read through this one maps it again (one fault per 2 MiB).
      (void)platform::AdviseRange(data_ + at, length, platform::Advice::kDontNeed, what_);
      if (!c.ok()) c = c.WithContext("bytes " + std::to_string(at) + "+" + std::to_string(length));
      if (c.code() == StatusCode::kBusy) {
        again.push_back(at);
        busy = c;
        continue;
      }
      if (!c.ok()) {
        if (first.ok()) first = c;
        failed_bytes += length;
        continue;
      }
      if (std::byte* views = views_.load(); views != nullptr) {
        // The page exists now: this only puts one 2 MiB entry where the views had 512 (or
        // none); a block with a private page refuses (EINVAL) and stays as it is.
        (void)platform::AdviseRange(views + at, length, platform::Advice::kCollapse, what_);
      } else {
        before_views.push_back(at);
      }
    }
    pending = std::move(again);
  }
  if (std::byte* views = views_.load(); views != nullptr) {
    for (uint64_t at : before_views) {
      if (stop_.load()) break;
      const uint64_t length = std::min(kPiece, bytes_ - at);
      (void)platform::AdviseRange(views + at, length, platform::Advice::kCollapse, what_);
    }
  }
  if (first.ok() && !pending.empty() && !stop_.load()) first = busy;
  uint64_t left = failed_bytes;
  for (uint64_t at : pending) left += std::min(kPiece, bytes_ - at);
  if (left > 0 && !stop_.load() && warn_) {
    warn_("expert-arena: " + what_ + ": " + FormatBytes(left) + " of " + FormatBytes(bytes_) +
          " left on 4 KiB pages after the build (" + first.message() +
          "); see docs/page-backing.md to get 2 MiB pages (free memory, a hugetlbfs mount)");
  }
  {
    std::lock_guard lock(mu_);
    problem_ = first;
    done_.store(true);
  }
  done_cv_.notify_all();
}

void LateCollapse::Wait() {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [this] { return done_.load(); });
}

Status LateCollapse::problem() const {
  std::lock_guard lock(mu_);
  return problem_;
}

}  // namespace expert_arena::pages
