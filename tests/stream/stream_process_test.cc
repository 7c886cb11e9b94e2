// Cross-process behaviour of tensor streaming, with real child processes (SpawnRole):
// round trips, many-to-many, two instances of one logical name, exact-key abort, spill at the cap and back, strict mode, release gated
// on a completion, dead readers, and a consumer dropping an unlinked segment. The sweep is in
// stream_sweep_test.cc.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "common/escape.h"
#include "expert_arena/stream.h"
#include "stream_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using testing::CheckPattern;
using testing::Child;
using testing::FillPattern;
using testing::ReadMessages;
using testing::SpawnRole;
using testing::StreamDirs;
using testing::TouchFile;
using testing::WaitForFile;
using testing::WriteMessages;

ConsumerOptions ConsumerFor(const std::string& shm, const std::string& spill) {
  ConsumerOptions o;
  o.directory = shm;
  o.spill_directory = spill;
  return o;
}

// args: shm spill descriptors-file [hold-marker gate-file]
// Opens every descriptor, checks the bytes against the key's pattern, prints one line per
// tensor ("ok KEY" / "bad KEY" / "refused KEY: why") and releases. With a marker and a gate,
// it holds the views, creates the marker, and releases gated on the gate file appearing.
EA_CHILD_ROLE(stream_consume) {
  auto consumer = StreamConsumer::Create(ConsumerFor(args[0], args[1]));
  if (!consumer.ok()) return 3;
  std::vector<StreamTensor> held;
  for (const auto& m : ReadMessages(args[2])) {
    auto t = consumer->Open(m);
    if (!t.ok()) {
      std::printf("refused %s\n", t.status().message().c_str());
      continue;
    }
    const std::string& key = t->descriptor().key;
    std::printf("%s %s\n", CheckPattern(t->bytes(), key) ? "ok" : "bad", key.c_str());
    held.push_back(std::move(t).value());
  }
  std::fflush(stdout);
  if (args.size() >= 4) {
    std::string gate = args[4];
    for (auto& t : held) {
      t.ReleaseWhen([gate] { return std::filesystem::exists(gate); });
    }
    TouchFile(args[3]);
    while (consumer->PollReleases() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return 0;
}

// args: shm spill descriptors-file marker — opens every descriptor, creates the marker and
// exits at once (_exit: no destructor runs), holding its views: a consumer that exits without
// releasing.
EA_CHILD_ROLE(stream_open_and_exit) {
  auto consumer = StreamConsumer::Create(ConsumerFor(args[0], args[1]));
  if (!consumer.ok()) return 3;
  std::vector<StreamTensor> held;
  for (const auto& m : ReadMessages(args[2])) {
    auto t = consumer->Open(m);
    if (!t.ok()) return 4;
    held.push_back(std::move(t).value());
  }
  TouchFile(args[3]);
  _exit(0);
}

// args: shm spill logical out-file count ready-file stop-file
// Puts `count` tensors (readers=2), writes their descriptors, creates the ready file, waits
// for the stop file, then checks that every block came back and exits 0.
EA_CHILD_ROLE(stream_produce) {
  StreamOptions o;
  o.directory = args[0];
  o.spill_directory = args[1];
  o.logical_name = args[2];
  o.segment_bytes = 8ull << 20;
  o.max_segments = 4;
  o.huge = HugePages::kOff;
  auto producer = StreamProducer::Create(o);
  if (!producer.ok()) {
    std::fprintf(stderr, "%s\n", producer.status().ToString().c_str());
    return 3;
  }
  int count = std::stoi(args[4]);
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    std::string key = args[2] + "-" + std::to_string(i);
    std::vector<std::byte> data(1000 + i * 7919);
    FillPattern(data, key);
    auto d = producer->Put(key, data, {"u8", {data.size()}}, 2);
    if (!d.ok()) return 4;
    out.push_back(*d);
  }
  WriteMessages(args[3], out);
  TouchFile(args[5]);
  if (!WaitForFile(args[6], 60)) return 5;
  if (!producer->Reclaim().ok()) return 6;
  auto stats = producer->Stats().value();
  std::printf("live %llu free %llu total %llu\n",
              static_cast<unsigned long long>(stats.live_blocks),
              static_cast<unsigned long long>(stats.free_bytes),
              static_cast<unsigned long long>(stats.total_bytes));
  return stats.live_blocks == 0 && stats.free_bytes == stats.total_bytes ? 0 : 7;
}

int CountLines(const std::string& text, const std::string& prefix) {
  int n = 0;
  size_t pos = 0;
  while ((pos = text.find(prefix, pos)) != std::string::npos) {
    if (pos == 0 || text[pos - 1] == '\n') ++n;
    pos += prefix.size();
  }
  return n;
}

TEST(StreamProcess, RoundTripThroughAnotherProcess) {
  StreamDirs dirs;
  std::string desc = dirs.spill() + "/descriptors";
  {
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
    std::vector<std::string> out;
    // Sizes: empty, odd, a block, and larger than a segment (a dedicated segment).
    std::vector<uint64_t> sizes = {0, 1, 4095, 4096, 1 << 20, 3 << 20, 12 << 20};
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::string key = "req-" + std::to_string(i);
      std::vector<std::byte> data(sizes[i]);
      FillPattern(data, key);
      ASSERT_OK_AND_ASSIGN(auto d, producer.Put(key, data, {"f32", {sizes[i] / 4}}));
      out.push_back(d);
    }
    EXPECT_EQ(producer.Stats()->dedicated_segments, 1u);
    WriteMessages(desc, out);
    Child c = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), desc});
    ASSERT_EQ(c.Wait(60), 0);
    EXPECT_EQ(CountLines(c.Output(), "ok "), static_cast<int>(sizes.size())) << c.Output();
    ASSERT_OK(producer.Reclaim());
    StreamStats s = producer.Stats().value();
    EXPECT_EQ(s.live_blocks, 0u);
    EXPECT_EQ(s.free_bytes, s.total_bytes);
    EXPECT_EQ(s.dedicated_segments, 0u);  // the one-shot segment went with its block
    EXPECT_EQ(s.spills, 0u);
  }
  std::filesystem::remove(desc);
  EXPECT_TRUE(dirs.remaining().empty());
}

