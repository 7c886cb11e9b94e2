// The --shared-expert-arena option group (include/expert_arena/cli.h) as an engine uses it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "expert_arena/cli.h"
#include "test_util.h"

namespace expert_arena::cli {
namespace {

// Parses `args` with the group added to a fresh app; returns CLI11's error text or "".
std::string Parse(std::vector<std::string> args, SharedArenaFlags& flags) {
  CLI::App app{"engine"};
  std::string model;
  app.add_option("--model", model);
  AddSharedArenaOptions(app, flags);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 wants them reversed
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  return "";
}

TEST(SharedArenaFlagsTest, WithoutTheFlagTheArenaIsPrivate) {
  SharedArenaFlags flags;
  ASSERT_EQ(Parse({"--model", "m.gguf"}, flags), "");
  ArenaOptions options;
  options.shared_path = "stale";
  flags.ApplyTo(options);
  EXPECT_FALSE(flags.shared());
  EXPECT_EQ(options.shared_path, "");
  EXPECT_EQ(options.huge, HugePages::kAuto);
  EXPECT_EQ(options.gpu, GpuDevice{});
  EXPECT_EQ(options.file_mode, 0600u);
}

TEST(SharedArenaFlagsTest, EveryOptionReachesArenaOptions) {
  SharedArenaFlags flags;
  ASSERT_EQ(Parse({"--shared-expert-arena", "/dev/shm/m.arena", "--arena-wait-timeout", "12.5",
                   "--arena-huge", "off", "--arena-mode", "0660", "--arena-allow-foreign-owner",
                   "--gpu", "cuda:1", "--gpu-required"},
                  flags),
            "");
  ArenaOptions options;
  flags.ApplyTo(options);
  EXPECT_EQ(options.shared_path, "/dev/shm/m.arena");
  EXPECT_DOUBLE_EQ(options.wait_timeout_seconds, 12.5);
  EXPECT_EQ(options.huge, HugePages::kOff);
  EXPECT_EQ(options.file_mode, 0660u);
  EXPECT_TRUE(options.allow_foreign_owner);
  EXPECT_EQ(options.gpu, (GpuDevice{GpuBackend::kCuda, 1}));
  EXPECT_TRUE(options.gpu_required);
}

TEST(SharedArenaFlagsTest, BadValuesAreUsageErrors) {
  for (std::vector<std::string> args : std::vector<std::vector<std::string>>{
           {"--arena-huge", "maybe"},
           {"--gpu", "cuda:x"},
           {"--gpu", "metal"},
           {"--shared-expert-arena", "/dev/shm/a", "--arena-mode", "0644x"},
           {"--shared-expert-arena", "/dev/shm/a", "--arena-mode", "0400"},
           {"--shared-expert-arena", "/dev/shm/a", "--arena-wait-timeout", "-1"},
           {"--arena-wait-timeout", "5"},  // needs --shared-expert-arena
       }) {
    SharedArenaFlags flags;
    EXPECT_NE(Parse(args, flags), "") << args[0] << " " << args[1];
  }
  SharedArenaFlags flags;
  EXPECT_EQ(Parse({"--gpu", "hip"}, flags), "");
}

// The closed sets of ArenaOptions are enums; their words parse back to them, and a word that
// is not one is refused naming the accepted ones (the C, CLI and Python front ends use these).
TEST(OptionWordsTest, EnumsParseFromTheirNamesAndRefuseOthers) {
  for (ModelReader r : {ModelReader::kAuto, ModelReader::kIoUring, ModelReader::kPread}) {
    ASSERT_OK_AND_ASSIGN(ModelReader back, ParseModelReader(ModelReaderName(r)));
    EXPECT_EQ(back, r);
  }
  for (PeerTransport t : {PeerTransport::kAuto, PeerTransport::kAm, PeerTransport::kGet}) {
    ASSERT_OK_AND_ASSIGN(PeerTransport back, ParsePeerTransport(PeerTransportName(t)));
    EXPECT_EQ(back, t);
  }
  auto reader = ParseModelReader("mmap");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader.status().message(), "reader must be auto, io_uring or pread, not \"mmap\"");
  auto transport = ParsePeerTransport("");
  ASSERT_FALSE(transport.ok());
  EXPECT_NE(transport.status().message().find("peer_transport must be auto, am or get"),
            std::string::npos);
  // An enum cast from anything is refused by Arena::Open before any role, by name.
  ArenaOptions options;
  options.progress = false;
  options.reader = static_cast<ModelReader>(7);
  auto opened = Arena::Open({.files = {"/nonexistent/model.gguf"}}, options);
  ASSERT_FALSE(opened.ok());
  EXPECT_NE(opened.status().message().find("reader 7 is not a ModelReader"), std::string::npos)
      << opened.status().message();
}

TEST(SharedArenaFlagsTest, HelpShowsTheGroup) {
  CLI::App app{"engine"};
  SharedArenaFlags flags;
  AddSharedArenaOptions(app, flags);
  std::string help = app.help();
  EXPECT_NE(help.find("Shared expert arena"), std::string::npos) << help;
  EXPECT_NE(help.find("--shared-expert-arena"), std::string::npos) << help;
}

}  // namespace
}  // namespace expert_arena::cli
