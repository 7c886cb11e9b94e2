// The shared-arena protocol with real engine processes: load once, wait, attach, restart,
// replace, refuse, survive a killed loader, and eight engines racing on a fresh file.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "arena/arena_file.h"
#include "arena/test_hooks.h"
#include "common/units.h"
#include "engine_role.h"
#include "format/arena_format.h"

namespace expert_arena::testing {
namespace {

EA_CHILD_ROLE(engine) { return EngineRole(args); }

constexpr uint64_t kModelBytes = 24 * kMiB;

class ArenaProtocolTest : public ::testing::Test {
 protected:
  ArenaProtocolTest() : model_(kModelBytes, 1), arena_("arena"), release_("release") {}

  Child StartEngine(const std::string& hook = "none", bool hold = false,
                    const std::string& model = "") {
    return SpawnRole("engine", {arena_.path(), model.empty() ? model_.path() : model, hook,
                                hold ? release_.path() : "-"});
  }
  nlohmann::json Finish(Child& child, int expected_exit = 0) {
    int code = child.Wait(120);
    EXPECT_EQ(code, expected_exit) << child.Output();
    return ParseEngineOutput(child.Output());
  }
  void Release() { std::ofstream(release_.path()) << "go"; }

  ScopedDataFile model_;
  ScopedPath arena_;
  ScopedPath release_;
};

TEST_F(ArenaProtocolTest, LoadThenAttachInTheSameProcess) {
  ArenaOptions options;
  options.shared_path = arena_.path();
  ModelSpec spec;
  spec.files = {model_.path()};
  spec.format = ModelFormat::kRaw;
  ASSERT_OK_AND_ASSIGN(Arena first, Arena::Open(spec, options));
  EXPECT_EQ(first.role(), ArenaRole::kLoaded);
  EXPECT_EQ(first.report().bytes_read, kModelBytes);
  ASSERT_OK_AND_ASSIGN(Arena second, Arena::Open(spec, options));
  EXPECT_EQ(second.role(), ArenaRole::kAttached);
  EXPECT_EQ(second.report().bytes_read, 0u);
  EXPECT_EQ(HexSum(first.tensor(0).bytes), FileSum(model_.path()));
  EXPECT_EQ(HexSum(second.tensor(0).bytes), FileSum(model_.path()));
  // Views of a shared arena know where they live in the file.
  EXPECT_EQ(second.tensor(0).file_offset, format::kHeaderPageBytes);
  EXPECT_TRUE(second.tensor(second.tensor_count()).name.empty());
  EXPECT_TRUE(second.tensor(~size_t{0}).bytes.empty());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(second.data().data()) % kHugePageBytes, 0u);
}

TEST_F(ArenaProtocolTest, SecondEngineWaitsWhileTheFirstLoadsThenAttaches) {
  Child loader = StartEngine("slow");
  ASSERT_TRUE(loader.WaitForOutput("LOADING", 60)) << loader.Output();
  Child waiter = StartEngine();
  nlohmann::json l = Finish(loader);
  nlohmann::json w = Finish(waiter);
  EXPECT_EQ(l["role"], "loaded");
  EXPECT_EQ(w["role"], "attached");
  EXPECT_EQ(w["waited_for"], l["pid"]) << "the waiter names the loading engine";
  EXPECT_GT(w["wait"].get<double>(), 0.0);
  EXPECT_EQ(w["bytes_read"], 0);
  EXPECT_EQ(l["sum"], FileSum(model_.path()));
  EXPECT_EQ(w["sum"], l["sum"]);
}

TEST_F(ArenaProtocolTest, RestartAttachesWithoutReadingTheModel) {
  Child first = StartEngine();
  nlohmann::json a = Finish(first);
  ASSERT_EQ(a["role"], "loaded");
  Child second = StartEngine();
  nlohmann::json b = Finish(second);
  EXPECT_EQ(b["role"], "attached");
  EXPECT_EQ(b["bytes_read"], 0);
  // /proc/self/io: the attach read() almost nothing (smaps and proc files only), far less than
  // the model.
  EXPECT_LT(b["rchar"].get<uint64_t>(), kModelBytes / 8) << b.dump();
  EXPECT_EQ(b["sum"], a["sum"]);
}

TEST_F(ArenaProtocolTest, AnotherModelIsRefusedWhileMappedAndReplacedOnceUnused) {
  Child holder = StartEngine("none", /*hold=*/true);
  ASSERT_TRUE(holder.WaitForOutput("HOLDING", 60)) << holder.Output();
  ScopedDataFile other(kModelBytes, 2);       // same size, another model
  ScopedDataFile bigger(kModelBytes * 2, 3);  // another size
  for (const std::string& path : {other.path(), bigger.path()}) {
    Child rival = StartEngine("none", false, path);
    nlohmann::json r = Finish(rival, 1);
    std::string error = r["error"];
    EXPECT_EQ(r["code"], "busy");
    EXPECT_NE(error.find(arena_.path()), std::string::npos) << error;
    EXPECT_NE(error.find(model_.path()), std::string::npos)
        << "names the model in the file: " << error;
    EXPECT_NE(error.find(path), std::string::npos) << "names the wanted model: " << error;
  }
  Release();
  Finish(holder);
  Child replacer = StartEngine("none", false, bigger.path());
  nlohmann::json r = Finish(replacer);
  EXPECT_EQ(r["role"], "loaded");
  EXPECT_EQ(r["sum"], FileSum(bigger.path()));
}

// Field lesson 002: a stale file is replaced by unlinking it, never by truncating it under a
// mapping: an old engine that maps the file without taking our locks (lesson 002's V1 engine)
// counts as no user, and must keep reading the bytes it mapped instead of taking a SIGBUS or
// seeing the new model. Two rounds: a file of an older format version (same model), then
// another model.
TEST_F(ArenaProtocolTest, ReplacementUnlinksAndNeverTruncatesUnderALocklessMapping) {
  ArenaOptions options;
  options.shared_path = arena_.path();
  ModelSpec spec;
  spec.files = {model_.path()};
  spec.format = ModelFormat::kRaw;
  {
    ASSERT_OK_AND_ASSIGN(Arena a, Arena::Open(spec, options));
    ASSERT_EQ(a.role(), ArenaRole::kLoaded);
  }
  // Maps the file at the path as an old engine would: no locks, read only.
  struct OldEngineMapping {
    int fd = -1;
    void* base = MAP_FAILED;
    size_t size = 0;
    ino_t inode = 0;
    ~OldEngineMapping() {
      if (base != MAP_FAILED) munmap(base, size);
      if (fd >= 0) close(fd);
    }
    std::span<const std::byte> data() const {
      return {static_cast<const std::byte*>(base) + format::kHeaderPageBytes, kModelBytes};
    }
    uint32_t version() const {
      uint32_t v = 0;
      std::memcpy(&v, static_cast<const char*>(base) + offsetof(format::HeaderFixed, version),
                  sizeof v);
      return v;
    }
  };
  auto map_old = [&](OldEngineMapping& m) {
    m.fd = open(arena_.path().c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(m.fd, 0) << std::strerror(errno);
    struct stat st;
    ASSERT_EQ(fstat(m.fd, &st), 0);
    m.size = static_cast<size_t>(st.st_size);
    m.inode = st.st_ino;
    m.base = mmap(nullptr, m.size, PROT_READ, MAP_SHARED, m.fd, 0);
    ASSERT_NE(m.base, MAP_FAILED) << std::strerror(errno);
  };
  struct stat now;

  // Round 1: the file says format version 1.
  OldEngineMapping v1;
  map_old(v1);
  const uint32_t old_version = 1;
  {
    // Through a writable shared mapping: hugetlbfs has no write(2).
    void* w = mmap(nullptr, v1.size, PROT_READ | PROT_WRITE, MAP_SHARED, v1.fd, 0);
    ASSERT_NE(w, MAP_FAILED) << std::strerror(errno);
    std::memcpy(static_cast<char*>(w) + offsetof(format::HeaderFixed, version), &old_version,
                sizeof old_version);
    munmap(w, v1.size);
  }
  const std::string model_sum = FileSum(model_.path());
  ASSERT_EQ(HexSum(v1.data()), model_sum);
  {
    ASSERT_OK_AND_ASSIGN(Arena b, Arena::Open(spec, options));
    EXPECT_EQ(b.role(), ArenaRole::kLoaded) << "a version 1 file must not be attached";
    EXPECT_EQ(HexSum(b.tensor(0).bytes), model_sum);
  }
  ASSERT_EQ(stat(arena_.path().c_str(), &now), 0);
  EXPECT_NE(now.st_ino, v1.inode) << "replaced in place, not unlinked";
  EXPECT_EQ(v1.version(), old_version) << "the old engine's mapping now shows the new file";
  EXPECT_EQ(HexSum(v1.data()), model_sum);

  // Round 2: another model replaces the (unused) file of this one.
  OldEngineMapping current;
  map_old(current);
  ScopedDataFile other(kModelBytes, 2);
  ModelSpec other_spec;
  other_spec.files = {other.path()};
  other_spec.format = ModelFormat::kRaw;
  {
    ASSERT_OK_AND_ASSIGN(Arena c, Arena::Open(other_spec, options));
    EXPECT_EQ(c.role(), ArenaRole::kLoaded);
    EXPECT_EQ(HexSum(c.tensor(0).bytes), FileSum(other.path()));
  }
  ASSERT_EQ(stat(arena_.path().c_str(), &now), 0);
  EXPECT_NE(now.st_ino, current.inode);
  EXPECT_EQ(HexSum(current.data()), model_sum) << "the old mapping lost the bytes it mapped";
  EXPECT_EQ(HexSum(v1.data()), model_sum);
}

TEST_F(ArenaProtocolTest, LoaderKilledBeforePublishingLeavesTheFileToTheNextEngine) {
  Child loader = StartEngine("hang");
  ASSERT_TRUE(loader.WaitForOutput("LOADING", 60)) << loader.Output();
  // Two engines arrive while it loads; both wait on its FILL lock.
  Child b = StartEngine();
  Child c = StartEngine();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  loader.Kill(SIGKILL);
  EXPECT_EQ(loader.Wait(30), 128 + SIGKILL);
  nlohmann::json rb = Finish(b);
  nlohmann::json rc = Finish(c);
  std::multiset<std::string> roles = {rb["role"], rc["role"]};
  EXPECT_EQ(roles, (std::multiset<std::string>{"attached", "loaded"})) << rb.dump() << "\n"
                                                                       << rc.dump();
  EXPECT_EQ(rb["sum"], FileSum(model_.path()));
  EXPECT_EQ(rc["sum"], rb["sum"]);
  ASSERT_OK_AND_ASSIGN(auto info, arena::InspectArenaFile(arena_.path()));
  EXPECT_EQ(info.state, "published");
}

TEST_F(ArenaProtocolTest, EightEnginesAtOnceOnAFreshFileLoadOnce) {
  std::vector<Child> engines;
  for (int i = 0; i < 8; ++i) engines.push_back(StartEngine());
  int loaded = 0;
  std::set<std::string> sums;
  for (Child& e : engines) {
    nlohmann::json r = Finish(e);
    loaded += r["role"] == "loaded";
    sums.insert(r["sum"].get<std::string>());
    if (r["role"] == "attached") {
      EXPECT_EQ(r["bytes_read"], 0);
    }
  }
  EXPECT_EQ(loaded, 1);
  EXPECT_EQ(sums, std::set<std::string>{FileSum(model_.path())});
}

TEST_F(ArenaProtocolTest, WaitTimesOutWithAClearMessage) {
  Child loader = StartEngine("hang");
  ASSERT_TRUE(loader.WaitForOutput("LOADING", 60)) << loader.Output();
  Child waiter = SpawnRole("engine", {arena_.path(), model_.path(), "none", "-", "auto", "0.5"});
  nlohmann::json r = Finish(waiter, 1);
  EXPECT_EQ(r["code"], "timed out");
  std::string error = r["error"];
  EXPECT_NE(error.find("pid " + std::to_string(loader.pid())), std::string::npos) << error;
  loader.Kill(SIGKILL);
  loader.Wait(30);
}

TEST_F(ArenaProtocolTest, RmRefusesWhileInUseAndRemovesOnceUnused) {
  Child holder = StartEngine("none", true);
  ASSERT_TRUE(holder.WaitForOutput("HOLDING", 60)) << holder.Output();
  Status s = arena::RemoveArenaFile(arena_.path());
  EXPECT_EQ(s.code(), StatusCode::kBusy) << s.ToString();
  ASSERT_OK_AND_ASSIGN(auto info, arena::InspectArenaFile(arena_.path()));
  EXPECT_TRUE(info.in_use);
  Release();
  Finish(holder);
  ASSERT_OK(arena::RemoveArenaFile(arena_.path()));
  struct stat st;
  EXPECT_NE(stat(arena_.path().c_str(), &st), 0);
}

// An engine replaces the file (unlink, create anew) between rm's open and its locks: rm must
// not unlink the new file, which that engine is loading or using.
TEST_F(ArenaProtocolTest, RmLeavesAFileThatReplacedTheOneItOpened) {
  Child loader = StartEngine();
  Finish(loader);
  std::string replaced_by;
  arena::test_hooks::SetAfterRemoveOpened([&] {
    ASSERT_EQ(unlink(arena_.path().c_str()), 0);
    Child again = StartEngine();  // finds no file: loads a new one at the path
    replaced_by = Finish(again).value("role", "");
  });
  Status s = arena::RemoveArenaFile(arena_.path());
  arena::test_hooks::SetAfterRemoveOpened(nullptr);
  EXPECT_EQ(replaced_by, "loaded");
  EXPECT_EQ(s.code(), StatusCode::kBusy) << s.ToString();
  EXPECT_NE(s.message().find("replaced"), std::string::npos) << s.ToString();
  ASSERT_OK_AND_ASSIGN(auto info, arena::InspectArenaFile(arena_.path()));
  EXPECT_EQ(info.state, "published");
  ASSERT_OK(arena::RemoveArenaFile(arena_.path()));  // and rm again removes it
}

// `expert-arena sweep` on an arena directory: the file a killed loader left unpublished is
// removed; a published arena (a restart attaches to it), one being loaded right now and a file
// that is not an arena are left alone.
TEST_F(ArenaProtocolTest, SweepRemovesOnlyArenasALoaderLeftUnfinished) {
  std::string dir = ArenaTestDir() + "/ea-test-sweep-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr) << std::strerror(errno);
  struct RemovedAtEnd {  // declared first: goes after the files
    std::string dir;
    ~RemovedAtEnd() { std::filesystem::remove_all(dir); }
  } remove_dir{dir};
  ScopedPath published("published", dir), unfinished("unfinished", dir),
      loading("loading", dir), other("other", dir);
  auto engine = [&](const ScopedPath& at, const std::string& hook) {
    return SpawnRole("engine", {at.path(), model_.path(), hook, "-"});
  };
  Child a = engine(published, "none");
  Finish(a);
  Child dead = engine(unfinished, "hang");
  ASSERT_TRUE(dead.WaitForOutput("LOADING", 60)) << dead.Output();
  dead.Kill(SIGKILL);
  dead.Wait(30);
  Child busy = engine(loading, "hang");
  ASSERT_TRUE(busy.WaitForOutput("LOADING", 60)) << busy.Output();
  std::string not_arena(8192, 'x');
  std::ofstream(other.path()) << not_arena;

  ASSERT_OK_AND_ASSIGN(auto report, arena::SweepArenaFiles(dir));
  EXPECT_EQ(report.removed, std::vector<std::string>{unfinished.path()});
  EXPECT_GE(report.removed_bytes, kModelBytes);
  EXPECT_EQ(std::set<std::string>(report.kept.begin(), report.kept.end()),
            (std::set<std::string>{published.path(), loading.path()}));
  struct stat st;
  EXPECT_NE(stat(unfinished.path().c_str(), &st), 0);
  EXPECT_EQ(stat(published.path().c_str(), &st), 0);
  EXPECT_EQ(stat(loading.path().c_str(), &st), 0);
  EXPECT_EQ(stat(other.path().c_str(), &st), 0);
  ASSERT_OK_AND_ASSIGN(auto info, arena::InspectArenaFile(published.path()));
  EXPECT_EQ(info.state, "published");

  busy.Kill(SIGKILL);
  busy.Wait(30);
  // The CLI says the same, and a second sweep finds the killed loader's file too.
  const std::string tool = BinDir() + "/expert-arena";
  if (!std::filesystem::exists(tool)) GTEST_SKIP() << "expert-arena not built: CLI part not run";
  Child cli = SpawnProgram(tool, {"sweep", dir});
  EXPECT_EQ(cli.Wait(60), 0) << cli.Output();
  EXPECT_NE(cli.Output().find(loading.path() + ": arena left unfinished by a loader that is gone"),
            std::string::npos)
      << cli.Output();
  EXPECT_NE(cli.Output().find("removed 1 unfinished arenas"), std::string::npos) << cli.Output();
  EXPECT_NE(stat(loading.path().c_str(), &st), 0);
  EXPECT_EQ(stat(published.path().c_str(), &st), 0);
}

// The copy-on-write mapping the Python views use: same bytes, written without a fault, and a
// write never reaches the shared mapping, the file or another engine.
TEST_F(ArenaProtocolTest, CopyOnWriteDataKeepsWritesInThisMapping) {
  ArenaOptions options;
  options.shared_path = arena_.path();
  ModelSpec spec;
  spec.files = {model_.path()};
  spec.format = ModelFormat::kRaw;
  ASSERT_OK_AND_ASSIGN(Arena loaded, Arena::Open(spec, options));
  ASSERT_OK_AND_ASSIGN(Arena attached, Arena::AttachExisting(arena_.path(), options));
  const std::string sum = FileSum(model_.path());
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> copy, attached.CopyOnWriteData());
  ASSERT_EQ(copy.size(), attached.data().size());
  EXPECT_NE(copy.data(), attached.data().data());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(copy.data()) % kHugePageBytes, 0u);
  const uint64_t size = attached.tensor(0).bytes.size();
  EXPECT_EQ(HexSum(copy.first(size)), sum);
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> again, attached.CopyOnWriteData());
  EXPECT_EQ(again.data(), copy.data());  // made once
  std::memset(copy.data(), 0x5a, 3 * 4096 + 17);
  EXPECT_NE(HexSum(copy.first(size)), sum);
  EXPECT_EQ(HexSum(attached.tensor(0).bytes), sum);
  EXPECT_EQ(HexSum(loaded.tensor(0).bytes), sum);
  ASSERT_OK_AND_ASSIGN(Arena third, Arena::AttachExisting(arena_.path(), options));
  EXPECT_EQ(HexSum(third.tensor(0).bytes), sum);
  // A private arena's own memory is made writable instead.
  ASSERT_OK_AND_ASSIGN(Arena private_arena, Arena::Open(spec, ArenaOptions{}));
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> own, private_arena.CopyOnWriteData());
  EXPECT_EQ(own.data(), private_arena.data().data());
  own[0] = std::byte{1};
  EXPECT_EQ(private_arena.data()[0], std::byte{1});
}

