// The rule for asking for 2 MiB pages, from the field: only when free 2 MiB blocks could back
// at least half of the arena, said either way, with an override; never on pages the
// filesystem already gives (or reserves) as 2 MiB.
#include "pages/page_backing.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "common/units.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "platform/system_info.h"
#include "test_util.h"

namespace expert_arena::pages {
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
  EXPECT_EQ(PageSourceFor(platform::FsKind::kHugetlbfs, "never"), PageSource::kHugetlbfs);
  EXPECT_EQ(PageSourceFor(platform::FsKind::kTmpfs, "always"), PageSource::kTmpfsHuge);
  EXPECT_EQ(PageSourceFor(platform::FsKind::kTmpfs, "within_size"), PageSource::kTmpfsHuge);
  EXPECT_EQ(PageSourceFor(platform::FsKind::kOther, "never"), PageSource::kOtherFs);
}

TEST(HugeDecisionTest, SlowCollapseIsExplainedOnlyWhenSlow) {
  EXPECT_EQ(SlowCollapseHint(0.2, 4 * kGiB), "");
  EXPECT_EQ(SlowCollapseHint(0.9, 512 * kMiB), "") << "too small to judge";
  const std::string hint = SlowCollapseHint(6.0, 4 * kGiB);
  EXPECT_NE(hint.find("1.50 s/GiB"), std::string::npos) << hint;
  EXPECT_NE(hint.find("hugetlbfs"), std::string::npos) << hint;
}

// A sized, unallocated file of `bytes` on a fresh plain tmpfs of `mount_bytes`, mapped, and
// CollapseParallel over it allocating piece by piece (what the shared arena does on 4 KiB
// tmpfs). ok() is false (with skip_reason()) when the mount cannot be made.
class PiecesFixture {
 public:
  PiecesFixture(uint64_t mount_bytes, uint64_t bytes)
      : mount_(testing::ScopedMount::Kind::kTmpfs, mount_bytes), bytes_(bytes) {}
  bool ok() const { return mount_.ok(); }
  const std::string& skip_reason() const { return mount_.skip_reason(); }

  // The file sized, not allocated, and mapped.
  Status Prepare() {
    path_.emplace("pieces", mount_.dir());
    platform::OpenOptions rw;
    rw.write = true;
    rw.create = true;
    EA_ASSIGN_OR_RETURN(fd_, platform::OpenFile(path_->path(), rw));
    EA_RETURN_IF_ERROR(platform::ExtendFile(fd_, bytes_));
    EA_ASSIGN_OR_RETURN(mapping_, platform::Mapping::MapFile(fd_, bytes_, true, kHugePageBytes));
    return Status::Ok();
  }
  // The file allocated whole (4 KiB pages) and its mapping asking for 2 MiB ones: an
  // engine-made arena's before LateCollapse.
  Status PrepareForLateCollapse() {
    EA_RETURN_IF_ERROR(Prepare());
    EA_RETURN_IF_ERROR(platform::AllocateFile(fd_, bytes_));
    return platform::AdviseRange(mapping_.data(), bytes_, platform::Advice::kHugePage, "test");
  }
  Result<double> Collapse() {
    EA_RETURN_IF_ERROR(Prepare());
    return CollapseParallel(mapping_.data(), bytes_, path_->path(), false, 2, &fd_);
  }
  const platform::UniqueFd& fd() const { return fd_; }
  const platform::Mapping& mapping() const { return mapping_; }
  platform::Mapping& mutable_mapping() { return mapping_; }
  const std::string& path() const { return path_->path(); }

 private:
  testing::ScopedMount mount_;
  uint64_t bytes_;
  std::optional<testing::ScopedPath> path_;
  platform::UniqueFd fd_;
  platform::Mapping mapping_;
};

// Allocating piece by piece while collapsing: every piece ends allocated and on 2 MiB pages
// when the filesystem has room...
TEST(CollapseInPiecesTest, AllocatesEveryPieceAndCollapsesIt) {
  const uint64_t bytes = 130 * kMiB;  // two whole 64 MiB pieces and a short one
  PiecesFixture f(256 * kMiB, bytes);
  if (!f.ok()) GTEST_SKIP() << f.skip_reason();
  auto seconds = f.Collapse();
  ASSERT_TRUE(seconds.ok()) << seconds.status().ToString();
  struct stat st;
  ASSERT_EQ(fstat(f.fd().get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_blocks) * 512, bytes) << "every piece allocated";
  std::byte* data = f.mapping().data();
  ASSERT_OK(platform::AdviseRange(data, bytes, platform::Advice::kPopulateRead, "test"));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, platform::HugeBytesInRange(data, bytes));
  EXPECT_EQ(huge, bytes);
  EXPECT_FALSE(platform::ExtendFile(f.fd(), bytes - kMiB).ok()) << "a file is never cut short";
}

