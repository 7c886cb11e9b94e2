// Creating, opening and removing stream segment files (layout in segment_format.h).
//
// Thread-safety: a SegmentFile is a move-only owner of the fd (and so of the OFD locks taken
// through it), the mapping and the GPU registration of one segment; members are declared in
// teardown order reversed (registration is dropped first, then the mapping, then the fd).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "gpu/gpu.h"
#include "pages/page_placement.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "stream/segment_format.h"

namespace spdlog {
class logger;
}

namespace expert_arena::stream {

struct SegmentFile {
  std::string name;
  std::string path;
  SegmentKind kind = SegmentKind::kRegular;
  uint64_t device = 0;
  uint64_t inode = 0;
  platform::UniqueFd fd;
  platform::Mapping mapping;
  std::unique_ptr<gpu::Registration> registration;
  SegmentView view;
  uint64_t pinned_bytes = 0;
  // Why CreateSegmentParams::placement was not applied (not required, refused by the kernel).
  std::string numa_note;

  uint64_t file_bytes() const { return mapping.size(); }
  const SegmentHeader& header() const { return *view.header; }
};

struct CreateSegmentParams {
  std::string directory;
  std::string name;
  SegmentKind kind = SegmentKind::kRegular;
  uint64_t data_bytes = 0;  // a multiple of 2 MiB
  uint32_t slot_count = 1;
  std::string logical_name;
  HugePages huge = HugePages::kOff;
  bool populate = true;  // fault the mapping in now (MADV_POPULATE_WRITE)
  // NUMA placement of the pages (null: first touch), set before the first page exists.
  const pages::PagePlacement* placement = nullptr;
};

// The file bytes of a segment with `data_bytes` of data.
uint64_t SegmentFileBytes(uint64_t data_bytes);

// Creates the file O_EXCL 0600 (O_NOFOLLOW), takes the owner lock, allocates it whole
// (posix_fallocate: a full filesystem is kNoSpace now, never SIGBUS later), maps it at a
// 2 MiB-aligned address, writes the header, and asks for 2 MiB pages while it is still empty.
// Fails with kBusy when a sweep raced us for the fresh file (the caller picks a new name).
Result<SegmentFile> CreateSegment(const CreateSegmentParams& params, spdlog::logger& log,
                                  std::string* huge_note);

// Opens and maps a peer's segment read-write (readers update the block states), checking the
// owner uid, the header and every size against the real file size.
Result<SegmentFile> OpenSegment(const std::string& directory, const std::string& name,
                                bool allow_foreign_owner);

// True when `path` still names the file we have open (not unlinked or replaced).
bool PathStillNames(const SegmentFile& segment);

}  // namespace expert_arena::stream
