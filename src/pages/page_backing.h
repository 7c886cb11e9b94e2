// The page code beneath arenas and stream segments: 2 MiB pages for a mapping, whether to ask
// for them, asking (MADV_HUGEPAGE, MADV_COLLAPSE in parallel), making them alongside a load,
// and placing them on NUMA nodes (PagePlacement) before the first one exists.
//
// The rule (from the field: per-fault compaction on a fragmented box stalled engines for
// minutes): on tmpfs and anonymous memory ask only when free 2 MiB blocks could back at least
// half of the arena, say so either way, and let the operator force it. hugetlbfs pages are
// reserved by the filesystem at fallocate time, so nothing is asked there.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/ready_front.h"
#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "pages/page_placement.h"
#include "platform/file.h"
#include "platform/kernel_features.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

namespace expert_arena::pages {

struct HugeDecision {
  bool ask = false;
  std::string note;  // for the start line
};

// Where the arena's pages come from.
enum class PageSource {
  kAnonymous,    // private arena
  kTmpfs,        // tmpfs without huge= (huge=never): 4 KiB pages unless collapsed
  kTmpfsAdvise,  // tmpfs huge=advise: 2 MiB pages where MADV_HUGEPAGE precedes the first
                 // touch, or collapsed
  kTmpfsHuge,    // tmpfs huge=always/within_size (or shmem_enabled=force): 2 MiB at fallocate
  kHugetlbfs,    // reserved 2 MiB (or larger) pages
  kOtherFs,      // any other filesystem (ext4, xfs, NFS...): the file's pages are its page
                 // cache, written back to the device; nothing to collapse
};

// The page source of a shared file on a filesystem of `kind` mounted with `tmpfs_huge`.
PageSource PageSourceFor(platform::FsKind kind, const std::string& tmpfs_huge);

// `free_blocks`: free 2 MiB blocks now (from /proc/buddyinfo). `can_collapse`: the kernel has
// MADV_COLLAPSE (6.1). Without it a tmpfs mounted huge=never cannot be given 2 MiB pages at
// all (the note says so and names the fixes); a tmpfs mounted huge=advise and anonymous memory
// get them from MADV_HUGEPAGE before the first touch.
HugeDecision DecideHugePages(
    HugePages mode, PageSource source, uint64_t bytes, uint64_t free_blocks,
    bool can_collapse = platform::Kernel().has(platform::KernelFeature::kCollapse));

// MADV_COLLAPSE of [data, data+bytes) (2 MiB-aligned) split into 64 MiB pieces across
// `threads` workers (0: up to 8, one per core). With populate_first each worker faults its
// piece in (MADV_POPULATE_WRITE) before collapsing it (anonymous memory has nothing to
// collapse until then). With `allocate` (the file mapped at `data` from offset 0, sized but
// not yet allocated) each worker allocates one small page per 2 MiB of its piece just before
// collapsing it; the collapse fills the rest with zeroes, which is much cheaper than copying
// a fully allocated range (bench/collapse_bench compares). The range is fully allocated
// where the collapse succeeded; the caller allocates the whole file afterwards anyway.
// Without MADV_COLLAPSE (before 6.1) nothing is collapsed: with `allocate`, the first byte of
// each 2 MiB is written instead (MADV_POPULATE_WRITE of one page, or a touch), so that a tmpfs
// mounted huge=advise allocates a 2 MiB page under the MADV_HUGEPAGE the caller gave; the
// caller checked the filesystem has room (statfs), as a touch past a full tmpfs is a SIGBUS.
// Returns the seconds it took; a failure names the first range that could not be allocated
// or collapsed. Every piece is attempted whatever happened to the others.
// `interleave_nodes`: the file's shared policy interleaves over that many nodes (see
// SeedPageOffset).
Result<double> CollapseParallel(std::byte* data, uint64_t bytes, const std::string& what,
                                bool populate_first, unsigned threads = 0,
                                const platform::UniqueFd* allocate = nullptr,
                                unsigned interleave_nodes = 1);

// The offset of the one small page allocated in the 2 MiB block at `at` before its collapse.
// MADV_COLLAPSE makes the 2 MiB page on the node holding the block's small pages, and under an
// interleave policy a small page goes to node (page index mod node count): the first page of
// every block (an index that is a multiple of 512) would put every block on the first node.
// This picks the page of the block whose index gives block i node i mod `interleave_nodes`,
// what interleaving 2 MiB pages gives.
uint64_t SeedPageOffset(uint64_t at, unsigned interleave_nodes, uint64_t base_page);

// "" or, when making 2 MiB pages for `bytes` took `seconds` at a rate far above what free
// 2 MiB blocks allow, a note for the start line saying why that may be and what avoids it.
std::string SlowCollapseHint(double seconds, uint64_t bytes);

// Reads the decision's inputs, asks for 2 MiB pages when the decision says so, and returns the
// decision with collapse timing added to its note. Never fatal: a collapse that fails is
// reported in the note (the arena works on 4 KiB pages too).
// `allocate`: see CollapseParallel; the caller still allocates the whole file afterwards
// (pieces are left unallocated when 2 MiB pages are not asked for or a piece fails).
HugeDecision ApplyHugePages(HugePages mode, PageSource source, std::byte* data, uint64_t bytes,
                            const std::string& what, double* collapse_seconds,
                            const platform::UniqueFd* allocate = nullptr,
                            unsigned interleave_nodes = 1);

// Whether AllocateAndMap makes the pages of such a file in pieces (4 KiB tmpfs with room for
// it, 2 MiB pages not refused): then, asked for `paced` pages, it makes none before the
// writer asks.
bool PagesInPieces(HugePages mode, PageSource source, uint64_t bytes, uint64_t available_bytes);

// How far paced pages may be made ahead of the writer's last ask, at most (4 pieces ahead, and
// the piece the ask ends in).
inline constexpr uint64_t kPacedPagesAheadBytes = 320ull << 20;

// Makes the pages of a mapping on background threads, in 64 MiB pieces taken front to back.
// For a file that is sized but not allocated, mapped at `data` from offset 0 (`fd` set): one
// small page per 2 MiB, then MADV_COLLAPSE (when `collapse`), then the whole piece allocated
// (a no-op where the collapse succeeded, 4 KiB pages where it did not) and populated
// (MADV_POPULATE_WRITE). For anonymous memory (`fd` null): populated, then collapsed (when
// `collapse`). front() moves past each piece once it and every piece before it are done, so a
// loader can write the first pieces while the later ones are still being made: on a VM whose
// free memory the host took back, making the 2 MiB pages costs 1-2 s/GiB, as much as reading
// the model from disk, and the two now overlap. No byte of a piece is written before the
// piece is allocated, so a filesystem that fills up meanwhile is an error (the front fails
// with it), never a SIGBUS.
//
// `paced`: a piece is made only once Permit() reached within 256 MiB of it, so the pages come
// as the writer asks for them rather than all at once: an engine that frees its own copy of
// each tensor after writing it holds the model about once at the build's peak, not twice.
//
// Thread-safety: front() may be waited on and Permit called from any thread; Finish, Note and
// the destructor from the owner only. The destructor stops the pieces not started yet and
// joins.
class BackgroundPages {
 public:
  BackgroundPages(const platform::UniqueFd* fd, std::byte* data, uint64_t bytes, std::string what,
                  bool collapse, unsigned threads = 0, unsigned interleave_nodes = 1,
                  bool paced = false);
  ~BackgroundPages();
  BackgroundPages(const BackgroundPages&) = delete;
  BackgroundPages& operator=(const BackgroundPages&) = delete;

