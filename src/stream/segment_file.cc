#include "stream/segment_file.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "pages/page_backing.h"
#include "platform/ofd_lock.h"
#include "platform/pid_namespace.h"
#include "platform/system_info.h"

namespace expert_arena::stream {

uint64_t SegmentFileBytes(uint64_t data_bytes) { return kHeaderRegionBytes + data_bytes; }

bool PathStillNames(const SegmentFile& segment) {
  auto st = platform::StatPath(segment.path);
  return st.ok() && st->device == segment.device && st->inode == segment.inode;
}

Result<SegmentFile> CreateSegment(const CreateSegmentParams& p, spdlog::logger& log,
                                  std::string* huge_note) {
  SegmentFile seg;
  seg.name = p.name;
  seg.path = p.directory + "/" + p.name;
  seg.kind = p.kind;
  EA_ASSIGN_OR_RETURN(
      seg.fd,
      platform::OpenFile(
          seg.path,
          {.write = true, .create = true, .exclusive = true, .no_follow = true, .mode = 0600}));
  EA_ASSIGN_OR_RETURN(
      bool locked, platform::TryLockByte(seg.fd, kOwnerLockByte, platform::LockMode::kExclusive));
  if (!locked) {
    // A sweep opened the fresh, still empty file and will unlink it; leave it to the sweep.
    return Busy("create " + seg.path + ": a sweep took the file before its owner lock");
  }
  uint64_t file_bytes = SegmentFileBytes(p.data_bytes);
  auto fail = [&](Status status) {
    (void)platform::UnlinkPath(seg.path);
    return status;
  };
  // 2 MiB pages per the arena's rule (pages/page_backing.h), every byte allocated.
  auto fs = platform::StatFilesystem(p.directory);
  auto source = pages::PageSourceFor(fs.ok() ? fs->kind : platform::FsKind::kTmpfs,
                                     fs.ok() ? fs->tmpfs_huge : "never");
  auto backed = pages::AllocateAndMap(seg.fd, file_bytes, kHugePageBytes, p.huge, source,
                                      fs.ok() ? fs->available_bytes : 0, seg.path,
                                      /*pages_in_background=*/false, p.placement);
  if (!backed.ok()) return fail(backed.status());
  seg.mapping = std::move(backed->mapping);
  seg.numa_note = backed->numa_note;
  if (huge_note != nullptr && p.huge != HugePages::kOff) *huge_note = backed->huge.note;
  if (p.populate) {
    Status s = platform::AdviseRange(seg.mapping.data(), file_bytes,
                                     platform::Advice::kPopulateWrite, seg.path);
    if (!s.ok()) log.debug("{}", s.message());
  }
  auto* h = reinterpret_cast<SegmentHeader*>(seg.mapping.data());
  std::memset(h, 0, sizeof *h);
  std::memcpy(h->magic, kSegmentMagic, sizeof kSegmentMagic);
  h->version = kSegmentVersion;
  h->header_struct_bytes = sizeof(SegmentHeader);
  h->file_bytes = file_bytes;
  h->data_offset = kHeaderRegionBytes;
  h->data_bytes = p.data_bytes;
  h->readers_offset = kReadersOffset;
  h->slots_offset = kSlotsOffset;
  h->reader_entries = kMaxReaders;
  h->reader_entry_bytes = sizeof(ReaderEntry);
  h->slot_count = p.slot_count;
  h->slot_bytes = sizeof(BlockSlot);
  h->kind = static_cast<uint32_t>(p.kind);
  h->owner_pid = static_cast<uint32_t>(platform::CurrentPid());
  auto start = platform::ProcessStartTime(platform::CurrentPid());
  h->owner_start_time = start.ok() ? *start : 0;
  h->owner_pid_namespace = platform::PidNamespaceId();
  h->owner_uid = platform::EffectiveUid();
  h->created_unix_ns =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  std::strncpy(h->logical_name, p.logical_name.c_str(), sizeof h->logical_name - 1);
  // fallocate gave zeroed pages, so every reader entry and block slot starts free.
  seg.view = SegmentView::Of(seg.mapping.data());
  EA_ASSIGN_OR_RETURN(auto st, platform::StatFd(seg.fd));
  seg.device = st.device;
  seg.inode = st.inode;
  if (!PathStillNames(seg)) {
    // A sweep unlinked the empty file between our create and our lock.
    return Busy("create " + seg.path + ": removed by a sweep before it was ready");
  }
  return seg;
}

Result<SegmentFile> OpenSegment(const std::string& directory, const std::string& name,
                                bool allow_foreign_owner) {
  SegmentFile seg;
  seg.name = name;
  seg.path = directory + "/" + name;
  EA_ASSIGN_OR_RETURN(seg.fd, platform::OpenFile(seg.path, {.write = true, .no_follow = true}));
  EA_ASSIGN_OR_RETURN(auto st, platform::StatFd(seg.fd));
  if (!st.regular) return PermissionDenied(seg.path + ": not a regular file");
  if (st.owner_uid != platform::EffectiveUid() && !allow_foreign_owner) {
    return PermissionDenied(seg.path + ": owned by uid " + std::to_string(st.owner_uid) +
                            ", not this user; refused (allow_foreign_owner opts in)");
  }
  if (st.size < kHeaderRegionBytes) {
    return Corrupt(seg.path + ": " + std::to_string(st.size) +
                   " bytes, smaller than a segment header region");
  }
  SegmentHeader header;
  EA_RETURN_IF_ERROR(
      platform::ReadFull(seg.fd, 0, std::as_writable_bytes(std::span<SegmentHeader>(&header, 1))));
  std::string why = ValidateHeader(header, st.size);
  if (!why.empty()) return Corrupt(seg.path + ": " + why);
  seg.kind = static_cast<SegmentKind>(header.kind);
  seg.device = st.device;
  seg.inode = st.inode;
  EA_ASSIGN_OR_RETURN(seg.mapping,
                      platform::Mapping::MapFile(seg.fd, st.size, true, kHugePageBytes));
  // Check the mapped copy again: the header is what the views below are computed from.
  why = ValidateHeader(*reinterpret_cast<const SegmentHeader*>(seg.mapping.data()), st.size);
  if (!why.empty()) return Corrupt(seg.path + ": " + why);
  seg.view = SegmentView::Of(seg.mapping.data());
  return seg;
}

}  // namespace expert_arena::stream
