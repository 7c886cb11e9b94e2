// The sweep of stream segments, in one place: what it removes (a killed producer's segments, a
// leftover of a crashed create, a copy nobody holds the lock of) and what it never touches (a
// live producer's segments, another user's files, files that are not segments), through the
// library call, the next producer's start and the CLI (`expert-arena sweep`, `info`). The C and
// Python bindings' own checks of it are in capi_stream_c_program.c and test_stream.py.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "expert_arena/stream.h"
#include "stream_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::Child;
using testing::ReadMessages;
using testing::SpawnRole;
using testing::StreamDirs;
using testing::WaitForFile;

// The sweep leaves another user's files alone (with a note), removes a leftover of ours that no
// owner holds (a crashed create), and ignores files that are not stream segments.
TEST(StreamSweep, LeavesAnotherUsersFilesAloneWithANote) {
  StreamDirs dirs;
  std::string leftover = dirs.shm() + "/ea-stream-crashed-1-2-abcd-0";
  std::string unrelated = dirs.shm() + "/not-a-stream-file";
  testing::TouchFile(leftover);
  testing::TouchFile(unrelated);
  std::string foreign = dirs.shm() + "/ea-stream-other-1-2-abcd-0";
  bool root = geteuid() == 0;
  if (root) {
    testing::TouchFile(foreign);
    ASSERT_EQ(chown(foreign.c_str(), 65534, 65534), 0);
  }
  ASSERT_OK_AND_ASSIGN(auto report, SweepStreamDirectory(dirs.shm()));
  ASSERT_EQ(report.removed.size(), 1u);
  EXPECT_EQ(report.removed[0], leftover);
  EXPECT_TRUE(std::filesystem::exists(unrelated));
  if (!root) GTEST_SKIP() << "needs root to make a file of another user";
  EXPECT_TRUE(std::filesystem::exists(foreign));
  bool noted = false;
  for (const auto& n : report.notes) noted |= n.find("uid 65534") != std::string::npos;
  EXPECT_TRUE(noted);
}

// Liveness is the owner's lock, not its pid: a copy of a live producer's segment names a live
// pid (ours) in its header, yet nobody holds its lock, so the sweep removes it (what a reused
// pid looks like); the original, whose lock is held, stays.
TEST(StreamSweep, AliveByLockNotByPid) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  // Creating commits nothing: the first segment comes with the first put.
  EXPECT_TRUE(producer.SegmentPaths().empty());
  EXPECT_EQ(producer.Stats()->segments, 0u);
  std::vector<std::byte> data(4096);
  ASSERT_OK(producer.Put("k", data, {}).status());
  ASSERT_EQ(producer.SegmentPaths().size(), 1u);
  std::string original = producer.SegmentPaths().at(0);
  std::string copy = dirs.shm() + "/ea-stream-copy-1-2-abcd-0";
  std::filesystem::copy_file(original, copy);
  ASSERT_OK_AND_ASSIGN(auto info, InspectSegment(copy));
  EXPECT_EQ(info.owner_pid, static_cast<uint32_t>(getpid()));
  EXPECT_FALSE(info.owner_alive);
  ASSERT_OK_AND_ASSIGN(auto live, InspectSegment(original));
  EXPECT_TRUE(live.owner_alive);
  ASSERT_OK_AND_ASSIGN(auto report, SweepStreamDirectory(dirs.shm()));
  ASSERT_EQ(report.removed.size(), 1u);
  EXPECT_EQ(report.removed[0], copy);
  EXPECT_TRUE(std::filesystem::exists(original));
}

