// The platform layer: OFD lock semantics, aligned mappings, the proc readers, the
// non-temporal copy and the cache size; and the escaping of peer-chosen bytes in messages.
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/escape.h"
#include "common/units.h"
#include "platform/file.h"
#include "platform/file_locks.h"
#include "platform/guarded_copy.h"
#include "platform/mapping.h"
#include "platform/memory_copy.h"
#include "platform/ofd_lock.h"
#include "platform/page_scan.h"
#include "platform/system_info.h"
#include "test_util.h"

namespace expert_arena::platform {
namespace {

OpenOptions RW() {
  OpenOptions o;
  o.write = true;
  o.create = true;
  return o;
}

TEST(OfdLockTest, TwoDescriptorsInOneProcessConflict) {
  testing::ScopedPath path("lock");
  ASSERT_OK_AND_ASSIGN(UniqueFd a, OpenFile(path.path(), RW()));
  ASSERT_OK_AND_ASSIGN(UniqueFd b, OpenFile(path.path(), RW()));
  ASSERT_OK_AND_ASSIGN(bool got, TryLockByte(a, 0, LockMode::kExclusive));
  EXPECT_TRUE(got);
  ASSERT_OK_AND_ASSIGN(bool got_b, TryLockByte(b, 0, LockMode::kShared));
  EXPECT_FALSE(got_b);
  // Another byte is independent.
  ASSERT_OK_AND_ASSIGN(bool other, TryLockByte(b, 1, LockMode::kShared));
  EXPECT_TRUE(other);
  a.Reset();  // closing drops the lock
  ASSERT_OK_AND_ASSIGN(bool after, TryLockByte(b, 0, LockMode::kExclusive));
  EXPECT_TRUE(after);
}

TEST(OfdLockTest, ExclusiveConvertsToSharedWithoutAGap) {
  testing::ScopedPath path("convert");
  ASSERT_OK_AND_ASSIGN(UniqueFd a, OpenFile(path.path(), RW()));
  ASSERT_OK_AND_ASSIGN(UniqueFd b, OpenFile(path.path(), RW()));
  ASSERT_OK_AND_ASSIGN(bool got, TryLockByte(a, 1, LockMode::kExclusive));
  ASSERT_TRUE(got);
  ASSERT_OK_AND_ASSIGN(bool converted, TryLockByte(a, 1, LockMode::kShared));
  EXPECT_TRUE(converted);
  ASSERT_OK_AND_ASSIGN(bool shared_b, TryLockByte(b, 1, LockMode::kShared));
  EXPECT_TRUE(shared_b);
  ASSERT_OK_AND_ASSIGN(bool excl_b, ByteIsLocked(b, 1, LockMode::kExclusive));
  EXPECT_TRUE(excl_b);
}

// /proc/locks as the kernel writes it: OFD locks have pid -1, a blocked request is a "->" line,
// device numbers are hex, "EOF" is the end of the file; fdinfo lines have a "lock:" prefix.
TEST(FileLocksTest, ParsesProcLocksAndFdinfoLines) {
  const auto locks = ParseFileLocks(
      "1: OFDLCK ADVISORY  READ  -1 00:1a:4242 1 1\n"
      "1: -> OFDLCK ADVISORY  WRITE -1 00:1a:4242 1 1\n"
      "2: POSIX  ADVISORY  WRITE 812 fd:01:77 0 EOF\n"
      "3: FLOCK  ADVISORY  WRITE 900 00:05:9 0 EOF\n"
      "not a lock line\n"
      "lock:\t1: OFDLCK ADVISORY  WRITE -1 00:1a:4242 0 0\n");
  ASSERT_EQ(locks.size(), 5u);
  EXPECT_EQ(locks[0].kind, "OFDLCK");
  EXPECT_FALSE(locks[0].write);
  EXPECT_EQ(locks[0].pid, -1);
  EXPECT_EQ(locks[0].device_minor, 0x1au);
  EXPECT_EQ(locks[0].inode, 4242u);
  EXPECT_TRUE(locks[1].waiting);
  EXPECT_EQ(locks[2].device_major, 0xfdu);
  EXPECT_EQ(locks[2].end, UINT64_MAX);
  EXPECT_EQ(locks[4].start, 0u);
  EXPECT_TRUE(locks[4].write);
  const uint64_t device = makedev(0, 0x1a);
  // Byte 1: the granted READ lock only (the waiting request does not count).
  EXPECT_EQ(CountLocksOnByte(locks, device, 4242, 1), 1u);
  EXPECT_EQ(CountLocksOnByte(locks, device, 4242, 0), 1u);
  EXPECT_EQ(CountLocksOnByte(locks, device, 4242, 0, /*only_read=*/true), 0u);
  EXPECT_EQ(CountLocksOnByte(locks, device, 4243, 1), 0u);
}

// A real OFD lock of this process: /proc/locks counts it and the fdinfo scan names this pid.
TEST(FileLocksTest, FindsThisProcessAsTheHolderOfItsOfdLock) {
  testing::ScopedPath path("holders");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  ASSERT_OK_AND_ASSIGN(FileStat st, StatFd(fd));
  ASSERT_OK_AND_ASSIGN(bool got, TryLockByte(fd, 1, LockMode::kShared));
  ASSERT_TRUE(got);
  ASSERT_OK_AND_ASSIGN(auto locks, ReadFileLocks());
  EXPECT_EQ(CountLocksOnByte(locks, st.device, st.inode, 1), 1u);
  EXPECT_EQ(CountLocksOnByte(locks, st.device, st.inode, 0), 0u);
  ASSERT_OK_AND_ASSIGN(LockHolderScan scan, FindLockHolders(st.device, st.inode, 1));
  ASSERT_EQ(scan.holders.size(), 1u);
  EXPECT_EQ(scan.holders[0].pid, getpid());
  EXPECT_FALSE(scan.holders[0].write);
  EXPECT_NE(scan.holders[0].command.find("platform_test"), std::string::npos)
      << scan.holders[0].command;
  ASSERT_OK_AND_ASSIGN(LockHolderScan none, FindLockHolders(st.device, st.inode, 0));
  EXPECT_TRUE(none.holders.empty());
}

TEST(FileTest, SymlinkIsRefused) {
  testing::ScopedPath target("target");
  testing::ScopedPath link("link");
  { ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(target.path(), RW())); }
  ASSERT_EQ(symlink(target.path().c_str(), link.path().c_str()), 0);
  auto fd = OpenFile(link.path(), RW());
  ASSERT_FALSE(fd.ok());
  EXPECT_NE(fd.status().message().find("symbolic link"), std::string::npos);
}

TEST(FileTest, CreatedFileIsPrivate) {
  testing::ScopedPath path("mode");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  ASSERT_OK_AND_ASSIGN(FileStat st, StatFd(fd));
  EXPECT_EQ(st.mode & 0777, 0600u);
}

TEST(MappingTest, FileMappingIsTwoMiBAligned) {
  testing::ScopedPath path("map");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  ASSERT_OK(AllocateFile(fd, 4 * kHugePageBytes));
  ASSERT_OK_AND_ASSIGN(Mapping m, Mapping::MapFile(fd, 4 * kHugePageBytes, true, kHugePageBytes));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m.data()) % kHugePageBytes, 0u);
  m.data()[0] = std::byte{7};
  ASSERT_OK(AdviseRange(m.data(), m.size(), Advice::kPopulateRead, path.path()));
}

