// Attach by fingerprint: an engine whose model's planning inputs (index bytes, each shard's
// size, time and header bytes, the selection, the alignment) hash as the arena recorded
// attaches without planning the model; any change the plan would see is another model, as
// the identity says.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "arena/test_hooks.h"
#include "expert_arena/arena.h"
#include "format/arena_format.h"
#include "generators/synthetic_model.h"
#include "source/safetensors_reader.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::testing {
namespace {

namespace fs = std::filesystem;

class FastAttachTest : public ::testing::Test {
 protected:
  FastAttachTest() : dir_("fast-attach"), arena_("arena") {}

  void SetUp() override {
    source::SyntheticModelOptions o;
    o.format = "safetensors";
    o.layout = "deepseek-v3";
    o.out = dir_.File("m");
    o.layers = 5;
    o.experts = 4;
    o.shards = 3;
    o.seed = 1;
    ASSERT_OK(source::WriteSyntheticModel(o).status());
    spec_.files = {dir_.File("m")};
    options_.shared_path = arena_.path();
    options_.progress = false;
  }

  // Opens the arena for `spec`, expects `role`, and returns how many plans that took.
  size_t OpenExpecting(const ModelSpec& spec, ArenaRole role,
                       std::optional<Arena>* keep = nullptr) {
    size_t before = arena::test_hooks::PlansMade();
    auto opened = Arena::Open(spec, options_);
    EXPECT_TRUE(opened.ok()) << opened.status().ToString();
    if (!opened.ok()) return 0;
    EXPECT_EQ(opened->role(), role) << ArenaRoleName(opened->role());
    if (keep != nullptr) keep->emplace(std::move(*opened));
    return arena::test_hooks::PlansMade() - before;
  }

  std::string ShardOf(const std::string& tensor) {
    std::ifstream in(dir_.File("m/") + source::kSafetensorsIndexName);
    nlohmann::json index = nlohmann::json::parse(in);
    return dir_.File("m/") + index["weight_map"][tensor].get<std::string>();
  }

  ScopedDir dir_;
  ScopedPath arena_;
  ModelSpec spec_;
  ArenaOptions options_;
};

constexpr const char* kExpert = "model.layers.3.mlp.experts.1.gate_proj.weight";

TEST_F(FastAttachTest, AttachReadsTheHeadersRawAndPlansNothing) {
  Arena loaded(Arena::Open(spec_, options_).value());
  ASSERT_EQ(loaded.role(), ArenaRole::kLoaded);
  // Layers 3 and 4 are MoE: 4 experts x 3 projections x (weight + weight_scale_inv).
  EXPECT_EQ(loaded.tensor_count(), 2u * 4 * 3 * 2);
  Arena attached(Arena::Open(spec_, options_).value());
  ASSERT_EQ(attached.role(), ArenaRole::kAttached);
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kAttached), 0u) << "the fingerprint matched";
  // What was read: the index and each shard's 8 + N header bytes, nothing of the data.
  uint64_t metadata = fs::file_size(dir_.File("m/") + source::kSafetensorsIndexName);
  for (const auto& entry : fs::directory_iterator(dir_.File("m"))) {
    if (entry.path().extension() != ".safetensors") continue;
    ASSERT_OK_AND_ASSIGN(source::SafetensorsFile f, source::ReadSafetensors(entry.path()));
    metadata += f.data_offset;
  }
  EXPECT_EQ(attached.report().bytes_read, metadata);
  ASSERT_EQ(attached.tensor_count(), loaded.tensor_count());
  for (size_t i = 0; i < loaded.tensor_count(); ++i) {
    TensorView a = loaded.tensor(i), b = attached.tensor(i);
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.dtype, b.dtype);
    EXPECT_TRUE(std::equal(a.shape.begin(), a.shape.end(), b.shape.begin(), b.shape.end()));
    EXPECT_EQ(a.file_offset, b.file_offset);
    EXPECT_TRUE(std::equal(a.bytes.begin(), a.bytes.end(), b.bytes.begin(), b.bytes.end()));
    auto found = attached.Find(a.name);
    ASSERT_TRUE(found.has_value()) << a.name;
    EXPECT_EQ(found->bytes.size(), a.bytes.size());
    EXPECT_TRUE(std::equal(found->bytes.begin(), found->bytes.end(), a.bytes.begin()));
  }
  EXPECT_EQ(attached.Find(kExpert)->dtype, "F8_E4M3");
  EXPECT_FALSE(attached.Find("model.layers.3.mlp.shared_experts.up_proj.weight").has_value());
}

