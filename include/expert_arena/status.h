// Status and Result<T>: the one error convention of expert-arena.
//
// Every fallible call in the library returns a Status or a Result<T>. A Status carries a
// code and a message that already names the file, the operation and the errno text, so
// callers print it as is. No exception leaves the library; only main() maps a Status to
// an exit code.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "expert_arena/export.h"

namespace expert_arena {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller asked for something that cannot work (bad option, bad input)
  kNotFound,
  kCorrupt,  // a file's contents fail validation
  kBusy,     // somebody else holds the resource (a mapped arena, a lock)
  kTimedOut,
  kNoSpace,      // a filesystem, the huge page pool or a cap is too small
  kUnsupported,  // not on this platform or this kernel
  kPermission,
  kIoError,  // an OS call failed; the message carries errno
  kInternal,
};

EXPERT_ARENA_EXPORT const char* StatusCodeName(StatusCode code);

class [[nodiscard]] EXPERT_ARENA_EXPORT Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "code: message", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is prefixed with `context: `.
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// An OS call failed: "<operation> <path>: <strerror(err)>", code derived from errno.
EXPERT_ARENA_EXPORT Status ErrnoStatus(int err, const std::string& operation,
                                       const std::string& path);

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status Corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status Busy(std::string m) { return {StatusCode::kBusy, std::move(m)}; }
inline Status NoSpace(std::string m) { return {StatusCode::kNoSpace, std::move(m)}; }
inline Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status TimedOut(std::string m) { return {StatusCode::kTimedOut, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status PermissionDenied(std::string m) { return {StatusCode::kPermission, std::move(m)}; }

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "Result built from an OK status carries no value");
    if (status_.ok()) status_ = Internal("Result built from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace expert_arena

#define EA_CONCAT_INNER(a, b) a##b
#define EA_CONCAT(a, b) EA_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` failed.
#define EA_RETURN_IF_ERROR(expr)                \
  do {                                          \
    ::expert_arena::Status ea_status_ = (expr); \
    if (!ea_status_.ok()) return ea_status_;    \
  } while (0)

// `EA_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result or returns its Status.
#define EA_ASSIGN_OR_RETURN(lhs, expr) \
  EA_ASSIGN_OR_RETURN_IMPL(EA_CONCAT(ea_result_, __LINE__), lhs, expr)
#define EA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
