// expert-arena load / info --json / verify through the real CLI: file_offset is absolute in
// the arena file, both readers give the same data region, and verify names a corrupted tensor.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "format/arena_format.h"
#include "platform/io_ring.h"
#include "platform/system_info.h"
#include "source_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::ScopedDir;
using testing::ScopedPath;

int ExpertArena(const std::vector<std::string>& args, std::string* out = nullptr) {
  auto child = testing::SpawnProgram(testing::BinDir() + "/expert-arena", args);
  int code = child.Wait(120);
  if (out) *out = child.Output();
  return code;
}

// Runs a shell command line, stderr folded into the captured output.
int Shell(const std::string& command, std::string* out) {
  auto child = testing::SpawnProgram("/bin/sh", {"-c", command + " 2>&1"});
  int code = child.Wait(120);
  *out = child.Output();
  return code;
}

TEST(CliLoadTest, InfoOffsetsAreAbsoluteAndVerifyNamesTheBadTensor) {
  ScopedDir dir("cli-load");
  const std::string model = dir.File("m.gguf");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "2",
                         "--experts", "4", "--hidden", "256", "--ffn", "384", "--dtype", "f16"}),
            0);
  auto independent = testing::ParseGgufIndependently(model);
  std::vector<std::string> readers = {"pread"};
  if (platform::IoRing::Create(4).ok()) readers.push_back("io_uring");
  std::vector<std::vector<std::byte>> data_regions;
  for (const std::string& reader : readers) {
    ScopedPath arena("arena-" + reader);
    std::string out;
    ASSERT_EQ(ExpertArena(
                  {"load", "--model", model, "--arena", arena.path(), "--reader", reader, "--json"},
                  &out),
              0);
    auto load = nlohmann::json::parse(out);
    EXPECT_EQ(load["reader"], reader);
    EXPECT_EQ(load["tensors"], 6);
    EXPECT_EQ(load["model_tensors"], 11);

    ASSERT_EQ(ExpertArena({"info", arena.path(), "--json"}, &out), 0);
    auto info = nlohmann::json::parse(out);
    ASSERT_EQ(info["tensors"].size(), 6u);
    for (const auto& t : info["tensors"]) {
      const std::string name = t["name"];
      const uint64_t offset = t["file_offset"], bytes = t["bytes"];
      EXPECT_EQ(t["dtype"], "f16");
      ASSERT_EQ(bytes, independent.at(name).bytes);
      auto in_arena = testing::ReadRange(arena.path(), offset, bytes);
      auto in_model = testing::ReadRange(model, independent.at(name).offset, bytes);
      EXPECT_EQ(in_arena, in_model) << name;
    }
    uint64_t header = info["header_bytes"], data = info["data_bytes"];
    data_regions.push_back(testing::ReadRange(arena.path(), header, data));

    ASSERT_EQ(ExpertArena({"verify", arena.path()}), 0);
    // Corrupt one byte in the middle of the fourth tensor (no engine maps the file now).
    const auto& victim = info["tensors"][3];
    const uint64_t at =
        static_cast<uint64_t>(victim["file_offset"]) + static_cast<uint64_t>(victim["bytes"]) / 2;
    int fd = ::open(arena.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char byte;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(at)), 1);
    byte = static_cast<char>(byte ^ 0x40);
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(at)), 1);
    ::close(fd);
    ASSERT_EQ(Shell(testing::BinDir() + "/expert-arena verify " + arena.path(), &out), 1) << out;
    EXPECT_NE(out.find(victim["name"].get<std::string>()), std::string::npos) << out;
    EXPECT_NE(out.find("checksum mismatch"), std::string::npos) << out;
  }
  if (data_regions.size() == 2) {
    EXPECT_EQ(data_regions[0], data_regions[1]);
  }
}

TEST(CliLoadTest, SelectAndAllOverrideTheDefault) {
  ScopedDir dir("cli-select");
  const std::string model = dir.File("m");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "safetensors", "--out", model, "--layers", "2",
                         "--experts", "2", "--hidden", "32", "--ffn", "32", "--shards", "2"}),
            0);
  for (auto [flags, tensors] : std::vector<std::pair<std::vector<std::string>, int>>{
           {{}, 12}, {{"--all"}, 17}, {{"--select", "embed_tokens|layernorm"}, 3}}) {
    ScopedPath arena("arena");
    std::vector<std::string> args = {"load", "--model", model, "--arena", arena.path(), "--json"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::string out;
    ASSERT_EQ(ExpertArena(args, &out), 0);
    auto j = nlohmann::json::parse(out);
    EXPECT_EQ(j["tensors"], tensors);
    EXPECT_EQ(j["model_tensors"], 17);
  }
}

