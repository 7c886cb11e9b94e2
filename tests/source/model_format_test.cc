// Files that are not models are refused, naming the file and what it looks like; raw bytes
// are loaded only when asked for (ModelFormat::kRaw); a forced format checks its header.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "expert_arena/arena.h"
#include "generators/synthetic_model.h"
#include "source/model_source.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena::source {
namespace {

using testing::NotAModel;
using testing::ScopedArenaDir;
using testing::ScopedDir;

std::string Write(const ScopedDir& dir, const std::string& name, const std::string& bytes) {
  std::string path = dir.File(name);
  std::vector<std::byte> data(bytes.size());
  // An empty file's vector has no storage: memcpy of 0 bytes from or to null is still UB.
  if (!bytes.empty()) std::memcpy(data.data(), bytes.data(), bytes.size());
  testing::WriteFileBytes(path, data);
  return path;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += n + " ";
  return out;
}

TEST(ModelFormatTest, EveryKindOfNotAModelIsRefusedNamingTheFileAndWhatItIs) {
  ScopedDir dir("not-a-model");
  for (const NotAModel& c : testing::NotAModels()) {
    SCOPED_TRACE(c.name);
    const std::string path = Write(dir, c.name, c.bytes);
    auto plan = PlanModel({.files = {path}});
    ASSERT_FALSE(plan.ok()) << "accepted as " << plan->format;
    const std::string& message = plan.status().message();
    EXPECT_TRUE(plan.status().code() == StatusCode::kInvalidArgument ||
                plan.status().code() == StatusCode::kCorrupt)
        << plan.status().ToString();
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
    EXPECT_NE(message.find(c.words), std::string::npos) << message;
    // The message is printable ASCII whatever the file holds.
    EXPECT_TRUE(std::all_of(message.begin(), message.end(), [](char ch) {
      return ch >= 0x20 && ch < 0x7f;
    })) << message;
  }
}

// An engine's view: Open refuses before it creates anything, shared or private.
TEST(ModelFormatTest, ARefusedOpenLeavesNothingInTheArenaDirectory) {
  ScopedDir dir("not-a-model-open");
  ScopedArenaDir arenas("refused");
  ArenaOptions shared;
  shared.progress = false;
  shared.shared_path = arenas.File("model.arena");
  for (const NotAModel& c : testing::NotAModels()) {
    SCOPED_TRACE(c.name);
    const std::string path = Write(dir, c.name, c.bytes);
    auto arena = Arena::Open({.files = {path}}, shared);
    ASSERT_FALSE(arena.ok());
    EXPECT_NE(arena.status().message().find(c.words), std::string::npos)
        << arena.status().message();
    EXPECT_TRUE(arenas.entries().empty()) << Join(arenas.entries());
    EXPECT_FALSE(Arena::Open({.files = {path}}, ArenaOptions{.progress = false}).ok());
  }
}

TEST(ModelFormatTest, RawBytesAreLoadedOnlyWhenAskedFor) {
  ScopedDir dir("raw-asked");
  std::string bytes(1000, '\x07');
  const std::string path = Write(dir, "blob.bin", bytes);
  auto refused = PlanModel({.files = {path}});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("ask for the raw format (format = ModelFormat::kRaw)"),
            std::string::npos)
      << refused.status().message();

  ASSERT_OK_AND_ASSIGN(ModelPlan plan, PlanModel({.files = {path}, .format = ModelFormat::kRaw}));
  EXPECT_EQ(plan.format, "raw");
  ASSERT_EQ(plan.table.tensors.size(), 1u);
  EXPECT_EQ(plan.table.tensors[0].name, "blob.bin");
  EXPECT_EQ(plan.table.tensors[0].dtype, "u8");
  EXPECT_EQ(plan.table.tensors[0].bytes, 1000u);

