#include "generators/tensor_file_writer.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "platform/file.h"
#include "platform/system_info.h"

namespace expert_arena::source {
namespace {
constexpr uint64_t kBufferBytes = 8ull << 20;
}

Status WriteTensorFile(const std::string& path, std::span<const std::byte> header,
                       std::span<const TensorPlacement> tensors, uint64_t file_bytes,
                       const TensorFiller& fill) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return tensors[a].offset < tensors[b].offset; });
  uint64_t cursor = header.size();
  for (size_t i : order) {
    if (tensors[i].offset < cursor || tensors[i].bytes > file_bytes ||
        tensors[i].offset > file_bytes - tensors[i].bytes) {
      return InvalidArgument(path + ": tensor " + std::to_string(i) +
                             " overlaps the header or another tensor, or runs past the end");
    }
    cursor = tensors[i].offset + tensors[i].bytes;
  }

  const std::string temp = path + ".tmp-" + std::to_string(platform::CurrentPid());
  (void)platform::UnlinkPath(temp);
  platform::OpenOptions options;
  options.write = true;
  options.create = true;
  options.exclusive = true;
  options.mode = 0644;
  EA_ASSIGN_OR_RETURN(platform::UniqueFd fd, platform::OpenFile(temp, options));
  auto fail = [&](Status s) {
    (void)platform::UnlinkPath(temp);
    return s;
  };

  std::vector<std::byte> buffer(kBufferBytes);
  uint64_t buffer_start = 0;  // file offset of buffer[0]
  size_t used = 0;
  auto flush = [&]() -> Status {
    EA_RETURN_IF_ERROR(platform::WriteFull(fd, buffer_start, {buffer.data(), used}));
    buffer_start += used;
    used = 0;
    return Status::Ok();
  };
  // Appends `n` bytes at the file position buffer_start + used, zeros or from the filler.
  auto append_zeros = [&](uint64_t n) -> Status {
    while (n > 0) {
      if (used == buffer.size()) EA_RETURN_IF_ERROR(flush());
      size_t take = static_cast<size_t>(std::min<uint64_t>(n, buffer.size() - used));
      std::memset(buffer.data() + used, 0, take);
      used += take;
      n -= take;
    }
    return Status::Ok();
  };
  for (size_t k = 0; k < header.size();) {
    if (used == buffer.size()) {
      Status s = flush();
      if (!s.ok()) return fail(s);
    }
    size_t take = std::min(header.size() - k, buffer.size() - used);
    std::memcpy(buffer.data() + used, header.data() + k, take);
    used += take;
    k += take;
  }
  for (size_t i : order) {
    const TensorPlacement& t = tensors[i];
    Status s = append_zeros(t.offset - (buffer_start + used));
    if (!s.ok()) return fail(s);
    const uint64_t granule = std::max<uint64_t>(t.granule, 1);
    for (uint64_t done = 0; done < t.bytes;) {
      uint64_t room = buffer.size() - used;
      uint64_t piece = std::min(t.bytes - done, room);
      if (piece < t.bytes - done) piece -= piece % granule;
      if (piece == 0) {
        s = flush();
        if (!s.ok()) return fail(s);
        continue;
      }
      s = fill(i, done, {buffer.data() + used, static_cast<size_t>(piece)});
      if (!s.ok()) return fail(s);
      used += piece;
      done += piece;
    }
  }
  Status s = append_zeros(file_bytes - (buffer_start + used));
  if (s.ok()) s = flush();
  if (s.ok()) s = platform::RenamePath(temp, path);
  if (!s.ok()) return fail(s);
  return Status::Ok();
}

}  // namespace expert_arena::source