// --pages-first makes every 2 MiB page before the read (the library's
// pages_alongside_load = false); the default makes them alongside. Both on plain /dev/shm.
TEST(CliLoadTest, PagesFirstTurnsOffPagesAlongsideTheLoad) {
  ScopedDir dir("cli-pages");
  const std::string model = dir.File("m.gguf");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "2",
                         "--experts", "4", "--hidden", "512", "--ffn", "512"}),
            0);
  for (const bool first : {false, true}) {
    ScopedPath arena("arena");
    std::vector<std::string> args = {"load",       "--model", model, "--arena",
                                     arena.path(), "--huge",  "on",  "--json"};
    if (first) args.push_back("--pages-first");
    std::string out;
    ASSERT_EQ(ExpertArena(args, &out), 0) << out;
    auto j = nlohmann::json::parse(out);
    const std::string note = j["huge_note"];
    EXPECT_NE(note.find("MADV_COLLAPSE"), std::string::npos) << note;
    EXPECT_EQ(note.find("alongside the load") == std::string::npos, first) << note;
  }
}

// A FIFO where a model, a shard or an arena file is expected is a clear error naming it, never
// a hang in open(2). Each command runs with a bound (exec: the kill reaches expert-arena).
TEST(CliLoadTest, AFifoIsRefusedNeverWaitedOn) {
  ScopedDir dir("cli-fifo");
  const std::string model = dir.File("m.gguf");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "1",
                         "--experts", "2", "--hidden", "256", "--ffn", "256"}),
            0);
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ScopedPath arena("fifo-arena");
  const std::string bin = testing::BinDir() + "/expert-arena";
  const std::vector<std::string> commands = {
      "load --model " + fifo + " --arena " + arena.path(),
      "load --model " + model + " --arena " + fifo,
      "info " + fifo,
      "verify " + fifo,
      "rm " + fifo,
  };
  for (const std::string& command : commands) {
    auto child = testing::SpawnProgram("/bin/sh", {"-c", "exec " + bin + " " + command + " 2>&1"});
    int code = child.Wait(30);
    const std::string out = child.Output();
    EXPECT_NE(code, -1) << command << ": still running after 30 s";
    EXPECT_NE(code, 0) << command << ": " << out;
    EXPECT_NE(out.find(fifo + ": not a regular file (a FIFO)"), std::string::npos)
        << command << ": " << out;
    struct stat st {};
    EXPECT_EQ(::stat(fifo.c_str(), &st), 0) << command << " removed the FIFO";
  }
}

// An arena put on a disk filesystem by mistake (here /tmp when it is one) still works, but the
// loader says what it costs and asks for no 2 MiB pages there (MADV_COLLAPSE would only fail).
TEST(CliLoadTest, AnArenaOnADiskFilesystemWorksAndSaysWhatItCosts) {
  ScopedDir dir("cli-diskfs");
  auto fs = platform::StatFilesystem(dir.path());
  if (!fs.ok() || fs->kind != platform::FsKind::kOther) {
    GTEST_SKIP() << dir.path() << " is on tmpfs or hugetlbfs here";
  }
  const std::string model = dir.File("m.gguf");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "1",
                         "--experts", "2", "--hidden", "64", "--ffn", "64"}),
            0);
  const std::string bin = testing::BinDir() + "/expert-arena";
  const std::string arena = dir.File("m.arena");
  std::string out;
  ASSERT_EQ(Shell(bin + " load --model " + model + " --arena " + arena + " --huge on --json", &out),
            0)
      << out;
  EXPECT_NE(out.find(arena + " is not on tmpfs or hugetlbfs"), std::string::npos) << out;
  EXPECT_NE(out.find("\"huge_note\":\"2 MiB pages not asked for: not on tmpfs or hugetlbfs\""),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("MADV_COLLAPSE"), std::string::npos) << out;
  ASSERT_EQ(Shell(bin + " load --model " + model + " --arena " + arena + " --json", &out), 0)
      << out;
  EXPECT_NE(out.find("\"role\":\"attached\""), std::string::npos) << out;
}

