// The rule for asking for 2 MiB pages, from the field: only when free 2 MiB blocks could back
// at least half of the arena, said either way, with an override; never on pages the
// filesystem already gives (or reserves) as 2 MiB.
#include "arena/page_backing.h"

#include "common/units.h"
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

}  // namespace
}  // namespace expert_arena::arena