TEST(SystemInfoTest, DevShmIsTmpfs) {
  auto fs = StatFilesystem("/dev/shm");
  ASSERT_OK(fs);
  EXPECT_EQ(fs->kind, FsKind::kTmpfs);
}

// A hugetlbfs mounted without size= has no limit of its own (statfs says 0 blocks): its pool
// is the limit, and that is what its size and free bytes say.
TEST(SystemInfoTest, HugetlbfsWithoutSizeIsSizedByItsPool) {
  {
    // One mounted with size= keeps its own limit. (One ScopedMount at a time: each holds the
    // machine's test lock.)
    testing::ScopedMount sized(testing::ScopedMount::Kind::kHugetlbfs, 4 * kHugePageBytes);
    if (!sized.ok()) GTEST_SKIP() << sized.skip_reason();
    ASSERT_OK_AND_ASSIGN(FilesystemInfo limited, StatFilesystem(sized.dir()));
    EXPECT_FALSE(limited.pool_sized);
    EXPECT_EQ(limited.total_bytes, 4 * kHugePageBytes);
  }
  testing::ScopedMount mount(testing::ScopedMount::Kind::kHugetlbfsNoSize, 8 * kHugePageBytes);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  ASSERT_OK_AND_ASSIGN(FilesystemInfo fs, StatFilesystem(mount.dir()));
  ASSERT_EQ(fs.kind, FsKind::kHugetlbfs);
  EXPECT_TRUE(fs.pool_sized);
  ASSERT_OK_AND_ASSIGN(HugetlbPool pool, ReadHugetlbPool(kHugePageBytes));
  EXPECT_EQ(fs.total_bytes, pool.total * kHugePageBytes);
  EXPECT_GE(fs.total_bytes, 8 * kHugePageBytes);
  EXPECT_EQ(fs.available_bytes, (pool.free - pool.reserved) * kHugePageBytes);
  // A file's pages leave the pool, and the free bytes say so.
  testing::ScopedPath file("pool", mount.dir());
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(file.path(), RW()));
  ASSERT_OK(AllocateFile(fd, 2 * kHugePageBytes));
  ASSERT_OK_AND_ASSIGN(FilesystemInfo after, StatFilesystem(mount.dir()));
  EXPECT_EQ(after.available_bytes + 2 * kHugePageBytes, fs.available_bytes);
}

