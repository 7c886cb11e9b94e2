// Fuzz target: a sharded safetensors model (model.safetensors.index.json and the shards it
// names), read the way `expert-arena load DIR` reads one: ReadSafetensorsIndex +
// ReadShardedSafetensors, then PlanModel on the directory. Checks that an accepted model's
// tensors lie inside the shard that holds them, do not overlap within a shard, carry names
// without control bytes, sit in the shard the index names, and that the plan keeps all of it;
// a refusal must not quote a control byte from the input (the terminal of whoever reads it).
//
// Input: the index JSON, then up to three shards, each after the separator "\n#shard#\n":
//
//   INDEX [SEP SHARD1 [SEP SHARD2 [SEP SHARD3]]]     (SHARD3 runs to the end, SEPs included)
//
// written as model.safetensors.index.json and s1/s2/s3.safetensors in one private directory
// under $TMPDIR (ea-fuzz-sharded-<pid>-XXXXXX), reused and overwritten on every run; a shard
// the input does not hold is removed, so the index may name a missing file. The directory is
// removed at exit; one left by a crashed run (its pid gone) is removed by the next run.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/escape.h"
#include "format/arena_table.h"
#include "fuzz_util.h"
#include "plan_check.h"
#include "source/model_source.h"
#include "source/safetensors_reader.h"

using namespace expert_arena;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kSeparator = "\n#shard#\n";
constexpr const char* kShardNames[] = {"s1.safetensors", "s2.safetensors", "s3.safetensors"};
constexpr const char* kPrefix = "ea-fuzz-sharded-";

// Removes directories of earlier runs whose process is gone (a crash skips the cleanup).
void RemoveStaleDirectories(const fs::path& tmp) {
  std::error_code ec;
  for (auto it = fs::directory_iterator(tmp, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (name.rfind(kPrefix, 0) != 0) continue;
    long pid = std::strtol(name.c_str() + std::strlen(kPrefix), nullptr, 10);
    if (pid <= 0 || (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) {
      std::error_code ignored;
      fs::remove_all(it->path(), ignored);
    }
  }
}

// The private directory, made on first use and removed at exit.
class WorkDirectory {
 public:
  WorkDirectory() {
    std::error_code ec;
    fs::path tmp = fs::temp_directory_path(ec);
    if (ec) tmp = "/tmp";
    RemoveStaleDirectories(tmp);
    std::string pattern =
        (tmp / (std::string(kPrefix) + std::to_string(getpid()) + "-XXXXXX")).string();
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("fuzz: mkdtemp");
      std::abort();
    }
    path_ = pattern;
  }
  ~WorkDirectory() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

const fs::path& Dir() {
  static WorkDirectory dir;
  return dir.path();
}

void WriteOrDie(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

bool CleanName(const std::string& name) { return format::TensorNameProblem(name).empty(); }

// A refusal says what is wrong without quoting control bytes from the files: the paths here
// are clean, so any control byte in a message came from a hostile index or shard.
void CheckRefusal(const Status& status) {
  fuzz::CheckRefusal(status);
  FUZZ_CHECK(ControlByteProblem(status.message()).empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path& dir = Dir();
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> pieces;
  for (int i = 0; i < 3; ++i) {
    size_t at = rest.find(kSeparator);
    if (at == std::string_view::npos) break;
    pieces.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kSeparator.size());
  }
  pieces.push_back(rest);  // the index, then the shards

  // Every file of the model and its size, as the readers must see it.
  std::map<std::string, uint64_t> sizes;
  const std::string index_path = (dir / source::kSafetensorsIndexName).string();
  WriteOrDie(index_path, pieces[0]);
  sizes[index_path] = pieces[0].size();
  for (size_t s = 0; s < 3; ++s) {
    fs::path shard = dir / kShardNames[s];
    if (s + 1 < pieces.size()) {
      WriteOrDie(shard, pieces[s + 1]);
      sizes[shard.string()] = pieces[s + 1].size();
    } else {
      std::error_code ec;
      fs::remove(shard, ec);
    }
  }

  auto index = source::ReadSafetensorsIndex(index_path);
  if (!index.ok()) {
    CheckRefusal(index.status());
  } else {
    auto shards = source::ReadShardedSafetensors(*index);
    if (!shards.ok()) {
      CheckRefusal(shards.status());
    } else {
      FUZZ_CHECK(shards->size() == index->shards.size());
      std::map<std::string, const source::SafetensorsFile*> by_path;
      for (size_t s = 0; s < shards->size(); ++s) {
        const source::SafetensorsFile& file = (*shards)[s];
        FUZZ_CHECK(file.path == index->shards[s]);
        FUZZ_CHECK(sizes.contains(file.path) && file.file_size == sizes[file.path]);
        FUZZ_CHECK(file.data_offset == 8 + file.header_bytes && file.data_offset <= file.file_size);
        by_path[file.path] = &file;
        uint64_t previous_end = 0;
        for (const source::SafetensorsTensorInfo& t : file.tensors) {
          FUZZ_CHECK(CleanName(t.name));
          FUZZ_CHECK(t.begin <= t.end && t.bytes == t.end - t.begin);
          FUZZ_CHECK(t.absolute_offset == file.data_offset + t.begin);
          FUZZ_CHECK(t.absolute_offset <= file.file_size &&
                     t.bytes <= file.file_size - t.absolute_offset);
          FUZZ_CHECK(t.begin >= previous_end || t.bytes == 0);
          if (t.bytes > 0) previous_end = t.end;
        }
      }
      for (const auto& entry : index->weight_map) {
        FUZZ_CHECK(entry.shard < index->shards.size());
        FUZZ_CHECK(by_path.contains(index->shards[entry.shard]));
        const auto& tensors = by_path[index->shards[entry.shard]]->tensors;
        FUZZ_CHECK(std::any_of(tensors.begin(), tensors.end(),
                               [&](const auto& t) { return t.name == entry.name; }));
      }
    }
  }

  // The planning path of `load DIR`: the directory resolves to its index.
  ModelSpec spec;
  spec.files = {dir.string()};
  spec.select_all = true;
  auto plan = source::PlanModel(spec);
  if (!plan.ok()) CheckRefusal(plan.status());
  fuzz::CheckPlanResult(plan, &sizes);
  return 0;
}