  // Asked for, raw takes any file as it is, a model file included (its bytes, unparsed).
  const NotAModel lfs = testing::NotAModels()[1];
  const std::string pointer = Write(dir, lfs.name, lfs.bytes);
  ASSERT_OK_AND_ASSIGN(ModelPlan as_raw,
                       PlanModel({.files = {pointer}, .format = ModelFormat::kRaw}));
  EXPECT_EQ(as_raw.table.tensors[0].bytes, lfs.bytes.size());

  ScopedArenaDir arenas("raw-asked");
  ArenaOptions options;
  options.progress = false;
  options.shared_path = arenas.File("raw.arena");
  ASSERT_OK_AND_ASSIGN(Arena arena,
                       Arena::Open({.files = {path}, .format = ModelFormat::kRaw}, options));
  ASSERT_EQ(arena.tensor_count(), 1u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(arena.tensor(0).bytes.data()),
                        arena.tensor(0).bytes.size()),
            bytes);
}

// The contents decide under kAuto, whatever the name; a forced format checks its header.
TEST(ModelFormatTest, ContentsDecideAndAForcedFormatChecksItsHeader) {
  ScopedDir dir("forced");
  SyntheticModelOptions gguf{.format = "gguf",
                             .out = dir.File("model.bin"),
                             .layers = 1,
                             .experts = 2,
                             .hidden = 32,
                             .ffn = 32};
  ASSERT_OK(WriteSyntheticModel(gguf));
  SyntheticModelOptions st = gguf;
  st.format = "safetensors";
  st.out = dir.File("weights.data");
  ASSERT_OK(WriteSyntheticModel(st));

  ASSERT_OK_AND_ASSIGN(ModelPlan a, PlanModel({.files = {gguf.out}}));
  EXPECT_EQ(a.format, "gguf");
  ASSERT_OK_AND_ASSIGN(ModelPlan b, PlanModel({.files = {st.out}}));
  EXPECT_EQ(b.format, "safetensors");
  ASSERT_OK_AND_ASSIGN(ModelPlan c, PlanModel({.files = {gguf.out}, .format = ModelFormat::kGguf}));
  EXPECT_EQ(c.format, "gguf");
  ASSERT_OK_AND_ASSIGN(ModelPlan d,
                       PlanModel({.files = {st.out}, .format = ModelFormat::kSafetensors}));
  EXPECT_EQ(d.format, "safetensors");

  auto not_gguf = PlanModel({.files = {st.out}, .format = ModelFormat::kGguf});
  ASSERT_FALSE(not_gguf.ok());
  EXPECT_EQ(not_gguf.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(not_gguf.status().message().find(st.out + ": GGUF magic expected, found '"),
            std::string::npos)
      << not_gguf.status().message();

  // A GGUF's first 8 bytes ("GGUF", version 3) read as a length far beyond the file.
  auto not_st = PlanModel({.files = {gguf.out}, .format = ModelFormat::kSafetensors});
  ASSERT_FALSE(not_st.ok());
  const uint64_t size = std::filesystem::file_size(gguf.out);
  EXPECT_NE(not_st.status().message().find(
                gguf.out + ": safetensors header length " + std::to_string(0x0000000346554747ull) +
                " is larger than the file (" + std::to_string(size) + " bytes)"),
            std::string::npos)
      << not_st.status().message();
}

// A .safetensors whose header length fits but whose header is not JSON: the safetensors
// reader, not the raw fallback, says what is wrong.
TEST(ModelFormatTest, ASafetensorsNameWithABadHeaderGoesToTheReader) {
  ScopedDir dir("bad-header");
  std::string bytes(8, '\0');
  uint64_t n = 16;
  std::memcpy(bytes.data(), &n, 8);
  bytes += "not json at all!";
  const std::string path = Write(dir, "model.safetensors", bytes);
  auto plan = PlanModel({.files = {path}});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find(path), std::string::npos) << plan.status().message();
  EXPECT_EQ(plan.status().message().find("raw"), std::string::npos) << plan.status().message();
}

}  // namespace
}  // namespace expert_arena::source