TEST_F(ArenaProtocolTest, PrivateArenaHasTheSameViews) {
  ModelSpec spec;
  spec.files = {model_.path()};
  spec.format = ModelFormat::kRaw;
  ArenaOptions options;
  ASSERT_OK_AND_ASSIGN(Arena arena, Arena::Open(spec, options));
  EXPECT_EQ(arena.role(), ArenaRole::kPrivate);
  EXPECT_EQ(HexSum(arena.tensor(0).bytes), FileSum(model_.path()));
  EXPECT_EQ(arena.tensor(0).checksum,
            XXH3_64bits(arena.tensor(0).bytes.data(), arena.tensor(0).bytes.size()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.data().data()) % kHugePageBytes, 0u);
  ASSERT_TRUE(arena.Find(arena.tensor(0).name).has_value());
  EXPECT_FALSE(arena.Find("no such tensor").has_value());
  // Past the last tensor: an empty view, never an exception out of the library.
  TensorView past = arena.tensor(arena.tensor_count());
  EXPECT_TRUE(past.name.empty());
  EXPECT_EQ(past.bytes.data(), nullptr);
}

TEST_F(ArenaProtocolTest, SymlinkAndForeignOwnerAreRefused) {
  ScopedPath link("link");
  if (symlink("/dev/shm/ea-nonexistent-target", link.path().c_str()) != 0) {
    GTEST_SKIP() << "this filesystem has no symlinks: " << std::strerror(errno);
  }
  ModelSpec spec;
  spec.files = {model_.path()};
  spec.format = ModelFormat::kRaw;
  ArenaOptions options;
  options.shared_path = link.path();
  auto refused = Arena::Open(spec, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("symbolic link"), std::string::npos);
  struct stat st;
  EXPECT_NE(stat("/dev/shm/ea-nonexistent-target", &st), 0) << "nothing created through the link";

  if (geteuid() != 0) GTEST_SKIP() << "foreign owner check needs root to chown";
  options.shared_path = arena_.path();
  { ASSERT_OK(Arena::Open(spec, options)); }
  ASSERT_EQ(chown(arena_.path().c_str(), 65534, 65534), 0);
  auto foreign = Arena::Open(spec, options);
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("owned by uid 65534"), std::string::npos)
      << foreign.status().message();
  options.allow_foreign_owner = true;
  ASSERT_OK_AND_ASSIGN(Arena opted, Arena::Open(spec, options));
  EXPECT_EQ(opted.role(), ArenaRole::kAttached);
}

