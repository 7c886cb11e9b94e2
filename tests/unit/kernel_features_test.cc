// The kernel-feature probes and the fallbacks they select (platform/kernel_features.h).
//
// Run plainly, the probes describe this kernel and the fallbacks are exercised directly. Run
// under tools/kernel-profile (EXPERT_ARENA_KERNEL_PROFILE set), ProbesAnswerAsTheProfileSays
// checks that every probe saw what the emulated kernel or runtime answers.
#include "platform/kernel_features.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "pages/page_backing.h"
#include "common/units.h"
#include "platform/file.h"
#include "platform/mapping.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using platform::Kernel;
using platform::KernelFeature;

// The pages of [p, p+bytes) that /proc/self/pagemap shows mapped: present, or a swap entry,
// which is what a page being migrated shows for a moment (compaction moves populated pages:
// about 1 run in 20 of the test below saw one such page on the development VM).
uint64_t PresentPages(const void* p, uint64_t bytes) {
  const uint64_t page = platform::BasePageSize();
  std::vector<uint64_t> entries(bytes / page);
  int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  const auto want = static_cast<ssize_t>(entries.size() * sizeof(uint64_t));
  EXPECT_EQ(::pread(fd, entries.data(), static_cast<size_t>(want),
                    static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / page * sizeof(uint64_t))),
            want);
  ::close(fd);
  uint64_t present = 0;
  for (uint64_t e : entries) present += ((e >> 63) | (e >> 62)) & 1;
  return present;
}

TEST(KernelFeaturesTest, ProbesAnswerAsTheProfileSays) {
  const char* env = std::getenv("EXPERT_ARENA_KERNEL_PROFILE");
  if (env == nullptr) GTEST_SKIP() << "not under tools/kernel-profile";
  const std::string profile = env;
  const auto& k = Kernel();
  auto answer = [&](KernelFeature f) { return k.get(f).answer; };
  if (profile == "linux-4.18") {
    EXPECT_FALSE(k.has(KernelFeature::kPopulate));
    EXPECT_EQ(answer(KernelFeature::kPopulate), "EINVAL");
    EXPECT_FALSE(k.has(KernelFeature::kCollapse));
    EXPECT_EQ(answer(KernelFeature::kCollapse), "EINVAL");
    EXPECT_FALSE(k.has(KernelFeature::kPagemapScan));
    EXPECT_EQ(answer(KernelFeature::kPagemapScan), "ENOTTY");
    EXPECT_FALSE(k.has(KernelFeature::kIoUring));
    EXPECT_EQ(answer(KernelFeature::kIoUring).substr(0, 6), "ENOSYS");
    EXPECT_FALSE(k.has(KernelFeature::kCachestat));
  } else if (profile == "linux-5.10") {
    EXPECT_FALSE(k.has(KernelFeature::kPopulate));
    EXPECT_FALSE(k.has(KernelFeature::kCollapse));
    EXPECT_FALSE(k.has(KernelFeature::kPagemapScan));
    EXPECT_TRUE(k.has(KernelFeature::kIoUring));
  } else if (profile == "linux-5.15") {
    EXPECT_TRUE(k.has(KernelFeature::kPopulate));
    EXPECT_FALSE(k.has(KernelFeature::kCollapse));
    EXPECT_FALSE(k.has(KernelFeature::kPagemapScan));
    EXPECT_TRUE(k.has(KernelFeature::kIoUring));
  } else if (profile == "linux-6.1") {
    EXPECT_TRUE(k.has(KernelFeature::kPopulate));
    EXPECT_TRUE(k.has(KernelFeature::kCollapse));
    EXPECT_FALSE(k.has(KernelFeature::kPagemapScan));
    EXPECT_TRUE(k.has(KernelFeature::kIoUring));
  } else if (profile == "docker" || profile == "podman") {
    EXPECT_TRUE(k.has(KernelFeature::kPopulate));
    EXPECT_FALSE(k.has(KernelFeature::kIoUring));
    EXPECT_EQ(answer(KernelFeature::kIoUring).substr(0, 6),
              profile == "docker" ? "EPERM:" : "ENOSYS");
  } else {
    FAIL() << "unknown profile " << profile;
  }
}