// Two producer processes with the SAME logical name, each read by two consumer processes.
TEST(StreamProcess, ManyToManyWithOneLogicalName) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  std::vector<Child> producers;
  for (int p = 0; p < 2; ++p) {
    std::string n = std::to_string(p);
    producers.push_back(
        SpawnRole("stream_produce", {dirs.shm(), dirs.spill(), "same", base + "desc" + n, "40",
                                     base + "ready" + n, base + "stop"}));
  }
  for (int p = 0; p < 2; ++p) {
    ASSERT_TRUE(WaitForFile(base + "ready" + std::to_string(p), 60));
  }
  // Both live and distinct: the second producer's start-up sweep left the first alone.
  std::vector<std::string> all = ReadMessages(base + "desc0");
  auto more = ReadMessages(base + "desc1");
  all.insert(all.end(), more.begin(), more.end());
  ASSERT_EQ(all.size(), 80u);
  ASSERT_OK_AND_ASSIGN(auto d0, TensorDescriptor::Decode(all.front()));
  ASSERT_OK_AND_ASSIGN(auto d1, TensorDescriptor::Decode(all.back()));
  EXPECT_NE(d0.segment, d1.segment);
  WriteMessages(base + "all", all);
  std::vector<Child> consumers;
  for (int c = 0; c < 2; ++c) {
    consumers.push_back(SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "all"}));
  }
  for (auto& c : consumers) {
    ASSERT_EQ(c.Wait(60), 0);
    EXPECT_EQ(CountLines(c.Output(), "ok "), 80) << c.Output();
  }
  TouchFile(base + "stop");
  for (auto& p : producers) {
    EXPECT_EQ(p.Wait(60), 0) << p.Output();
  }
  std::filesystem::remove_all(dirs.spill());
  std::filesystem::create_directory(dirs.spill());
  EXPECT_TRUE(dirs.remaining().empty());
}

// abort("abc") frees abc's blocks only: never abc_1_2's or abc_1_2_0_0's (field lesson 004),
// and a block a reader holds now is freed only after that reader releases it.
TEST(StreamProcess, AbortIsExactAndWaitsForHolders) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::string> keys = {"abc", "abc_1_2", "abc_1_2_0_0", "0", "abc_def"};
  std::vector<std::string> descs;
  for (const auto& key : keys) {
    for (int chunk = 0; chunk < 2; ++chunk) {
      std::vector<std::byte> data(30000 + chunk);
      FillPattern(data, key);
      ASSERT_OK_AND_ASSIGN(auto d, producer.Put(key, data, {}));
      descs.push_back(d);
    }
  }
  // A consumer process holds abc's first chunk, gated on a file.
  WriteMessages(base + "held", {descs[0]});
  Child holder = SpawnRole(
      "stream_consume", {dirs.shm(), dirs.spill(), base + "held", base + "holding", base + "gate"});
  ASSERT_TRUE(WaitForFile(base + "holding", 60));
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("abc"));
  EXPECT_EQ(marked, 2u);
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 9u);  // abc's unheld chunk freed, the held one not
  // Every other key's tensors are intact and readable by another process.
  std::vector<std::string> others(descs.begin() + 2, descs.end());
  WriteMessages(base + "others", others);
  Child reader = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "others"});
  ASSERT_EQ(reader.Wait(60), 0);
  EXPECT_EQ(CountLines(reader.Output(), "ok "), 8) << reader.Output();
  // abc's chunks are refused to new readers.
  WriteMessages(base + "aborted", {descs[1]});
  Child late = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "aborted"});
  ASSERT_EQ(late.Wait(60), 0);
  EXPECT_EQ(CountLines(late.Output(), "refused "), 1) << late.Output();
  // The holder releases: now the aborted block goes.
  TouchFile(base + "gate");
  ASSERT_EQ(holder.Wait(60), 0);
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// The release waits for the (simulated) device copy: the block stays while the predicate is
// false, and comes back once it is true.
TEST(StreamProcess, ReleaseGatedOnCompletion) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(1 << 20);
  FillPattern(data, "gated");
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("gated", data, {}));
  WriteMessages(base + "d", {d});
  Child c = SpawnRole("stream_consume",
                      {dirs.shm(), dirs.spill(), base + "d", base + "opened", base + "copy-done"});
  ASSERT_TRUE(WaitForFile(base + "opened", 60));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);
  TouchFile(base + "copy-done");
  ASSERT_EQ(c.Wait(60), 0);
  EXPECT_EQ(CountLines(c.Output(), "ok "), 1);
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// A consumer killed while it holds a view: an abort of that key frees the block once the
// producer sees the reader is gone (its lock byte is free).
TEST(StreamProcess, DeadReaderHoldsAreCleared) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(100000);
  FillPattern(data, "k");
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("k", data, {}));
  WriteMessages(base + "d", {d});
  Child c = SpawnRole("stream_consume",
                      {dirs.shm(), dirs.spill(), base + "d", base + "opened", base + "never"});
  ASSERT_TRUE(WaitForFile(base + "opened", 60));
  c.Kill(SIGKILL);
  c.Wait(10);
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("k"));
  EXPECT_EQ(marked, 1u);
  ASSERT_OK(producer.Reclaim());
  StreamStats s = producer.Stats().value();
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.dead_readers_cleared, 1u);
}

