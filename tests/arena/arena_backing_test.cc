// The arena on its three backings (plain /dev/shm with MADV_COLLAPSE, tmpfs huge=always,
// hugetlbfs): loaded by one process, attached by another, whole on 2 MiB pages; and the
// errors a too-small filesystem or huge page pool must give.
#include <sys/stat.h>

#include "arena/arena_file.h"
#include "common/units.h"
#include "engine_role.h"
#include "platform/system_info.h"

namespace expert_arena::testing {
namespace {

EA_CHILD_ROLE(engine) { return EngineRole(args); }

constexpr uint64_t kModelBytes = 32 * kMiB;

enum class Backing { kDevShm, kTmpfsHuge, kHugetlbfs };

std::string BackingName(const ::testing::TestParamInfo<Backing>& info) {
  switch (info.param) {
    case Backing::kDevShm:
      return "DevShm";
    case Backing::kTmpfsHuge:
      return "TmpfsHugeAlways";
    case Backing::kHugetlbfs:
      return "Hugetlbfs";
  }
  return "unknown";
}

class ArenaBackingTest : public ::testing::TestWithParam<Backing> {};

TEST_P(ArenaBackingTest, LoadAndAttachAcrossProcessesOnTwoMiBPages) {
  std::unique_ptr<ScopedMount> mount;
  std::string dir = ArenaTestDir();
  if (GetParam() != Backing::kDevShm) {
    mount = std::make_unique<ScopedMount>(GetParam() == Backing::kHugetlbfs
                                              ? ScopedMount::Kind::kHugetlbfs
                                              : ScopedMount::Kind::kTmpfsHuge,
                                          kModelBytes + 8 * kMiB);
    if (!mount->ok()) GTEST_SKIP() << mount->skip_reason();
    dir = mount->dir();
  }
  ScopedDataFile model(kModelBytes, 7);
  ScopedPath arena("arena", dir);
  Child loader = SpawnRole("engine", {arena.path(), model.path(), "none", "-"});
  ASSERT_EQ(loader.Wait(120), 0) << loader.Output();
  Child attacher = SpawnRole("engine", {arena.path(), model.path(), "none", "-"});
  ASSERT_EQ(attacher.Wait(120), 0) << attacher.Output();
  nlohmann::json l = ParseEngineOutput(loader.Output());
  nlohmann::json a = ParseEngineOutput(attacher.Output());
  EXPECT_EQ(l["role"], "loaded");
  EXPECT_EQ(a["role"], "attached");
  EXPECT_EQ(l["sum"], FileSum(model.path()));
  EXPECT_EQ(a["sum"], FileSum(model.path()));
  std::string line = l["line"];
  EXPECT_NE(line.find("on 2 MiB pages"), std::string::npos) << line;
  uint64_t mapping = kModelBytes + 2 * kMiB;  // header page + data
  bool asked =
      line.find("2 MiB pages asked for") != std::string::npos || GetParam() != Backing::kDevShm;
  if (!asked) GTEST_SKIP() << "free 2 MiB blocks too few to ask for huge pages: " << line;
  EXPECT_EQ(l["huge"], mapping) << line;
  EXPECT_EQ(a["huge"], mapping) << a["line"];
}

INSTANTIATE_TEST_SUITE_P(Backings, ArenaBackingTest,
                         ::testing::Values(Backing::kDevShm, Backing::kTmpfsHuge,
                                           Backing::kHugetlbfs),
                         BackingName);

// Both tmpfs kinds: huge=always allocates the whole file up front; on 4 KiB tmpfs the
// arena allocates piece by piece while collapsing, and must still fail cleanly.
class ArenaSpaceTest : public ::testing::TestWithParam<ScopedMount::Kind> {};

TEST_P(ArenaSpaceTest, TmpfsTooSmallIsAnErrorNamingTheSizesAndLeavesNoFile) {
  ScopedMount mount(GetParam(), 16 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(kModelBytes, 8);
  ScopedPath arena("arena", mount.dir());
  ModelSpec spec;
  spec.files = {model.path()};
  ArenaOptions options;
  options.shared_path = arena.path();
  auto result = Arena::Open(spec, options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(result.status().message().find("34.0 MiB"), std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("available"), std::string::npos);
  struct stat st;
  EXPECT_NE(stat(arena.path().c_str(), &st), 0) << "the failed load removed its file";
}

INSTANTIATE_TEST_SUITE_P(Tmpfs, ArenaSpaceTest,
                         ::testing::Values(ScopedMount::Kind::kTmpfs,
                                           ScopedMount::Kind::kTmpfsHuge),
                         [](const ::testing::TestParamInfo<ScopedMount::Kind>& info) {
                           return info.param == ScopedMount::Kind::kTmpfs ? "FourKiB" : "Huge";
                         });

TEST(ArenaHugetlbSpaceTest, TooFewHugePagesSaysWhatToSet) {
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs, 8 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(kModelBytes, 9);
  ScopedPath arena("arena", mount.dir());
  ModelSpec spec;
  spec.files = {model.path()};
  ArenaOptions options;
  options.shared_path = arena.path();
  auto result = Arena::Open(spec, options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(result.status().message().find("nr_hugepages"), std::string::npos)
      << result.status().message();
  struct stat st;
  EXPECT_NE(stat(arena.path().c_str(), &st), 0);
}

// Seed 002: the hugetlbfs pages of an arena go back to the pool when its file is deleted
// (and not before: a published file keeps them for a restart to attach).
TEST(ArenaHugetlbSpaceTest, RemovingTheArenaGivesItsHugePagesBack) {
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs, kModelBytes + 8 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(kModelBytes, 10);
  ScopedPath arena("arena", mount.dir());
  ModelSpec spec;
  spec.files = {model.path()};
  ArenaOptions options;
  options.shared_path = arena.path();
  ASSERT_OK_AND_ASSIGN(auto before, platform::ReadHugetlbPool());
  {
    ASSERT_OK_AND_ASSIGN(Arena a, Arena::Open(spec, options));
    ASSERT_EQ(a.role(), ArenaRole::kLoaded);
  }
  ASSERT_OK_AND_ASSIGN(auto published, platform::ReadHugetlbPool());
  const uint64_t file_pages = (kModelBytes + 2 * kMiB) / (2 * kMiB);
  EXPECT_EQ(before.free - published.free, file_pages) << "the unmapped file keeps its pages";
  ASSERT_OK(arena::RemoveArenaFile(arena.path()));
  ASSERT_OK_AND_ASSIGN(auto after, platform::ReadHugetlbPool());
  EXPECT_EQ(after.free, before.free);
}

}  // namespace
}  // namespace expert_arena::testing
