#include "platform/ofd_lock.h"

#include <fcntl.h>

#include <cerrno>

namespace expert_arena::platform {
namespace {

struct flock MakeLock(short type, uint64_t offset) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = static_cast<off_t>(offset);
  lock.l_len = 1;
  lock.l_pid = 0;  // must be 0 for OFD locks
  return lock;
}

}  // namespace

Result<bool> TryLockByte(const UniqueFd& fd, uint64_t offset, LockMode mode) {
  struct flock lock = MakeLock(mode == LockMode::kExclusive ? F_WRLCK : F_RDLCK, offset);
  while (::fcntl(fd.get(), F_OFD_SETLK, &lock) != 0) {
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EACCES) return false;
    return ErrnoStatus(errno, "lock (F_OFD_SETLK) byte " + std::to_string(offset) + " of",
                       fd.path());
  }
  return true;
}

Status UnlockByte(const UniqueFd& fd, uint64_t offset) {
  struct flock lock = MakeLock(F_UNLCK, offset);
  if (::fcntl(fd.get(), F_OFD_SETLK, &lock) != 0) {
    return ErrnoStatus(errno, "unlock (F_OFD_SETLK) byte " + std::to_string(offset) + " of",
                       fd.path());
  }
  return Status::Ok();
}

Result<bool> ByteIsLocked(const UniqueFd& fd, uint64_t offset, LockMode mode) {
  struct flock lock = MakeLock(mode == LockMode::kExclusive ? F_WRLCK : F_RDLCK, offset);
  if (::fcntl(fd.get(), F_OFD_GETLK, &lock) != 0) {
    return ErrnoStatus(errno, "query lock (F_OFD_GETLK) byte " + std::to_string(offset) + " of",
                       fd.path());
  }
  return lock.l_type != F_UNLCK;
}

}  // namespace expert_arena::platform