// Each reader against what it reads, seen another way: bytes this process read, its start
// time from its own stat line, the bracketed word of shmem_enabled, the buddy allocator's
// counts. (The arena's "model bytes read" and the sweep's pid identity rest on these.)
TEST(SystemInfoTest, ProcessIoCountsTheBytesThisProcessReads) {
  testing::ScopedPath path("io");
  const std::string bytes(3 << 20, 'x');
  {
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
    ASSERT_EQ(pwrite(fd.get(), bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  }
  ASSERT_OK_AND_ASSIGN(ProcessIo before, ReadProcessIo());
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), {}));
  std::string back(bytes.size(), '\0');
  ASSERT_EQ(pread(fd.get(), back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
  ASSERT_OK_AND_ASSIGN(ProcessIo after, ReadProcessIo());
  EXPECT_GE(after.rchar - before.rchar, bytes.size());
  EXPECT_LT(after.rchar - before.rchar, bytes.size() + (1 << 20));  // the reads of /proc only
  EXPECT_GE(after.wchar, bytes.size());
}

TEST(SystemInfoTest, ProcessStartTimeIsField22OfStatAndUnknownPidsAreNotFound) {
  std::ifstream stat("/proc/self/stat");
  std::string line;
  std::getline(stat, line);
  // Fields after the command (which may hold spaces and parentheses): state is field 3.
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i) rest >> field;
  ASSERT_OK_AND_ASSIGN(uint64_t self_start, ProcessStartTime(getpid()));
  EXPECT_EQ(self_start, std::stoull(field));
  EXPECT_GT(self_start, 0u);
  auto none = ProcessStartTime(999999999);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
}

TEST(SystemInfoTest, ShmemHugeSettingIsTheBracketedWord) {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.empty()) GTEST_SKIP() << "no shmem_enabled on this kernel";
  const size_t open = text.find('['), close = text.find(']');
  ASSERT_NE(open, std::string::npos);
  EXPECT_EQ(ShmemHugeSetting(), text.substr(open + 1, close - open - 1));
}

