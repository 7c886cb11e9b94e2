#include "platform/file.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "common/units.h"

namespace expert_arena::platform {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

void UniqueFd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

// What a file that is not a regular file is, for messages.
const char* FileTypeName(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a file";
}

}  // namespace

Result<UniqueFd> OpenFile(const std::string& path, const OpenOptions& options) {
  // O_NONBLOCK: open(2) of a FIFO waits for a writer and that of some devices for a carrier;
  // with it no open blocks, and the fstat below refuses both. It means nothing for regular
  // files and is cleared before the descriptor is handed out anyway.
  int flags = O_CLOEXEC | O_NONBLOCK | (options.write ? O_RDWR : O_RDONLY);
  if (options.create) flags |= O_CREAT;
  if (options.create && options.exclusive) flags |= O_EXCL;
  if (options.no_follow) flags |= O_NOFOLLOW;
  if (options.direct) flags |= O_DIRECT;
  bool created = false;
  int fd = -1;
  if (options.create && options.exact_mode && !options.exclusive) {
    // Tell a file made here from one that was there: only the former gets the exact mode.
    for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
      fd = ::open(path.c_str(), flags | O_EXCL, options.mode);
      if (fd >= 0) {
        created = true;
      } else if (errno == EEXIST) {
        fd = ::open(path.c_str(), flags & ~O_CREAT, options.mode);
        if (fd < 0 && errno != ENOENT) break;  // ENOENT: removed meanwhile, create again
      } else {
        break;
      }
    }
  } else {
    fd = ::open(path.c_str(), flags, options.mode);
    created = fd >= 0 && options.create && options.exclusive;
  }
  if (fd < 0 && errno == EWOULDBLOCK) {
    // A lease held by another process (Samba, NFS server): wait for its break as a plain
    // open does. A FIFO or a device never answers EWOULDBLOCK to open.
    fd = ::open(path.c_str(), flags & ~O_NONBLOCK, options.mode);
  }
  if (fd < 0) {
    int err = errno;
    if (err == ELOOP && options.no_follow) {
      return PermissionDenied("open " + path +
                              ": is a symbolic link; refusing to follow it (O_NOFOLLOW)");
    }
    return ErrnoStatus(err, "open", path);
  }
  UniqueFd out(fd, path);
  // open(2) applies the umask; a group mode such as 0660 asked for must not become 0640.
  if (created && options.exact_mode && ::fchmod(fd, options.mode) != 0) {
    return ErrnoStatus(errno, "fchmod", path);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "fstat", path);
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument(path + ": not a regular file (" + FileTypeName(st.st_mode) + ")");
  }
  int status_flags = ::fcntl(fd, F_GETFL);
  if (status_flags < 0 || ::fcntl(fd, F_SETFL, status_flags & ~O_NONBLOCK) != 0) {
    return ErrnoStatus(errno, "fcntl(F_SETFL)", path);
  }
  return out;
}

static FileStat FromStat(const struct stat& st) {
  FileStat out;
  out.size = static_cast<uint64_t>(st.st_size);
  out.device = static_cast<uint64_t>(st.st_dev);
  out.inode = static_cast<uint64_t>(st.st_ino);
  out.owner_uid = st.st_uid;
  out.owner_gid = st.st_gid;
  out.mode = st.st_mode;
  out.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  out.regular = S_ISREG(st.st_mode);
  return out;
}

Result<FileStat> StatFd(const UniqueFd& fd) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, "fstat", fd.path());
  return FromStat(st);
}

Result<FileStat> StatPath(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", path);
  return FromStat(st);
}

