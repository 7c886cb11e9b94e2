#include "arena/arena_file.h"

#include <filesystem>
#include <vector>

#include "arena/arena_locks.h"
#include "arena/numa_placement.h"
#include "arena/shared_protocol.h"
#include "common/fault_points.h"
#include "common/units.h"
#include "load/loader.h"
#include "platform/directory.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/ofd_lock.h"
#include "platform/system_info.h"

namespace expert_arena::arena {
namespace {

Result<platform::UniqueFd> OpenExisting(const std::string& path, bool write) {
  platform::OpenOptions options;
  options.write = write;
  return platform::OpenFile(path, options);
}

// Locks on `byte` of the file, from /proc/locks; -1 when it cannot be read.
int64_t CountUsers(const platform::FileStat& st, uint64_t byte) {
  auto locks = platform::ReadFileLocks();
  if (!locks.ok()) return -1;
  return static_cast<int64_t>(platform::CountLocksOnByte(*locks, st.device, st.inode, byte));
}

// The processes holding `byte` of the file, merged into `info`.
void AddHolders(const platform::FileStat& st, uint64_t byte, ArenaFileInfo* info) {
  auto scan = platform::FindLockHolders(st.device, st.inode, byte);
  if (!scan.ok()) return;
  info->holders_unreadable = std::max(info->holders_unreadable, scan->unreadable_processes);
  for (auto& h : scan->holders) {
    bool known = false;
    for (const auto& seen : info->holders) known = known || seen.pid == h.pid;
    if (!known) info->holders.push_back(std::move(h));
  }
}

}  // namespace

std::string DescribeHolders(const std::vector<platform::LockHolder>& holders, int64_t users,
                            uint64_t unreadable) {
  std::string out;
  for (size_t i = 0; i < holders.size(); ++i) {
    if (i > 0) out += i + 1 == holders.size() ? " and " : ", ";
    out += platform::DescribeLockHolder(holders[i]);
  }
  // A process may hold several handles (and a forked child shares its parent's), so `users`
  // locks need not be `users` processes: the count is given only when nobody could be named.
  if (holders.empty() && users > 0) {
    out = std::to_string(users) + " process" + (users == 1 ? "" : "es") +
          " that /proc does not show to this user (" +
          (unreadable > 0 ? "another user's: run as root to name them; or " : "") +
          "of another PID namespace: a container)";
  }
  if (out.empty()) out = "a process this user cannot see";
  return out;
}

Result<ArenaFileInfo> InspectArenaFile(const std::string& path, bool scan_pages,
                                       bool name_holders) {
  // Read-only: `info` and `ls` work for a user of the file's group too (F_OFD_GETLK asks
  // about a write lock on a descriptor opened for reading as well).
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, OpenExisting(path, false));
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  ArenaFileInfo info;
  info.path = path;
  info.file_bytes = st.size;
  info.owner_uid = st.owner_uid;
  info.mode = st.mode & 07777;
  auto fs = platform::StatFilesystem(DirectoryOf(path));
  info.backing = fs.ok() ? platform::FsKindName(fs->kind) : "unknown";
  if (fs.ok() && fs->kind == platform::FsKind::kHugetlbfs) {
    info.page_bytes = std::max<uint64_t>(fs->block_bytes, kHugePageBytes);
  } else if (fs.ok() && fs->kind == platform::FsKind::kTmpfs) {
    info.page_bytes = kHugePageBytes;
  }
  EA_ASSIGN_OR_RETURN(info.in_use,
                      platform::ByteIsLocked(fd, kUserByte, platform::LockMode::kExclusive));
  EA_ASSIGN_OR_RETURN(info.loading_now,
                      platform::ByteIsLocked(fd, kFillByte, platform::LockMode::kExclusive));
  info.users = CountUsers(st, kUserByte);
  if (name_holders && (info.in_use || info.loading_now)) {
    AddHolders(st, kUserByte, &info);
    AddHolders(st, kFillByte, &info);
  }
  if (st.size == 0) {
    info.state = "empty";
    return info;
  }
  std::vector<std::byte> fixed(std::min<uint64_t>(st.size, sizeof(format::HeaderFixed)));
  EA_RETURN_IF_ERROR(platform::ReadFull(fd, 0, fixed));
  info.summary = format::SummarizeHeader(fixed);
  if (!info.summary.our_magic) {
    info.state = "not an arena";
    return info;
  }
  if (info.summary.state == format::FileState::kBuilt && info.loading_now) {
    info.state = "built, awaiting confirmation";
    return info;
  }
  if (info.summary.state == format::FileState::kBuilt ||
      info.summary.state == format::FileState::kFailed) {
    // Its engine is gone or said it failed: engines of its identity rebuild it once, then
    // refuse (docs/arena-protocol.md, "Publish only what runs").
    info.state = info.summary.state == format::FileState::kFailed ? "build failed"
                                                                   : "built, never confirmed";
    info.problem = BuildFailure(info.summary);
    return info;
  }
  if (info.summary.state != format::FileState::kPublished) {
    info.state = info.loading_now ? "loading" : "loading (loader gone)";
    return info;
  }
  uint64_t header_bytes = info.summary.layout.header_bytes;
  if (header_bytes == 0 || header_bytes > st.size || header_bytes > 1024 * kMiB) {
    info.state = "damaged";
    info.problem = "header size " + std::to_string(header_bytes) + " does not fit the " +
                   std::to_string(st.size) + "-byte file";
    return info;
  }
  std::vector<std::byte> region(header_bytes);
  EA_RETURN_IF_ERROR(platform::ReadFull(fd, 0, region));
  Status decoded = format::DecodeHeader(region, st.size, path, &info.table, &info.summary);
  if (!decoded.ok()) {
    info.state = "damaged";
    info.problem = decoded.message();
    return info;
  }
  info.state = "published";
  if (!scan_pages) return info;
  // Page backing: map read-only, fault in (no copy: the pages exist), count 2 MiB entries.
  uint64_t alignment = fs.ok() && fs->kind == platform::FsKind::kHugetlbfs
                           ? std::max(fs->block_bytes, kHugePageBytes)
                           : kHugePageBytes;
  auto mapping = platform::Mapping::MapFile(fd, st.size, false, alignment);
  if (mapping.ok() &&
      platform::AdviseRange(mapping->data(), mapping->size(), platform::Advice::kPopulateRead, path)
          .ok()) {
    auto huge = platform::HugeBytesInRange(mapping->data(), mapping->size());
    if (huge.ok()) info.huge_bytes = *huge;
    info.mapped_bytes = mapping->size();
    ArenaReport numa;
    MeasureNuma(mapping->data(), numa);
    info.numa_policy = numa.numa_policy;
    info.numa_nodes = numa.numa_nodes;
  }
  return info;
}

