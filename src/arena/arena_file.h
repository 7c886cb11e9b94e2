// Operations on an arena file by path, for tools: inspect, verify, remove. They take the same
// locks as engines, so `rm` never unlinks a file an engine maps or loads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "format/arena_format.h"
#include "format/arena_table.h"
#include "platform/file_locks.h"

namespace expert_arena::arena {

struct ArenaFileInfo {
  std::string path;
  uint64_t file_bytes = 0;
  uint32_t owner_uid = 0;
  uint32_t mode = 0;
  std::string state;         // "published", "loading", "empty", "not an arena", "damaged"
  std::string problem;       // why it is damaged, when it is
  bool in_use = false;       // an engine holds USER
  bool loading_now = false;  // an engine holds FILL
  std::string backing;       // tmpfs, hugetlbfs, other
  uint64_t page_bytes = 0;   // its huge page size: 2 MiB, 1 GiB (hugetlbfs pagesize=1G); 0: other
  uint64_t huge_bytes = 0;   // of a read-only mapping of the file, from the page tables
  uint64_t mapped_bytes = 0;
  // With scan_pages, on a host with several NUMA nodes: the file's policy and its bytes on each
  // node, from numa_maps (docs/numa.md); empty otherwise.
  std::string numa_policy;
  std::vector<NumaNodeBytes> numa_nodes;
  // Granted locks on USER in /proc/locks: one per open arena handle (an engine, a holder,
  // `serve`); -1 when /proc/locks cannot be read.
  int64_t users = -1;
  // With name_holders: the processes holding USER or FILL, as far as /proc shows them, and how
  // many processes could not be looked at (another user's, without privilege).
  std::vector<platform::LockHolder> holders;
  uint64_t holders_unreadable = 0;
  format::HeaderSummary summary;
  format::ArenaTable table;  // when published and valid
};

// Reads the header (and, when published, the table) without taking any lock. With
// `scan_pages` it also maps the file and reads from the page tables how much of it is on
// 2 MiB pages (huge_bytes, mapped_bytes); a listing of many large arenas leaves that out.
// With `name_holders` it also scans /proc for the processes that hold its locks (holders).
// Whether the file at `path` (of `size` bytes) begins with an arena header's magic.
bool HasArenaMagic(const std::string& path, uint64_t size);

Result<ArenaFileInfo> InspectArenaFile(const std::string& path, bool scan_pages = true,
                                       bool name_holders = false);

// "pid 12 (moe-engine --model ...) and pid 13 (expert-arena serve ...)", from `holders`; with
// `users` locks but nobody named, says how many and why they are not named.
std::string DescribeHolders(const std::vector<platform::LockHolder>& holders, int64_t users,
                            uint64_t unreadable);

// Recomputes every tensor's checksum. Returns the index of the first bad tensor, or -1.
// Holds USER shared while it reads, like an engine.
Result<int64_t> VerifyArenaFile(const std::string& path, format::ArenaTable* table);

// Unlinks the file when no engine maps or loads it; kBusy with a message naming the processes
// that do (pid and command, where /proc shows them) otherwise.
Status RemoveArenaFile(const std::string& path);

// What SweepArenaFiles found in a directory, one line per arena file for the operator.
struct ArenaSweepReport {
  std::vector<std::string> removed;  // unfinished arenas whose loader is gone, unlinked
  uint64_t removed_bytes = 0;
  std::vector<std::string> kept;   // published arenas (a restart attaches), and arenas
                                   // being loaded or mapped right now
  std::vector<std::string> notes;  // one line per arena file: what it is, what was done
};

// The arena files (files with the arena magic) of this user in `directory`: removes the ones a
// loader left unpublished when it died (no engine loads or maps them; the next engine would
// replace them anyway, and until then they hold their whole size of RAM); lists the others.
// A published arena is never removed here, in use or not (`expert-arena rm` does that).
// Files of other users and files that are not arenas are not touched.
Result<ArenaSweepReport> SweepArenaFiles(const std::string& directory);

}  // namespace expert_arena::arena
