// The exposition of `expert-arena metrics` and expert_arena.metrics() (docs/deployment.md).
//
// Names follow Prometheus' conventions: the expert_arena_ prefix, base units (bytes), a gauge
// per fact; an arena's labels are path, backing and state (the words of `ls --json`), a
// segment's path, stream and kind. Takes no lock and changes nothing. Reading an arena's page
// tables maps it read-only (as `info` does): a walk of one entry per page, short on 2 MiB
// pages, longer on 4 KiB ones.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "arena/arena_file.h"
#include "common/units.h"
#include "expert_arena/metrics.h"
#include "expert_arena/stream.h"
#include "metrics/exposition.h"
#include "platform/directory.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"

namespace expert_arena {
namespace {

using metrics::Exposition;
using metrics::Labels;

void DeclareFamilies(Exposition& e) {
  e.Declare("expert_arena_directory_up", "gauge",
            "1 when the directory could be listed, 0 when not (missing or unreadable).");
  e.Declare("expert_arena_filesystem_size_bytes", "gauge",
            "Size of the filesystem holding the directory (statfs).");
  e.Declare("expert_arena_filesystem_avail_bytes", "gauge",
            "Bytes of the filesystem holding the directory that are still free (statfs).");
  e.Declare("expert_arena_arena_bytes", "gauge", "Size of the arena file.");
  e.Declare("expert_arena_arena_huge_page_bytes", "gauge",
            "Bytes of a published arena on huge pages of page_size (2MiB: tmpfs or hugetlbfs, "
            "1GiB: hugetlbfs), read from the page tables.");
  e.Declare("expert_arena_arena_page_size_bytes", "gauge",
            "The page size most of a published arena's bytes really got, from the page tables: "
            "2097152 or 1073741824 on huge pages, 4096 where it fell back to small pages "
            "(fragmented memory at load, a tmpfs without huge pages).");
  e.Declare("expert_arena_arena_small_page_bytes", "gauge",
            "Bytes of a published arena on small (4 KiB) pages, read from the page tables.");
  e.Declare("expert_arena_arena_node_bytes", "gauge",
            "Bytes of a published arena on each NUMA node, from numa_maps (hosts with several "
            "nodes only; docs/numa.md).");
  e.Declare("expert_arena_arena_in_use", "gauge",
            "1 when a process maps the arena (holds its USER lock), else 0.");
  e.Declare("expert_arena_arena_loading", "gauge",
            "1 when an engine is loading the arena now (holds its FILL lock), else 0.");
  e.Declare("expert_arena_arena_users", "gauge",
            "Open arena handles (engines, holders, serve) holding the USER lock, from "
            "/proc/locks.");
  e.Declare("expert_arena_arena_info", "gauge",
            "The model an arena holds (identity and its hash) and its format version; always 1.");
  e.Declare("expert_arena_segment_bytes", "gauge", "Size of the stream segment file.");
  e.Declare("expert_arena_segment_data_bytes", "gauge", "Bytes of the segment's data region.");
  e.Declare("expert_arena_segment_free_bytes", "gauge",
            "Data bytes of the segment that no live block holds.");
  e.Declare("expert_arena_segment_largest_free_block_bytes", "gauge",
            "The longest run of free data bytes between live blocks (the largest tensor that "
            "still fits).");
  e.Declare("expert_arena_segment_live_blocks", "gauge",
            "Blocks of the segment being written, published or aborted but still read.");
  e.Declare("expert_arena_segment_readers", "gauge", "Consumer processes mapping the segment.");
  e.Declare("expert_arena_segment_owner_alive", "gauge",
            "1 when the producer that owns the segment holds its lock, 0 when it is gone.");
  e.Declare("expert_arena_reclaimable_bytes", "gauge",
            "Bytes of the directory that `expert-arena sweep` (unfinished arenas of a dead "
            "loader, segments of a dead owner) or `expert-arena rm` (published arenas no process "
            "maps, damaged ones, records of failed builds) would free, run as the files' owner.");
  e.Declare("expert_arena_unreadable_files", "gauge",
            "Files with the arena or segment magic that could not be read (permission, damage).");
}

// "2MiB", "1GiB": the page_size label.
std::string PageSizeLabel(uint64_t bytes) {
  if (bytes >= kGiB && bytes % kGiB == 0) return std::to_string(bytes / kGiB) + "GiB";
  return std::to_string(bytes / kMiB) + "MiB";
}

struct DirectoryTotals {
  uint64_t sweep_bytes = 0, rm_bytes = 0, unreadable = 0;
};

void AddArena(Exposition& e, const std::string& path,
              const Result<platform::FilesystemInfo>& fs, DirectoryTotals& totals) {
  auto info = arena::InspectArenaFile(path, /*scan_pages=*/true);
  if (!info.ok()) {
    ++totals.unreadable;
    return;
  }
  const auto& a = *info;
  const Labels labels = {{"path", path}, {"backing", a.backing}, {"state", a.state}};
  e.Add("expert_arena_arena_bytes", labels, a.file_bytes);
  if (a.state == "published") {
    // hugetlbfs: every page is one of the mount's size; tmpfs: 2 MiB pages where the page
    // tables say so, the rest 4 KiB.
    const bool hugetlbfs = fs.ok() && fs->kind == platform::FsKind::kHugetlbfs;
    const uint64_t page = hugetlbfs ? std::max(fs->block_bytes, kHugePageBytes) : kHugePageBytes;
    const uint64_t on_huge = hugetlbfs ? a.mapped_bytes : a.huge_bytes;
    for (uint64_t size : {kHugePageBytes, kGiB}) {
      Labels l = labels;
      l.emplace_back("page_size", PageSizeLabel(size));
      e.Add("expert_arena_arena_huge_page_bytes", l, size == page ? on_huge : 0);
    }
    if (page != kHugePageBytes && page != kGiB) {
      Labels l = labels;
      l.emplace_back("page_size", PageSizeLabel(page));
      e.Add("expert_arena_arena_huge_page_bytes", l, on_huge);
    }
    // Most of the bytes decide: an arena whose collapse left a few small pages is still on
    // huge pages; one that fell back to small pages (a warning at load) says 4096 here.
    e.Add("expert_arena_arena_page_size_bytes", labels,
          2 * on_huge >= a.mapped_bytes && a.mapped_bytes > 0 ? page : platform::BasePageSize());
    e.Add("expert_arena_arena_small_page_bytes", labels,
          a.mapped_bytes - std::min(on_huge, a.mapped_bytes));
    for (const NumaNodeBytes& n : a.numa_nodes) {
      Labels l = labels;
      l.emplace_back("node", std::to_string(n.node));
      e.Add("expert_arena_arena_node_bytes", l, n.bytes);
    }
  }
  e.Add("expert_arena_arena_in_use", labels, a.in_use ? 1 : 0);
  e.Add("expert_arena_arena_loading", labels, a.loading_now ? 1 : 0);
  if (a.users >= 0) e.Add("expert_arena_arena_users", labels, static_cast<uint64_t>(a.users));
  if (a.summary.our_magic) {
    char hash[32];
    std::snprintf(hash, sizeof hash, "%016llx",
                  static_cast<unsigned long long>(a.summary.identity_hash));
    Labels l = labels;
    l.emplace_back("identity", a.summary.identity_text);
    l.emplace_back("identity_hash", hash);
    l.emplace_back("format_version", std::to_string(a.summary.version));
    e.Add("expert_arena_arena_info", l, 1);
  }
  const bool busy = a.in_use || a.loading_now;
  if (a.state == "loading (loader gone)" && !busy) totals.sweep_bytes += a.file_bytes;
  // A failed build's record is kept by sweep (it stops a crash loop); rm frees it.
  const bool failed_build = a.state == "build failed" || a.state == "built, never confirmed";
  if ((a.state == "published" || a.state == "damaged" || failed_build) && !busy) {
    totals.rm_bytes += a.file_bytes;
  }
}

void AddSegment(Exposition& e, const std::string& path, DirectoryTotals& totals) {
  auto info = InspectSegment(path);
  if (!info.ok() || !info->ours) {
    ++totals.unreadable;
    return;
  }
  const auto& g = *info;
  const Labels labels = {{"path", path},
                         {"stream", g.logical_name},
                         {"kind", g.spill       ? "spill"
                                  : g.dedicated ? "dedicated"
                                                : "regular"}};
  e.Add("expert_arena_segment_bytes", labels, g.file_bytes);
  e.Add("expert_arena_segment_data_bytes", labels, g.data_bytes);
  e.Add("expert_arena_segment_free_bytes", labels, g.free_bytes);
  e.Add("expert_arena_segment_largest_free_block_bytes", labels, g.largest_free_bytes);
  e.Add("expert_arena_segment_live_blocks", labels, g.live_blocks);
  e.Add("expert_arena_segment_readers", labels, g.readers);
  e.Add("expert_arena_segment_owner_alive", labels, g.owner_alive ? 1 : 0);
  if (!g.owner_alive) totals.sweep_bytes += g.file_bytes;
}

// Adds one directory; one that cannot be listed is expert_arena_directory_up 0, and the reason
// goes to `problems`.
void AddDirectory(Exposition& e, const std::string& dir, std::vector<std::string>* problems) {
  auto names = platform::ListDirectory(dir);
  e.Add("expert_arena_directory_up", {{"directory", dir}}, names.ok() ? 1 : 0);
  if (!names.ok()) {
    if (problems != nullptr) problems->push_back(names.status().message());
    return;
  }
  auto fs = platform::StatFilesystem(dir);
  if (fs.ok()) {
    const Labels labels = {{"directory", dir}, {"backing", platform::FsKindName(fs->kind)}};
    e.Add("expert_arena_filesystem_size_bytes", labels, fs->total_bytes);
    e.Add("expert_arena_filesystem_avail_bytes", labels, fs->available_bytes);
  }
  std::sort(names->begin(), names->end());
  DirectoryTotals totals;
  for (const auto& name : *names) {
    const std::string path = dir + "/" + name;
    auto st = platform::StatPath(path);
    if (!st.ok() || !st->regular) continue;
    if (IsStreamSegment(path)) {
      AddSegment(e, path, totals);
    } else if (arena::HasArenaMagic(path, st->size)) {
      AddArena(e, path, fs, totals);
    }
  }
  e.Add("expert_arena_reclaimable_bytes", {{"directory", dir}, {"command", "sweep"}},
        totals.sweep_bytes);
  e.Add("expert_arena_reclaimable_bytes", {{"directory", dir}, {"command", "rm"}},
        totals.rm_bytes);
  e.Add("expert_arena_unreadable_files", {{"directory", dir}}, totals.unreadable);
}

}  // namespace

std::string PrometheusText(const std::vector<std::string>& directories,
                           std::vector<std::string>* problems) {
  Exposition e;
  DeclareFamilies(e);
  for (const auto& dir : directories) AddDirectory(e, dir, problems);
  return e.Text();
}

}  // namespace expert_arena
