// Copies out of a read-only mapping of a file that another process may truncate meanwhile
// (the shared KV cache file of a prefill engine, which a decode engine reads at memory speed
// through a mapping instead of a pread per run).
//
// A page the truncation took raises SIGBUS in the thread that touches it. CopyOutOfMapping
// catches that signal for the range it copies from and returns an error naming the run: the
// process goes on. The handler is installed on the first guarded copy and stays; a SIGBUS that
// is not one of a guarded copy's (another address, another thread, a signal sent with kill)
// goes to the handler that was there before it (a function, or the default action: the
// process ends as it would have). A handler installed after this one (Python's faulthandler
// enabled later) sees the signals first.
//
// MappedFileSource owns such a mapping of a whole file: it maps the pages in on a thread of
// its own (MADV_POPULATE_READ, nice 10, so the first copies do not pay a fault per 64 KiB),
// and lets go of the mapping (and the file's memory with it) once the file is removed, checked
// every `watch_seconds`; a copy running then keeps the mapping until it returns.
//
// Thread-safety: CopyOutOfMapping may run on any number of threads at once (up to
// kGuardedThreads guarded at a time; more wait). MappedFileSource's methods are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::platform {

inline constexpr int kGuardedThreads = 64;

// One run of a copy: `bytes` at `offset` of the mapping to `to`.
struct CopyRun {
  uint64_t offset;
  std::byte* to;
  uint64_t bytes;
};

// Copies each run out of [base, base + size); a run outside it is kInvalidArgument, a page that
// is gone (the file was truncated under the mapping) kCorrupt naming the run and `what`, with
// the runs before it copied. Returns the bytes copied.
Result<uint64_t> CopyOutOfMapping(const std::byte* base, uint64_t size,
                                  std::span<const CopyRun> runs, const std::string& what);

class MappedFileSource {
 public:
  // Maps all of `fd` (a regular file of at least one byte) read-only; the descriptor is
  // duplicated (the caller's stays the caller's). `what` names the file in messages.
  static Result<std::shared_ptr<MappedFileSource>> Open(int fd, const std::string& what,
                                                        double watch_seconds = 1.0);
  ~MappedFileSource();
  MappedFileSource(const MappedFileSource&) = delete;
  MappedFileSource& operator=(const MappedFileSource&) = delete;

  // CopyOutOfMapping of the runs; kNotFound once the file was removed and the mapping let go.
  Result<uint64_t> Copy(std::span<const CopyRun> runs) const;
  // The file's size when it was mapped.
  uint64_t size() const;
  // Whether the mapping is still held (false once the file was found removed).
  bool mapped() const;
  // Waits up to `seconds` for the thread's MADV_POPULATE_READ to end; whether it did.
  bool WaitPopulated(double seconds) const;

 private:
  struct State;
  explicit MappedFileSource(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace expert_arena::platform