Result<int64_t> VerifyArenaFile(const std::string& path, format::ArenaTable* table) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, OpenExisting(path, false));
  EA_ASSIGN_OR_RETURN(bool user, platform::TryLockByte(fd, kUserByte, platform::LockMode::kShared));
  if (!user) return Busy(path + ": an engine is loading or replacing it; try again later");
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  auto fs = platform::StatFilesystem(DirectoryOf(path));
  uint64_t alignment = fs.ok() && fs->kind == platform::FsKind::kHugetlbfs
                           ? std::max(fs->block_bytes, kHugePageBytes)
                           : kHugePageBytes;
  if (st.size == 0) return Corrupt(path + ": empty file");
  EA_ASSIGN_OR_RETURN(platform::Mapping mapping,
                      platform::Mapping::MapFile(fd, st.size, false, alignment));
  auto summary = format::SummarizeHeader(
      mapping.bytes().first(std::min<uint64_t>(st.size, sizeof(format::HeaderFixed))));
  if (summary.our_magic && summary.state != format::FileState::kPublished) {
    return Corrupt(path + ": not published (a load did not finish)");
  }
  uint64_t header_bytes = summary.layout.header_bytes;
  if (header_bytes == 0 || header_bytes > st.size) {
    header_bytes = std::min<uint64_t>(st.size, format::kHeaderPageBytes);
  }
  EA_RETURN_IF_ERROR(
      format::DecodeHeader(mapping.bytes().first(header_bytes), st.size, path, table, nullptr));
  return load::FirstBadChecksum(mapping.bytes().subspan(header_bytes, table->data_bytes), *table);
}

namespace {

// Opens the file `path` names and takes FILL and USER exclusively, as an engine replacing it
// would: kBusy when an engine loads or maps it. While both are held no engine can replace
// the file, so the path is checked to still name it once they are taken.
Result<platform::UniqueFd> LockForRemoval(const std::string& path) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, OpenExisting(path, true));
  EA_ASSIGN_OR_RETURN(platform::FileStat st, platform::StatFd(fd));
  fault_points::AfterRemoveOpened();
  EA_ASSIGN_OR_RETURN(bool fill,
                      platform::TryLockByte(fd, kFillByte, platform::LockMode::kExclusive));
  if (!fill) return Busy(path + ": an engine is loading it; not removed");
  EA_ASSIGN_OR_RETURN(bool user,
                      platform::TryLockByte(fd, kUserByte, platform::LockMode::kExclusive));
  if (!user) {
    ArenaFileInfo who;
    who.users = CountUsers(st, kUserByte);
    AddHolders(st, kUserByte, &who);
    return Busy(path + ": in use by " + DescribeHolders(who.holders, who.users,
                                                       who.holders_unreadable) +
                "; not removed (stop them, then run rm again)");
  }
  // The locks are on the file we opened; unlinking the path is only right while it still names
  // that file, not one an engine created in its place meanwhile (and is loading or using).
  if (!PathNamesFile(path, st)) {
    return Busy(path + ": replaced by an engine while rm looked at it; not removed (run rm again)");
  }
  return fd;
}

