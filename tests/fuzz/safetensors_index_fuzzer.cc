// Fuzz target: the sharded-model index reader (ReadSafetensorsIndex) on arbitrary index
// contents. Checks the promise that a hostile index cannot name a file outside the index's
// own directory. The shards themselves are not opened here: the index lives in /proc/self/fd,
// where a shard named "0" would be this process's stdin.
#include <algorithm>
#include <set>
#include <string_view>
#include <filesystem>

#include "fuzz_util.h"
#include "source/safetensors_reader.h"

using namespace expert_arena;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  platform::UniqueFd fd = fuzz::MemoryFileOrDie("fuzz-index", fuzz::Bytes(data, size));
  auto index = source::ReadSafetensorsIndex(fd.path());
  if (!index.ok()) {
    fuzz::CheckRefusal(index.status());
    return 0;
  }
  const std::filesystem::path dir = std::filesystem::path(fd.path()).parent_path();
  FUZZ_CHECK(index->bytes_read == size);
  FUZZ_CHECK(!index->shards.empty());
  FUZZ_CHECK(std::is_sorted(index->shards.begin(), index->shards.end()));
  FUZZ_CHECK(std::adjacent_find(index->shards.begin(), index->shards.end()) == index->shards.end());
  for (const std::string& shard : index->shards) {
    std::filesystem::path p(shard);
    FUZZ_CHECK(p.parent_path() == dir);
    std::string name = p.filename().string();
    FUZZ_CHECK(!name.empty() && name != "." && name != "..");
    FUZZ_CHECK(name.find('/') == std::string::npos && name.find('\0') == std::string::npos);
  }
  std::set<std::string_view> names;
  for (const source::SafetensorsIndex::Entry& entry : index->weight_map) {
    FUZZ_CHECK(entry.shard < index->shards.size());
    FUZZ_CHECK(names.insert(entry.name).second);  // each name once
  }
  return 0;
}
