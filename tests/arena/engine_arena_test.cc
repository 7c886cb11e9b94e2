// Engine-made arenas (Arena::OpenEngine): tensors an engine made itself, published once and
// attached by every other engine, in real processes.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "expert_arena/arena.h"
#include "gtest/gtest.h"
#include "platform/mapping.h"
#include "platform/system_info.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::Child;
using testing::ScopedArenaDir;
using testing::SpawnRole;

// The engine's "transform": tensor i holds bytes (seed + i + j) for j = 0...
std::vector<EngineTensor> Declared(uint64_t bytes_each) {
  std::vector<EngineTensor> out;
  for (int i = 0; i < 4; ++i) {
    EngineTensor t;
    t.name = "layers." + std::to_string(i) + ".mlp.experts.w13_weight";
    t.dtype = "BF16";
    t.shape = {8, 2, bytes_each / 16};
    t.bytes = bytes_each;
    out.push_back(t);
  }
  EngineTensor scale{"layers.0.scale", "F32", {3}, 12, 64};
  out.push_back(scale);
  return out;
}

Status FillPattern(std::span<const WritableTensor> views, uint8_t seed) {
  for (size_t i = 0; i < views.size(); ++i) {
    for (size_t j = 0; j < views[i].bytes.size(); ++j) {
      views[i].bytes[j] = static_cast<std::byte>(seed + i + j);
    }
  }
  return Status::Ok();
}

bool HoldsPattern(const Arena& arena, uint8_t seed) {
  for (size_t i = 0; i < arena.tensor_count(); ++i) {
    TensorView v = arena.tensor(i);
    for (size_t j = 0; j < v.bytes.size(); ++j) {
      if (v.bytes[j] != static_cast<std::byte>(seed + i + j)) return false;
    }
  }
  return true;
}

struct Counted {
  int declared = 0;
  int filled = 0;
};

EngineArenaSpec Spec(const std::string& identity, std::vector<std::string> files, uint8_t seed,
                     Counted* counted, uint64_t bytes_each = 3 * 1024 * 1024) {
  EngineArenaSpec spec;
  spec.identity = identity;
  spec.files = std::move(files);
  spec.declare = [=]() -> Result<std::vector<EngineTensor>> {
    if (counted != nullptr) ++counted->declared;
    return Declared(bytes_each);
  };
  spec.fill = [=](std::span<const WritableTensor> views) {
    if (counted != nullptr) ++counted->filled;
    return FillPattern(views, seed);
  };
  return spec;
}

ArenaOptions Options(const std::string& path) {
  ArenaOptions o;
  o.shared_path = path;
  o.progress = false;
  o.wait_timeout_seconds = 60;
  return o;
}