TEST(StreamSweep, RemovesAKilledProducersSegmentsNeverALiveOnes) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  Child doomed =
      SpawnRole("stream_produce_and_hang", {dirs.shm(), dirs.spill(), "doomed", base + "doomed"});
  Child alive =
      SpawnRole("stream_produce_and_hang", {dirs.shm(), dirs.spill(), "alive", base + "alive"});
  ASSERT_TRUE(WaitForFile(base + "doomed", 60));
  ASSERT_TRUE(WaitForFile(base + "alive", 60));
  ASSERT_OK_AND_ASSIGN(auto doomed_d,
                       TensorDescriptor::Decode(ReadMessages(base + "doomed.desc").at(0)));
  ASSERT_OK_AND_ASSIGN(auto alive_d,
                       TensorDescriptor::Decode(ReadMessages(base + "alive.desc").at(0)));
  doomed.Kill(SIGKILL);
  EXPECT_EQ(doomed.Wait(10), 128 + SIGKILL);
  EXPECT_TRUE(std::filesystem::exists(dirs.shm() + "/" + doomed_d.segment));
  {
    // The next start sweeps.
    ASSERT_OK_AND_ASSIGN(auto next, StreamProducer::Create(dirs.Producer("next")));
    std::vector<std::byte> data(100);
    ASSERT_OK(next.Put("n", data, {}).status());  // its first segment
    EXPECT_FALSE(std::filesystem::exists(dirs.shm() + "/" + doomed_d.segment));
    EXPECT_TRUE(std::filesystem::exists(dirs.shm() + "/" + alive_d.segment));
    // An explicit sweep (what `expert-arena sweep` runs) keeps both live producers' files.
    ASSERT_OK_AND_ASSIGN(auto report, SweepStreamDirectory(dirs.shm()));
    EXPECT_TRUE(report.removed.empty());
    EXPECT_EQ(report.live.size(), 2u);
    // The live producer's tensor is intact and readable.
    ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(ReadMessages(base + "alive.desc").at(0)));
    EXPECT_EQ(t.bytes().size(), 5000u);
  }
  alive.Kill(SIGKILL);
  alive.Wait(10);
  ASSERT_OK_AND_ASSIGN(auto report, SweepStreamDirectory(dirs.shm()));
  EXPECT_EQ(report.removed.size(), 1u);
  std::filesystem::remove_all(dirs.spill());
  std::filesystem::create_directory(dirs.spill());
  EXPECT_TRUE(dirs.remaining().empty());
}

// The CLI: `info` on a segment names its owner and liveness; `sweep DIR` removes a dead
// owner's segments only.
TEST(StreamSweep, CliInfoAndSweep) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  const std::string tool = testing::BinDir() + "/expert-arena";
  if (!std::filesystem::exists(tool)) GTEST_SKIP() << "expert-arena not built";
  Child owner =
      SpawnRole("stream_produce_and_hang", {dirs.shm(), dirs.spill(), "cli", base + "ready"});
  ASSERT_TRUE(WaitForFile(base + "ready", 60));
  ASSERT_OK_AND_ASSIGN(auto d, TensorDescriptor::Decode(ReadMessages(base + "ready.desc").at(0)));
  std::string seg = dirs.shm() + "/" + d.segment;
  Child info = testing::SpawnProgram(tool, {"info", seg});
  ASSERT_EQ(info.Wait(30), 0);
  EXPECT_NE(info.Output().find("pid " + std::to_string(owner.pid())), std::string::npos)
      << info.Output();
  EXPECT_NE(info.Output().find("alive"), std::string::npos) << info.Output();
  EXPECT_NE(info.Output().find("1 live"), std::string::npos) << info.Output();
  Child sweep_live = testing::SpawnProgram(tool, {"sweep", dirs.shm()});
  ASSERT_EQ(sweep_live.Wait(30), 0);
  EXPECT_TRUE(std::filesystem::exists(seg));
  owner.Kill(SIGKILL);
  owner.Wait(10);
  Child info_dead = testing::SpawnProgram(tool, {"info", seg, "--json"});
  ASSERT_EQ(info_dead.Wait(30), 0);
  EXPECT_NE(info_dead.Output().find("\"owner_alive\": false"), std::string::npos)
      << info_dead.Output();
  Child sweep = testing::SpawnProgram(tool, {"sweep", dirs.shm()});
  ASSERT_EQ(sweep.Wait(30), 0);
  EXPECT_NE(sweep.Output().find("removed 1"), std::string::npos) << sweep.Output();
  EXPECT_FALSE(std::filesystem::exists(seg));
}

}  // namespace
}  // namespace expert_arena