// A file that is not a model: exit 1, a message naming the file and what it looks like, and
// nothing in the arena's directory; --format raw loads the same bytes as one u8 tensor.
TEST(CliLoadTest, NotAModelIsRefusedAndRawIsLoadedOnlyWhenAsked) {
  ScopedDir dir("cli-not-a-model");
  testing::ScopedArenaDir arenas("cli-refused");
  const std::string arena = arenas.File("m.arena");
  for (const testing::NotAModel& c : testing::NotAModels()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.File(c.name);
    std::vector<std::byte> bytes(c.bytes.size());
    if (!bytes.empty()) std::memcpy(bytes.data(), c.bytes.data(), bytes.size());
    testing::WriteFileBytes(path, bytes);
    std::string out;
    EXPECT_EQ(Shell(testing::BinDir() + "/expert-arena load --model '" + path + "' --arena " +
                        arena + " --json",
                    &out),
              1);
    EXPECT_EQ(out.rfind("expert-arena load: " + path + ": ", 0), 0u) << out;
    EXPECT_NE(out.find(c.words), std::string::npos) << out;
    if (c.name == "weights.dat") {
      // In the CLI's words: its flag, not the C++ field.
      EXPECT_NE(out.find("(expert-arena load --format raw)"), std::string::npos) << out;
    }
    EXPECT_EQ(out.find("\"role\""), std::string::npos) << out;
    EXPECT_TRUE(arenas.entries().empty());
  }
  // Asked for: the bytes as one tensor, listed by info.
  const std::string blob = dir.File("weights.bin");
  std::string out;
  ASSERT_EQ(
      ExpertArena({"load", "--format", "raw", "--model", blob, "--arena", arena, "--json"}, &out),
      0)
      << out;
  auto load = nlohmann::json::parse(out);
  EXPECT_EQ(load["tensors"], 1);
  ASSERT_EQ(ExpertArena({"info", arena, "--json"}, &out), 0);
  auto info = nlohmann::json::parse(out);
  ASSERT_EQ(info["tensors"].size(), 1u);
  EXPECT_EQ(info["tensors"][0]["name"], "weights.bin");
  EXPECT_EQ(info["tensors"][0]["dtype"], "u8");
  EXPECT_EQ(ExpertArena({"rm", arena}), 0);
  // An unknown format is a usage error (CLI11), before anything is opened.
  EXPECT_NE(ExpertArena({"load", "--format", "bin", "--model", blob, "--arena", arena}), 0);
  EXPECT_TRUE(arenas.entries().empty());
}

// An arena path in a directory that does not exist: the message says so in those words and
// what to do, not which system call failed; ls and metrics say the same of the directory.
TEST(CliLoadTest, AMissingDirectoryIsNamedAsSuch) {
  ScopedDir dir("cli-missing-dir");
  const std::string model = dir.File("m.gguf");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "1",
                         "--experts", "2", "--hidden", "64", "--ffn", "64"}),
            0);
  const std::string missing = dir.File("no-such-dir");
  std::string out;
  EXPECT_EQ(Shell(testing::BinDir() + "/expert-arena load --model " + model + " --arena " +
                      missing + "/m.arena",
                  &out),
            1);
  EXPECT_NE(out.find("the arena's directory " + missing + " does not exist"), std::string::npos)
      << out;
  EXPECT_NE(out.find("mkdir -p " + missing), std::string::npos) << out;
  EXPECT_EQ(out.find("statfs"), std::string::npos) << out;
  EXPECT_EQ(Shell(testing::BinDir() + "/expert-arena ls " + missing, &out), 1);
  EXPECT_NE(out.find(missing + ": the directory does not exist"), std::string::npos) << out;
}