TEST(SystemInfoTest, FreeHugeBlocksCountsOrdersFromNineOfBuddyinfo) {
  std::ifstream in("/proc/buddyinfo");
  uint64_t blocks = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line.substr(line.find("zone") + 4));
    std::string zone;
    fields >> zone;
    uint64_t count = 0;
    for (int order = 0; fields >> count; ++order) {
      if (order >= 9) blocks += count << (order - 9);
    }
  }
  ASSERT_OK_AND_ASSIGN(uint64_t free_blocks, FreeHugeBlocks());
  // Both reads see a moving allocator: within a few hundred blocks of each other.
  EXPECT_NEAR(static_cast<double>(free_blocks), static_cast<double>(blocks), 512.0);
}

TEST(SystemInfoTest, SmapsCountsCollapsedTmpfsPages) {
  testing::ScopedPath path("smaps");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  const uint64_t bytes = 8 * kHugePageBytes;
  ASSERT_OK(AllocateFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(Mapping m, Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  Status collapsed = AdviseRange(m.data(), bytes, Advice::kCollapse, path.path());
  if (!collapsed.ok()) GTEST_SKIP() << "MADV_COLLAPSE unavailable: " << collapsed.message();
  ASSERT_OK(AdviseRange(m.data(), bytes, Advice::kPopulateWrite, path.path()));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, HugeBytesInRange(m.data(), bytes));
  EXPECT_EQ(huge, bytes);
  ASSERT_OK_AND_ASSIGN(uint64_t from_smaps, HugeBytesInRangeFromSmaps(m.data(), bytes));
  EXPECT_EQ(from_smaps, bytes);
}

// Field lesson 002: hugetlb pages are listed in smaps as Shared_Hugetlb / Private_Hugetlb, not in
// Rss or the *PmdMapped fields, so a report that read only those said "0 of 55.44 GiB on 2 MiB
// pages" for a hugetlbfs arena. Both readers (page-table scan and the smaps fallback) count them.
TEST(SystemInfoTest, HugetlbPagesCountInEveryReader) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kHugetlbfs, 8 * kHugePageBytes);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  testing::ScopedPath path("hugetlb", mount.dir());
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  const uint64_t bytes = 4 * kHugePageBytes;
  ASSERT_OK(AllocateFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(Mapping m, Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  ASSERT_OK(AdviseRange(m.data(), bytes, Advice::kPopulateWrite, path.path()));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, HugeBytesInRange(m.data(), bytes));
  EXPECT_EQ(huge, bytes);
  ASSERT_OK_AND_ASSIGN(uint64_t from_smaps, HugeBytesInRangeFromSmaps(m.data(), bytes));
  EXPECT_EQ(from_smaps, bytes);
  Result<uint64_t> scanned = ScanHugeBytes(m.data(), bytes);
  if (scanned.ok()) {
    EXPECT_EQ(*scanned, bytes);
  }
}