// ...and on a filesystem too small the collapses fail without a signal, and allocating the
// whole file (what the shared arena does next, before writing) is a kNoSpace naming it.
TEST(CollapseInPiecesTest, FilesystemTooSmallFailsCleanly) {
  const uint64_t bytes = 256 * kMiB;
  PiecesFixture f(96 * kMiB, bytes);
  if (!f.ok()) GTEST_SKIP() << f.skip_reason();
  ASSERT_FALSE(f.Collapse().ok()) << "256 MiB cannot all be collapsed on a 96 MiB tmpfs";
  Status whole = platform::AllocateFile(f.fd(), bytes);
  ASSERT_FALSE(whole.ok());
  EXPECT_EQ(whole.code(), StatusCode::kNoSpace) << whole.ToString();
  EXPECT_NE(whole.message().find(f.path()), std::string::npos) << whole.message();
  EXPECT_NE(whole.message().find("256.0 MiB"), std::string::npos) << whole.message();
  EXPECT_NE(whole.message().find("available"), std::string::npos) << whole.message();
}

// BackgroundPages: the front reaches the end only when every piece is allocated and on 2 MiB
// pages, and a waiter for the end sees it there; one and two workers.
TEST(BackgroundPagesTest, FrontReachesTheEndWithEveryPieceAllocatedOnTwoMiBPages) {
  const uint64_t bytes = 194 * kMiB;  // three whole 64 MiB pieces and a short one
  for (unsigned threads : {1u, 2u}) {
    PiecesFixture f(256 * kMiB, bytes);
    if (!f.ok()) GTEST_SKIP() << f.skip_reason();
    ASSERT_OK(f.Prepare());
    BackgroundPages pages(&f.fd(), f.mapping().data(), bytes, f.path(), /*collapse=*/true, threads);
    std::vector<uint64_t> seen;  // the front each time a piece's worth of bytes was waited for
    std::thread waiter([&] {
      for (uint64_t end = 64 * kMiB; end < bytes + 64 * kMiB; end += 64 * kMiB) {
        Status s = pages.front().WaitFor(std::min(end, bytes));
        if (!s.ok()) return;
        seen.push_back(pages.front().ready());
      }
    });
    ASSERT_OK(pages.Finish());
    waiter.join();
    ASSERT_EQ(seen.size(), 4u) << threads;
    for (size_t i = 0; i < seen.size(); ++i) {
      EXPECT_GE(seen[i], std::min<uint64_t>((i + 1) * 64 * kMiB, bytes)) << i;
    }
    EXPECT_EQ(pages.front().ready(), bytes);
    EXPECT_TRUE(pages.collapse_problem().ok()) << pages.collapse_problem().ToString();
    EXPECT_GT(pages.seconds(), 0.0);
    struct stat st;
    ASSERT_EQ(fstat(f.fd().get(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_blocks) * 512, bytes) << "every piece allocated";
    ASSERT_OK_AND_ASSIGN(uint64_t huge, platform::HugeBytesInRange(f.mapping().data(), bytes));
    EXPECT_EQ(huge, bytes) << threads << " workers";
  }
}

// A filesystem too small for the file: the pieces that fit are made, the first that does not
// fails the front with kNoSpace naming the file, and a waiter for the end gets that error
// instead of waiting forever. Nothing is written (a write into the unallocated rest would be
// a SIGBUS and end this test).
TEST(BackgroundPagesTest, FullFilesystemFailsTheFrontWithNoSpace) {
  const uint64_t bytes = 256 * kMiB;
  PiecesFixture f(100 * kMiB, bytes);
  if (!f.ok()) GTEST_SKIP() << f.skip_reason();
  ASSERT_OK(f.Prepare());
  BackgroundPages pages(&f.fd(), f.mapping().data(), bytes, f.path(), /*collapse=*/true, 1);
  Status waited = pages.front().WaitFor(bytes);
  Status finished = pages.Finish();
  ASSERT_FALSE(finished.ok());
  EXPECT_EQ(finished.code(), StatusCode::kNoSpace) << finished.ToString();
  EXPECT_NE(finished.message().find(f.path()), std::string::npos) << finished.message();
  EXPECT_EQ(waited.ToString(), finished.ToString());
  EXPECT_EQ(pages.front().ready(), 64 * kMiB) << "the one piece that fits is ready";
}

// Anonymous memory (a private arena): each piece is faulted in and collapsed; the front
// reaches the end with the whole range populated and on 2 MiB pages.
TEST(BackgroundPagesTest, AnonymousMemoryIsPopulatedAndCollapsed) {
  const uint64_t bytes = 130 * kMiB;
  ASSERT_OK_AND_ASSIGN(auto memory, platform::Mapping::MapAnonymous(bytes, kHugePageBytes));
  ASSERT_OK(platform::AdviseRange(memory.data(), bytes, platform::Advice::kHugePage, "test"));
  BackgroundPages pages(nullptr, memory.data(), bytes, "private", /*collapse=*/true, 2);
  ASSERT_OK(pages.front().WaitFor(bytes));
  ASSERT_OK(pages.Finish());
  if (!pages.collapse_problem().ok()) {
    GTEST_SKIP() << "MADV_COLLAPSE of anonymous memory: " << pages.collapse_problem().ToString();
  }
  ASSERT_OK_AND_ASSIGN(uint64_t huge, platform::HugeBytesInRange(memory.data(), bytes));
  EXPECT_EQ(huge, bytes);
  EXPECT_NE(pages.Note(std::chrono::steady_clock::now()).find("alongside the load"),
            std::string::npos);
}

// Destroying it before it is done stops the pieces not started and joins; no hang, no leak.
TEST(BackgroundPagesTest, DestroyedEarlyStops) {
  const uint64_t bytes = 512 * kMiB;
  PiecesFixture f(600 * kMiB, bytes);
  if (!f.ok()) GTEST_SKIP() << f.skip_reason();
  ASSERT_OK(f.Prepare());
  uint64_t ready = 0;
  {
    BackgroundPages pages(&f.fd(), f.mapping().data(), bytes, f.path(), /*collapse=*/true, 1);
    ASSERT_OK(pages.front().WaitFor(1));
    ready = pages.front().ready();
  }
  struct stat st;
  ASSERT_EQ(fstat(f.fd().get(), &st), 0);
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, bytes)
      << "it stopped before the last pieces (ready at " << ready << ")";
}