TEST(KernelFeaturesTest, MissingCollapseIsUnsupportedWithoutACall) {
  if (Kernel().has(KernelFeature::kCollapse)) GTEST_SKIP() << "this kernel has MADV_COLLAPSE";
  ASSERT_OK_AND_ASSIGN(auto m, platform::Mapping::MapAnonymous(kHugePageBytes, kHugePageBytes));
  Status s = platform::AdviseRange(m.data(), m.size(), platform::Advice::kCollapse, "anon");
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.ToString();
  EXPECT_NE(s.message().find("6.1"), std::string::npos) << s.message();
}

// The touch fallback changes no byte and leaves every page of a file mapping present, read
// or write, whatever the kernel has.
TEST(KernelFeaturesTest, PopulateByTouchMapsEveryPageAndChangesNoByte) {
  testing::ScopedPath path("touch");
  ASSERT_OK_AND_ASSIGN(platform::UniqueFd fd,
                       platform::OpenFile(path.path(), {.write = true, .create = true}));
  const uint64_t bytes = 70 * kMiB;  // more than one 64 MiB piece, not a multiple of it
  ASSERT_OK(platform::AllocateFile(fd, bytes));
  {
    ASSERT_OK_AND_ASSIGN(auto w, platform::Mapping::MapFile(fd, bytes, true, kHugePageBytes));
    for (uint64_t at = 0; at < bytes; at += 4096) w.data()[at + 7] = std::byte{0x5a};
  }
  for (bool write : {false, true}) {
    ASSERT_OK_AND_ASSIGN(auto m, platform::Mapping::MapFile(fd, bytes, write, kHugePageBytes));
    EXPECT_EQ(PresentPages(m.data(), bytes), 0u);
    platform::PopulateByTouch(m.data(), bytes, write, 2);
    EXPECT_EQ(PresentPages(m.data(), bytes), bytes / platform::BasePageSize()) << write;
    for (uint64_t at = 0; at < bytes; at += 4096) {
      ASSERT_EQ(m.data()[at], std::byte{0}) << at;
      ASSERT_EQ(m.data()[at + 7], std::byte{0x5a}) << at;
    }
  }
}

TEST(KernelFeaturesTest, PopulateByTouchWritesAnonymousMemory) {
  const uint64_t bytes = 6 * kMiB + 4096;
  ASSERT_OK_AND_ASSIGN(auto m, platform::Mapping::MapAnonymous(bytes, kHugePageBytes));
  platform::PopulateByTouch(m.data(), bytes, true, 1);
  EXPECT_EQ(PresentPages(m.data(), bytes / 4096 * 4096), bytes / 4096);
}

TEST(KernelFeaturesTest, WithoutCollapseATmpfsMountedHugeNeverNamesTheFixes) {
  pages::HugeDecision d = pages::DecideHugePages(HugePages::kAuto, pages::PageSource::kTmpfs, kGiB,
                                                 1 << 20, /*can_collapse=*/false);
  EXPECT_FALSE(d.ask);
  for (const char* words : {"lacks MADV_COLLAPSE", "huge=never", "huge=advise", "hugetlbfs"}) {
    EXPECT_NE(d.note.find(words), std::string::npos) << words << " in " << d.note;
  }
  d = pages::DecideHugePages(HugePages::kAuto, pages::PageSource::kTmpfsAdvise, kGiB, 1 << 20,
                             /*can_collapse=*/false);
  EXPECT_TRUE(d.ask) << d.note;
  EXPECT_NE(d.note.find("MADV_HUGEPAGE before the first touch"), std::string::npos) << d.note;
  EXPECT_EQ(pages::PageSourceFor(platform::FsKind::kTmpfs, "advise"),
            pages::PageSource::kTmpfsAdvise);
}

TEST(KernelFeaturesTest, NoteNamesOnlyFallbacksThatRan) {
  const platform::FallbackLedger before = platform::ReadFallbackLedger();
  std::vector<platform::MissingFeature> missing = platform::MissingFeatures(before);
  EXPECT_EQ(platform::KernelNote(missing), "");
  platform::MissingFeature m;
  m.feature = KernelFeature::kPopulate;
  m.name = "MADV_POPULATE_READ/WRITE";
  m.since = "5.14";
  m.answer = "EINVAL";
  m.fallback = "pages touched from threads";
  m.cost = {1, 4 * kGiB, 0.25};
  const std::string note = platform::KernelNote({m});
  EXPECT_NE(note.find("MADV_POPULATE_READ/WRITE (5.14, EINVAL: pages touched from threads, "
                      "0.250 s for 4.00 GiB)"),
            std::string::npos)
      << note;
}

}  // namespace
}  // namespace expert_arena
