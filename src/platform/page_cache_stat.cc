#include "platform/page_cache_stat.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace expert_arena::platform {
namespace {

// Not in every libc's headers yet: the uapi structs and the (all-architecture) number.
struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache;
  uint64_t nr_dirty;
  uint64_t nr_writeback;
  uint64_t nr_evicted;
  uint64_t nr_recently_evicted;
};
#ifdef SYS_cachestat
constexpr long kCachestat = SYS_cachestat;
#else
constexpr long kCachestat = 451;
#endif

}  // namespace

Result<uint64_t> CachedPages(const UniqueFd& fd, uint64_t offset, uint64_t length) {
  CachestatRange range{offset, length};
  Cachestat stat{};
  if (::syscall(kCachestat, fd.get(), &range, &stat, 0) != 0) {
    const int err = errno;
    if (err == ENOSYS || err == EPERM) {
      return Unsupported("cachestat refused (" + std::to_string(err) + ") for " + fd.path());
    }
    return ErrnoStatus(err, "cachestat", fd.path());
  }
  return stat.nr_cache;
}

}  // namespace expert_arena::platform
