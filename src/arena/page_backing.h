// 2 MiB pages for an arena: whether to ask for them, asking (MADV_HUGEPAGE, MADV_COLLAPSE in
// parallel), and reading back from the page tables how much of the mapping really is on them.
//
// The rule (from the field: per-fault compaction on a fragmented box stalled engines for
// minutes): on tmpfs and anonymous memory ask only when free 2 MiB blocks could back at least
// half of the arena, say so either way, and let the operator force it. hugetlbfs pages are
// reserved by the filesystem at fallocate time, so nothing is asked there.
#pragma once

#include <cstdint>
#include <string>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "platform/file.h"
#include "platform/mapping.h"

namespace expert_arena::arena {

struct HugeDecision {
  bool ask = false;
  std::string note;  // for the start line
};

// Where the arena's pages come from.
enum class PageSource {
  kAnonymous,  // private arena
  kTmpfs,      // tmpfs without huge= (or huge=advise): 4 KiB pages unless collapsed
  kTmpfsHuge,  // tmpfs huge=always/within_size (or shmem_enabled=force): 2 MiB at fallocate
  kHugetlbfs,  // reserved 2 MiB (or larger) pages
};

// The page source of a shared file on a filesystem of `kind` mounted with `tmpfs_huge`.
PageSource PageSourceFor(bool hugetlbfs, const std::string& tmpfs_huge);

// `free_blocks`: free 2 MiB blocks now (from /proc/buddyinfo).
HugeDecision DecideHugePages(HugePages mode, PageSource source, uint64_t bytes,
                             uint64_t free_blocks);

// MADV_COLLAPSE of [data, data+bytes) (2 MiB-aligned) split into 64 MiB pieces across
// `threads` workers (0: up to 8, one per core). With populate_first each worker faults its
// piece in (MADV_POPULATE_WRITE) before collapsing it (anonymous memory has nothing to
// collapse until then). With `allocate` (the file mapped at `data` from offset 0, sized but
// not yet allocated) each worker allocates one small page per 2 MiB of its piece just before
// collapsing it; the collapse fills the rest with zeroes, which is much cheaper than copying
// a fully allocated range (bench/collapse_bench compares). The range is fully allocated
// where the collapse succeeded; the caller allocates the whole file afterwards anyway.
// Returns the seconds it took; a failure names the first range that could not be allocated
// or collapsed. Every piece is attempted whatever happened to the others.
Result<double> CollapseParallel(std::byte* data, uint64_t bytes, const std::string& what,
                                bool populate_first, unsigned threads = 0,
                                const platform::UniqueFd* allocate = nullptr);

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
                            const platform::UniqueFd* allocate = nullptr);

// A shared file allocated, mapped writable and, per the rule above, on 2 MiB pages.
struct BackedFile {
  platform::Mapping mapping;
  HugeDecision huge;            // its note goes into the start line
  double collapse_seconds = 0;  // 0 when nothing was collapsed
};

// Allocates the empty file behind `fd` to `bytes`, maps it writable (`alignment`: 2 MiB, or
// the hugetlbfs page size), and makes its pages 2 MiB per DecideHugePages. Every byte is
// allocated when it returns: a filesystem too small is posix_fallocate's kNoSpace naming the
// sizes, never a SIGBUS later. On 4 KiB tmpfs with room for the file, the file is only sized
// first and each collapse worker allocates one page per 2 MiB (CollapseParallel): allocating
// the whole file first would make 4 KiB pages that the collapse then copies (25x the time,
// bench/collapse_bench). `available_bytes`: the filesystem's free space (statfs). The caller
// removes the file on failure.
Result<BackedFile> AllocateAndMap(const platform::UniqueFd& fd, uint64_t bytes, uint64_t alignment,
                                  HugePages mode, PageSource source, uint64_t available_bytes,
                                  const std::string& what);

}  // namespace expert_arena::arena