  const ReadyFront& front() const { return front_; }
  // Paced: lets the pieces that hold any of [0, end) be made (never back).
  void Permit(uint64_t end);
  // Permits every piece, then waits for every piece. The error of the first piece that could
  // not be allocated or populated (fatal: the file is not whole); collapse failures are not
  // (see collapse_problem).
  Status Finish();
  // After Finish: seconds from the start to the last piece (paced: the time while any
  // piece was being made), and the first collapse failure
  // (OK when every piece is on 2 MiB pages or none was asked for).
  double seconds() const { return seconds_; }
  std::chrono::steady_clock::time_point finished_at() const { return finished_at_; }
  // After Finish: for the start line, e.g. "; MADV_COLLAPSE 2.39 s alongside the load, which
  // ended 0.01 s after it" (`load_done`: when the load ended); "" when nothing was collapsed.
  std::string Note(std::chrono::steady_clock::time_point load_done) const;
  uint64_t bytes() const { return bytes_; }
  const Status& collapse_problem() const { return collapse_problem_; }

 private:
  void Work();
  Status MakePiece(uint64_t offset, uint64_t length);
  void NoteCollapseProblem(const Status& c, uint64_t offset, uint64_t length);

  const platform::UniqueFd* fd_;
  std::byte* data_;
  uint64_t bytes_;
  std::string what_;
  bool collapse_;
  unsigned interleave_nodes_;
  bool paced_;
  std::chrono::steady_clock::time_point start_;
  ReadyFront front_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable permit_cv_;
  uint64_t permitted_ = 0;     // paced: bytes [0, permitted_) asked for, guarded by mu_
  // Paced: the time when any piece was being made, summed; pieces in the making and since
  // when some were. Guarded by mu_.
  double busy_seconds_ = 0;
  unsigned active_ = 0;
  std::chrono::steady_clock::time_point active_since_;
  std::vector<uint8_t> done_;  // per piece, guarded by mu_
  size_t done_prefix_ = 0;     // pieces done front to back, guarded by mu_
  Status fatal_;               // guarded by mu_
  Status collapse_problem_;    // guarded by mu_
  double seconds_ = 0;
  std::chrono::steady_clock::time_point finished_at_;
  std::vector<std::thread> workers_;
};

// Collapses a mapping of a shared file whose pages are all made (and written) to 2 MiB pages
// on one background thread at the lowest CPU priority (nice 19), 2 MiB at a time front to
// back: the 2 MiB pages of an engine-made arena on 4 KiB tmpfs, made after its build instead
// of before each write. On a VM whose free memory the host took back a 2 MiB page costs
// 1-2 s/GiB to make, more than the whole copy of the engine's tensors, and an engine does not
// need them to start: they replace the small pages under every mapping of the file (any
// process's) as each piece is done. A collapse that fails leaves its piece on 4 KiB pages
// (the first failure is kept); one the kernel calls busy is tried again, seconds later. Each
// page made leaves this mapping's page tables (MADV_DONTNEED: the file keeps it; the next read
// here maps it again), as an engine may read through another mapping of the file: the views'
// (AlsoMapIn). The mappings must outlive it; the destructor
// stops between pieces and joins (in a process forked meanwhile, where the thread does not
// exist, it only lets go of it).
class LateCollapse {
 public:
  // `warn` (may be empty) is called once, from its thread, when it ends with pieces left on
  // 4 KiB pages (not when stopped): the arena's fallback warning, which an engine otherwise
  // gets at open.
  LateCollapse(std::byte* data, uint64_t bytes, std::string what,
               std::function<void(const std::string&)> warn = {});
  ~LateCollapse();
  LateCollapse(const LateCollapse&) = delete;
  LateCollapse& operator=(const LateCollapse&) = delete;