// The page-table scan counts exactly the range asked about: a mapping half on 2 MiB pages
// reads as half, 4 KiB pages as none, and a sub-range as its own share.
TEST(SystemInfoTest, PageScanCountsOnlyHugeEntriesOfTheRange) {
  testing::ScopedPath path("scan");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  const uint64_t bytes = 8 * kHugePageBytes;
  ASSERT_OK(AllocateFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(Mapping m, Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  Result<uint64_t> scanned = ScanHugeBytes(m.data(), bytes);
  if (!scanned.ok() && scanned.status().code() == StatusCode::kUnsupported) {
    GTEST_SKIP() << scanned.status().message();
  }
  ASSERT_OK(AdviseRange(m.data(), bytes, Advice::kPopulateWrite, path.path()));
  ASSERT_OK_AND_ASSIGN(uint64_t none, ScanHugeBytes(m.data(), bytes));
  if (none != 0) GTEST_SKIP() << "this tmpfs already gives 2 MiB pages (shmem_enabled)";
  const uint64_t half = bytes / 2;
  Status collapsed = AdviseRange(m.data(), half, Advice::kCollapse, path.path());
  if (!collapsed.ok()) GTEST_SKIP() << "MADV_COLLAPSE unavailable: " << collapsed.message();
  ASSERT_OK(AdviseRange(m.data(), bytes, Advice::kPopulateRead, path.path()));
  ASSERT_OK_AND_ASSIGN(uint64_t huge, HugeBytesInRange(m.data(), bytes));
  EXPECT_EQ(huge, half);
  ASSERT_OK_AND_ASSIGN(uint64_t first_page, ScanHugeBytes(m.data() + kHugePageBytes, 4096));
  EXPECT_EQ(first_page, 4096u);
  ASSERT_OK_AND_ASSIGN(uint64_t tail, ScanHugeBytes(m.data() + half, half));
  EXPECT_EQ(tail, 0u);
  // smaps can only answer for the whole mapping.
  ASSERT_OK_AND_ASSIGN(uint64_t from_smaps, HugeBytesInRangeFromSmaps(m.data(), bytes));
  EXPECT_EQ(from_smaps, half);
}

// What PrivatePagesIn reports for [start, start + length), as offsets from `base`, by both
// readers (PAGEMAP_SCAN where the kernel has it, and /proc/self/pagemap).
std::vector<std::pair<uint64_t, uint64_t>> PrivateOffsets(const std::byte* base,
                                                          const std::byte* start,
                                                          uint64_t length) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  Result<std::vector<AddressRange>> scanned = PrivatePagesIn(start, length);
  Result<std::vector<AddressRange>> read = PrivatePagesInByPagemap(start, length);
  EXPECT_OK(scanned);
  EXPECT_OK(read);
  if (!scanned.ok() || !read.ok()) return out;
  const auto b = reinterpret_cast<uintptr_t>(base);
  for (const AddressRange& r : *scanned) out.push_back({r.start - b, r.end - r.start});
  std::vector<std::pair<uint64_t, uint64_t>> from_pagemap;
  for (const AddressRange& r : *read) from_pagemap.push_back({r.start - b, r.end - r.start});
  EXPECT_EQ(out, from_pagemap) << "PAGEMAP_SCAN and pagemap disagree";
  return out;
}

// A write through a MAP_PRIVATE mapping of a shared file keeps every address but makes the
// page this process's own copy: found by what the page is, exactly that page, and nothing for
// pages only read (they are the file's, shared with every other process).
TEST(PageScanTest, PrivatePagesAreTheCopiesAWriteMadeInAFileMapping) {
  testing::ScopedPath path("private");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  const uint64_t bytes = 2 * kHugePageBytes;
  ASSERT_OK(AllocateFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(Mapping shared, Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  std::memset(shared.data(), 0x5a, bytes);
  ASSERT_OK_AND_ASSIGN(Mapping views,
                       Mapping::MapFileCopyOnWrite(fd, bytes, kHugePageBytes, false));
  ASSERT_OK(AdviseRange(views.data(), bytes, Advice::kPopulateRead, path.path()));
  EXPECT_TRUE(PrivateOffsets(views.data(), views.data(), bytes).empty());
  ASSERT_OK_AND_ASSIGN(uint64_t untouched, PrivateBytesIn(views.data(), bytes));
  EXPECT_EQ(untouched, 0u);

  const uint64_t page = BasePageSize();
  views.data()[5 * page + 17] = std::byte{1};
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(PrivateOffsets(views.data(), views.data(), bytes), (Ranges{{5 * page, page}}));
  ASSERT_OK_AND_ASSIGN(uint64_t written, PrivateBytesIn(views.data(), bytes));
  EXPECT_EQ(written, page);
  // Clipped to the range asked about; a range beside the page has none.
  EXPECT_EQ(PrivateOffsets(views.data(), views.data() + 5 * page + 100, 10),
            (Ranges{{5 * page + 100, 10}}));
  EXPECT_TRUE(PrivateOffsets(views.data(), views.data() + 6 * page, bytes - 6 * page).empty());
  // The file and its shared mapping never saw the write.
  EXPECT_EQ(shared.data()[5 * page + 17], std::byte{0x5a});
  // Anonymous memory is private through and through (what a private arena is made of).
  ASSERT_OK_AND_ASSIGN(Mapping anonymous, Mapping::MapAnonymous(4 * page, page));
  std::memset(anonymous.data(), 1, 4 * page);
  ASSERT_OK_AND_ASSIGN(uint64_t own, PrivateBytesIn(anonymous.data(), 4 * page));
  EXPECT_EQ(own, 4 * page);
}

// On hugetlbfs the copy a write makes is a whole private huge page.
TEST(PageScanTest, PrivateHugetlbPageIsFound) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kHugetlbfs, 8 * kHugePageBytes);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  testing::ScopedPath path("hugetlb-private", mount.dir());
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  const uint64_t bytes = 2 * kHugePageBytes;
  ASSERT_OK(AllocateFile(fd, bytes));
  ASSERT_OK_AND_ASSIGN(Mapping shared, Mapping::MapFile(fd, bytes, true, kHugePageBytes));
  std::memset(shared.data(), 0x5a, bytes);
  ASSERT_OK_AND_ASSIGN(Mapping views,
                       Mapping::MapFileCopyOnWrite(fd, bytes, kHugePageBytes, true));
  ASSERT_OK(AdviseRange(views.data(), bytes, Advice::kPopulateRead, path.path()));
  EXPECT_TRUE(PrivateOffsets(views.data(), views.data(), bytes).empty());
  views.data()[kHugePageBytes + 3] = std::byte{1};
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(PrivateOffsets(views.data(), views.data(), bytes),
            (Ranges{{kHugePageBytes, kHugePageBytes}}));
  EXPECT_EQ(shared.data()[kHugePageBytes + 3], std::byte{0x5a});
}

TEST(FileTest, AllocateBeyondTheFilesystemNamesTheSizes) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kTmpfsHuge, 8 * kMiB);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  testing::ScopedPath path("big", mount.dir());
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  Status s = AllocateFile(fd, 64 * kMiB);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_NE(s.message().find("64.0 MiB"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("available"), std::string::npos) << s.message();
}

