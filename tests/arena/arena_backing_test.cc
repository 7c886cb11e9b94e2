// The arena on its three backings (plain /dev/shm with MADV_COLLAPSE, tmpfs huge=always,
// hugetlbfs): loaded by one process, attached by another, whole on 2 MiB pages; and the
// errors a too-small filesystem or huge page pool must give.
#include <fcntl.h>
#include <sys/stat.h>

#include <functional>
#include <mutex>

#include "arena/arena_file.h"
#include "pages/page_hooks.h"
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
  spec.format = ModelFormat::kRaw;
  ArenaOptions options;
  options.shared_path = arena.path();
  auto result = Arena::Open(spec, options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(result.status().message().find("34.0 MiB"), std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("available"), std::string::npos);
  // The container fixes: Docker's and Kubernetes' /dev/shm is 64 MiB unless sized.
  for (const char* fix : {"--shm-size=", "medium: Memory", "bind-mounted"}) {
    EXPECT_NE(result.status().message().find(fix), std::string::npos)
        << fix << " in " << result.status().message();
  }
  // The host's fix: a remount of this very mount with a size that holds the arena (16 MiB in
  // use or not, plus 34 MiB, rounded up to whole GiB, plus one).
  const std::string remount = "mount -o remount,size=2G " + mount.dir() + "`";
  EXPECT_NE(result.status().message().find(remount), std::string::npos)
      << remount << " in " << result.status().message();
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
  spec.format = ModelFormat::kRaw;
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

// hugetlbfs mounted pagesize=1G: the arena loads and attaches on 1 GiB pages, the start line,
// the report and `info` name the page size, and a small arena says it pays a whole page.
TEST(ArenaHugetlbSpaceTest, OneGiBPagesAreNamedAndASmallArenaSaysItPaysAWholePage) {
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs1G, 1024 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(6 * kMiB, 11);
  ScopedPath path("arena", mount.dir());
  ArenaOptions options;
  options.shared_path = path.path();
  ModelSpec spec;
  spec.files = {model.path()};
  spec.format = ModelFormat::kRaw;
  ASSERT_OK_AND_ASSIGN(Arena loaded, Arena::Open(spec, options));
  EXPECT_EQ(loaded.report().page_bytes, 1024 * kMiB);
  const std::string line = loaded.report().StartLine();
  EXPECT_NE(line.find("on 1 GiB pages"), std::string::npos) << line;
  EXPECT_NE(line.find("hugetlbfs: 1 GiB pages reserved by the filesystem"), std::string::npos)
      << line;
  EXPECT_NE(line.find("hugetlbfs sizes files in whole 1 GiB pages"), std::string::npos)
      << line;
  EXPECT_EQ(line.find("2 MiB pages"), std::string::npos) << line;
  ASSERT_OK_AND_ASSIGN(Arena attached, Arena::AttachExisting(path.path(), options));
  EXPECT_EQ(attached.report().page_bytes, 1024 * kMiB);
  EXPECT_EQ(HexSum(attached.tensor(0).bytes), FileSum(model.path()));
  ASSERT_OK_AND_ASSIGN(arena::ArenaFileInfo info, arena::InspectArenaFile(path.path()));
  EXPECT_EQ(info.page_bytes, 1024 * kMiB);
  EXPECT_EQ(info.file_bytes % (1024 * kMiB), 0u);
}

// A pool of 1 GiB pages too small: the message names that pool and its own file, not
// vm.nr_hugepages (the default size's).
TEST(ArenaHugetlbSpaceTest, TooFewOneGiBPagesNamesTheirPool) {
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs1G, 1024 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(1100 * kMiB, 12);
  ScopedPath arena("arena", mount.dir());
  ModelSpec spec;
  spec.files = {model.path()};
  spec.format = ModelFormat::kRaw;
  ArenaOptions options;
  options.shared_path = arena.path();
  auto result = Arena::Open(spec, options);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(result.status().message().find("hugepages-1048576kB"), std::string::npos)
      << result.status().message();
  EXPECT_EQ(result.status().message().find("vm.nr_hugepages"), std::string::npos)
      << result.status().message();
  struct stat st;
  EXPECT_NE(stat(arena.path().c_str(), &st), 0);
}

// Field lesson 002: the hugetlbfs pages of an arena go back to the pool when its file is deleted
// (and not before: a published file keeps them for a restart to attach).
// The copy-on-write mapping the Python views use, on hugetlbfs (MAP_NORESERVE: the mapping
// reserves no huge page; a write takes a free one): it reads the arena's bytes, and a write
// stays in it. tmpfs: ArenaProtocolTest.CopyOnWriteDataKeepsWritesInThisMapping.
TEST(ArenaHugetlbSpaceTest, CopyOnWriteDataReadsTheArenaAndKeepsWrites) {
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs, kModelBytes + 8 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(kModelBytes, 7);
  ScopedPath path("arena", mount.dir());
  ArenaOptions options;
  options.shared_path = path.path();
  ModelSpec spec;
  spec.files = {model.path()};
  spec.format = ModelFormat::kRaw;
  ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open(spec, options));
  const std::string sum = FileSum(model.path());
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> copy, arena.CopyOnWriteData());
  const uint64_t size = arena.tensor(0).bytes.size();
  EXPECT_EQ(HexSum(copy.first(size)), sum);
  copy[5] = ~copy[5];
  copy[size - 1] = ~copy[size - 1];
  EXPECT_NE(HexSum(copy.first(size)), sum);
  EXPECT_EQ(HexSum(arena.tensor(0).bytes), sum);
  ASSERT_OK_AND_ASSIGN(Arena attached, Arena::AttachExisting(path.path(), options));
  EXPECT_EQ(HexSum(attached.tensor(0).bytes), sum);
}