TEST_F(FastAttachTest, EveryChangeThePlanWouldSeeIsAnotherModel) {
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kLoaded), 1u);
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kAttached), 0u);

  // Another selection, all tensors, another alignment: each its own arena (replacing the
  // last, which nobody maps), attached without a plan once loaded.
  ModelSpec selected = spec_;
  selected.select = "experts\\.0\\.";
  ModelSpec all = spec_;
  all.select_all = true;
  ModelSpec aligned = spec_;
  aligned.alignment = 8192;
  for (const ModelSpec* spec : {&selected, &all, &aligned, &spec_}) {
    EXPECT_EQ(OpenExpecting(*spec, ArenaRole::kLoaded), 1u);
    EXPECT_EQ(OpenExpecting(*spec, ArenaRole::kAttached), 0u);
  }

  // A shard touched (same bytes, newer time): another model, as the identity says.
  const std::string shard = ShardOf(kExpert);
  fs::last_write_time(shard, fs::last_write_time(shard) + std::chrono::seconds(1));
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kLoaded), 1u);
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kAttached), 0u);

  // A header changed in place, same size and time: the expert's shape [16,16] becomes [32,8]
  // (the same 256 bytes). Only the raw header bytes tell; the new arena has the new shape.
  {
    auto time = fs::last_write_time(shard);
    std::vector<std::byte> bytes = ReadFileBytes(shard);
    std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    std::string key = std::string("\"") + kExpert + "\":{\"dtype\":\"F8_E4M3\",\"shape\":[";
    size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(text.substr(at + key.size(), 6), "16,16]");
    std::memcpy(bytes.data() + at + key.size(), "32,8] ", 6);
    // Keep it valid JSON: the space after ']' is whitespace before the next ','.
    WriteFileBytes(shard, bytes);
    fs::last_write_time(shard, time);
  }
  std::optional<Arena> replaced;
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kLoaded, &replaced), 1u);
  ASSERT_TRUE(replaced.has_value());
  auto shape = replaced->Find(kExpert)->shape;
  EXPECT_EQ(std::vector<uint64_t>(shape.begin(), shape.end()), (std::vector<uint64_t>{32, 8}));
}

// Bytes of the index that the identity does not cover (it names the same tensors in the same
// shards): the plan is made again, finds the same identity and attaches, as before the
// fingerprint.
TEST_F(FastAttachTest, ChangedIndexIsPlannedAgainAndAttachesByIdentity) {
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kLoaded), 1u);
  std::ofstream(dir_.File("m/") + source::kSafetensorsIndexName, std::ios::app) << "\n";
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kAttached), 1u);
  // The index file named directly is another given file: planned, same identity, attached.
  ModelSpec by_index = spec_;
  by_index.files = {dir_.File("m/") + source::kSafetensorsIndexName};
  EXPECT_EQ(OpenExpecting(by_index, ArenaRole::kAttached), 1u);
}

// An arena written before the fingerprint and the name index (those header fields zero) is
// still attached: by planning and the identity, its table decoded into memory.
TEST_F(FastAttachTest, ArenaWithoutFingerprintOrNameIndexIsAttachedByIdentity) {
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kLoaded), 1u);
  {
    std::fstream file(arena_.path(), std::ios::in | std::ios::out | std::ios::binary);
    format::HeaderFixed fixed;
    file.read(reinterpret_cast<char*>(&fixed), sizeof fixed);
    ASSERT_TRUE(file.good());
    ASSERT_NE(fixed.fingerprint, 0u);
    fixed.fingerprint = fixed.name_index_offset = fixed.name_index_slots = 0;
    fixed.name_index_checksum = 0;
    fixed.header_checksum = 0;
    fixed.header_checksum =
        format::Checksum({reinterpret_cast<const std::byte*>(&fixed), sizeof fixed});
    file.seekp(0);
    file.write(reinterpret_cast<const char*>(&fixed), sizeof fixed);
  }
  std::optional<Arena> old;
  EXPECT_EQ(OpenExpecting(spec_, ArenaRole::kAttached, &old), 1u);
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->tensor_count(), 48u);
  auto found = old->Find(kExpert);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->name, kExpert);
  EXPECT_EQ(found->dtype, "F8_E4M3");
}

// Real processes: the CLI loads, another CLI process attaches through the fingerprint.
TEST_F(FastAttachTest, SecondProcessAttaches) {
  const std::string tool = BinDir() + "/expert-arena";
  if (!fs::exists(tool)) GTEST_SKIP() << "expert-arena not built";
  std::vector<std::string> args = {"load", "--model", dir_.File("m"), "--arena", arena_.path(),
                                   "--json"};
  nlohmann::json runs[2];
  for (nlohmann::json& run : runs) {
    Child child = SpawnProgram(tool, args);
    ASSERT_EQ(child.Wait(120), 0) << child.Output();
    run = nlohmann::json::parse(child.Output());
  }
  EXPECT_EQ(runs[0]["role"], "loaded");
  EXPECT_EQ(runs[1]["role"], "attached");
  EXPECT_EQ(runs[1]["identity_hash"], runs[0]["identity_hash"]);
  EXPECT_EQ(runs[1]["tensors"], 48);
}

}  // namespace
}  // namespace expert_arena::testing