// args: arena path, identity, checkpoint file, seed, mode ("run", "hold FILE", "die-in-fill",
// "fail-in-fill", "sleep-in-declare"; with confirm_after_run: "confirm", "die-before-confirm",
// "fail-in-run REASON", "confirm-after FILE" (confirms once FILE exists), "note FILE" (says
// whether FILE existed when the arena opened)). Prints one JSON line.
EA_CHILD_ROLE(engine_arena) {
  const std::string& path = args.at(0);
  const std::string& identity = args.at(1);
  const std::string& file = args.at(2);
  const uint8_t seed = static_cast<uint8_t>(std::stoi(args.at(3)));
  const std::string& mode = args.at(4);
  Counted counted;
  EngineArenaSpec spec = Spec(identity, {file}, seed, &counted);
  if (mode == "die-in-fill") {
    spec.fill = [](std::span<const WritableTensor> views) {
      views[0].bytes[0] = std::byte{1};
      std::printf("{\"filling\":true}\n");
      std::fflush(stdout);
      kill(getpid(), SIGKILL);
      return Status::Ok();
    };
  } else if (mode == "fail-in-fill") {
    spec.fill = [](std::span<const WritableTensor>) { return Internal("out of engine memory"); };
  } else if (mode == "sleep-in-declare") {
    spec.declare = [&]() -> Result<std::vector<EngineTensor>> {
      ++counted.declared;
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      return Declared(3 * 1024 * 1024);
    };
  }
  const bool confirming = mode == "confirm" || mode == "die-before-confirm" ||
                          mode.starts_with("fail-in-run ") || mode.starts_with("confirm-after ") ||
                          mode.starts_with("note ");
  spec.confirm_after_run = confirming;
  auto arena = Arena::OpenEngine(spec, Options(path));
  nlohmann::json j;
  if (mode.starts_with("note ")) j["noted"] = std::filesystem::exists(mode.substr(5));
  if (arena.ok() && confirming) {
    j["awaiting_confirm"] = arena->awaiting_confirm();
    // The engine's "first forwards": they read every view.
    j["ran"] = HoldsPattern(*arena, seed);
    if (mode == "die-before-confirm") {
      std::printf("{\"built\":true}\n");
      std::fflush(stdout);
      kill(getpid(), SIGKILL);
    }
    if (mode.starts_with("confirm-after ")) {
      std::printf("{\"built\":true}\n");
      std::fflush(stdout);
      const std::string release = mode.substr(14);
      while (!std::filesystem::exists(release)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    Status ended = mode.starts_with("fail-in-run ") ? arena->Abandon(mode.substr(12))
                                                    : arena->Confirm();
    j["ended"] = ended.ok();
    j["still_awaiting"] = arena->awaiting_confirm();
  }
  j["ok"] = arena.ok();
  if (!arena.ok()) {
    j["error"] = arena.status().message();
    j["code"] = static_cast<int>(arena.status().code());
  } else {
    j["role"] = ArenaRoleName(arena->role());
    j["declared"] = counted.declared;
    j["filled"] = counted.filled;
    j["pattern"] = HoldsPattern(*arena, seed);
    j["tensors"] = arena->tensor_count();
    j["identity"] = arena->report().identity;
  }
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  if (mode.starts_with("hold ")) {
    const std::string release = mode.substr(5);
    for (int i = 0; i < 3000 && !std::filesystem::exists(release); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return arena.ok() ? 0 : 3;
}

nlohmann::json Json(Child& child, int expected = 0) {
  int code = child.Wait(120);
  EXPECT_EQ(code, expected) << child.Output();
  const std::string& out = child.Output();
  size_t last = out.rfind('{');
  if (last == std::string::npos) return nlohmann::json::object();
  return nlohmann::json::parse(out.substr(last), nullptr, false);
}

class EngineArenaTest : public ::testing::Test {
 protected:
  EngineArenaTest() : dir_("engine") {
    checkpoint_ = "/tmp/ea-engine-ckpt-" + std::to_string(getpid()) + "-" +
                  ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".safetensors";
    WriteCheckpoint("{\"a\":1}");
  }
  ~EngineArenaTest() override {
    std::filesystem::remove(checkpoint_);
    std::filesystem::remove(release_);
  }
  void WriteCheckpoint(const std::string& header) {
    std::ofstream f(checkpoint_, std::ios::binary | std::ios::trunc);
    uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header << std::string(4096, 'x');
  }
  Child Engine(const std::string& mode = "run", const std::string& identity = "vllm 0.32 tp0/1",
               int seed = 7) {
    return SpawnRole("engine_arena",
                     {arena(), identity, checkpoint_, std::to_string(seed), mode});
  }
  std::string arena() const { return dir_.File("model.arena"); }

  ScopedArenaDir dir_;
  std::string checkpoint_;
  std::string release_ = "/tmp/ea-engine-release-" + std::to_string(getpid());
};

TEST_F(EngineArenaTest, FirstEngineBuildsTheOthersAttachWithoutDeclaring) {
  Child first = Engine();
  nlohmann::json a = Json(first);
  EXPECT_EQ(a["role"], "loaded");
  EXPECT_EQ(a["declared"], 1);
  EXPECT_EQ(a["filled"], 1);
  EXPECT_TRUE(a["pattern"]);
  EXPECT_EQ(a["tensors"], 5);
  // A restart, and another engine: attach, never declare or fill.
  for (int i = 0; i < 2; ++i) {
    Child again = Engine();
    nlohmann::json b = Json(again);
    EXPECT_EQ(b["role"], "attached") << b;
    EXPECT_EQ(b["declared"], 0);
    EXPECT_EQ(b["filled"], 0);
    EXPECT_TRUE(b["pattern"]);
  }
}

TEST_F(EngineArenaTest, EnginesStartedAtOnceBuildOnce) {
  std::vector<Child> engines;
  for (int i = 0; i < 4; ++i) engines.push_back(Engine("sleep-in-declare"));
  int loaded = 0, attached = 0, declared = 0;
  for (Child& c : engines) {
    nlohmann::json j = Json(c);
    loaded += j["role"] == "loaded";
    attached += j["role"] == "attached";
    declared += j.value("declared", 0);
    EXPECT_TRUE(j["pattern"]) << j;
  }
  EXPECT_EQ(loaded, 1);
  EXPECT_EQ(attached, 3);
  EXPECT_EQ(declared, 1);
}

TEST_F(EngineArenaTest, AnotherIdentityOrCheckpointIsAnotherArena) {
  Child first = Engine();
  EXPECT_EQ(Json(first)["role"], "loaded");
  // Another transform setting: the unused arena is replaced.
  Child other = Engine("run", "vllm 0.32 tp1/2", 9);
  nlohmann::json j = Json(other);
  EXPECT_EQ(j["role"], "loaded") << j;
  EXPECT_TRUE(j["pattern"]);
  // A changed checkpoint (another header): built again.
  WriteCheckpoint("{\"a\":2}");
  Child changed = Engine("run", "vllm 0.32 tp1/2", 9);
  EXPECT_EQ(Json(changed)["role"], "loaded");
  Child same = Engine("run", "vllm 0.32 tp1/2", 9);
  EXPECT_EQ(Json(same)["role"], "attached");
}

TEST_F(EngineArenaTest, AnotherIdentityInUseIsBusyAndBuildsNothing) {
  Child holder = Engine("hold " + release_);
  ASSERT_TRUE(holder.WaitForOutput("\"role\"", 60)) << holder.Output();
  Child other = Engine("run", "transformers 5.24 bf16", 9);
  nlohmann::json j = Json(other, 3);
  EXPECT_FALSE(j["ok"]);
  EXPECT_EQ(j["code"], static_cast<int>(StatusCode::kBusy));
  EXPECT_NE(j["error"].get<std::string>().find("in use by another engine"), std::string::npos) << j;
  std::ofstream(release_) << "go";
  EXPECT_EQ(holder.Wait(60), 0);
}

TEST_F(EngineArenaTest, AFailedBuildPublishesNothingAndLeavesNoFile) {
  Child failing = Engine("fail-in-fill");
  nlohmann::json j = Json(failing, 3);
  EXPECT_NE(j["error"].get<std::string>().find("out of engine memory"), std::string::npos) << j;
  EXPECT_TRUE(dir_.entries().empty());
  Child next = Engine();
  nlohmann::json k = Json(next);
  EXPECT_EQ(k["role"], "loaded");
  EXPECT_TRUE(k["pattern"]);
}

TEST_F(EngineArenaTest, ABuilderKilledMidFillLeavesNothingTheNextEngineTrusts) {
  Child dying = Engine("die-in-fill");
  EXPECT_EQ(dying.Wait(60), 128 + SIGKILL);
  Child next = Engine();
  nlohmann::json j = Json(next);
  EXPECT_EQ(j["role"], "loaded") << j;
  EXPECT_EQ(j["declared"], 1);
  EXPECT_TRUE(j["pattern"]);
}

// Publish only what runs: an engine that builds with confirm_after_run publishes the arena only
// when it confirms; the others wait for that.
TEST_F(EngineArenaTest, WaitingEnginesAttachOnlyOnceTheBuilderConfirmed) {
  Child builder = Engine("confirm-after " + release_);
  ASSERT_TRUE(builder.WaitForOutput("\"built\"", 60)) << builder.Output();
  Child waiter = Engine("note " + release_);
  // The waiter is blocked on FILL until the builder confirms, which it does only once the
  // release file exists: the waiter saw the file when its arena opened.
  std::ofstream(release_) << "go";
  nlohmann::json b = Json(builder);
  EXPECT_EQ(b["role"], "loaded") << b;
  EXPECT_TRUE(b["awaiting_confirm"]);
  EXPECT_TRUE(b["ended"]);
  EXPECT_FALSE(b["still_awaiting"]);
  nlohmann::json w = Json(waiter);
  EXPECT_EQ(w["role"], "attached") << w;
  EXPECT_TRUE(w["noted"]) << "attached before the builder confirmed: " << w;
  EXPECT_TRUE(w["pattern"]);
  EXPECT_FALSE(w["awaiting_confirm"]);
  // A restart attaches to the published arena.
  Child again = Engine("confirm");
  EXPECT_EQ(Json(again)["role"], "attached");
}

TEST_F(EngineArenaTest, ABuilderKilledBeforeConfirmingLeavesNothingTheNextEngineAttachesTo) {
  Child dying = Engine("die-before-confirm");
  EXPECT_EQ(dying.Wait(60), 128 + SIGKILL);
  ASSERT_NE(dying.Output().find("\"built\""), std::string::npos) << dying.Output();
  // The file is filled and checksummed, but never confirmed: the next engine rebuilds it.
  Child next = Engine("confirm");
  nlohmann::json j = Json(next);
  EXPECT_EQ(j["role"], "loaded") << j;
  EXPECT_EQ(j["declared"], 1);
  EXPECT_TRUE(j["pattern"]);
  Child after = Engine("confirm");
  EXPECT_EQ(Json(after)["role"], "attached");
}

TEST_F(EngineArenaTest, AFailedRunIsRebuiltOnceThenRefusedWithTheFirstFailure) {
  Child first = Engine("fail-in-run warm-up forward: NaN in layer 3");
  nlohmann::json a = Json(first);
  EXPECT_EQ(a["role"], "loaded") << a;
  EXPECT_TRUE(a["ended"]);
  // The next engine of this identity does not trust it: it builds again (once).
  Child second = Engine("fail-in-run the same NaN again");
  nlohmann::json b = Json(second);
  EXPECT_EQ(b["role"], "loaded") << b;
  EXPECT_EQ(b["declared"], 1);
  // A second failure of the same identity: refused with the first failure, nothing built.
  for (int i = 0; i < 2; ++i) {
    Child third = Engine("confirm");
    nlohmann::json c = Json(third, 3);
    EXPECT_FALSE(c["ok"]);
    EXPECT_EQ(c["code"], static_cast<int>(StatusCode::kInvalidArgument));
    const std::string error = c["error"].get<std::string>();
    EXPECT_NE(error.find("warm-up forward: NaN in layer 3"), std::string::npos) << error;
    EXPECT_NE(error.find("not building it a third time"), std::string::npos) << error;
  }
  // Another identity (a fixed configuration) replaces the record and builds.
  Child fixed = Engine("confirm", "vllm 0.32 tp0/1 fixed");
  EXPECT_EQ(Json(fixed)["role"], "loaded");
}

TEST(EngineArenaSpecTest, BadDeclarationsAreRefusedNamingTheTensor) {
  ScopedArenaDir dir("engine-bad");
  auto refuse = [&](std::vector<EngineTensor> tensors, const std::string& words) {
    EngineArenaSpec spec;
    spec.identity = "test";
    spec.declare = [=]() -> Result<std::vector<EngineTensor>> { return tensors; };
    spec.fill = [](std::span<const WritableTensor>) { return Status::Ok(); };
    auto arena = Arena::OpenEngine(spec, Options(dir.File("bad.arena")));
    ASSERT_FALSE(arena.ok());
    EXPECT_EQ(arena.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(arena.status().message().find(words), std::string::npos) << arena.status().message();
    EXPECT_TRUE(dir.entries().empty());
  };
  refuse({}, "no tensor");
  refuse({{"a", "F32", {1}, 4}, {"a", "F32", {1}, 4}}, "declared twice");
  refuse({{"a", "F32", {1}, 4, 3}}, "power of two");
  refuse({{"a", "", {1}, 4}}, "dtype");
  refuse({{"", "F32", {1}, 4}}, "declared tensor");
  refuse({{"a", "F32", {1, 1, 1, 1, 1, 1, 1, 1, 1}, 4}}, "dimensions");

  EngineArenaSpec spec = Spec("", {}, 1, nullptr);
  auto no_identity = Arena::OpenEngine(spec, Options(dir.File("x.arena")));
  EXPECT_NE(no_identity.status().message().find("needs an identity"), std::string::npos);
  spec.identity = "x";
  auto private_arena = Arena::OpenEngine(spec, ArenaOptions{});
  EXPECT_NE(private_arena.status().message().find("needs a shared path"), std::string::npos);
  spec.files = {"/nonexistent/model.safetensors"};
  auto missing = Arena::OpenEngine(spec, Options(dir.File("x.arena")));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/model.safetensors"), std::string::npos);
  // A declare that throws publishes nothing.
  spec.files = {};
  spec.declare = []() -> Result<std::vector<EngineTensor>> { throw std::runtime_error("boom"); };
  auto threw = Arena::OpenEngine(spec, Options(dir.File("x.arena")));
  EXPECT_NE(threw.status().message().find("boom"), std::string::npos);
  EXPECT_TRUE(dir.entries().empty());
}

// Bytes of the file at `path` that are allocated (tmpfs: its pages).
uint64_t AllocatedBytes(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

// pages_as_written: the pages of a tensor are made when the fill asks for them, so an engine
// that frees its own copy of each tensor once written holds the model once, not twice; with
// their 2 MiB pages made before each write (huge_after_build false) or after the build.
class PacedPagesTest : public ::testing::TestWithParam<bool> {};

INSTANTIATE_TEST_SUITE_P(HugeAfterBuild, PacedPagesTest, ::testing::Bool());

TEST_P(PacedPagesTest, PagesAreMadeAsTheFillAsksForThem) {
  const bool huge_after_build = GetParam();
  ScopedArenaDir dir("engine-pages");
  const std::string path = dir.File("paced.arena");
  constexpr uint64_t kEach = 128ull << 20;
  constexpr int kCount = 6;
  // The pages run up to 256 MiB ahead of the last ask, in 64 MiB pieces.
  constexpr uint64_t kAhead = (256ull + 128) << 20;
  EngineArenaSpec spec;
  spec.identity = "paced";
  spec.pages_as_written = true;
  spec.huge_after_build = huge_after_build;
  spec.declare = []() -> Result<std::vector<EngineTensor>> {
    std::vector<EngineTensor> out;
    for (int i = 0; i < kCount; ++i) {
      out.push_back({"t" + std::to_string(i), "U8", {kEach}, kEach, 0});
    }
    return out;
  };
  std::vector<uint64_t> before, after;
  spec.fill = [&](std::span<const WritableTensor> views) -> Status {
    for (size_t i = 0; i < views.size(); ++i) {
      before.push_back(AllocatedBytes(path));
      EA_RETURN_IF_ERROR(views[i].make_pages());
      after.push_back(AllocatedBytes(path));
      std::memset(views[i].bytes.data(), static_cast<int>(0x40 + i), views[i].bytes.size());
    }
    return Status::Ok();
  };
  auto arena = Arena::OpenEngine(spec, Options(path));
  ASSERT_TRUE(arena.ok()) << arena.status().message();
  for (size_t i = 0; i < kCount; ++i) {
    TensorView v = arena->tensor(i);
    ASSERT_EQ(v.bytes.size(), kEach);
    EXPECT_EQ(v.bytes.front(), static_cast<std::byte>(0x40 + i));
    EXPECT_EQ(v.bytes.back(), static_cast<std::byte>(0x40 + i));
  }
  const std::string note = arena->report().huge_note;
  if (note.find(huge_after_build ? "after the build" : "as the engine wrote") ==
      std::string::npos) {
    GTEST_SKIP() << "pages made before fill here (not 4 KiB tmpfs with 2 MiB pages): " << note;
  }
  // Before the first tensor asked, the pages ahead of the header at most; each ask made its
  // tensor's pages, and never all of the file's before the last ones were asked for.
  ASSERT_EQ(before.size(), static_cast<size_t>(kCount));
  EXPECT_LE(before[0], kAhead) << note;
  for (size_t i = 0; i < kCount; ++i) {
    EXPECT_GE(after[i], (i + 1) * kEach) << i;
    EXPECT_LE(after[i], (i + 1) * kEach + kAhead) << i;
  }
}

// A fill that writes without asking for the pages still publishes its bytes: the pages left
// are made once fill returns, around what it wrote.
TEST(EngineArenaPagesTest, AFillThatNeverAsksStillPublishesItsBytes) {
  ScopedArenaDir dir("engine-pages-unasked");
  EngineArenaSpec spec = Spec("unasked", {}, 3, nullptr, 40ull << 20);
  spec.pages_as_written = true;
  auto arena = Arena::OpenEngine(spec, Options(dir.File("unasked.arena")));
  ASSERT_TRUE(arena.ok()) << arena.status().message();
  EXPECT_TRUE(HoldsPattern(*arena, 3));
}

// The bytes of an arena's tensors, 2 MiB-aligned inward: what its 2 MiB pages can cover.
std::pair<const std::byte*, uint64_t> WholeBlocks(const Arena& arena) {
  constexpr uintptr_t kBlock = 2u << 20;
  const TensorView first = arena.tensor(0);
  const TensorView last = arena.tensor(arena.tensor_count() - 1);
  const auto begin = (reinterpret_cast<uintptr_t>(first.bytes.data()) + kBlock - 1) / kBlock *
                     kBlock;
  const auto end =
      reinterpret_cast<uintptr_t>(last.bytes.data() + last.bytes.size()) / kBlock * kBlock;
  return {reinterpret_cast<const std::byte*>(begin), end > begin ? end - begin : 0};
}

// The bytes of [blocks, blocks+length) on 2 MiB pages once all are, or after 60 s (read back
// in each time: a page made leaves the page tables of the mapping that made it).
uint64_t HugeOnceMade(const std::byte* blocks, uint64_t length) {
  uint64_t huge = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    Status read = platform::AdviseRange(const_cast<std::byte*>(blocks), length,
                                        platform::Advice::kPopulateRead, "test");
    auto h = platform::HugeBytesInRange(blocks, length);
    if (!read.ok() || !h.ok()) {
      ADD_FAILURE() << read.ToString() << "; " << h.status().ToString();
      return 0;
    }
    if ((huge = *h) == length) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return huge;
}

// An engine-made arena of 128 MiB tensors whose 2 MiB pages come after its build (on 4 KiB
// tmpfs).
EngineArenaSpec LateSpec(const std::string& identity, uint8_t seed, Counted* counted = nullptr) {
  EngineArenaSpec spec = Spec(identity, {}, seed, counted, 128ull << 20);
  spec.pages_as_written = true;
  spec.huge_after_build = true;
  return spec;
}

// With huge_after_build, on 4 KiB tmpfs an engine-made arena's 2 MiB pages come after its
// build, on a thread of its own at nice 19 (the fill waits for no 2 MiB page): once made they
// are under the engine's read-only mapping, with the bytes it wrote.
TEST(EngineArenaPagesTest, TwoMiBPagesComeAfterTheBuild) {
  ScopedArenaDir dir("engine-late-collapse");
  EngineArenaSpec spec = Spec("late", {}, 5, nullptr, 40ull << 20);
  spec.pages_as_written = true;
  spec.huge_after_build = true;
  auto arena = Arena::OpenEngine(spec, Options(dir.File("late.arena")));
  ASSERT_TRUE(arena.ok()) << arena.status().message();
  const std::string note = arena->report().huge_note;
  if (note.find("after the build") == std::string::npos) {
    GTEST_SKIP() << "2 MiB pages not made after the build here: " << note;
  }
  const auto [blocks, length] = WholeBlocks(*arena);
  ASSERT_GE(length, 100ull << 20);
  const uint64_t huge = HugeOnceMade(blocks, length);
  auto free_blocks = platform::FreeHugeBlocks();
  EXPECT_EQ(huge, length) << "free 2 MiB blocks: " << (free_blocks.ok() ? *free_blocks : 0)
                          << "; " << note;
  EXPECT_TRUE(HoldsPattern(*arena, 5));
}

// An engine that closes its arena, or exits, while the 2 MiB pages are being made waits for
// one page at most, and the file keeps every byte for the next engine, which makes the 2 MiB
// pages still missing; a child forked meanwhile (where the thread does not exist) closes its
// copy and exits.
TEST(EngineArenaPagesTest, ClosingOrForkingWhileTheLatePagesAreMadeLosesNothing) {
  ScopedArenaDir dir("engine-late-close");
  const std::string path = dir.File("close.arena");
  const EngineArenaSpec spec = LateSpec("late-close", 9);
  bool late = false;
  {
    auto arena = Arena::OpenEngine(spec, Options(path));
    ASSERT_TRUE(arena.ok()) << arena.status().message();
    late = arena->report().huge_note.find("after the build") != std::string::npos;
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      { Arena gone = std::move(*arena); }
      ::_exit(0);
    }
    int status = 0;
    pid_t waited = 0;
    for (int i = 0; i < 600 && (waited = ::waitpid(child, &status, WNOHANG)) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (waited == 0) {
      ::kill(child, SIGKILL);
      ::waitpid(child, &status, 0);
    }
    EXPECT_EQ(waited, child) << "the forked child hung closing its copy of the arena";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }  // closed here, most likely before every 2 MiB page was made
  Counted counted;
  auto again = Arena::OpenEngine(LateSpec("late-close", 9, &counted), Options(path));
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->report().role, ArenaRole::kAttached);
  EXPECT_EQ(counted.filled, 0);
  EXPECT_TRUE(HoldsPattern(*again, 9));
  if (!late) GTEST_SKIP() << "2 MiB pages not made after the build here";
  // What the first engine left on 4 KiB pages this one makes (skipped where it made all).
  const auto [blocks, length] = WholeBlocks(*again);
  const uint64_t huge = HugeOnceMade(blocks, length);
  EXPECT_EQ(huge, length) << again->report().huge_note;
  EXPECT_TRUE(HoldsPattern(*again, 9));
}

// The views an engine's tensors read (CopyOnWriteData's MAP_PRIVATE mapping) get the 2 MiB
// pages made after the build as 2 MiB entries, even once a write through them made a private
// page: the kernel alone left such a mapping on 4 KiB entries over every new page (vLLM's
// views hold a few private pages). The block with the private page keeps it.
TEST(EngineArenaPagesTest, TheViewsGetTheLatePagesAsTwoMiBEntries) {
  ScopedArenaDir dir("engine-late-views");
  const std::string path = dir.File("views.arena");
  {
    // Closed at once: the file stays (most of it) on 4 KiB pages for the engine below.
    auto first = Arena::OpenEngine(LateSpec("late-views", 3), Options(path));
    ASSERT_TRUE(first.ok()) << first.status().message();
    if (first->report().huge_note.find("after the build") == std::string::npos) {
      GTEST_SKIP() << "2 MiB pages not made after the build here: " << first->report().huge_note;
    }
  }
  auto arena = Arena::OpenEngine(LateSpec("late-views", 3), Options(path));
  ASSERT_TRUE(arena.ok()) << arena.status().message();
  auto views = arena->CopyOnWriteData();  // as the pages are being made
  ASSERT_TRUE(views.ok()) << views.status().message();
  const auto [blocks, length] = WholeBlocks(*arena);
  ASSERT_GE(length, 100ull << 20);
  std::byte* view_blocks = views->data() + (blocks - arena->data().data());
  const uint64_t last_block = length - (2ull << 20);
  view_blocks[last_block] = std::byte{0x5a};  // a private page: the mapping gets an anon_vma
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  uint64_t huge = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    auto h = platform::HugeBytesInRange(view_blocks, last_block);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    if ((huge = *h) == last_block) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(huge, last_block) << "of the views' bytes on 2 MiB entries; "
                              << arena->report().huge_note;
  // The views read the arena's bytes; the private page reads what was written there.
  EXPECT_EQ(std::memcmp(view_blocks, blocks, last_block), 0);
  EXPECT_EQ(view_blocks[last_block], std::byte{0x5a});
  EXPECT_TRUE(HoldsPattern(*arena, 3));
}

}  // namespace
}  // namespace expert_arena
