// File descriptors and file operations: every open/read/write/fallocate/unlink of the
// library goes through here, with errors that name the operation, the path and errno.
//
// Thread-safety: UniqueFd is a move-only owner; distinct objects may be used from
// distinct threads. Linux only (compiled under __linux__).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// Owns one file descriptor and the open file description behind it, so the OFD locks
// taken through it live exactly as long as this object.
class UniqueFd {
 public:
  UniqueFd() = default;
  UniqueFd(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
    other.fd_ = -1;
  }
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // The path it was opened with, for messages.
  const std::string& path() const { return path_; }
  void Reset();

 private:
  int fd_ = -1;
  std::string path_;
};

struct OpenOptions {
  bool write = false;
  bool create = false;     // O_CREAT (never O_TRUNC: a file may be mapped by others)
  bool exclusive = false;  // O_EXCL with create
  bool no_follow = true;   // O_NOFOLLOW: a symlink at the last component is refused
  bool direct = false;     // O_DIRECT
  mode_t mode = 0600;
  // With create: a file this call creates gets exactly `mode` (fchmod after the create), not
  // `mode` less the umask; an existing file is opened as it is.
  bool exact_mode = false;
};

// open(2) with O_CLOEXEC, of a regular file only: anything else (a FIFO, a device, a socket,
// a directory) is kInvalidArgument "PATH: not a regular file (a FIFO)", and the open never
// blocks on it (it is made with O_NONBLOCK, cleared on the descriptor returned). A symlink
// refused by O_NOFOLLOW gets a message that says so.
Result<UniqueFd> OpenFile(const std::string& path, const OpenOptions& options);

struct FileStat {
  uint64_t size = 0;
  uint64_t device = 0;
  uint64_t inode = 0;
  uint32_t owner_uid = 0;
  uint32_t owner_gid = 0;
  uint32_t mode = 0;
  int64_t mtime_ns = 0;
  bool regular = false;
};

Result<FileStat> StatFd(const UniqueFd& fd);
// lstat(2): a symlink is reported as not regular.
Result<FileStat> StatPath(const std::string& path);

// Reads exactly buffer.size() bytes at offset; a short file is kCorrupt naming the sizes.
Status ReadFull(const UniqueFd& fd, uint64_t offset, std::span<std::byte> buffer);
// Reads up to buffer.size() bytes; returns the count (short only at end of file).
Result<size_t> ReadSome(const UniqueFd& fd, uint64_t offset, std::span<std::byte> buffer);
Status WriteFull(const UniqueFd& fd, uint64_t offset, std::span<const std::byte> buffer);

// posix_fallocate(3) of [0, bytes). ENOSPC becomes kNoSpace naming the bytes needed and
// what the filesystem has available.
Status AllocateFile(const UniqueFd& fd, uint64_t bytes);
// posix_fallocate(3) of [offset, offset + bytes), same errors.
Status AllocateRange(const UniqueFd& fd, uint64_t offset, uint64_t bytes);
// Sets the size of a file this process just created to `bytes` without allocating (ftruncate).
// It only grows: a smaller size is refused, so a file somebody maps is never cut short.
Status ExtendFile(const UniqueFd& fd, uint64_t bytes);

Status UnlinkPath(const std::string& path);
Status FsyncFd(const UniqueFd& fd);
Status RenamePath(const std::string& from, const std::string& to);
// Replaces `path` with a file holding `contents` and `mode`, atomically: written to a
// temporary file in the same directory (its name does not end like `path`, so a reader that
// picks files by suffix never sees it), fsync'd, then renamed over `path`. A reader sees the
// old file or the new one, never a part. On failure the temporary file is removed and `path`
// is left as it was.
Status ReplaceFileAtomically(const std::string& path, std::string_view contents, mode_t mode);
// mkdir -p; the last component gets `mode` when this call creates it (an existing directory is
// left as it is).
Status MakeDirectories(const std::string& path, mode_t mode);
// euid of this process.
uint32_t EffectiveUid();

// Who may use the file at `path` and who asks, for a refusal that says why: "owned by uid 1001
// (alice), group 1002 (models), mode 0640; this process: uid 1003 (bob), groups 1003 (bob)".
// The parts that cannot be read (a directory this user may not search) say so.
std::string DescribeFileAccess(const std::string& path);

}  // namespace expert_arena::platform
