// Fuzz target: the GGUF header reader (source/gguf_reader.h) on arbitrary file contents, then
// planning on what it accepted. Checks that an accepted file's tensors lie inside the file,
// after the data section start, aligned, without overlapping, and that a refusal quotes no
// control byte from the file.
#include <algorithm>
#include <vector>

#include "fuzz_util.h"
#include "plan_check.h"
#include "source/gguf_reader.h"

using namespace expert_arena;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  platform::UniqueFd fd = fuzz::MemoryFileOrDie("fuzz-gguf", fuzz::Bytes(data, size));
  auto file = source::ReadGguf(fd, size);
  if (!file.ok()) {
    fuzz::CheckCleanRefusal(file.status());
    return 0;
  }
  FUZZ_CHECK(file->file_size == size);
  FUZZ_CHECK(file->alignment != 0);
  FUZZ_CHECK(file->data_offset <= size);
  FUZZ_CHECK(file->header_bytes_read <= size);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const source::GgufTensorInfo& t : file->tensors) {
    FUZZ_CHECK(t.type != nullptr);
    FUZZ_CHECK(t.offset <= size && t.absolute_offset == file->data_offset + t.offset);
    FUZZ_CHECK(t.absolute_offset <= size && t.bytes <= size - t.absolute_offset);
    FUZZ_CHECK(t.offset % file->alignment == 0);
    if (t.bytes > 0) ranges.emplace_back(t.absolute_offset, t.bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    FUZZ_CHECK(ranges[i - 1].first + ranges[i - 1].second <= ranges[i].first);
  }
  fuzz::CheckPlan(fd.path(), size);
  return 0;
}