// The arena file edited on disk as it was found: the up projection given the gate's offset,
// every checksum computed again. verify and info refuse it naming the tensors; load does not
// attach to it (it holds a damaged arena, replaced when no engine maps it).
TEST(CliLoadTest, AnEditedTableIsRefusedByVerifyAndNeverAttached) {
  ScopedDir dir("cli-edited");
  testing::ScopedArenaDir arenas("cli-edited");
  const std::string model = dir.File("m.gguf");
  const std::string arena = arenas.File("edited.arena");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "1",
                         "--experts", "2", "--hidden", "64", "--ffn", "64"}),
            0);
  std::string out;
  ASSERT_EQ(ExpertArena({"load", "--model", model, "--arena", arena, "--json"}, &out), 0) << out;
  ASSERT_EQ(ExpertArena({"verify", arena}), 0);
  const auto fixed_bytes = testing::ReadRange(arena, 0, sizeof(format::HeaderFixed));
  format::HeaderFixed fixed;
  std::memcpy(&fixed, fixed_bytes.data(), sizeof fixed);
  const auto header = testing::ReadRange(arena, 0, fixed.header_bytes);
  format::ArenaTable table;
  ASSERT_OK(format::DecodeHeader(header, fixed.file_bytes, arena, &table, nullptr));
  // Rewrites the header region for `table`, checksums and name index computed again.
  auto store = [&](const format::ArenaTable& edited) {
    std::vector<std::byte> region(fixed.header_bytes);
    ASSERT_OK(format::EncodeHeader(edited, {fixed.header_bytes, fixed.data_bytes, fixed.file_bytes},
                                   format::FileState::kPublished, 0, 0, fixed.created_unix_ns,
                                   fixed.published_unix_ns, region));
    int fd = ::open(arena.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, region.data(), region.size(), 0), static_cast<ssize_t>(region.size()));
    ::close(fd);
  };
  format::TensorRecord* gate = nullptr;
  format::TensorRecord* up = nullptr;
  for (format::TensorRecord& t : table.tensors) {
    if (t.name == "blk.0.ffn_gate_exps.weight") gate = &t;
    if (t.name == "blk.0.ffn_up_exps.weight") up = &t;
  }
  ASSERT_TRUE(gate != nullptr && up != nullptr);
  up->arena_offset = gate->arena_offset;
  up->checksum = gate->checksum;
  for (bool identity_recomputed : {false, true}) {
    SCOPED_TRACE(identity_recomputed ? "identity recomputed" : "identity as stored");
    if (identity_recomputed) format::ComputeIdentity(table);
    store(table);
    ASSERT_EQ(Shell(testing::BinDir() + "/expert-arena verify " + arena, &out), 1) << out;
    EXPECT_NE(out.find(arena + ": tensors blk.0.ffn_gate_exps.weight"), std::string::npos) << out;
    EXPECT_NE(out.find("and blk.0.ffn_up_exps.weight (data offset"), std::string::npos) << out;
    EXPECT_NE(out.find("overlap"), std::string::npos) << out;
    Shell(testing::BinDir() + "/expert-arena info " + arena, &out);
    EXPECT_NE(out.find("damaged"), std::string::npos) << out;
    EXPECT_NE(out.find("overlap"), std::string::npos) << out;
  }
  ASSERT_EQ(ExpertArena({"load", "--model", model, "--arena", arena, "--json"}, &out), 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["role"], "loaded") << out;
  EXPECT_EQ(ExpertArena({"verify", arena}), 0);
  EXPECT_EQ(ExpertArena({"rm", arena}), 0);
}

// --mode takes read and write bits only; write for every user needs --allow-world-writable, and
// so does attaching to an arena file every user may write.
TEST(CliLoadTest, ModesWithSpecialBitsAreRefusedAndWorldWritableIsAskedForByName) {
  ScopedDir dir("cli-mode");
  testing::ScopedArenaDir arenas("cli-mode");
  const std::string model = dir.File("m.gguf");
  const std::string arena = arenas.File("mode.arena");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "1",
                         "--experts", "2", "--hidden", "64", "--ffn", "64"}),
            0);
  const std::string load =
      testing::BinDir() + "/expert-arena load --model " + model + " --arena " + arena;
  std::string out;
  for (const char* mode : {"4755", "0777", "2660", "0700"}) {
    EXPECT_NE(Shell(load + " --mode " + mode, &out), 0) << out;
    EXPECT_NE(out.find("no setuid, setgid, sticky or execute bit"), std::string::npos) << out;
  }
  EXPECT_NE(Shell(load + " --mode 0666", &out), 0) << out;
  EXPECT_NE(out.find("file_mode 0666 lets every user write the arena"), std::string::npos) << out;
  EXPECT_TRUE(arenas.entries().empty());
  const std::vector<std::string> args = {"load", "--model", model, "--arena", arena, "--json"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = args;
    all.insert(all.end(), more.begin(), more.end());
    return all;
  };
  ASSERT_EQ(ExpertArena(with({"--mode", "0666", "--allow-world-writable"}), &out), 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["role"], "loaded") << out;
  struct stat st {};
  ASSERT_EQ(::stat(arena.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0666u);
  EXPECT_NE(Shell(load, &out), 0) << out;
  EXPECT_NE(out.find(arena + " has mode 0666: any user may write it"), std::string::npos) << out;
  EXPECT_NE(out.find("chmod o-w " + arena), std::string::npos) << out;
  ASSERT_EQ(ExpertArena(with({"--allow-world-writable"}), &out), 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["role"], "attached") << out;
  ASSERT_EQ(::chmod(arena.c_str(), 0600), 0);
  ASSERT_EQ(ExpertArena(args, &out), 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["role"], "attached") << out;
  EXPECT_EQ(ExpertArena({"rm", arena}), 0);
}