// ---- copies and caches --------------------------------------------------------------------

TEST(CopyNonTemporal, CopiesEveryAlignmentAndSize) {
  std::vector<std::byte> from(1 << 20), to(1 << 20);
  std::mt19937 rng(5);
  for (std::byte& b : from) b = static_cast<std::byte>(rng());
  for (int i = 0; i < 300; ++i) {
    size_t src = rng() % 200, dst = rng() % 200;
    // Every size to 100, then around the 16 KiB groups of four pages, then any.
    const size_t around_groups[] = {16383, 16384, 16385, 16384 + 128, 49152 + 4096 + 64 + 3};
    size_t n = i < 100   ? static_cast<size_t>(i)
               : i < 105 ? around_groups[i - 100]
                         : rng() % ((1 << 20) - 400);
    std::memset(to.data(), 0x5a, to.size());
    platform::CopyNonTemporal(to.data() + dst, from.data() + src, n);
    ASSERT_EQ(std::memcmp(to.data() + dst, from.data() + src, n), 0) << n;
    for (size_t k = 0; k < dst; ++k) ASSERT_EQ(to[k], std::byte{0x5a});
    ASSERT_EQ(to[dst + n], std::byte{0x5a}) << n;
  }
}

// A file's owner truncating it under a reader's mapping: the guarded copy returns an error
// naming the run (the runs before it copied) where a plain memcpy would end the process.
TEST(GuardedCopyTest, TruncationUnderTheMappingIsAnErrorNamingTheRun) {
  testing::ScopedPath path("guarded");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  std::vector<std::byte> data(4 << 20);
  std::mt19937 rng(9);
  for (std::byte& b : data) b = static_cast<std::byte>(rng());
  ASSERT_OK(WriteFull(fd, 0, data));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<MappedFileSource> source,
                       MappedFileSource::Open(fd.get(), "the file", 0.05));
  EXPECT_EQ(source->size(), data.size());
  EXPECT_TRUE(source->WaitPopulated(30));
  std::vector<std::byte> out(data.size());
  std::vector<CopyRun> runs = {{4096, out.data(), 8192}, {0, out.data() + 8192, 100}};
  ASSERT_OK_AND_ASSIGN(uint64_t copied, source->Copy(runs));
  EXPECT_EQ(copied, 8292u);
  EXPECT_EQ(std::memcmp(out.data(), data.data() + 4096, 8192), 0);
  EXPECT_EQ(std::memcmp(out.data() + 8192, data.data(), 100), 0);
  std::vector<CopyRun> past = {{(4 << 20) - 8, out.data(), 16}};
  EXPECT_EQ(source->Copy(past).status().code(), StatusCode::kInvalidArgument);

  ASSERT_EQ(::ftruncate(fd.get(), 1 << 20), 0);
  std::vector<CopyRun> across = {{0, out.data(), 4096}, {1 << 20, out.data(), 2 << 20}};
  Result<uint64_t> torn = source->Copy(across);
  ASSERT_FALSE(torn.ok());
  EXPECT_EQ(torn.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(torn.status().message().find("the file lost pages under the copy (truncated by its "
                                         "owner): run 1 (2097152 bytes at offset 1048576)"),
            std::string::npos)
      << torn.status().message();
  // The thread goes on copying what is there.
  std::vector<CopyRun> inside = {{0, out.data(), 1 << 20}};
  ASSERT_OK_AND_ASSIGN(copied, source->Copy(inside));
  EXPECT_EQ(copied, 1u << 20);

  // Removed: the watcher lets go of the mapping.
  ASSERT_EQ(::unlink(path.path().c_str()), 0);
  for (int i = 0; i < 200 && source->mapped(); ++i) ::usleep(50 * 1000);
  EXPECT_FALSE(source->mapped());
  EXPECT_EQ(source->Copy(inside).status().code(), StatusCode::kNotFound);
}