constexpr char kNoCollapse[] = "no MADV_COLLAPSE in this kernel";

// LateCollapse over a file whose pages are all made and written (an engine-made arena after
// its build): every 2 MiB of it ends on a 2 MiB page with the bytes written, under a
// read-only mapping as an arena's is.
TEST(LateCollapseTest, WrittenPagesEndOnTwoMiBPagesWithTheirBytes) {
  if (!platform::Kernel().has(platform::KernelFeature::kCollapse)) GTEST_SKIP() << kNoCollapse;
  const uint64_t bytes = 130 * kMiB;
  PiecesFixture f(256 * kMiB, bytes);
  if (!f.ok()) GTEST_SKIP() << f.skip_reason();
  ASSERT_OK(f.PrepareForLateCollapse());
  std::byte* data = f.mapping().data();
  for (uint64_t i = 0; i < bytes; i += 512) data[i] = static_cast<std::byte>(i / 512 * 7);
  ASSERT_OK_AND_ASSIGN(uint64_t before, platform::HugeBytesInRange(data, bytes));
  EXPECT_EQ(before, 0u) << "written into 4 KiB pages";
  ASSERT_OK(f.mutable_mapping().MakeReadOnly());
  LateCollapse late(data, bytes, f.path());
  late.Wait();
  EXPECT_TRUE(late.done());
  EXPECT_OK(late.problem());
  // Each page left this mapping's page tables once made: read back in, on 2 MiB entries.
  ASSERT_OK_AND_ASSIGN(uint64_t left, platform::HugeBytesInRange(data, bytes));
  EXPECT_EQ(left, 0u);
  ASSERT_OK(platform::AdviseRange(data, bytes, platform::Advice::kPopulateRead, "test"));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, platform::HugeBytesInRange(data, bytes));
  EXPECT_EQ(huge, bytes);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < bytes; i += 512) {
    wrong += data[i] != static_cast<std::byte>(i / 512 * 7);
  }
  EXPECT_EQ(wrong, 0u);
}

// The bytes a late-collapse test writes (every 512th, from `seed`), and whether they read back.
void WriteEvery512th(std::byte* data, uint64_t bytes, int seed) {
  for (uint64_t i = 0; i < bytes; i += 512) data[i] = static_cast<std::byte>(i / 512 * seed);
}
uint64_t FirstWrong512th(const std::byte* data, uint64_t bytes, int seed) {
  for (uint64_t i = 0; i < bytes; i += 512) {
    if (data[i] != static_cast<std::byte>(i / 512 * seed)) return i;
  }
  return bytes;
}

