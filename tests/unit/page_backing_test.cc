// The rule for asking for 2 MiB pages, from the field: only when free 2 MiB blocks could back
// at least half of the arena, said either way, with an override; never on pages the
// filesystem already gives (or reserves) as 2 MiB.
#include "arena/page_backing.h"

#include <sys/stat.h>

#include "common/units.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"
#include "test_util.h"

namespace expert_arena::arena {
namespace {

constexpr uint64_t kArena = 10 * kGiB;
constexpr uint64_t kBlocksForHalf = kArena / 2 / kHugePageBytes;

TEST(HugeDecisionTest, AutoAsksWhenFreeBlocksCoverHalf) {
  HugeDecision d = DecideHugePages(HugePages::kAuto, PageSource::kTmpfs, kArena, kBlocksForHalf);
  EXPECT_TRUE(d.ask);
  EXPECT_NE(d.note.find("asked for"), std::string::npos);
}

TEST(HugeDecisionTest, AutoHoldsBackOnAFragmentedBoxAndSaysSo) {
  HugeDecision d =
      DecideHugePages(HugePages::kAuto, PageSource::kTmpfs, kArena, kBlocksForHalf - 1);
  EXPECT_FALSE(d.ask);
  EXPECT_NE(d.note.find("not asked for"), std::string::npos) << d.note;
  EXPECT_NE(d.note.find("--huge on"), std::string::npos) << "names the override: " << d.note;
}

TEST(HugeDecisionTest, OverridesWin) {
  EXPECT_TRUE(DecideHugePages(HugePages::kOn, PageSource::kTmpfs, kArena, 0).ask);
  EXPECT_FALSE(DecideHugePages(HugePages::kOff, PageSource::kAnonymous, kArena, 1 << 20).ask);
}

TEST(HugeDecisionTest, FilesystemPagesAreNeverCollapsed) {
  EXPECT_FALSE(DecideHugePages(HugePages::kOn, PageSource::kHugetlbfs, kArena, 1 << 20).ask);
  HugeDecision d = DecideHugePages(HugePages::kOn, PageSource::kTmpfsHuge, kArena, 1 << 20);
  EXPECT_FALSE(d.ask);
  EXPECT_NE(d.note.find("huge=always"), std::string::npos);
}

TEST(HugeDecisionTest, PageSourceFollowsTheMountOption) {
  EXPECT_EQ(PageSourceFor(true, "never"), PageSource::kHugetlbfs);
  EXPECT_EQ(PageSourceFor(false, "always"), PageSource::kTmpfsHuge);
  EXPECT_EQ(PageSourceFor(false, "within_size"), PageSource::kTmpfsHuge);
}

// Allocating piece by piece while collapsing (the shared arena on 4 KiB tmpfs): every piece
// ends allocated and on 2 MiB pages when the filesystem has room...
TEST(CollapseInPiecesTest, AllocatesEveryPieceAndCollapsesIt) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kTmpfs, 256 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  testing::ScopedPath path("pieces", mount.dir());
  platform::OpenOptions rw;
  rw.write = true;
  rw.create = true;
  ASSERT_OK_AND_ASSIGN(platform::UniqueFd fd, platform::OpenFile(path.path(), rw));
  const uint64_t bytes = 130 * kMiB;  // two whole 64 MiB pieces and a short one
  ASSERT_OK(platform::ExtendFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(platform::Mapping m,
                       platform::Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  auto seconds = CollapseParallel(m.data(), bytes, path.path(), false, 2, &fd);
  ASSERT_TRUE(seconds.ok()) << seconds.status().ToString();
  struct stat st;
  ASSERT_EQ(fstat(fd.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_blocks) * 512, bytes) << "every piece allocated";
  ASSERT_OK(platform::AdviseRange(m.data(), bytes, platform::Advice::kPopulateRead, "test"));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, platform::HugeBytesInRange(m.data(), bytes));
  EXPECT_EQ(huge, bytes);
  EXPECT_FALSE(platform::ExtendFile(fd, bytes - kMiB).ok()) << "a file is never cut short";
}

// ...and on a filesystem too small the collapses fail without a signal, and allocating the
// whole file (what the shared arena does next, before writing) is a kNoSpace naming it.
TEST(CollapseInPiecesTest, FilesystemTooSmallFailsCleanly) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kTmpfs, 96 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  testing::ScopedPath path("pieces", mount.dir());
  platform::OpenOptions rw;
  rw.write = true;
  rw.create = true;
  ASSERT_OK_AND_ASSIGN(platform::UniqueFd fd, platform::OpenFile(path.path(), rw));
  const uint64_t bytes = 256 * kMiB;
  ASSERT_OK(platform::ExtendFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(platform::Mapping m,
                       platform::Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  auto seconds = CollapseParallel(m.data(), bytes, path.path(), false, 2, &fd);
  ASSERT_FALSE(seconds.ok()) << "256 MiB cannot all be collapsed on a 96 MiB tmpfs";
  Status whole = platform::AllocateFile(fd, bytes);
  ASSERT_FALSE(whole.ok());
  EXPECT_EQ(whole.code(), StatusCode::kNoSpace) << whole.ToString();
  EXPECT_NE(whole.message().find(path.path()), std::string::npos) << whole.message();
  EXPECT_NE(whole.message().find("256.0 MiB"), std::string::npos) << whole.message();
  EXPECT_NE(whole.message().find("available"), std::string::npos) << whole.message();
}

}  // namespace
}  // namespace expert_arena::arena