// At the cap the producer spills (never hangs, never fails); the consumer reads the spilled
// tensor through the same Open; once space is back, tensors go to the segment again.
TEST(StreamProcess, SpillAtTheCapAndBack) {
  StreamDirs dirs;
  const std::string base = dirs.shm() + "/../";
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 4 << 20;
  o.max_segments = 1;
  std::string desc_file = dirs.spill() + "-descs";
  {
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
    std::vector<std::string> descs;
    for (int i = 0; i < 6; ++i) {  // 6 x 1 MiB into a 4 MiB segment
      std::string key = "t";       // appended: g++ 12 -O3 false -Wrestrict (GCC PR 105651)
      key += std::to_string(i);
      std::vector<std::byte> data(1 << 20);
      FillPattern(data, key);
      ASSERT_OK_AND_ASSIGN(auto d, producer.Put(key, data, {}));
      descs.push_back(d);
    }
    StreamStats s = producer.Stats().value();
    EXPECT_EQ(s.spills, 2u);
    EXPECT_EQ(s.spill_files, 2u);
    ASSERT_OK_AND_ASSIGN(auto last, TensorDescriptor::Decode(descs.back()));
    EXPECT_TRUE(last.spilled);
    EXPECT_TRUE(std::filesystem::exists(dirs.spill() + "/" + last.segment));
    WriteMessages(desc_file, descs);
    Child c = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), desc_file});
    ASSERT_EQ(c.Wait(60), 0);
    EXPECT_EQ(CountLines(c.Output(), "ok "), 6) << c.Output();
    std::vector<std::byte> data(1 << 20);
    FillPattern(data, "after");
    ASSERT_OK_AND_ASSIGN(auto again, producer.Put("after", data, {}));
    ASSERT_OK_AND_ASSIGN(auto again_d, TensorDescriptor::Decode(again));
    EXPECT_FALSE(again_d.spilled);
    s = producer.Stats().value();
    EXPECT_EQ(s.spill_files, 0u);  // consumed spill files are gone
    EXPECT_EQ(s.live_blocks, 1u);
  }
  std::filesystem::remove(desc_file);
  EXPECT_TRUE(dirs.remaining().empty());
}

TEST(StreamProcess, StrictModeFailsWithinItsBound) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 1;
  o.strict = true;
  o.strict_wait_seconds = 0.2;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<std::byte> data(2 << 20);
  ASSERT_OK(producer.Put("fill", data, {}));
  auto start = std::chrono::steady_clock::now();
  auto r = producer.Reserve("more", 1 << 20);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(r.status().message().find("strict mode"), std::string::npos) << r.status().message();
  EXPECT_GE(seconds, 0.2);
  EXPECT_LT(seconds, 20.0);  // bounded: never a hang (loose: the machine is shared)
  EXPECT_EQ(producer.Stats()->spills, 0u);
}

// A consumer keeps a peer's segment mapped while it holds a view, and drops the mapping once
// the file was unlinked (the producer exited) and the view is released.
TEST(StreamProcess, ConsumerDropsAnUnlinkedSegmentAfterItsViews) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  Child owner =
      SpawnRole("stream_produce_and_hang", {dirs.shm(), dirs.spill(), "gone", base + "ready"});
  ASSERT_TRUE(WaitForFile(base + "ready", 60));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(ReadMessages(base + "ready.desc").at(0)));
  owner.Kill(SIGKILL);
  owner.Wait(10);
  ASSERT_OK(SweepStreamDirectory(dirs.shm()));
  EXPECT_TRUE(std::filesystem::is_empty(dirs.shm()));
  consumer.PollReleases();
  EXPECT_EQ(consumer.Stats().mapped_segments, 1u);  // still viewed
  EXPECT_EQ(t.bytes().size(), 5000u);
  t.Release();
  consumer.PollReleases();
  ConsumerStats s = consumer.Stats();
  EXPECT_EQ(s.mapped_segments, 0u);
  EXPECT_EQ(s.dropped_segments, 1u);
}

