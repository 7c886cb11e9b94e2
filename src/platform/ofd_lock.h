// Open-file-description (OFD) byte-range locks: F_OFD_SETLK / F_OFD_SETLKW.
//
// OFD locks belong to the open file description, not to the process: two descriptors
// opened separately in one process conflict with each other (so an attach in the same
// process behaves like another process), and the kernel drops them when the last
// descriptor of that description closes, including when the process dies. Process-wide
// POSIX locks (F_SETLK) would do neither. A lock may cover bytes past the end of the
// file, so a lock byte needs no file content.
//
// Converting a held write lock to a read lock (or back) on the same description is one
// F_OFD_SETLK call, and the kernel does it without a window in which the byte is unlocked.
#pragma once

#include <cstdint>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

enum class LockMode { kShared, kExclusive };

// Tries to take (or convert to) `mode` on the one byte at `offset`. Returns true when
// taken, false when another open file description holds a conflicting lock.
Result<bool> TryLockByte(const UniqueFd& fd, uint64_t offset, LockMode mode);

// Releases the byte. Closing the descriptor releases it too.
Status UnlockByte(const UniqueFd& fd, uint64_t offset);

// True when some other open file description holds a lock on the byte that would conflict
// with `mode` (F_OFD_GETLK; nothing is taken).
Result<bool> ByteIsLocked(const UniqueFd& fd, uint64_t offset, LockMode mode);

}  // namespace expert_arena::platform