// ---- damaged files ----------------------------------------------------------------------

class DamagedArenaTest : public ArenaProtocolTest {
 protected:
  // A published arena, then `damage` applied to the file through a writable shared mapping
  // (hugetlbfs has no write(2)) or ftruncate.
  void PublishThenDamage(const std::function<void(int fd, uint64_t size)>& damage) {
    ModelSpec spec;
    spec.files = {model_.path()};
    spec.format = ModelFormat::kRaw;
    ArenaOptions options;
    options.shared_path = arena_.path();
    { ASSERT_OK(Arena::Open(spec, options)); }
    int fd = open(arena_.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    struct stat st;
    fstat(fd, &st);
    damage(fd, static_cast<uint64_t>(st.st_size));
    close(fd);
  }
  // Attaching without a model refuses with a message naming the file; loading with the
  // model replaces the damaged file (nobody maps it) and gives the right bytes.
  void ExpectRefusedThenReplaced(const std::string& expected_words) {
    ArenaOptions options;
    options.progress = false;
    auto attach = Arena::AttachExisting(arena_.path(), options);
    ASSERT_FALSE(attach.ok());
    EXPECT_NE(attach.status().message().find(arena_.path()), std::string::npos)
        << attach.status().message();
    EXPECT_NE(attach.status().message().find(expected_words), std::string::npos)
        << attach.status().message();
    ASSERT_OK_AND_ASSIGN(auto info, arena::InspectArenaFile(arena_.path()));
    EXPECT_NE(info.state, "published");
    Child engine = StartEngine();
    nlohmann::json r = Finish(engine);
    EXPECT_EQ(r["role"], "loaded");
    EXPECT_EQ(r["sum"], FileSum(model_.path()));
  }
};

// Writes `bytes` at `offset` of the file through a shared mapping of its first 2 MiB pages.
void WriteThroughMapping(int fd, uint64_t offset, const void* bytes, size_t n) {
  uint64_t span = (offset + n + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED) << std::strerror(errno);
  std::memcpy(static_cast<char*>(p) + offset, bytes, n);
  munmap(p, span);
}

TEST_F(DamagedArenaTest, Truncated) {
  PublishThenDamage([](int fd, uint64_t size) {
    // Whole 2 MiB pages, so hugetlbfs accepts the truncation too.
    ASSERT_EQ(ftruncate(fd, size / 2 / kHugePageBytes * kHugePageBytes), 0);
  });
  ExpectRefusedThenReplaced("bytes");
}

TEST_F(DamagedArenaTest, TruncatedInsideTheHeader) {
  bool truncated = true;
  PublishThenDamage([&](int fd, uint64_t) { truncated = ftruncate(fd, 100) == 0; });
  if (!truncated) GTEST_SKIP() << "this filesystem truncates only to whole huge pages";
  ExpectRefusedThenReplaced("");
}

TEST_F(DamagedArenaTest, CorruptedHeader) {
  PublishThenDamage([](int fd, uint64_t) {
    char junk[16] = "garbage";
    WriteThroughMapping(fd, 600, junk, sizeof junk);
  });
  ExpectRefusedThenReplaced("checksum");
}

TEST_F(DamagedArenaTest, WrongMagic) {
  PublishThenDamage([](int fd, uint64_t) { WriteThroughMapping(fd, 0, "NOTARENA", 8); });
  ExpectRefusedThenReplaced("not an expert-arena file");
}

TEST_F(DamagedArenaTest, OffsetsPastTheEnd) {
  PublishThenDamage([](int fd, uint64_t) {
    format::HeaderFixed fixed;
    ASSERT_EQ(pread(fd, &fixed, sizeof fixed, 0), static_cast<ssize_t>(sizeof fixed));
    fixed.tensors_offset = UINT64_MAX - 64;  // a hostile header with a valid checksum
    fixed.header_checksum = 0;
    fixed.header_checksum = XXH3_64bits(&fixed, sizeof fixed);
    WriteThroughMapping(fd, 0, &fixed, sizeof fixed);
  });
  ExpectRefusedThenReplaced("outside");
}

TEST_F(DamagedArenaTest, CorruptedDataFailsVerifyNamingTheTensor) {
  PublishThenDamage(
      [](int fd, uint64_t) { WriteThroughMapping(fd, format::kHeaderPageBytes + 12345, "x", 1); });
  format::ArenaTable table;
  ASSERT_OK_AND_ASSIGN(int64_t bad, arena::VerifyArenaFile(arena_.path(), &table));
  ASSERT_EQ(bad, 0);
  EXPECT_EQ(table.tensors[0].name, std::filesystem::path(model_.path()).filename().string());
}

}  // namespace
}  // namespace expert_arena::testing