// `expert-arena ls DIR`: every arena and stream segment of a shared directory with what holds
// it, from real processes: a published arena nobody maps (rm frees it), one an engine holds
// (in use), a live producer's segment and a killed producer's (sweep frees it); other files,
// a FIFO among them, are only counted (and never opened: a FIFO would block). The holder runs
// `load --hold` with stdin on /dev/null, which must not end the hold.
TEST(StreamProcess, CliLsListsArenasAndSegmentsWithWhatHoldsThem) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  const std::string tool = testing::BinDir() + "/expert-arena";
  if (!std::filesystem::exists(tool)) GTEST_SKIP() << "expert-arena not built";
  const std::string model = base + "m.gguf";
  Child gen =
      testing::SpawnProgram(tool, {"gen-model", "--format", "gguf", "--out", model, "--layers", "2",
                                   "--experts", "2", "--hidden", "64", "--ffn", "64"});
  ASSERT_EQ(gen.Wait(60), 0);
  const std::string idle = dirs.shm() + "/idle.arena", held = dirs.shm() + "/held.arena";
  Child load = testing::SpawnProgram(tool, {"load", "--model", model, "--arena", idle});
  ASSERT_EQ(load.Wait(60), 0);
  // stdin /dev/null, as under a service manager: --hold still holds until SIGTERM.
  Child holder = testing::SpawnProgram(
      "/bin/sh", {"-c", "exec " + tool + " load --model " + model + " --arena " + held +
                            " --hold --json </dev/null"});
  ASSERT_TRUE(holder.WaitForOutput("\"role\"", 60)) << holder.Output();
  Child live = SpawnRole("stream_produce_and_hang", {dirs.shm(), dirs.spill(), "live", base + "l"});
  Child dead = SpawnRole("stream_produce_and_hang", {dirs.shm(), dirs.spill(), "dead", base + "d"});
  ASSERT_TRUE(WaitForFile(base + "l", 60));
  ASSERT_TRUE(WaitForFile(base + "d", 60));
  dead.Kill(SIGKILL);
  EXPECT_EQ(dead.Wait(10), 128 + SIGKILL);
  TouchFile(dirs.shm() + "/notes.txt");
  ASSERT_EQ(::mkfifo((dirs.shm() + "/fifo").c_str(), 0600), 0);

  Child ls = testing::SpawnProgram(tool, {"ls", dirs.shm(), "--json"});
  ASSERT_EQ(ls.Wait(30), 0) << "a FIFO in the directory must not block ls";
  const nlohmann::json j = nlohmann::json::parse(ls.Output());
  ASSERT_EQ(j["arenas"].size(), 2u) << j.dump(1);
  for (const auto& a : j["arenas"]) {
    EXPECT_EQ(a["state"], "published") << a.dump();
    EXPECT_EQ(a["in_use"], a["path"] == held) << a.dump();
  }
  ASSERT_EQ(j["segments"].size(), 2u) << j.dump(1);
  for (const auto& g : j["segments"]) {
    const bool is_live = g["logical_name"] == "live";
    EXPECT_EQ(g["owner_alive"], is_live) << g.dump();
    EXPECT_EQ(g["owner_pid"], is_live ? live.pid() : dead.pid()) << g.dump();
    EXPECT_EQ(g["live_blocks"], 1) << g.dump();
  }
  EXPECT_EQ(j["arenas_in_use"], 1);
  EXPECT_EQ(j["dead_owner_segments"], 1);
  EXPECT_EQ(j["other_files"], 2) << "notes.txt and the FIFO";

  Child text = testing::SpawnProgram(tool, {"ls", dirs.shm()});
  ASSERT_EQ(text.Wait(30), 0);
  const std::string out = text.Output();
  EXPECT_NE(out.find(idle + ": not in use; kept for the next engine (rm frees it)"),
            std::string::npos)
      << out;
  // Who holds it, by pid and command (/proc/locks and the holder's fdinfo).
  EXPECT_NE(out.find(held + ": in use by pid " + std::to_string(holder.pid()) +
                     " (expert-arena load --model "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("owner pid " + std::to_string(dead.pid()) + " gone (sweep frees it)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("2 arenas"), std::string::npos) << out;
  EXPECT_NE(out.find("2 other files not shown"), std::string::npos) << out;

  holder.Kill(SIGTERM);
  EXPECT_EQ(holder.Wait(30), 0);
  live.Kill(SIGKILL);
  live.Wait(10);
}

// `info` prints a segment's logical name, which another process wrote, escaped: bytes of 0x80
// and up (the 8-bit CSI 0x9b among them) come out as \xNN in the text and the JSON, which then
// stays valid UTF-8 (raw, such a byte makes the JSON dump throw), and a name with a control byte is
// refused with the name escaped (on stderr, exit 1).
TEST(StreamProcess, CliInfoPrintsALogicalNameEscaped) {
  StreamDirs dirs;
  const std::string tool = testing::BinDir() + "/expert-arena";
  if (!std::filesystem::exists(tool)) GTEST_SKIP() << "expert-arena not built";
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(100);
  ASSERT_OK(producer.Put("k", data, {}).status());  // its first segment
  const std::string seg = producer.SegmentPaths().at(0);
  testing::WriteLogicalName(seg, "caf\xc3\xa9\x9b[2J");
  Child info = testing::SpawnProgram(tool, {"info", seg});
  ASSERT_EQ(info.Wait(30), 0);
  EXPECT_NE(info.Output().find("of \"caf\\xc3\\xa9\\x9b[2J\""), std::string::npos)
      << EscapeForMessage(info.Output());
  EXPECT_TRUE(testing::PrintableAscii(info.Output(), true));
  Child json = testing::SpawnProgram(tool, {"info", seg, "--json"});
  ASSERT_EQ(json.Wait(30), 0);
  EXPECT_NE(json.Output().find("\"logical_name\": \"caf\\\\xc3\\\\xa9\\\\x9b[2J\""),
            std::string::npos)
      << EscapeForMessage(json.Output());
  EXPECT_TRUE(testing::PrintableAscii(json.Output(), true));
  testing::WriteLogicalName(seg, "x\x1b[2J");
  Child refused = testing::SpawnProgram(tool, {"info", seg});
  EXPECT_EQ(refused.Wait(30), 1);
  EXPECT_TRUE(testing::PrintableAscii(refused.Output(), true));
}

// Field lesson 000: fixed segment names let a second server with the same entity name truncate the
// first one's live segments (8 MiB of wrong bytes, no error). A producer process started with
// the same logical name while the first one's tensors are unread leaves every byte of them
// alone, and both sets of files coexist.
TEST(StreamProcess, ASecondInstanceOfALogicalNameLeavesTheFirstsBytesAlone) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  StreamOptions o = dirs.Producer("same");
  o.segment_bytes = 8ull << 20;
  o.max_segments = 4;
  ASSERT_OK_AND_ASSIGN(auto first, StreamProducer::Create(o));
  std::vector<std::string> descs;
  for (int i = 0; i < 10; ++i) {
    std::string key = "first-" + std::to_string(i);
    std::vector<std::byte> data(5000 + i * 100000);
    FillPattern(data, key);
    ASSERT_OK_AND_ASSIGN(auto d, first.Put(key, data, {}));
    descs.push_back(d);
  }
  std::vector<std::string> first_paths = first.SegmentPaths();
  Child second = SpawnRole("stream_produce", {dirs.shm(), dirs.spill(), "same", base + "desc", "40",
                                              base + "ready", base + "stop"});
  ASSERT_TRUE(WaitForFile(base + "ready", 60)) << second.Output();
  ASSERT_OK_AND_ASSIGN(auto theirs, TensorDescriptor::Decode(ReadMessages(base + "desc").at(0)));
  for (const auto& path : first_paths) {
    EXPECT_TRUE(std::filesystem::exists(path)) << path;
    EXPECT_NE(std::filesystem::path(path).filename().string(), theirs.segment);
  }
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  for (const auto& d : descs) {
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
    EXPECT_TRUE(CheckPattern(t.bytes(), t.descriptor().key)) << t.descriptor().key;
  }
  // The second instance's tensors are intact too (it checks all of them came back at exit).
  Child reader = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "desc"});
  ASSERT_EQ(reader.Wait(60), 0);
  Child reader2 = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "desc"});
  ASSERT_EQ(reader2.Wait(60), 0);
  EXPECT_EQ(CountLines(reader.Output(), "ok "), 40) << reader.Output();
  TouchFile(base + "stop");
  EXPECT_EQ(second.Wait(60), 0) << second.Output();
}

