// Group sharing between users: an arena made with a group mode has exactly that mode whatever
// the umask, an engine of another user in the group attaches (read-only when the mode gives the
// group read only), and a user outside the group is refused with a message that says why.
// The users are numeric ids set in each child (setresuid/setresgid/setgroups): nothing is added
// to /etc/passwd, so nothing is left behind.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "../arena/engine_role.h"
#include "common/units.h"
#include "contain.h"
#include "expert_arena/stream.h"

namespace expert_arena::testing {
namespace {

EA_CHILD_ROLE(engine) { return EngineRole(args); }

constexpr int kGroup = 64100;     // the group the engines share
constexpr int kLoader = 64101;    // primary group kGroup
constexpr int kMember = 64102;    // its own group, kGroup as a supplementary group
constexpr int kOutsider = 64103;  // not in kGroup

struct Case {
  int mode;
  int umask;
};

class OtherUsersTest : public ::testing::TestWithParam<Case> {
 protected:
  OtherUsersTest() : model_(8 * kMiB, 23), dir_("users") {}
  void SetUp() override {
    if (!WhyCannotContain().empty()) EA_SKIP_OR_FAIL_IN_CI(WhyCannotContain());
    // The other users must reach the directory: /dev/shm (or EXPERT_ARENA_TEST_DIR) must be
    // searchable by everyone, as it is unless a process chmods it.
    struct stat parent;
    ASSERT_EQ(stat(ArenaTestDir().c_str(), &parent), 0);
    ASSERT_NE(parent.st_mode & 01, 0u)
        << ArenaTestDir() << " is mode " << std::oct << (parent.st_mode & 07777)
        << ": other users cannot reach arenas in it";
    // Like /dev/shm: everyone may create, nobody may remove another's file.
    ASSERT_EQ(chmod(dir_.path().c_str(), 01777), 0);
    ASSERT_EQ(chmod(model_.path().c_str(), 0644), 0);
  }
  std::string Arena() const { return dir_.File("model.arena"); }
  Containment As(int uid, int gid, std::vector<int> groups = {}) const {
    return {.uid = uid, .gid = gid, .groups = std::move(groups), .umask = GetParam().umask};
  }
  std::string Mode() const {
    char buf[16];
    std::snprintf(buf, sizeof buf, "0%o", GetParam().mode);
    return buf;
  }
  nlohmann::json Run(const Containment& who, int expected_exit, const std::string& mode = "-") {
    Child c = SpawnContained(who, "engine",
                             {Arena(), model_.path(), "none", "-", "-", "30", mode, "foreign"});
    EXPECT_EQ(c.Wait(120), expected_exit) << c.Output();
    return ParseEngineOutput(c.Output());
  }