Result<size_t> ReadSome(const UniqueFd& fd, uint64_t offset, std::span<std::byte> buffer) {
  size_t done = 0;
  while (done < buffer.size()) {
    ssize_t n = ::pread(fd.get(), buffer.data() + done, buffer.size() - done,
                        static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "read", fd.path());
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

Status ReadFull(const UniqueFd& fd, uint64_t offset, std::span<std::byte> buffer) {
  EA_ASSIGN_OR_RETURN(size_t got, ReadSome(fd, offset, buffer));
  if (got != buffer.size()) {
    return Corrupt(fd.path() + ": file too short: wanted " + std::to_string(buffer.size()) +
                   " bytes at offset " + std::to_string(offset) + ", got " + std::to_string(got));
  }
  return Status::Ok();
}

Status WriteFull(const UniqueFd& fd, uint64_t offset, std::span<const std::byte> buffer) {
  size_t done = 0;
  while (done < buffer.size()) {
    ssize_t n = ::pwrite(fd.get(), buffer.data() + done, buffer.size() - done,
                         static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", fd.path());
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status AllocateFile(const UniqueFd& fd, uint64_t bytes) { return AllocateRange(fd, 0, bytes); }

Status AllocateRange(const UniqueFd& fd, uint64_t offset, uint64_t bytes) {
  int err = 0;
  do {
    // hugetlbfs stops at a pending signal (EINTR) with the pages so far kept: ask again.
    err = ::posix_fallocate(fd.get(), static_cast<off_t>(offset), static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err == 0) return Status::Ok();
  if (err == ENOSPC || err == EFBIG) {
    struct statvfs vfs {};
    std::string available = "unknown";
    if (::fstatvfs(fd.get(), &vfs) == 0) {
      available = FormatBytes(static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize);
    }
    std::string range = offset == 0 ? std::string()
                                    : " (bytes " + std::to_string(offset) + "+" +
                                          std::to_string(bytes) + ")";
    return NoSpace("allocate " + fd.path() + range + ": needs " + FormatBytes(offset + bytes) +
                   " (" + std::to_string(offset + bytes) + " bytes) but its filesystem has " +
                   available + " available");
  }
  return ErrnoStatus(err, "posix_fallocate", fd.path());
}

Status ExtendFile(const UniqueFd& fd, uint64_t bytes) {
  EA_ASSIGN_OR_RETURN(FileStat st, StatFd(fd));
  if (st.size > bytes) {
    return InvalidArgument("extend " + fd.path() + " to " + std::to_string(bytes) +
                           " bytes: it already has " + std::to_string(st.size));
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus(errno, "ftruncate", fd.path());
  }
  return Status::Ok();
}

Status UnlinkPath(const std::string& path) {
  if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, "unlink", path);
  return Status::Ok();
}

Status FsyncFd(const UniqueFd& fd) {
  if (::fsync(fd.get()) != 0) return ErrnoStatus(errno, "fsync", fd.path());
  return Status::Ok();
}

Status RenamePath(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoStatus(errno, "rename", from);
  return Status::Ok();
}

Status ReplaceFileAtomically(const std::string& path, std::string_view contents, mode_t mode) {
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  // Left by a process that had our pid and was killed between its create and its rename.
  (void)::unlink(temporary.c_str());
  Status written = [&]() -> Status {
    EA_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(temporary, {.write = true,
                                                          .create = true,
                                                          .exclusive = true,
                                                          .mode = mode,
                                                          .exact_mode = true}));
    EA_RETURN_IF_ERROR(WriteFull(fd, 0, std::as_bytes(std::span(contents))));
    EA_RETURN_IF_ERROR(FsyncFd(fd));
    return RenamePath(temporary, path);
  }();
  if (!written.ok()) (void)::unlink(temporary.c_str());
  return written;
}

Status MakeDirectories(const std::string& path, mode_t mode) {
  std::error_code ec;
  // Only a directory made here gets `mode`: an existing one (/var/tmp, /dev/shm, a directory
  // shared with other users) keeps its own, or a producer run as root would make it 0700.
  bool created = std::filesystem::create_directories(path, ec);
  if (ec) return ErrnoStatus(ec.value(), "mkdir", path);
  if (created) ::chmod(path.c_str(), mode);
  return Status::Ok();
}

uint32_t EffectiveUid() { return ::geteuid(); }

namespace {

std::string UserName(uid_t uid) {
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    return std::to_string(uid) + " (" + found->pw_name + ")";
  }
  return std::to_string(uid);
}

std::string GroupName(gid_t gid) {
  std::vector<char> buf(16384);
  struct group gr {};
  struct group* found = nullptr;
  if (::getgrgid_r(gid, &gr, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    return std::to_string(gid) + " (" + found->gr_name + ")";
  }
  return std::to_string(gid);
}

}  // namespace

std::string DescribeFileAccess(const std::string& path) {
  std::string out;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    char mode[16];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    out = "owned by uid " + UserName(st.st_uid) + ", group " + GroupName(st.st_gid) + ", mode " +
          mode;
  } else {
    out = "its owner and mode cannot be read (" + std::string(std::strerror(errno)) +
          "; the directory may not be searchable by this user)";
  }
  out += "; this process: uid " + UserName(::geteuid()) + ", groups " + GroupName(::getegid());
  std::vector<gid_t> groups(256);
  int n = ::getgroups(static_cast<int>(groups.size()), groups.data());
  for (int i = 0; i < n; ++i) {
    if (groups[i] != ::getegid()) out += ", " + GroupName(groups[i]);
  }
  return out;
}

}  // namespace expert_arena::platform