TEST(ArenaHugetlbSpaceTest, RemovingTheArenaGivesItsHugePagesBack) {
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs, kModelBytes + 8 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(kModelBytes, 10);
  ScopedPath arena("arena", mount.dir());
  ModelSpec spec;
  spec.files = {model.path()};
  spec.format = ModelFormat::kRaw;
  ArenaOptions options;
  options.shared_path = arena.path();
  // The pages counted are the mount's own (it has a size=, so statfs counts its pages and no
  // one else's): the system's pool is shared with whatever else runs beside this test.
  const auto free_pages = [&]() -> Result<uint64_t> {
    EA_ASSIGN_OR_RETURN(platform::FilesystemInfo fs, platform::StatFilesystem(mount.dir()));
    if (fs.pool_sized) return Internal("the test's hugetlbfs mount has no size= of its own");
    return fs.available_bytes / (2 * kMiB);
  };
  ASSERT_OK_AND_ASSIGN(uint64_t before, free_pages());
  {
    ASSERT_OK_AND_ASSIGN(Arena a, Arena::Open(spec, options));
    ASSERT_EQ(a.role(), ArenaRole::kLoaded);
  }
  ASSERT_OK_AND_ASSIGN(uint64_t published, free_pages());
  const uint64_t file_pages = (kModelBytes + 2 * kMiB) / (2 * kMiB);
  EXPECT_EQ(before - published, file_pages) << "the unmapped file keeps its pages";
  ASSERT_OK(arena::RemoveArenaFile(arena.path()));
  ASSERT_OK_AND_ASSIGN(uint64_t after, free_pages());
  EXPECT_EQ(after, before);
}

// On plain tmpfs the 2 MiB pages are made in the background while the load fills the pieces
// already made (ArenaOptions::pages_alongside_load, the default) or all before the load: the
// same bytes, the whole mapping on 2 MiB pages, and the start line says which.
TEST(ArenaPagesAlongsideTest, BothOrdersGiveTheSameArenaOnTwoMiBPages) {
  const uint64_t model_bytes = 200 * kMiB + 12345;  // four 64 MiB pieces, the last one short
  ScopedDataFile model(model_bytes, 11);
  const std::string want = FileSum(model.path());
  for (const bool alongside : {true, false}) {
    ScopedPath arena("arena", ArenaTestDir());
    ModelSpec spec;
    spec.files = {model.path()};
    spec.format = ModelFormat::kRaw;
    ArenaOptions options;
    options.shared_path = arena.path();
    options.progress = false;
    options.pages_alongside_load = alongside;
    ASSERT_OK_AND_ASSIGN(Arena a, Arena::Open(spec, options));
    ASSERT_EQ(a.role(), ArenaRole::kLoaded);
    ASSERT_EQ(a.tensor_count(), 1u);
    EXPECT_EQ(HexSum(a.tensor(0).bytes), want) << alongside;
    const ArenaReport& r = a.report();
    if (r.huge_note.find("2 MiB pages asked for") == std::string::npos) {
      GTEST_SKIP() << "free 2 MiB blocks too few to ask for huge pages: " << r.huge_note;
    }
    EXPECT_EQ(r.huge_bytes, r.mapped_bytes) << r.huge_note;
    EXPECT_EQ(r.huge_note.find("alongside the load") != std::string::npos, alongside)
        << r.huge_note;
    EXPECT_GT(r.collapse_seconds, 0.0);
    format::ArenaTable table;
    ASSERT_OK_AND_ASSIGN(int64_t bad, arena::VerifyArenaFile(arena.path(), &table));
    EXPECT_EQ(bad, -1);
  }
}