  ScopedDataFile model_;
  ScopedArenaDir dir_;
};

TEST_P(OtherUsersTest, AGroupMemberAttachesAndAnOutsiderIsToldWhy) {
  nlohmann::json loaded = Run(As(kLoader, kGroup), 0, Mode());
  ASSERT_EQ(loaded["role"], "loaded") << loaded;
  struct stat st;
  ASSERT_EQ(stat(Arena().c_str(), &st), 0);
  EXPECT_EQ(static_cast<int>(st.st_mode & 07777), GetParam().mode) << "exactly the mode asked for";
  EXPECT_EQ(static_cast<int>(st.st_uid), kLoader);
  EXPECT_EQ(static_cast<int>(st.st_gid), kGroup);

  nlohmann::json member = Run(As(kMember, kMember, {kGroup}), 0);
  EXPECT_EQ(member["role"], "attached") << member;
  EXPECT_EQ(member["sum"], loaded["sum"]);
  EXPECT_EQ(member["sum"], FileSum(model_.path()));
  EXPECT_EQ(member["bytes_read"], 0);

  nlohmann::json outsider = Run(As(kOutsider, kOutsider), 1);
  EXPECT_EQ(outsider["code"], "permission denied") << outsider;
  const std::string why = outsider["error"].get<std::string>();
  for (const std::string& word :
       {"owned by uid " + std::to_string(kLoader), "group " + std::to_string(kGroup),
        "mode " + Mode(), "uid " + std::to_string(kOutsider), std::string("--arena-mode 0660")}) {
    EXPECT_NE(why.find(word), std::string::npos) << "'" << word << "' in: " << why;
  }
}

TEST_P(OtherUsersTest, CliLoadTakesTheModeWhateverTheUmask) {
  Child load = SpawnContained(As(kLoader, kGroup), BinDir() + "/expert-arena",
                              {"load", "--model", model_.path(), "--format", "raw", "--arena",
                               Arena(), "--mode", Mode(), "--json"});
  ASSERT_EQ(load.Wait(120), 0) << load.Output();
  struct stat st;
  ASSERT_EQ(stat(Arena().c_str(), &st), 0);
  EXPECT_EQ(static_cast<int>(st.st_mode & 07777), GetParam().mode);
  // A member attaches with the CLI too (read-only when the mode is 0640).
  Child attach = SpawnContained(As(kMember, kMember, {kGroup}), BinDir() + "/expert-arena",
                                {"load", "--model", model_.path(), "--format", "raw", "--arena",
                                 Arena(), "--allow-foreign-owner", "--json"});
  ASSERT_EQ(attach.Wait(120), 0) << attach.Output();
  EXPECT_EQ(nlohmann::json::parse(attach.Output())["role"], "attached");
}

// The issue's own case: `moe-engine --arena-mode 0660` run by one user, another user of the
// group attaching with --arena-allow-foreign-owner, the same output checksum.
TEST_P(OtherUsersTest, MoeEnginesOfTwoUsersShareTheArena) {
  ScopedPath model("model.gguf", "/tmp");
  Child gen = SpawnProgram(BinDir() + "/expert-arena",
                           {"gen-model", "--format", "gguf", "--out", model.path(), "--layers", "2",
                            "--experts", "4", "--hidden", "64", "--ffn", "96"});
  ASSERT_EQ(gen.Wait(120), 0);
  ASSERT_EQ(chmod(model.path().c_str(), 0644), 0);
  auto engine = [&](const Containment& who, std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "--model", model.path(), "--json", "--tokens", "8", "--shared-expert-arena", Arena()};
    args.insert(args.end(), extra.begin(), extra.end());
    Child c = SpawnContained(who, BinDir() + "/moe-engine", args);
    EXPECT_EQ(c.Wait(120), 0) << c.Output();
    return nlohmann::json::parse(c.Output(), nullptr, false);
  };
  nlohmann::json first = engine(As(kLoader, kGroup), {"--arena-mode", Mode()});
  ASSERT_TRUE(first.is_object());
  EXPECT_EQ(first["role"], "loaded");
  struct stat st;
  ASSERT_EQ(stat(Arena().c_str(), &st), 0);
  EXPECT_EQ(static_cast<int>(st.st_mode & 07777), GetParam().mode);
  nlohmann::json second = engine(As(kMember, kMember, {kGroup}), {"--arena-allow-foreign-owner"});
  ASSERT_TRUE(second.is_object());
  EXPECT_EQ(second["role"], "attached");
  EXPECT_EQ(second["checksum"], first["checksum"]);
}

// An empty file of the loader's, as a loader killed right after creating it leaves: a member
// that may write it (0660) loads into it; one that may only read it (0640) cannot, and says so
// instead of failing on a lock or a write.
TEST_P(OtherUsersTest, AMemberLoadsALeftoverFileOnlyWhenItMayWriteIt) {
  Child make = SpawnContained(As(kLoader, kGroup), "/usr/bin/touch", {Arena()});
  ASSERT_EQ(make.Wait(30), 0);
  ASSERT_EQ(chmod(Arena().c_str(), GetParam().mode), 0);
  if (GetParam().mode & 020) {
    nlohmann::json member = Run(As(kMember, kMember, {kGroup}), 0);
    EXPECT_EQ(member["role"], "loaded") << member;
    EXPECT_EQ(member["sum"], FileSum(model_.path()));
    return;
  }
  nlohmann::json member = Run(As(kMember, kMember, {kGroup}), 1);
  EXPECT_EQ(member["code"], "permission denied") << member;
  EXPECT_NE(member["error"].get<std::string>().find("may only read it"), std::string::npos)
      << member;
}

// A stream producer whose spill directory exists (the default /var/tmp, or /dev/shm, shared by
// every user) leaves its mode alone: it used to chmod it to 0700 when run as root, locking every
// other user out of /var/tmp.
TEST(SharedDirectoryTest, ProducerKeepsTheModeOfAnExistingSpillDirectory) {
  ScopedArenaDir dir("spill");
  ASSERT_EQ(chmod(dir.path().c_str(), 01777), 0);
  StreamOptions o;
  o.directory = dir.path();
  o.spill_directory = dir.path();
  o.logical_name = "spill_mode";
  o.segment_bytes = 4 * kMiB;
  o.huge = HugePages::kOff;
  {
    auto producer = StreamProducer::Create(o);
    ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  }
  struct stat st;
  ASSERT_EQ(stat(dir.path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 01777u);
  // A directory it makes is its own: 0700.
  o.spill_directory = dir.File("made");
  {
    auto producer = StreamProducer::Create(o);
    ASSERT_TRUE(producer.ok()) << producer.status().ToString();
  }
  ASSERT_EQ(stat(o.spill_directory.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
}

INSTANTIATE_TEST_SUITE_P(ModesAndUmasks, OtherUsersTest,
                         ::testing::Values(Case{0660, 022}, Case{0660, 077}, Case{0640, 022},
                                           Case{0640, 077}),
                         [](const auto& info) {
                           char buf[32];
                           std::snprintf(buf, sizeof buf, "Mode0%oUmask0%o", info.param.mode,
                                         info.param.umask);
                           return std::string(buf);
                         });

}  // namespace
}  // namespace expert_arena::testing