  std::byte* data() const { return data_; }
  bool done() const { return done_.load(); }
  // Another mapping of the same bytes in this process, `views` at data()'s offset (Arena::
  // CopyOnWriteData's, which an engine's tensors read): each page made is mapped there as
  // one 2 MiB entry too. The kernel does that by itself only for a mapping that holds no
  // private page; one private page in a MAP_PRIVATE mapping (a write through a view) left
  // every new page there on 4 KiB entries. Blocks holding a private page stay so.
  void AlsoMapIn(std::byte* views) { views_.store(views); }
  // Waits until every piece was tried (tests and tools; an engine never waits).
  void Wait();
  // After done(): the first failure.
  Status problem() const;

 private:
  void Work();
  // Waits up to `wait`; true when the destructor asked it to stop.
  bool StoppedWithin(std::chrono::milliseconds wait);

  std::byte* data_;
  uint64_t bytes_;
  std::string what_;
  std::function<void(const std::string&)> warn_;
  pid_t owner_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_{false};
  std::atomic<std::byte*> views_{nullptr};
  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  std::condition_variable stop_cv_;
  Status problem_;  // guarded by mu_
  std::thread thread_;
};

// A shared file allocated, mapped writable and, per the rule above, on 2 MiB pages.
struct BackedFile {
  platform::Mapping mapping;
  HugeDecision huge;            // its note goes into the start line
  double collapse_seconds = 0;  // 0 when nothing was collapsed
  // Set when AllocateAndMap was asked to make the pages in the background and did: bytes are
  // written only where pages->front() says they are ready, and FinishPages is called before
  // the file is published.
  std::unique_ptr<BackgroundPages> pages;
  // Set when the pages are made on 4 KiB pages as written and collapsed to 2 MiB pages after
  // the build (AllocateAndMap's `collapse_after_fill`): the owner starts a LateCollapse of the
  // mapping once the file is written.
  bool collapse_after_fill = false;
  // Why the NUMA placement asked for was not applied ("auto" only; "" when it was, or none).
  std::string numa_note;

