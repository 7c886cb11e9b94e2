// Fuzz target: the safetensors header reader (source/safetensors_reader.h) on arbitrary file
// contents, then planning on what it accepted. Checks that an accepted file's tensors lie in
// its data section, sized as their dtype and shape say, in offset order, without overlapping.
#include "fuzz_util.h"
#include "plan_check.h"
#include "format/dtypes.h"
#include "source/safetensors_reader.h"

using namespace expert_arena;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  platform::UniqueFd fd = fuzz::MemoryFileOrDie("fuzz-safetensors", fuzz::Bytes(data, size));
  auto file = source::ReadSafetensors(fd, size);
  if (!file.ok()) {
    fuzz::CheckRefusal(file.status());
    return 0;
  }
  FUZZ_CHECK(file->file_size == size);
  FUZZ_CHECK(file->header_bytes <= size && file->data_offset == 8 + file->header_bytes);
  FUZZ_CHECK(file->data_offset <= size);
  uint64_t previous_end = 0;
  for (const source::SafetensorsTensorInfo& t : file->tensors) {
    FUZZ_CHECK(t.begin <= t.end && t.bytes == t.end - t.begin);
    FUZZ_CHECK(t.absolute_offset == file->data_offset + t.begin);
    FUZZ_CHECK(t.absolute_offset <= size && t.bytes <= size - t.absolute_offset);
    FUZZ_CHECK(source::FindSafetensorsDtype(t.dtype) != nullptr);
    FUZZ_CHECK(t.shape.size() <= 8);
    // Sorted by offset and disjoint (empty tensors may share an offset).
    FUZZ_CHECK(t.begin >= previous_end || t.bytes == 0);
    if (t.bytes > 0) previous_end = t.end;
  }
  fuzz::CheckPlan(fd.path(), size);
  return 0;
}