// A small arena's start line prints MiB and ms, never "0.00 GiB" or "0.00 s"; info's page line
// too.
TEST(CliLoadTest, SmallSizesAndTimesPrintInUnitsThatShowThem) {
  ScopedDir dir("cli-small");
  ScopedPath arena("small");
  const std::string model = dir.File("m.gguf");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "2",
                         "--experts", "4", "--hidden", "256", "--ffn", "384"}),
            0);
  std::string out;
  for (const char* role : {"loaded", "attached"}) {
    SCOPED_TRACE(role);
    ASSERT_EQ(Shell(testing::BinDir() + "/expert-arena load --model " + model + " --arena " +
                        arena.path(),
                    &out),
              0);
    EXPECT_NE(out.find(std::string("expert-arena: ") + role), std::string::npos) << out;
    EXPECT_NE(out.find(" MiB in "), std::string::npos) << out;
    EXPECT_NE(out.find(" ms"), std::string::npos) << out;
    EXPECT_EQ(out.find("0.00 GiB"), std::string::npos) << out;
    EXPECT_EQ(out.find("0.00 s"), std::string::npos) << out;
  }
  ASSERT_EQ(Shell(testing::BinDir() + "/expert-arena info " + arena.path(), &out), 0);
  EXPECT_NE(out.find(" MiB on 2 MiB pages"), std::string::npos) << out;
  EXPECT_EQ(out.find("0.00 GiB"), std::string::npos) << out;
}

// rm of an arena that a process holds names it (pid and command, from /proc/locks' lock in the
// holder's fdinfo), and so do info and ls; once it is gone rm removes the file. The holder runs
// from a directory whose path alone is longer than the command shown: the program is named by
// its base name, wherever it is installed or built.
TEST(CliLoadTest, RmAndLsNameWhoHoldsTheArena) {
  ScopedDir dir("cli-holder");
  testing::ScopedArenaDir arenas("cli-holder");
  const std::string model = dir.File("m.gguf");
  const std::string arena = arenas.File("held.arena");
  ASSERT_EQ(ExpertArena({"gen-model", "--format", "gguf", "--out", model, "--layers", "1",
                         "--experts", "2", "--hidden", "64", "--ffn", "64"}),
            0);
  const std::string tool = testing::BinDir() + "/expert-arena";
  const std::string deep = dir.File(std::string(120, 'd'));
  ASSERT_EQ(::mkdir(deep.c_str(), 0700), 0);
  const std::string deep_tool = deep + "/expert-arena";
  ASSERT_EQ(::symlink(tool.c_str(), deep_tool.c_str()), 0);
  testing::Child holder = testing::SpawnProgram(
      "/bin/sh", {"-c", "exec " + deep_tool + " load --model " + model + " --arena " + arena +
                            " --hold --json </dev/null"});
  ASSERT_TRUE(holder.WaitForOutput("\"role\"", 60)) << holder.Output();
  // The command is cut after 80 bytes (with "..."): the program and its subcommand come first.
  const std::string named =
      "pid " + std::to_string(holder.pid()) + " (expert-arena load --model ";
  std::string out;
  EXPECT_EQ(Shell(tool + " rm " + arena, &out), 1);
  EXPECT_NE(out.find(arena + ": in use by " + named), std::string::npos) << out;
  EXPECT_NE(out.find("not removed"), std::string::npos) << out;
  EXPECT_EQ(out.find("at least one engine"), std::string::npos) << out;
  ASSERT_EQ(Shell(tool + " ls " + arenas.path(), &out), 0);
  EXPECT_NE(out.find(arena + ": in use by " + named), std::string::npos) << out;
  ASSERT_EQ(ExpertArena({"ls", arenas.path(), "--json"}, &out), 0);
  auto ls = nlohmann::json::parse(out);
  ASSERT_EQ(ls["arenas"].size(), 1u) << out;
  EXPECT_EQ(ls["arenas"][0]["users"], 1) << out;
  ASSERT_EQ(ls["arenas"][0]["holders"].size(), 1u) << out;
  EXPECT_EQ(ls["arenas"][0]["holders"][0]["pid"], holder.pid()) << out;
  ASSERT_EQ(Shell(tool + " info " + arena, &out), 0);
  EXPECT_NE(out.find("in use:    yes, by " + named), std::string::npos) << out;
  holder.Kill(SIGTERM);
  EXPECT_EQ(holder.Wait(30), 0);
  EXPECT_EQ(ExpertArena({"rm", arena}), 0);
  EXPECT_TRUE(arenas.entries().empty());
}

}  // namespace
}  // namespace expert_arena
