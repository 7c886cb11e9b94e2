// Sequential, bounded reads of a model file's header through a small buffer.
//
// Every read is checked against the real file size before it happens, so a length or count
// taken from a hostile header can never make the reader run past the end of the file or
// allocate more than the file could hold. Failures name the file and what was being read.
//
// Thread-safety: one object per thread; it borrows the descriptor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "expert_arena/status.h"
#include "platform/file.h"

namespace expert_arena::source {

class HeaderReader {
 public:
  HeaderReader(const platform::UniqueFd& fd, uint64_t file_size);

  uint64_t position() const { return position_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t remaining() const { return file_size_ - position_; }
  // Bytes actually read from the file so far (the buffer reads ahead a little).
  uint64_t bytes_read() const { return bytes_read_; }

  // Copies the next n bytes; kCorrupt naming `what` when the file ends first.
  Status Read(void* out, uint64_t n, const std::string& what);
  Status Skip(uint64_t n, const std::string& what);
  template <typename T>
  Result<T> Scalar(const std::string& what) {
    T value{};
    EA_RETURN_IF_ERROR(Read(&value, sizeof value, what));
    return value;
  }
  // A u64 length followed by that many bytes; the length must not exceed max_bytes.
  Result<std::string> String(uint64_t max_bytes, const std::string& what);
  // The u64 length of such a string, checked the same way; its bytes are next (Read or Skip).
  Result<uint64_t> StringLength(uint64_t max_bytes, const std::string& what);

 private:
  Status Fill(uint64_t n, const std::string& what);

  const platform::UniqueFd& fd_;
  uint64_t file_size_;
  uint64_t position_ = 0;
  uint64_t bytes_read_ = 0;
  std::vector<std::byte> buffer_;
  uint64_t buffer_start_ = 0;  // file offset of buffer_[0]
  size_t buffer_valid_ = 0;
};

}  // namespace expert_arena::source
