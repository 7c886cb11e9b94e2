// How much of a file range is in the page cache, by cachestat(2) (Linux 6.5): the kernel walks
// the page cache's folios, not every 4 KiB page as mincore(2) does (on a 4 GiB file, 1M page
// lookups: ~70 ms here, a fifth of a warm load).
#pragma once

#include <cstdint>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

// Pages of [offset, offset + length) in the page cache. kUnsupported where the kernel is older
// or a seccomp filter refuses the call (then use PageCacheResidency, file_cache.h).
Result<uint64_t> CachedPages(const UniqueFd& fd, uint64_t offset, uint64_t length);

}  // namespace expert_arena::platform
