#include "expert_arena/status.h"

#include <cerrno>
#include <cstring>

namespace expert_arena {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kCorrupt:
      return "corrupt";
    case StatusCode::kBusy:
      return "busy";
    case StatusCode::kTimedOut:
      return "timed out";
    case StatusCode::kNoSpace:
      return "no space";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kPermission:
      return "permission denied";
    case StatusCode::kIoError:
      return "I/O error";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

Status ErrnoStatus(int err, const std::string& operation, const std::string& path) {
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EACCES:
    case EPERM:
      code = StatusCode::kPermission;
      break;
    case ENOSPC:
    case ENOMEM:
    case EDQUOT:
    case EFBIG:
      code = StatusCode::kNoSpace;
      break;
    case EWOULDBLOCK:
      code = StatusCode::kBusy;
      break;
    case EINVAL:
      code = StatusCode::kInvalidArgument;
      break;
    case ENOSYS:
    case EOPNOTSUPP:
      code = StatusCode::kUnsupported;
      break;
    case ETIMEDOUT:
      code = StatusCode::kTimedOut;
      break;
    default:
      break;
  }
  std::string message = operation;
  if (!path.empty()) message += " " + path;
  message += ": ";
  message += std::strerror(err);
  message += " (errno " + std::to_string(err) + ")";
  return Status(code, std::move(message));
}

}  // namespace expert_arena
