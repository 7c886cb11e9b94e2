// A loader in a memory cgroup too small for the arena: refused before it writes a page (exit 1,
// the cgroup, its limit and usage, the arena's size and the fixes named, no file left), where it
// used to be OOM-killed part-way with no message. An engine attaching from such a cgroup works:
// the pages are charged to whoever made them. Real cgroups, made and removed here.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "../arena/engine_role.h"
#include "common/units.h"
#include "contain.h"

namespace expert_arena::testing {
namespace {

EA_CHILD_ROLE(engine) { return EngineRole(args); }

// An engine-made arena's builder that holds its own copy of each tensor (`count` x 64 MiB,
// written) and, with `mode` "frees", lets each go once it is written into the arena (and says
// so: EngineArenaSpec::freed_as_written); "keeps" holds them all. args: arena path, mode,
// count. Prints {"ok", "error", "code", "charge"}.
EA_CHILD_ROLE(freeing_builder) {
  const std::string& path = args.at(0);
  const bool frees = args.at(1) == "frees";
  const int count = std::stoi(args.at(2));
  constexpr uint64_t kEach = 64 * kMiB;
  std::vector<std::byte*> own;
  for (int i = 0; i < count; ++i) {
    void* p = ::mmap(nullptr, kEach, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 2;
    std::memset(p, 0x30 + i, kEach);
    own.push_back(static_cast<std::byte*>(p));
  }
  EngineArenaSpec spec;
  spec.identity = "freeing builder";
  spec.pages_as_written = true;
  spec.freed_as_written = frees ? count * kEach : 0;
  spec.declare = [&]() -> Result<std::vector<EngineTensor>> {
    std::vector<EngineTensor> out;
    for (int i = 0; i < count; ++i) out.push_back({"t" + std::to_string(i), "U8", {kEach}, kEach});
    return out;
  };
  spec.fill = [&](std::span<const WritableTensor> views) -> Status {
    for (size_t i = 0; i < views.size(); ++i) {
      EA_RETURN_IF_ERROR(views[i].make_pages());
      std::memcpy(views[i].bytes.data(), own[i], kEach);
      if (frees) {
        ::munmap(own[i], kEach);
        own[i] = nullptr;
      }
    }
    return Status::Ok();
  };
  ArenaOptions options;
  options.shared_path = path;
  options.progress = false;
  auto arena = Arena::OpenEngine(spec, options);
  nlohmann::json j;
  j["ok"] = arena.ok();
  if (arena.ok()) {
    j["charge"] = arena->report().charge_note;
    bool exact = true;
    for (int i = 0; i < count; ++i) {
      TensorView v = arena->tensor(i);
      exact = exact && v.bytes.front() == static_cast<std::byte>(0x30 + i) &&
              v.bytes.back() == static_cast<std::byte>(0x30 + i);
    }
    j["exact"] = exact;
  } else {
    j["error"] = arena.status().message();
    j["code"] = StatusCodeName(arena.status().code());
  }
  std::printf("%s\n", j.dump().c_str());
  return arena.ok() ? 0 : 1;
}

// 224 MiB of tensor data: a 226 MiB arena file (one 2 MiB header page). The limit leaves a
// process room for itself under AddressSanitizer too: the instrumented CLI is charged 73 MiB
// before it opens anything (the plain one 1 MiB; 2026-12-04), so a 64 MiB limit killed it at
// start.
constexpr uint64_t kModelBytes = 224 * kMiB;
constexpr uint64_t kSmallLimit = 160 * kMiB;

class CgroupTest : public ::testing::Test {
 protected:
  CgroupTest() : model_(kModelBytes, 19), dir_("cgroup") {}
  void SetUp() override {
    if (!cgroup_.ok()) EA_SKIP_OR_FAIL_IN_CI("memory cgroups: " + cgroup_.skip_reason());
    // Only this test's processes are in it: usage starts near 0, so the limit is what counts.
    const std::string limit_file = cgroup_.version() == 1 ? "memory.limit_in_bytes" : "memory.max";
    ASSERT_TRUE(cgroup_.Write(limit_file, std::to_string(kSmallLimit)));
  }
  std::string Arena() const { return dir_.File("model.arena"); }

  ScopedDataFile model_;
  ScopedArenaDir dir_;
  ScopedCgroup cgroup_;
};

TEST_F(CgroupTest, LoaderOverTheLimitIsRefusedWithTheFixesAndLeavesNoFile) {
  Containment in_cgroup{.cgroup = cgroup_.dir(), .stderr_to_stdout = true};
  Child loader =
      SpawnContained(in_cgroup, BinDir() + "/expert-arena",
                     {"load", "--model", model_.path(), "--format", "raw", "--arena", Arena()});
  int code = loader.Wait(120);
  const std::string& out = loader.Output();
  EXPECT_EQ(code, 1) << "refused, not OOM-killed (137): " << out;
  for (const std::string& word :
       {cgroup_.path(), std::string("160.0 MiB"), std::string("226.0 MiB"), std::string("in use"),
        std::string("--hold"), std::string("DaemonSet"), std::string("raise"),
        std::string("hugetlbfs"), std::string("nothing published")}) {
    EXPECT_NE(out.find(word), std::string::npos) << "'" << word << "' in: " << out;
  }
  EXPECT_TRUE(dir_.entries().empty()) << "no partial arena file is left";
}

TEST_F(CgroupTest, EngineOverTheLimitIsRefusedToo) {
  Child engine =
      SpawnContained({.cgroup = cgroup_.dir()}, "engine", {Arena(), model_.path(), "none", "-"});
  EXPECT_EQ(engine.Wait(120), 1) << engine.Output();
  nlohmann::json j = ParseEngineOutput(engine.Output());
  EXPECT_EQ(j["code"], "no space") << engine.Output();
  EXPECT_NE(j["error"].get<std::string>().find(cgroup_.path()), std::string::npos) << j;
  EXPECT_TRUE(dir_.entries().empty());
}

// A builder that frees its own copy of each tensor as it writes holds the model about once:
// the check counts the build's peak, so a limit that holds the model and a part of it more
// (not two models) lets it build, where one that keeps its copies is refused as before.
TEST_F(CgroupTest, ABuilderThatFreesAsItWritesBuildsUnderALimitBelowTwoModels) {
  // 768 MiB of the engine's own tensors; 1.4 GiB holds them and the pages made ahead of the
  // writes (320 MiB and a 64 MiB tensor), not them and a 770 MiB arena.
  const std::string limit_file = cgroup_.version() == 1 ? "memory.limit_in_bytes" : "memory.max";
  ASSERT_TRUE(cgroup_.Write(limit_file, std::to_string(1434 * kMiB)));
  Child keeps = SpawnContained({.cgroup = cgroup_.dir()}, "freeing_builder",
                               {Arena(), "keeps", "12"});
  EXPECT_EQ(keeps.Wait(120), 1) << "refused, not OOM-killed: " << keeps.Output();
  nlohmann::json k = ParseEngineOutput(keeps.Output());
  EXPECT_EQ(k["code"], "no space") << keeps.Output();
  EXPECT_TRUE(dir_.entries().empty());

  Child frees = SpawnContained({.cgroup = cgroup_.dir()}, "freeing_builder",
                               {Arena(), "frees", "12"});
  ASSERT_EQ(frees.Wait(120), 0) << frees.Output();
  nlohmann::json f = ParseEngineOutput(frees.Output());
  EXPECT_TRUE(f["ok"]) << frees.Output();
  EXPECT_TRUE(f["exact"]) << frees.Output();
  EXPECT_NE(f["charge"].get<std::string>().find("at the build's peak"), std::string::npos) << f;
  std::filesystem::remove(Arena());
}

TEST_F(CgroupTest, AttachingUnderALimitBelowTheArenaWorks) {
  // Loaded outside the limit (this test process: the holder), attached from inside it.
  Child loader = SpawnRole("engine", {Arena(), model_.path(), "none", "-"});
  ASSERT_EQ(loader.Wait(120), 0) << loader.Output();
  nlohmann::json l = ParseEngineOutput(loader.Output());
  ASSERT_EQ(l["role"], "loaded");
  Child attacher =
      SpawnContained({.cgroup = cgroup_.dir()}, "engine", {Arena(), model_.path(), "none", "-"});
  ASSERT_EQ(attacher.Wait(120), 0)
      << "an attacher is not charged for the arena: " << attacher.Output();
  nlohmann::json a = ParseEngineOutput(attacher.Output());
  EXPECT_EQ(a["role"], "attached");
  EXPECT_EQ(a["sum"], l["sum"]);
  EXPECT_EQ(a["sum"], FileSum(model_.path()));
}

TEST_F(CgroupTest, LoaderWithRoomSaysWhereTheChargeGoes) {
  const std::string limit_file = cgroup_.version() == 1 ? "memory.limit_in_bytes" : "memory.max";
  ASSERT_TRUE(cgroup_.Write(limit_file, std::to_string(512 * kMiB)));
  Child loader =
      SpawnContained({.cgroup = cgroup_.dir()}, "engine", {Arena(), model_.path(), "none", "-"});
  ASSERT_EQ(loader.Wait(120), 0) << loader.Output();
  nlohmann::json j = ParseEngineOutput(loader.Output());
  EXPECT_EQ(j["role"], "loaded");
  const std::string line = j["line"].get<std::string>();
  EXPECT_NE(line.find("memory: charged to memory cgroup " + cgroup_.path()), std::string::npos)
      << line;
  std::filesystem::remove(Arena());  // its pages are charged to the cgroup until it goes
}

// hugetlbfs pages are charged to the hugetlb controller: a loader whose hugetlb.2MB limit is 0
// (what Kubernetes gives a pod that requests no hugepages-2Mi) is refused before it faults a
// page, naming the controller's file and the Kubernetes request that fixes it.
TEST(HugetlbCgroupTest, LoaderWithoutAHugepageLimitIsRefused) {
  ScopedCgroup cgroup("hugetlb");
  if (!cgroup.ok()) EA_SKIP_OR_FAIL_IN_CI("hugetlb cgroup: " + cgroup.skip_reason());
  const std::string limit_file =
      cgroup.version() == 1 ? "hugetlb.2MB.limit_in_bytes" : "hugetlb.2MB.max";
  ASSERT_TRUE(cgroup.Write(limit_file, "0"));
  ScopedMount mount(ScopedMount::Kind::kHugetlbfs, 64 * kMiB);
  if (!mount.ok()) EA_SKIP_OR_FAIL_IN_CI("hugetlbfs: " + mount.skip_reason());
  ScopedDataFile model(8 * kMiB, 31);
  ScopedPath arena("hugetlb", mount.dir());
  Child loader = SpawnContained({.cgroup = cgroup.dir()}, "engine",
                                {arena.path(), model.path(), "none", "-"});
  EXPECT_EQ(loader.Wait(120), 1) << loader.Output();
  nlohmann::json j = ParseEngineOutput(loader.Output());
  const std::string why = j["error"].is_string() ? j["error"].get<std::string>() : "";
  for (const std::string& word :
       {cgroup.path(), limit_file, std::string("hugepages-2Mi"), std::string("--hold")}) {
    EXPECT_NE(why.find(word), std::string::npos) << "'" << word << "' in: " << loader.Output();
  }
  struct stat st;
  EXPECT_NE(stat(arena.path().c_str(), &st), 0) << "no file left";
}

}  // namespace
}  // namespace expert_arena::testing
