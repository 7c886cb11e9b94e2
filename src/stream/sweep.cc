// Sweeping dead owners' segments, and inspecting one segment for tools.
//
// Liveness is the owner's OFD lock on byte 0 of each of its segment files: the kernel drops it
// when the owner exits or is killed, and a new process that reuses the pid does not hold it.
// So a sweep that can take the lock knows the owner is gone; the pid and start time in the
// header are only for messages. A producer creating a segment takes the lock right after the
// O_EXCL create and checks afterwards that its path still names its file, so a sweep that
// wins that race costs the producer a retry under a new name, never a lost segment.
#include <algorithm>
#include <cstring>
#include <utility>

#include "expert_arena/stream.h"
#include "platform/directory.h"
#include "platform/file.h"
#include "platform/ofd_lock.h"
#include "platform/pid_namespace.h"
#include "stream/segment_format.h"

namespace expert_arena {

using stream::BlockSlot;
using stream::BlockState;
using stream::ControlWord;
using stream::SegmentHeader;

namespace {

std::string OwnerText(const SegmentHeader& h) {
  // A segment of a producer in another container: its pid is not one of ours.
  return platform::DescribePid(h.owner_pid, h.owner_pid_namespace) + " (started at tick " +
         std::to_string(h.owner_start_time) + ")";
}

Result<SegmentHeader> ReadHeader(const platform::UniqueFd& fd, uint64_t file_bytes,
                                 std::string* problem) {
  SegmentHeader h{};
  if (file_bytes < sizeof h) {
    *problem = "shorter than a segment header";
    return h;
  }
  EA_RETURN_IF_ERROR(platform::ReadFull(fd, 0, std::as_writable_bytes(std::span(&h, 1))));
  *problem = stream::ValidateHeader(h, file_bytes);
  return h;
}

}  // namespace

bool IsStreamSegment(const std::string& path) {
  auto fd = platform::OpenFile(path, {.no_follow = true});
  if (!fd.ok()) return false;
  char magic[8] = {};
  auto got = platform::ReadSome(*fd, 0, std::as_writable_bytes(std::span(magic)));
  return got.ok() && *got == sizeof magic &&
         std::memcmp(magic, stream::kSegmentMagic, sizeof magic) == 0;
}

Result<SegmentInfo> InspectSegment(const std::string& path) {
  EA_ASSIGN_OR_RETURN(auto fd, platform::OpenFile(path, {.no_follow = true}));
  EA_ASSIGN_OR_RETURN(auto st, platform::StatFd(fd));
  if (!st.regular) return InvalidArgument(path + ": not a regular file");
  SegmentInfo info;
  info.path = path;
  info.file_bytes = st.size;
  info.owner_uid = st.owner_uid;
  std::string problem;
  EA_ASSIGN_OR_RETURN(SegmentHeader h, ReadHeader(fd, st.size, &problem));
  if (!problem.empty()) {
    info.problem = problem;
    return info;
  }
  info.ours = true;
  info.owner_pid = h.owner_pid;
  info.owner_start_time = h.owner_start_time;
  info.owner_pid_namespace = h.owner_pid_namespace;
  info.owner_pid_local = platform::PidIsLocal(h.owner_pid_namespace);
  info.owner_text = platform::DescribePid(h.owner_pid, h.owner_pid_namespace);
  info.dedicated = h.kind == static_cast<uint32_t>(stream::SegmentKind::kDedicated);
  info.spill = h.kind == static_cast<uint32_t>(stream::SegmentKind::kSpill);
  info.logical_name.assign(h.logical_name, strnlen(h.logical_name, sizeof h.logical_name));
  info.data_bytes = h.data_bytes;
  info.slots = h.slot_count;
  EA_ASSIGN_OR_RETURN(info.owner_alive, platform::ByteIsLocked(fd, stream::kOwnerLockByte,
                                                               platform::LockMode::kExclusive));
  std::vector<stream::ReaderEntry> readers(stream::kMaxReaders);
  EA_RETURN_IF_ERROR(
      platform::ReadFull(fd, h.readers_offset, std::as_writable_bytes(std::span(readers))));
  for (const auto& r : readers) info.readers += r.owner != 0 ? 1 : 0;
  std::vector<BlockSlot> slots(h.slot_count);
  EA_RETURN_IF_ERROR(
      platform::ReadFull(fd, h.slots_offset, std::as_writable_bytes(std::span(slots))));
  std::vector<std::pair<uint64_t, uint64_t>> used;  // [begin, end) in the file
  for (const auto& s : slots) {
    BlockState state = ControlWord::State(s.control);
    if (state == BlockState::kFree) continue;
    ++info.live_blocks;
    info.live_bytes += s.length;
    if (state == BlockState::kPublished) ++info.published_blocks;
    if (state == BlockState::kAborted) ++info.aborted_blocks;
    const uint64_t begin = std::min(s.offset, h.file_bytes);
    used.emplace_back(begin, begin + std::min(s.length, h.file_bytes - begin));
  }
  // The gaps between live blocks. A slot is written by another process: offsets and lengths
  // outside the data region are clipped to it, never trusted to be ordered or disjoint.
  const uint64_t data_begin = h.data_offset, data_end = h.data_offset + h.data_bytes;
  std::sort(used.begin(), used.end());
  uint64_t cursor = data_begin, covered = 0;
  for (const auto& [begin, end] : used) {
    const uint64_t b = std::clamp(begin, data_begin, data_end);
    const uint64_t e = std::clamp(end, data_begin, data_end);
    if (b > cursor) info.largest_free_bytes = std::max(info.largest_free_bytes, b - cursor);
    if (e > cursor) {
      covered += e - std::max(b, cursor);
      cursor = e;
    }
  }
  info.largest_free_bytes = std::max(info.largest_free_bytes, data_end - cursor);
  info.free_bytes = h.data_bytes - covered;
  return info;
}

Result<SweepReport> SweepStreamDirectory(const std::string& directory) {
  EA_ASSIGN_OR_RETURN(auto names, platform::ListDirectory(directory));
  SweepReport report;
  const uint32_t me = platform::EffectiveUid();
  for (const auto& name : names) {
    if (!stream::IsValidSegmentName(name)) continue;
    std::string path = directory + "/" + name;
    auto st = platform::StatPath(path);
    if (!st.ok()) continue;  // removed meanwhile
    if (!st->regular) {
      report.notes.push_back(path + ": not a regular file; left alone");
      continue;
    }
    if (st->owner_uid != me) {
      report.notes.push_back(path + ": belongs to uid " + std::to_string(st->owner_uid) +
                             "; left alone");
      continue;
    }
    auto fd = platform::OpenFile(path, {.write = true, .no_follow = true});
    if (!fd.ok()) {
      report.notes.push_back(path + ": " + fd.status().message() + "; left alone");
      continue;
    }
    auto taken = platform::TryLockByte(*fd, stream::kOwnerLockByte, platform::LockMode::kExclusive);
    if (!taken.ok()) {
      report.notes.push_back(path + ": " + taken.status().message() + "; left alone");
      continue;
    }
    if (!*taken) {
      report.live.push_back(path);
      continue;
    }
    auto now = platform::StatFd(*fd);
    auto again = platform::StatPath(path);
    if (!now.ok() || !again.ok() || now->inode != again->inode || now->device != again->device) {
      continue;  // replaced or removed while we looked
    }
    std::string problem;
    auto h = ReadHeader(*fd, now->size, &problem);
    Status removed = platform::UnlinkPath(path);
    if (!removed.ok()) {
      report.notes.push_back(removed.message());
      continue;
    }
    report.removed.push_back(path);
    if (h.ok() && problem.empty()) {
      report.notes.push_back(path + ": owner " + OwnerText(*h) + " is gone; removed");
    } else {
      report.notes.push_back(path + ": no owner holds it (" +
                             (problem.empty() ? std::string("unreadable header") : problem) +
                             "); removed");
    }
  }
  return report;
}

}  // namespace expert_arena
