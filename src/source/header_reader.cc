#include "source/header_reader.h"

#include <algorithm>
#include <cstring>

namespace expert_arena::source {
namespace {
constexpr size_t kBufferBytes = 256 * 1024;
}

HeaderReader::HeaderReader(const platform::UniqueFd& fd, uint64_t file_size)
    : fd_(fd), file_size_(file_size) {}

Status HeaderReader::Fill(uint64_t n, const std::string& what) {
  if (n > remaining()) {
    return Corrupt(fd_.path() + ": truncated: file ends inside " + what + " (needs " +
                   std::to_string(n) + " bytes at offset " + std::to_string(position_) +
                   ", file is " + std::to_string(file_size_) + " bytes)");
  }
  return Status::Ok();
}

Status HeaderReader::Read(void* out, uint64_t n, const std::string& what) {
  EA_RETURN_IF_ERROR(Fill(n, what));
  auto* dst = static_cast<std::byte*>(out);
  while (n > 0) {
    uint64_t buffer_end = buffer_start_ + buffer_valid_;
    if (position_ >= buffer_start_ && position_ < buffer_end) {
      size_t take = static_cast<size_t>(std::min<uint64_t>(n, buffer_end - position_));
      if (dst != nullptr) {
        std::memcpy(dst, buffer_.data() + (position_ - buffer_start_), take);
        dst += take;
      }
      position_ += take;
      n -= take;
      continue;
    }
    if (dst != nullptr && n >= kBufferBytes) {
      // A large string or array: straight into the destination.
      EA_RETURN_IF_ERROR(platform::ReadFull(fd_, position_, {dst, static_cast<size_t>(n)}));
      bytes_read_ += n;
      position_ += n;
      return Status::Ok();
    }
    if (dst == nullptr && n >= kBufferBytes) {
      position_ += n;  // skipping: nothing to read
      return Status::Ok();
    }
    buffer_.resize(kBufferBytes);
    size_t want = static_cast<size_t>(std::min<uint64_t>(kBufferBytes, remaining()));
    EA_ASSIGN_OR_RETURN(size_t got, platform::ReadSome(fd_, position_, {buffer_.data(), want}));
    if (got == 0) {
      return Corrupt(fd_.path() + ": file shrank while its header was read (at offset " +
                     std::to_string(position_) + ")");
    }
    bytes_read_ += got;
    buffer_start_ = position_;
    buffer_valid_ = got;
  }
  return Status::Ok();
}

Status HeaderReader::Skip(uint64_t n, const std::string& what) { return Read(nullptr, n, what); }

Result<uint64_t> HeaderReader::StringLength(uint64_t max_bytes, const std::string& what) {
  EA_ASSIGN_OR_RETURN(uint64_t length, Scalar<uint64_t>("the length of " + what));
  if (length > max_bytes || length > remaining()) {
    return Corrupt(fd_.path() + ": " + what + " claims " + std::to_string(length) +
                   " bytes at offset " + std::to_string(position_) + " (limit " +
                   std::to_string(std::min(max_bytes, remaining())) + ")");
  }
  return length;
}

Result<std::string> HeaderReader::String(uint64_t max_bytes, const std::string& what) {
  EA_ASSIGN_OR_RETURN(uint64_t length, StringLength(max_bytes, what));
  std::string out(static_cast<size_t>(length), '\0');
  EA_RETURN_IF_ERROR(Read(out.data(), length, what));
  return out;
}

}  // namespace expert_arena::source