// One page of a mapping held by a pipe (vmsplice references it, no copy) until Release or the
// end: a page the kernel's collapse finds referenced elsewhere, so calls busy.
class HeldPage {
 public:
  explicit HeldPage(std::byte* page) {
    if (::pipe(fds_) != 0) return;
    iovec held{page, 4096};
    ok_ = ::vmsplice(fds_[1], &held, 1, 0) == 4096;
  }
  ~HeldPage() { Release(); }
  bool ok() const { return ok_; }
  void Release() {
    if (fds_[0] < 0) return;
    std::vector<char> drained(4096);
    const ssize_t got = ::read(fds_[0], drained.data(), drained.size());
    EXPECT_EQ(got, 4096) << "the held page's bytes from the pipe";
    ::close(fds_[0]);
    ::close(fds_[1]);
    fds_[0] = fds_[1] = -1;
  }

 private:
  int fds_[2] = {-1, -1};
  bool ok_ = false;
};

// Bytes of [data, data+bytes) on 2 MiB entries once read back in (a page made left the page
// tables of the mapping that made it).
uint64_t HugeOnceRead(std::byte* data, uint64_t bytes) {
  if (!platform::AdviseRange(data, bytes, platform::Advice::kPopulateRead, "test").ok()) return 0;
  auto huge = platform::HugeBytesInRange(data, bytes);
  return huge.ok() ? *huge : 0;
}

// 8 MiB written into 4 KiB pages, for a LateCollapse one of whose pieces is busy.
class LateCollapseBusyTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBytes = 8 * kMiB;
  static constexpr int kSeed = 3;
  void SetUp() override {
    if (!platform::Kernel().has(platform::KernelFeature::kCollapse)) GTEST_SKIP() << kNoCollapse;
    f_.emplace(64 * kMiB, kBytes);
    if (!f_->ok()) GTEST_SKIP() << f_->skip_reason();
    ASSERT_OK(f_->PrepareForLateCollapse());
    data_ = f_->mapping().data();
    WriteEvery512th(data_, kBytes, kSeed);
  }
  std::optional<PiecesFixture> f_;
  std::byte* data_ = nullptr;
};

// A piece the kernel calls busy (a page of it referenced elsewhere: here a pipe holds it, as
// a page is held for seconds after another engine exits) is tried again later and ends on a
// 2 MiB page once let go; without the retry it stayed on 4 KiB pages for good.
TEST_F(LateCollapseBusyTest, ABusyPieceIsTriedAgain) {
  HeldPage held(data_ + 3 * kMiB);
  ASSERT_TRUE(held.ok()) << std::strerror(errno);
  LateCollapse late(data_, kBytes, f_->path());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  held.Release();
  late.Wait();
  EXPECT_OK(late.problem());
  EXPECT_EQ(HugeOnceRead(data_, kBytes), kBytes);
  EXPECT_EQ(FirstWrong512th(data_, kBytes, kSeed), kBytes);
}

// A piece still busy after every retry stays on 4 KiB pages, with its bytes, and is warned of
// once (the arena's fallback warning, which a late collapse has instead of one at open).
TEST_F(LateCollapseBusyTest, APieceBusyToTheEndIsWarnedOf) {
  HeldPage held(data_ + 5 * kMiB);  // through every pass (about 15 s)
  ASSERT_TRUE(held.ok()) << std::strerror(errno);
  std::vector<std::string> warnings;
  {
    LateCollapse late(data_, kBytes, f_->path(),
                      [&](const std::string& m) { warnings.push_back(m); });
    late.Wait();
    EXPECT_EQ(late.problem().code(), StatusCode::kBusy) << late.problem().ToString();
  }
  held.Release();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("2.0 MiB of 8.0 MiB left on 4 KiB pages"), std::string::npos)
      << warnings[0];
  EXPECT_EQ(HugeOnceRead(data_, kBytes), kBytes - 2 * kMiB);
  EXPECT_EQ(FirstWrong512th(data_, kBytes, kSeed), kBytes);
}

// Destroyed at once (the engine closed its arena): it stops after the page in the making,
// long before the end.
TEST(LateCollapseTest, DestroyedEarlyStops) {
  if (!platform::Kernel().has(platform::KernelFeature::kCollapse)) GTEST_SKIP() << kNoCollapse;
  const uint64_t bytes = 512 * kMiB;
  PiecesFixture f(600 * kMiB, bytes);
  if (!f.ok()) GTEST_SKIP() << f.skip_reason();
  ASSERT_OK(f.PrepareForLateCollapse());
  std::byte* data = f.mapping().data();
  ASSERT_OK(platform::AdviseRange(data, bytes, platform::Advice::kPopulateWrite, "test"));
  { LateCollapse late(data, bytes, f.path()); }
  ASSERT_OK(platform::AdviseRange(data, bytes, platform::Advice::kPopulateRead, "test"));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, platform::HugeBytesInRange(data, bytes));
  EXPECT_LT(huge, bytes);
}

}  // namespace
}  // namespace expert_arena::pages