Result<format::HeaderSummary> ReadSummary(const platform::UniqueFd& fd, uint64_t file_bytes) {
  std::vector<std::byte> fixed(std::min<uint64_t>(file_bytes, sizeof(format::HeaderFixed)));
  EA_RETURN_IF_ERROR(platform::ReadFull(fd, 0, fixed));
  return format::SummarizeHeader(fixed);
}

}  // namespace

Status RemoveArenaFile(const std::string& path) {
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, LockForRemoval(path));
  return platform::UnlinkPath(path);
}

Result<ArenaSweepReport> SweepArenaFiles(const std::string& directory) {
  EA_ASSIGN_OR_RETURN(std::vector<std::string> names, platform::ListDirectory(directory));
  ArenaSweepReport report;
  const uint32_t me = platform::EffectiveUid();
  for (const auto& name : names) {
    const std::string path = directory + "/" + name;
    auto st = platform::StatPath(path);
    if (!st.ok() || !st->regular || st->owner_uid != me) continue;
    if (st->size < sizeof(format::HeaderFixed)) continue;  // no header: not ours to judge
    auto fd = platform::OpenFile(path, {.no_follow = true});
    if (!fd.ok()) continue;
    auto summary = ReadSummary(*fd, st->size);
    if (!summary.ok() || !summary->our_magic) continue;
    const std::string size = FormatBytes(st->size);
    if (summary->state == format::FileState::kBuilt ||
        summary->state == format::FileState::kFailed) {
      // The record of a failed build is what stops engines of its identity from building and
      // failing in a loop: the operator removes it (rm) once the cause is fixed.
      report.kept.push_back(path);
      auto building = platform::ByteIsLocked(*fd, kFillByte, platform::LockMode::kExclusive);
      if (building.ok() && *building && summary->state == format::FileState::kBuilt) {
        report.notes.push_back(path + ": built, its engine running its first forwards on it " +
                               "before publishing it; left alone");
        continue;
      }
      report.notes.push_back(path + ": a build that never ran (" + BuildFailure(*summary) +
                             "), " + size + "; kept so that engines of its identity rebuild "
                             "it once, then refuse (`expert-arena rm " + path +
                             "` frees it)");
      continue;
    }
    if (summary->state == format::FileState::kPublished) {
      auto in_use = platform::ByteIsLocked(*fd, kUserByte, platform::LockMode::kExclusive);
      report.kept.push_back(path);
      report.notes.push_back(path + ": published arena, " + size +
                             (in_use.ok() && *in_use ? ", in use; left alone"
                                                     : ", not in use; kept for the next engine "
                                                       "(`expert-arena rm " +
                                                           path + "` frees it)"));
      continue;
    }
    // Unpublished: a loader is at work (FILL held) or died. Decide under the locks, reading
    // the state again there: a load may have been published since the read above.
    auto locked = LockForRemoval(path);
    if (!locked.ok()) {
      report.kept.push_back(path);
      report.notes.push_back(locked.status().message());
      continue;
    }
    auto again = platform::StatFd(*locked);
    auto now = again.ok() ? ReadSummary(*locked, again->size) : again.status();
    if (!now.ok() || now->state == format::FileState::kPublished) {
      report.kept.push_back(path);
      report.notes.push_back(path + ": published while the sweep looked at it; left alone");
      continue;
    }
    Status removed = platform::UnlinkPath(path);
    if (!removed.ok()) {
      report.notes.push_back(removed.message());
      continue;
    }
    report.removed.push_back(path);
    report.removed_bytes += again->size;
    report.notes.push_back(path + ": arena left unfinished by a loader that is gone, " + size +
                           "; removed");
  }
  return report;
}

bool HasArenaMagic(const std::string& path, uint64_t size) {
  if (size < sizeof(format::HeaderFixed)) return false;
  auto fd = platform::OpenFile(path, {.no_follow = true});
  if (!fd.ok()) return false;
  std::vector<std::byte> fixed(sizeof(format::HeaderFixed));
  if (!platform::ReadFull(*fd, 0, fixed).ok()) return false;
  return format::SummarizeHeader(fixed).our_magic;
}

}  // namespace expert_arena::arena
