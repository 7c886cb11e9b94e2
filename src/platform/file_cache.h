// What the loader needs to know about a model file beyond its size: which of its pages are
// already in the page cache (read those buffered: a copy from memory beats the disk), and
// whether and how it can be read with O_DIRECT (straight from the device into the arena).
#pragma once

#include <cstdint>
#include <vector>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

struct DirectIoAlignment {
  uint32_t memory = 0;  // buffer address alignment; 0: O_DIRECT not known to work
  uint32_t offset = 0;  // file offset and length alignment
};

// From statx(STATX_DIOALIGN) (Linux 6.1) on an fd opened with O_DIRECT; a kernel that does
// not say gets the conservative 4096/4096 when O_DIRECT opened at all.
DirectIoAlignment QueryDirectIoAlignment(const UniqueFd& direct_fd);

// One byte per base page of [0, size): bit 0 set when the page is in the page cache
// (mincore(2) on a read-only mapping that is never touched).
Result<std::vector<uint8_t>> PageCacheResidency(const UniqueFd& fd, uint64_t size);

// Writes the file's dirty pages and drops its pages from the page cache (fdatasync, then
// posix_fadvise DONTNEED): a cold read of one file without dropping every cache on the host.
Status EvictFromPageCache(const UniqueFd& fd);

// isatty(2) on stderr.
bool StderrIsTerminal();

}  // namespace expert_arena::platform
