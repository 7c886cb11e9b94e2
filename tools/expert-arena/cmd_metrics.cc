// expert-arena metrics [DIR ...] [--textfile PATH]: what `ls` sees, in Prometheus' text
// exposition format (version 0.0.4), for node_exporter's textfile collector (the convention for
// host-level state that no daemon serves) or any scraper that runs a command.
//
// Names follow Prometheus' conventions: the expert_arena_ prefix, base units (bytes), a gauge
// per fact; an arena's labels are path, backing and state (the words of `ls --json`), a
// segment's path, stream and kind. Takes no lock and changes nothing. Reading an arena's page
// tables maps it read-only (as `info` does): a walk of one entry per page, short on 2 MiB
// pages, longer on 4 KiB ones.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "arena/arena_file.h"
#include "commands.h"
#include "common/escape.h"
#include "common/units.h"
#include "expert_arena/stream.h"
#include "platform/directory.h"
#include "platform/file.h"
#include "platform/system_info.h"

namespace expert_arena::cli {
namespace {

using Labels = std::vector<std::pair<std::string, std::string>>;

// The families of one exposition, each written as one group (the format requires a family's
// samples to be consecutive), in the order they were first declared.
class Exposition {
 public:
  void Declare(const std::string& name, const std::string& type, const std::string& help) {
    if (index_.count(name) != 0) return;
    index_[name] = families_.size();
    families_.push_back({name, type, help, {}});
  }

  void Add(const std::string& name, const Labels& labels, uint64_t value) {
    std::string line = name;
    if (!labels.empty()) {
      line += '{';
      for (size_t i = 0; i < labels.size(); ++i) {
        if (i > 0) line += ',';
        line += labels[i].first + "=\"" + LabelValue(labels[i].second) + '"';
      }
      line += '}';
    }
    families_[index_.at(name)].samples.push_back(line + ' ' + std::to_string(value));
  }

  std::string Text() const {
    std::string out;
    for (const auto& f : families_) {
      if (f.samples.empty()) continue;
      out += "# HELP " + f.name + ' ' + f.help + '\n';
      out += "# TYPE " + f.name + ' ' + f.type + '\n';
      for (const auto& s : f.samples) out += s + '\n';
    }
    return out;
  }

 private:
  struct Family {
    std::string name, type, help;
    std::vector<std::string> samples;
  };

  // A label value must be UTF-8 with \, " and newline escaped. A path or a stream name may be
  // any bytes: anything but printable ASCII is written as `ls` writes it (\xNN), so the value
  // is always valid and names the same file as `ls` does.
  static std::string LabelValue(const std::string& raw) {
    bool plain = true;
    for (unsigned char c : raw) plain = plain && c >= 0x20 && c < 0x7f;
    const std::string text = plain ? raw : EscapeForMessage(raw);
    std::string out;
    for (char c : text) {
      if (c == '\\' || c == '"') out += '\\';
      out += c;
    }
    return out;
  }

  std::vector<Family> families_;
  std::map<std::string, size_t> index_;
};

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
            "maps, damaged ones) would free, run as the files' owner.");
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
  if ((a.state == "published" || a.state == "damaged") && !busy) totals.rm_bytes += a.file_bytes;
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

// Adds one directory; false (with a line on stderr) when it cannot be listed.
bool AddDirectory(Exposition& e, const std::string& dir) {
  auto names = platform::ListDirectory(dir);
  e.Add("expert_arena_directory_up", {{"directory", dir}}, names.ok() ? 1 : 0);
  if (!names.ok()) {
    std::fprintf(stderr, "expert-arena metrics: %s (reported as expert_arena_directory_up 0)\n",
                 names.status().message().c_str());
    return false;
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
    } else if (HasArenaMagic(path, st->size)) {
      AddArena(e, path, fs, totals);
    }
  }
  e.Add("expert_arena_reclaimable_bytes", {{"directory", dir}, {"command", "sweep"}},
        totals.sweep_bytes);
  e.Add("expert_arena_reclaimable_bytes", {{"directory", dir}, {"command", "rm"}},
        totals.rm_bytes);
  e.Add("expert_arena_unreadable_files", {{"directory", dir}}, totals.unreadable);
  return true;
}

int RunMetrics(const std::vector<std::string>& dirs, const std::string& textfile) {
  Exposition e;
  DeclareFamilies(e);
  for (const auto& dir : dirs) AddDirectory(e, dir);
  const std::string text = e.Text();
  if (textfile.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return std::fflush(stdout) == 0 ? 0 : 1;
  }
  // node_exporter reads the directory while we write: it must see the old file or the new one.
  Status written = platform::ReplaceFileAtomically(textfile, text, 0644);
  if (!written.ok()) {
    std::fprintf(stderr, "expert-arena metrics: %s\n", written.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

void RegisterMetrics(CLI::App& app, int& exit_code) {
  auto dirs = std::make_shared<std::vector<std::string>>();
  auto textfile = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "metrics", "Prometheus text exposition of the arenas and stream segments in directories");
  cmd->add_option("dir", *dirs, "Shared directories (default /dev/shm)");
  cmd->add_option("--textfile", *textfile,
                  "Write to this file atomically instead of stdout (node_exporter's textfile "
                  "collector: a .prom file in its --collector.textfile.directory)");
  cmd->callback([dirs, textfile, &exit_code] {
    std::vector<std::string> list = *dirs;
    if (list.empty()) list.push_back("/dev/shm");
    exit_code = RunMetrics(list, *textfile);
  });
}

}  // namespace expert_arena::cli