// Field lesson 003: a slot is reused only once EVERY reader has released it. With two readers, the
// first reader's release leaves the block in place for the second; a third Open is refused.
TEST(StreamProcess, ABlockStaysUntilItsLastReaderReleases) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(300000);
  FillPattern(data, "two");
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("two", data, {}, /*readers=*/2));
  WriteMessages(base + "d", {d});
  Child a = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "d"});
  ASSERT_EQ(a.Wait(60), 0);
  EXPECT_EQ(CountLines(a.Output(), "ok "), 1) << a.Output();
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);  // the second reader has not read it yet
  // Space pressure must not take it either: fill the rest of the segment and more.
  std::vector<std::byte> filler(1 << 20);
  for (int i = 0; i < 3; ++i) ASSERT_OK(producer.Put("filler" + std::to_string(i), filler, {}));
  Child b = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "d"});
  ASSERT_EQ(b.Wait(60), 0);
  EXPECT_EQ(CountLines(b.Output(), "ok "), 1) << b.Output();
  ASSERT_OK(producer.Abort("filler0"));
  ASSERT_OK(producer.Abort("filler1"));
  ASSERT_OK(producer.Abort("filler2"));
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
  Child late = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "d"});
  ASSERT_EQ(late.Wait(60), 0);
  EXPECT_EQ(CountLines(late.Output(), "refused "), 1) << late.Output();
}

