// What every part of the C interface shares: the thread's last error, the StatusCode to errno
// mapping, the guard that keeps C++ exceptions from crossing, and the size-prefixed copy-out.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "expert_arena/status.h"

namespace expert_arena::capi {

// The message of the last failed call on this thread (ea_last_error).
inline thread_local std::string last_error;

inline int ErrnoFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return 0;
    case StatusCode::kInvalidArgument:
      return -EINVAL;
    case StatusCode::kNotFound:
      return -ENOENT;
    case StatusCode::kCorrupt:
      return -EBADMSG;
    case StatusCode::kBusy:
      return -EBUSY;
    case StatusCode::kTimedOut:
      return -ETIMEDOUT;
    case StatusCode::kNoSpace:
      return -ENOSPC;
    case StatusCode::kUnsupported:
      return -ENOTSUP;
    case StatusCode::kPermission:
      return -EACCES;
    case StatusCode::kIoError:
      return -EIO;
    case StatusCode::kInternal:
      return -EIO;
  }
  return -EIO;
}

inline int Fail(int rc, std::string message) {
  last_error = std::move(message);
  return rc;
}

inline int Fail(const Status& status) { return Fail(ErrnoFor(status.code()), status.message()); }

// Runs `body`, turning any exception into an error code.
template <typename F>
int Guarded(const char* what, F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(-ENOMEM, std::string(what) + ": out of memory");
  } catch (const std::exception& e) {
    return Fail(-EIO, std::string(what) + ": " + e.what());
  } catch (...) {
    return Fail(-EIO, std::string(what) + ": unexpected error");
  }
}

// Copies the first `caller_size` bytes of `ours` out to the caller, whose struct may be an
// older (shorter) version; the caller's `size` field is kept.
template <typename T>
void CopyOut(const T& ours, T* out) {
  size_t caller_size = out->size;
  std::memcpy(static_cast<void*>(out), &ours, std::min(caller_size, sizeof(T)));
  out->size = caller_size;
}

}  // namespace expert_arena::capi