// Loads `model` into a new shared arena at `arena` with 2 MiB pages made alongside the load,
// running `event` once, in the page maker, just before it starts piece 1 (while the loader
// works on piece 0).
Result<Arena> OpenWithEventBeforePiece1(const std::string& model, const std::string& arena,
                                        std::function<void()> event) {
  std::once_flag once;
  pages::test_hooks::SetBeforePagePiece([&](size_t piece) {
    if (piece == 1) std::call_once(once, event);
  });
  ModelSpec spec;
  spec.files = {model};
  spec.format = ModelFormat::kRaw;
  ArenaOptions options;
  options.shared_path = arena;
  options.progress = false;
  options.huge = HugePages::kOn;
  auto result = Arena::Open(spec, options);
  pages::test_hooks::SetBeforePagePiece(nullptr);
  return result;
}

// The filesystem fills up while the pages are made alongside the load (another process
// takes the space after the check of free space at the start): the load fails with kNoSpace
// naming the file, never a SIGBUS, and removes its file.
TEST(ArenaPagesAlongsideTest, FilesystemFilledDuringTheLoadIsAnErrorAndLeavesNoFile) {
  const uint64_t model_bytes = 200 * kMiB;
  ScopedMount mount(ScopedMount::Kind::kTmpfs, model_bytes + 16 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ScopedDataFile model(model_bytes, 12);
  ScopedPath arena("arena", mount.dir());
  ScopedPath hog("hog", mount.dir());
  auto result = OpenWithEventBeforePiece1(model.path(), arena.path(), [&] {
    // Take every free byte of the mount, the way a rival process would.
    const int fd = ::open(hog.path().c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    for (uint64_t chunk = 256 * kMiB; chunk >= 4096; chunk /= 2) {
      struct stat st;
      ASSERT_EQ(::fstat(fd, &st), 0);
      while (::posix_fallocate(fd, st.st_size, chunk) == 0) {
        ASSERT_EQ(::fstat(fd, &st), 0);
      }
    }
    ::close(fd);
  });
  ASSERT_FALSE(result.ok()) << "the hog took the space the arena needed";
  EXPECT_EQ(result.status().code(), StatusCode::kNoSpace) << result.status().ToString();
  EXPECT_NE(result.status().message().find(arena.path()), std::string::npos)
      << result.status().message();
  struct stat st;
  EXPECT_NE(stat(arena.path().c_str(), &st), 0) << "the failed load removed its file";
}

// The model is cut short while the pages are made alongside the load: the load fails naming
// the model, the pages stop, and the unpublished file is removed.
TEST(ArenaPagesAlongsideTest, SourceCutShortDuringTheLoadIsAnErrorAndLeavesNoFile) {
  const uint64_t model_bytes = 200 * kMiB;
  ScopedDataFile model(model_bytes, 13);
  ScopedPath arena("arena", ArenaTestDir());
  auto result = OpenWithEventBeforePiece1(model.path(), arena.path(), [&] {
    ASSERT_EQ(::truncate(model.path().c_str(), 64 * kMiB), 0);
  });
  ASSERT_FALSE(result.ok()) << "the model lost its last 136 MiB during the load";
  EXPECT_NE(result.status().message().find(model.path()), std::string::npos)
      << result.status().message();
  struct stat st;
  EXPECT_NE(stat(arena.path().c_str(), &st), 0) << "the failed load removed its file";
}

}  // namespace
}  // namespace expert_arena::testing