// Threads copying at once, each with its own guard, while the owner truncates and grows the
// file: every copy ends whole or as the error, none ends the process.
TEST(GuardedCopyTest, ConcurrentCopiesUnderTruncationEachEndWholeOrWithTheError) {
  testing::ScopedPath path("guarded-threads");
  ASSERT_OK_AND_ASSIGN(UniqueFd fd, OpenFile(path.path(), RW()));
  constexpr uint64_t kSize = 2 << 20;
  ASSERT_OK(WriteFull(fd, 0, std::vector<std::byte>(kSize, std::byte{7})));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<MappedFileSource> source,
                       MappedFileSource::Open(fd.get(), "the file"));
  std::atomic<bool> stop{false};
  std::atomic<int> whole{0}, torn{0}, other{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&] {
      std::vector<std::byte> out(kSize);
      std::vector<CopyRun> runs = {{0, out.data(), kSize}};
      for (int i = 0; i < 2000 && !stop.load(); ++i) {
        Result<uint64_t> r = source->Copy(runs);
        if (r.ok()) {
          ++whole;
        } else if (r.status().code() == StatusCode::kCorrupt) {
          ++torn;
        } else {
          ++other;
        }
      }
    });
  }
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(::ftruncate(fd.get(), 4096), 0);
    ::usleep(200);
    ASSERT_EQ(::ftruncate(fd.get(), kSize), 0);
    ::usleep(200);
  }
  stop = true;
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(whole.load() + torn.load(), 0);
  std::vector<std::byte> out(kSize);
  std::vector<CopyRun> runs = {{0, out.data(), kSize}};
  EXPECT_TRUE(source->Copy(runs).ok());
}