// Field lesson 000: backpressure waited for acknowledgements that only the blocked thread could
// process, so strict mode always ran into its timeout. Here the release state lives in the
// segment: a single-threaded producer waiting at the cap gets the space back the moment a
// consumer process releases, with nothing relayed through the producer.
TEST(StreamProcess, StrictWaitEndsWhenAnotherProcessReleases) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 1;
  o.strict = true;
  o.strict_wait_seconds = 120;  // far beyond the test: reaching it is the failure
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<std::byte> data(2 << 20);
  FillPattern(data, "fill");
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("fill", data, {}));
  WriteMessages(base + "d", {d});
  Child holder = SpawnRole("stream_consume",
                           {dirs.shm(), dirs.spill(), base + "d", base + "holding", base + "gate"});
  ASSERT_TRUE(WaitForFile(base + "holding", 60));
  // The gate opens from another thread, a little later, so that the reserve below is most
  // likely already waiting; either order must succeed.
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    TouchFile(base + "gate");
  });
  auto r = producer.Reserve("more", 1 << 20);
  opener.join();
  ASSERT_OK(r.status());
  EXPECT_FALSE(r->spilled());
  EXPECT_EQ(producer.Stats()->spills, 0u);
  ASSERT_EQ(holder.Wait(60), 0);
}

// ---- fork --------------------------------------------------------------------------------

// Runs `body` in a forked child (this test's process, not a new program: what an engine that
// forks its workers does) and returns its exit status, or -1 when it did not exit normally.
// The child leaves with _exit, so nothing of the parent's test state is torn down twice.
int InForkedChild(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// True when `status` is the fork refusal naming `creator`.
bool IsForkRefusal(const Status& status, pid_t creator) {
  return status.code() == StatusCode::kInvalidArgument &&
         status.message().find("created in process " + std::to_string(creator) +
                               "; a forked child") != std::string::npos;
}

// Issue 21 item 1: a forked child must never hand out the parent's blocks, nor unlink the
// parent's segments or spend its readers' shares when it drops what it inherited.
TEST(StreamFork, AChildRefusesTheParentsProducerAndLeavesItsSegments) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto parent, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(100000);
  FillPattern(data, "before");
  ASSERT_OK_AND_ASSIGN(auto before, parent.Put("before", data, {}));
  ASSERT_OK_AND_ASSIGN(auto reserved, parent.Reserve("reserved", 5000));  // held across fork
  const std::vector<std::string> segments = parent.SegmentPaths();
  const pid_t me = getpid();
  std::optional<StreamProducer> inherited(std::move(parent));
  std::optional<Reservation> inherited_reservation(std::move(reserved));
  int child = InForkedChild([&] {
    std::vector<std::byte> mine(5000);
    auto put = inherited->Put("child", mine, {});
    if (put.ok() || !IsForkRefusal(put.status(), me)) return 10;
    if (inherited->Reserve("child", 10).ok() || inherited->Abort("before").ok() ||
        inherited->Reclaim().ok() || inherited->Pending().ok()) {
      return 11;
    }
    // Not even the figures: they would be the parent's, inherited.
    auto stats = inherited->Stats();
    if (stats.ok() || !IsForkRefusal(stats.status(), me)) return 16;
    if (inherited_reservation->Publish({}).ok()) return 12;
    // Dropping what was inherited: no unlink, no block given back.
    inherited_reservation.reset();
    inherited.reset();
    // The child's own producer works, with its own segments.
    auto own = StreamProducer::Create(dirs.Producer("child"));
    if (!own.ok()) return 13;
    auto d = own->Put("child", mine, {});
    if (!d.ok()) return 14;
    for (const auto& p : own->SegmentPaths()) {
      for (const auto& q : segments) {
        if (p == q) return 15;
      }
    }
    return 0;
  });
  EXPECT_EQ(child, 0);
  for (const auto& p : segments) EXPECT_TRUE(std::filesystem::exists(p)) << p;
  StreamProducer& producer = *inherited;
  // The reservation the child dropped is still the parent's: publishing it works.
  FillPattern(inherited_reservation->bytes(), "reserved");
  ASSERT_OK_AND_ASSIGN(auto reserved_d, inherited_reservation->Publish({}));
  // The next put lands elsewhere than every block handed out before the fork.
  ASSERT_OK_AND_ASSIGN(auto after, producer.Put("after", data, {}));
  ASSERT_OK_AND_ASSIGN(auto a, TensorDescriptor::Decode(after));
  ASSERT_OK_AND_ASSIGN(auto b, TensorDescriptor::Decode(before));
  ASSERT_OK_AND_ASSIGN(auto r, TensorDescriptor::Decode(reserved_d));
  EXPECT_TRUE(a.segment != b.segment || a.offset != b.offset);
  EXPECT_TRUE(a.segment != r.segment || a.offset != r.offset);
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  ASSERT_OK_AND_ASSIGN(auto tb, consumer.Open(before));
  ASSERT_OK_AND_ASSIGN(auto tr, consumer.Open(reserved_d));
  EXPECT_TRUE(CheckPattern(tb.bytes(), "before"));
  EXPECT_TRUE(CheckPattern(tr.bytes(), "reserved"));
  StreamStats stats = producer.Stats().value();
  EXPECT_EQ(stats.live_blocks, 3u);
}

