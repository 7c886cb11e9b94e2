#include "platform/file_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "platform/mapping.h"

namespace expert_arena::platform {

DirectIoAlignment QueryDirectIoAlignment(const UniqueFd& direct_fd) {
  DirectIoAlignment out{4096, 4096};
#if defined(STATX_DIOALIGN)
  struct statx st {};
  if (::statx(direct_fd.get(), "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) == 0 &&
      (st.stx_mask & STATX_DIOALIGN) != 0) {
    // 0/0 means the file cannot do direct I/O (the filesystem says so).
    out.memory = st.stx_dio_mem_align;
    out.offset = st.stx_dio_offset_align;
  }
#endif
  return out;
}

Result<std::vector<uint8_t>> PageCacheResidency(const UniqueFd& fd, uint64_t size) {
  const uint64_t page = BasePageSize();
  std::vector<uint8_t> resident((size + page - 1) / page, 0);
  if (size == 0) return resident;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return ErrnoStatus(errno, "mmap (for mincore)", fd.path());
  int rc = ::mincore(map, size, resident.data());
  int err = errno;
  ::munmap(map, size);
  if (rc != 0) return ErrnoStatus(err, "mincore", fd.path());
  return resident;
}

Status EvictFromPageCache(const UniqueFd& fd) {
  if (::fdatasync(fd.get()) != 0) return ErrnoStatus(errno, "fdatasync", fd.path());
  int err = ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  if (err != 0) return ErrnoStatus(err, "posix_fadvise(DONTNEED)", fd.path());
  return Status::Ok();
}

bool StderrIsTerminal() { return ::isatty(STDERR_FILENO) == 1; }

}  // namespace expert_arena::platform