TEST(LastLevelCacheBytes, IsACacheSizeOrUnknown) {
  uint64_t bytes = platform::LastLevelCacheBytes();
  if (bytes == 0) GTEST_SKIP() << "sysfs gives no cache sizes here";
  EXPECT_GE(bytes, 64u << 10);
  EXPECT_LE(bytes, 4ull << 30);
}

TEST(EscapeForMessage, WritesEveryByteAPeerChoseAsPrintableAscii) {
  EXPECT_EQ(EscapeForMessage("abc_1_2 req/17:0"), "abc_1_2 req/17:0");
  EXPECT_EQ(EscapeForMessage("a\x1b[31m"), "a\\x1b[31m");
  EXPECT_EQ(EscapeForMessage(std::string("n\0l", 3)), "n\\x00l");
  EXPECT_EQ(EscapeForMessage("line\nforged\r"), "line\\x0aforged\\x0d");
  EXPECT_EQ(EscapeForMessage("del\x7f"), "del\\x7f");
  // UTF-8 and the 8-bit CSI (0x9b) alike: bytes of 0x80 and up are written as \xNN.
  EXPECT_EQ(EscapeForMessage("caf\xc3\xa9\x9b"), "caf\\xc3\\xa9\\x9b");
  // Quotes and backslashes are escaped, so the quoted form is unambiguous.
  EXPECT_EQ(EscapeForMessage("say \"hi\\\""), "say \\\"hi\\\\\\\"");
  EXPECT_EQ(QuoteForMessage("k"), "\"k\"");
  EXPECT_EQ(QuoteForMessage(std::string(200, 'k'), 4), "\"kkkk\"...");
  EXPECT_EQ(ControlByteProblem("fine \xc3\xa9"), "");
  EXPECT_EQ(ControlByteProblem("tab\there"), "the control byte 0x09 at byte 3 of 8");
}

TEST(EscapeForDisplay, KeepsValidUtf8AndEscapesControlsAndOtherBytes) {
  EXPECT_EQ(EscapeForDisplay("/models/m.gguf"), "/models/m.gguf");
  // Valid UTF-8 (2, 3 and 4 bytes) is shown as it is, backslashes and quotes too.
  EXPECT_EQ(EscapeForDisplay("caf\xc3\xa9 \xe6\xa8\xa1\xe5\x9e\x8b \xf0\x9f\x98\x80 a\\b\""),
            "caf\xc3\xa9 \xe6\xa8\xa1\xe5\x9e\x8b \xf0\x9f\x98\x80 a\\b\"");
  // C0 controls, DEL and the C1 controls (the 8-bit CSI U+009B) are escaped byte by byte.
  EXPECT_EQ(EscapeForDisplay("a\x1b[31m\n\x7f"), "a\\x1b[31m\\x0a\\x7f");
  EXPECT_EQ(EscapeForDisplay("\xc2\x9b" "2J"), "\\xc2\\x9b2J");
  // Bytes that are not UTF-8: stray, cut short, overlong, surrogates, above U+10FFFF.
  EXPECT_EQ(EscapeForDisplay("name\xff"), "name\\xff");
  EXPECT_EQ(EscapeForDisplay("\x80x\xe6\xa8"), "\\x80x\\xe6\\xa8");
  EXPECT_EQ(EscapeForDisplay("\xc0\xaf"), "\\xc0\\xaf");
  EXPECT_EQ(EscapeForDisplay("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(EscapeForDisplay("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");
  EXPECT_EQ(EscapeForDisplay(std::string("n\0l", 3)), "n\\x00l");
}

}  // namespace
}  // namespace expert_arena::platform