// A child of a consumer holding views: Open refuses, and dropping the inherited views and the
// consumer spends none of the parent's shares nor clears its holds.
TEST(StreamFork, AChildDroppingInheritedViewsLeavesTheParentsHolds) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(64 << 10);
  FillPattern(data, "held");
  ASSERT_OK_AND_ASSIGN(auto held_d, producer.Put("held", data, {}, 2));
  FillPattern(data, "other");
  ASSERT_OK_AND_ASSIGN(auto other_d, producer.Put("other", data, {}));
  ASSERT_OK_AND_ASSIGN(auto view, consumer.Open(held_d));
  const pid_t me = getpid();
  std::optional<StreamConsumer> inherited(std::move(consumer));
  std::optional<StreamTensor> inherited_view(std::move(view));
  int child = InForkedChild([&] {
    auto opened = inherited->Open(other_d);
    if (opened.ok() || !IsForkRefusal(opened.status(), me)) return 10;
    if (!CheckPattern(inherited_view->bytes(), "held")) return 11;  // still mapped, readable
    inherited_view->Release();
    inherited_view.reset();
    inherited.reset();
    // The child's own consumer opens the parent's descriptors like any other process.
    auto own = StreamConsumer::Create(dirs.Consumer());
    if (!own.ok()) return 12;
    auto t = own->Open(held_d);
    if (!t.ok() || !CheckPattern(t->bytes(), "held")) return 13;
    return 0;  // _exit: the child's own view dies with the process (its lease ends)
  });
  EXPECT_EQ(child, 0);
  // The parent's view is intact; the child's own hold ended with the child (a lease, spent
  // when the producer notices), so the block waits for the parent's release only.
  EXPECT_TRUE(CheckPattern(inherited_view->bytes(), "held"));
  ASSERT_OK(producer.Reclaim());
  ASSERT_OK_AND_ASSIGN(auto pending, producer.Pending());
  ASSERT_EQ(pending.size(), 2u);
  for (const PendingBlock& p : pending) {
    if (p.key == "held") {
      EXPECT_EQ(p.readers_left, 1u);  // 2, less the child's dead consumer's share
      EXPECT_EQ(p.holders, 1u);       // the parent's view
    }
  }
  inherited_view->Release();
  ASSERT_OK_AND_ASSIGN(auto t, inherited->Open(other_d));
  EXPECT_TRUE(CheckPattern(t.bytes(), "other"));
  t.Release();
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// Forks while another thread puts and releases (small segments, so the producer grows, grows
// ahead and reclaims meanwhile): every child gets a refusal, and the parent's tensors stay
// bit-exact with its segments in place.
TEST(StreamFork, ForkWhileAnotherThreadPuts) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 4;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::atomic<int> rounds{0};
  std::thread putter([&] {
    std::vector<std::byte> data;
    for (int i = 0; !stop.load(); ++i) {
      std::string key = "k" + std::to_string(i);
      data.resize(1000 + (i % 7) * 100000);
      FillPattern(data, key);
      auto d = producer.Put(key, data, {});
      if (!d.ok()) {
        ++bad;
        continue;
      }
      auto t = consumer.Open(*d);
      if (!t.ok() || !CheckPattern(t->bytes(), key)) ++bad;
      rounds.fetch_add(1);
    }
  });
  const pid_t me = getpid();
  for (int f = 0; f < 20; ++f) {
    while (rounds.load() < f * 5) std::this_thread::yield();
    int child = InForkedChild([&] {
      std::vector<std::byte> mine(100);
      auto put = producer.Put("child", mine, {});
      if (put.ok() || !IsForkRefusal(put.status(), me)) return 10;
      return 0;  // the producer and consumer are the parent test's: dropped by the parent
    });
    EXPECT_EQ(child, 0) << "fork " << f;
  }
  stop.store(true);
  putter.join();
  EXPECT_EQ(bad.load(), 0);
  for (const auto& p : producer.SegmentPaths()) EXPECT_TRUE(std::filesystem::exists(p)) << p;
  std::vector<std::byte> data(3000);
  FillPattern(data, "last");
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("last", data, {}));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
  EXPECT_TRUE(CheckPattern(t.bytes(), "last"));
}

// ---- leases --------------------------------------------------------------------------------