  // Waits for the background pages (if any) and completes `huge.note` and collapse_seconds;
  // the first piece that could not be allocated or populated. Called right after the load:
  // the note says how long after the last page the load ended (what the pages did not hide).
  Status FinishPages();
};

// Allocates the empty file behind `fd` to `bytes`, maps it writable (`alignment`: 2 MiB, or
// the hugetlbfs page size), and makes its pages 2 MiB per DecideHugePages. Every byte is
// allocated (on hugetlbfs without a placement: reserved by the mapping) when it returns: a
// filesystem or pool too small is kNoSpace from posix_fallocate or mmap, never a SIGBUS later.
// On 4 KiB tmpfs with room for the file, the file is only sized
// first and each collapse worker allocates one page per 2 MiB (CollapseParallel): allocating
// the whole file first would make 4 KiB pages that the collapse then copies (25x the time,
// bench/collapse_bench). `available_bytes`: the filesystem's free space (statfs). The caller
// removes the file on failure.
// `pages_in_background`: on 4 KiB tmpfs with room for the file and 2 MiB pages asked for,
// return as soon as the file is sized and mapped, with the pages made by BackgroundPages
// (BackedFile::pages); elsewhere it changes nothing. `paced`: where PagesInPieces, the pages
// are made as the writer permits them (BackgroundPages), on 2 MiB pages or 4 KiB ones. `fd`
// must outlive the BackedFile.
// `placement` (null: first touch): on tmpfs the file is sized and mapped, its shared policy
// set (mbind), and only then allocated; on hugetlbfs it is allocated under the thread policy
// (set_mempolicy). A placement other than first touch elsewhere, or one the kernel refuses, is
// an error unless it is not `required` (then BackedFile::numa_note says why it was not applied).
// `collapse_after_fill` (with `paced`, 2 MiB pages asked for, MADV_COLLAPSE, no interleave): the
// paced pieces are made on 4 KiB pages and BackedFile::collapse_after_fill asks the owner for a
// LateCollapse once written (the writer never waits for a 2 MiB page).
Result<BackedFile> AllocateAndMap(const platform::UniqueFd& fd, uint64_t bytes, uint64_t alignment,
                                  HugePages mode, PageSource source, uint64_t available_bytes,
                                  const std::string& what, bool pages_in_background = false,
                                  const PagePlacement* placement = nullptr, bool paced = false,
                                  bool collapse_after_fill = false);

}  // namespace expert_arena::pages
