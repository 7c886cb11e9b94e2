// Who holds a lock on a file, as the kernel says: /proc/locks for every lock of the host, and
// /proc/PID/fdinfo for which process holds each one.
//
// An OFD lock belongs to an open file description, not to a process, so /proc/locks prints its
// pid as -1: it counts the holders but does not name them. The descriptor's fdinfo lists the
// locks of its description ("lock:" lines, Linux 3.15+), so a scan of the processes' open
// descriptors names them, as far as this process may read their /proc entries (another user's
// descriptors need root or CAP_SYS_PTRACE; a process of another PID namespace is not in our
// /proc at all). Neither read takes a lock or changes anything.
//
// Thread-safety: plain functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::platform {

// One line of /proc/locks (or one "lock:" line of an fdinfo file).
struct FileLockRecord {
  std::string kind;      // "OFDLCK", "POSIX", "FLOCK", "LEASE", ...
  bool write = false;    // WRITE, else READ
  bool waiting = false;  // a "->" line: a request blocked on the lock above it
  int64_t pid = 0;       // -1 for OFD locks (they have no owning process)
  uint32_t device_major = 0;
  uint32_t device_minor = 0;
  uint64_t inode = 0;
  uint64_t start = 0;
  uint64_t end = UINT64_MAX;  // inclusive; UINT64_MAX for "EOF"
};

// Parses the text of /proc/locks (or the lock lines of an fdinfo file, "lock:\t" prefixed).
// Lines it does not understand are skipped: the format has grown fields over the years.
std::vector<FileLockRecord> ParseFileLocks(std::string_view text);

// /proc/locks, parsed. kNotFound when there is no /proc.
Result<std::vector<FileLockRecord>> ReadFileLocks();

// How many granted (not waiting) locks in `locks` are on the file (`device` as stat's st_dev,
// `inode`) and cover byte `offset`; with `only_read`, shared (READ) locks only.
uint64_t CountLocksOnByte(const std::vector<FileLockRecord>& locks, uint64_t device,
                          uint64_t inode, uint64_t offset, bool only_read = false);

struct LockHolder {
  int64_t pid = 0;
  std::string command;  // /proc/PID/cmdline with spaces between arguments (comm when empty)
  bool write = false;
};

struct LockHolderScan {
  std::vector<LockHolder> holders;  // one per process, by pid
  // Processes whose descriptors this process could not read (another user's without
  // privilege): a holder among them is not named.
  uint64_t unreadable_processes = 0;
};

// The processes that hold a granted lock covering byte `offset` of the file (`device`,
// `inode`), found through /proc/*/fd and /proc/*/fdinfo. Costs one stat per open descriptor of
// every process this process may look at: for tools, not for a hot path. kNotFound without
// /proc.
Result<LockHolderScan> FindLockHolders(uint64_t device, uint64_t inode, uint64_t offset);

// "pid 42 (moe-engine --model /m.gguf ...)": the pid and at most `max_bytes` of its command
// with the program named by its base name (/opt/x/bin/moe-engine is moe-engine), escaped for
// a message.
std::string DescribeLockHolder(const LockHolder& holder, size_t max_bytes = 80);

}  // namespace expert_arena::platform