// Issue 21 item 6: a consumer process killed while it holds views, and one that exits without
// releasing, give their blocks back to the producer without an abort; a live consumer's holds
// are never released for it.
TEST(StreamLease, ADeadConsumersHoldsComeBackALiveOnesStay) {
  StreamDirs dirs;
  const std::string base = dirs.spill() + "/";
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(100000);
  auto put = [&](const std::string& key, uint32_t readers) {
    FillPattern(data, key);
    auto d = producer.Put(key, data, {}, readers);
    EXPECT_OK(d.status());
    return d.ok() ? *d : std::string();
  };
  WriteMessages(base + "killed", {put("killed-only", 1), put("shared", 2)});
  WriteMessages(base + "exited", {put("exited-only", 1)});
  WriteMessages(base + "live", {put("live-only", 1), put("shared-live", 1)});
  // "shared" is held by the killed consumer and the live one.
  std::vector<std::string> live_descs = ReadMessages(base + "live");
  live_descs.push_back(ReadMessages(base + "killed").at(1));
  WriteMessages(base + "live", live_descs);
  Child live = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "live",
                                            base + "live.held", base + "gate"});
  Child killed = SpawnRole("stream_consume", {dirs.shm(), dirs.spill(), base + "killed",
                                              base + "killed.held", base + "never"});
  Child exited =
      SpawnRole("stream_open_and_exit", {dirs.shm(), dirs.spill(), base + "exited", base + "x"});
  ASSERT_TRUE(WaitForFile(base + "live.held", 60));
  ASSERT_TRUE(WaitForFile(base + "killed.held", 60));
  ASSERT_EQ(exited.Wait(60), 0);
  killed.Kill(SIGKILL);
  killed.Wait(10);
  // Pending settles first (the lease check runs now): the dead consumers' blocks are back.
  ASSERT_OK_AND_ASSIGN(auto pending, producer.Pending());
  std::map<std::string, PendingBlock> by_key;
  for (const auto& p : pending) by_key[p.key] = p;
  EXPECT_EQ(by_key.count("killed-only"), 0u);
  EXPECT_EQ(by_key.count("exited-only"), 0u);
  ASSERT_EQ(by_key.count("shared"), 1u);
  EXPECT_EQ(by_key["shared"].readers_left, 1u);  // the live consumer's share is still out
  EXPECT_EQ(by_key["shared"].holders, 1u);
  EXPECT_EQ(by_key["shared"].state, "published");
  ASSERT_EQ(by_key.count("live-only"), 1u);
  EXPECT_EQ(by_key["live-only"].readers_left, 1u);
  EXPECT_EQ(by_key["live-only"].holders, 1u);
  EXPECT_EQ(by_key.count("shared-live"), 1u);
  EXPECT_GE(by_key["live-only"].age_seconds, 0.0);
  // The producer noticed the dead readers, or a consumer that took a dead one's reader entry
  // over did (stream::SpendDeadReaderHolds either way), depending on the order they started.
  // The live consumer reads its bytes intact, then releases: everything comes back.
  TouchFile(base + "gate");
  ASSERT_EQ(live.Wait(60), 0);
  EXPECT_EQ(CountLines(live.Output(), "ok "), 3) << live.Output();
  ASSERT_OK(producer.Reclaim());
  ASSERT_OK_AND_ASSIGN(auto after, producer.Pending());
  EXPECT_TRUE(after.empty());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// Issue 21 item 7: a failed OpenMany gives back what it opened before the bad item without
// spending a share, so every descriptor (readers=1) opens again.
TEST(StreamLease, AFailedOpenManyLeavesEveryDescriptorOpenable) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(5000);
  std::vector<std::string> descs;
  for (const char* key : {"a", "b", "c"}) {
    FillPattern(data, key);
    ASSERT_OK_AND_ASSIGN(auto d, producer.Put(key, data, {}));
    descs.push_back(d);
  }
  ASSERT_OK_AND_ASSIGN(auto aborted, producer.Put("gone", data, {}));
  ASSERT_OK(producer.Abort("gone").status());
  std::vector<std::string_view> batch = {descs[0], descs[1], aborted, descs[2]};
  auto failed = consumer.OpenMany(batch);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("item 2 of 4"), std::string::npos)
      << failed.status().message();
  std::vector<std::string_view> good = {descs[0], descs[1], descs[2]};
  ASSERT_OK_AND_ASSIGN(auto opened, consumer.OpenMany(good));
  ASSERT_EQ(opened.size(), 3u);
  EXPECT_TRUE(CheckPattern(opened[0].bytes(), "a"));
  EXPECT_TRUE(CheckPattern(opened[2].bytes(), "c"));
  opened.clear();
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// Issue 21 item 9: after the producer closed, a stale descriptor says so.
TEST(StreamLease, AStaleDescriptorAfterCloseNamesTheClose) {
  StreamDirs dirs;
  std::optional<StreamProducer> producer;
  ASSERT_OK_AND_ASSIGN(producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(5000);
  ASSERT_OK_AND_ASSIGN(auto first, producer->Put("first", data, {}));
  ASSERT_OK_AND_ASSIGN(auto second, producer->Put("second", data, {}));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(first));  // the segment is mapped now
  producer.reset();
  auto stale = consumer.Open(second);
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.status().message().find("closed the stream"), std::string::npos)
      << stale.status().message();
  ASSERT_OK_AND_ASSIGN(auto fresh, StreamConsumer::Create(dirs.Consumer()));
  auto gone = fresh.Open(second);
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.status().message().find("closed the stream or exited"), std::string::npos)
      << gone.status().message();
}

}  // namespace
}  // namespace expert_arena
