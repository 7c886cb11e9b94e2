// In-process tests of the stream pieces: allocator, descriptor wire form, validation of
// hostile descriptors, sizing, fragmentation warning. Cross-process behaviour is in
// stream_process_test.cc, the sweep in stream_sweep_test.cc.
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "common/escape.h"
#include "expert_arena/stream.h"
#include "gpu/runtime.h"
#include "platform/file.h"
#include "platform/system_info.h"
#include "stream/block_allocator.h"
#include "stream_test_util.h"
#include "test_util.h"

namespace expert_arena {
namespace {

using stream::Block;
using stream::BlockAllocator;
using testing::PrintableAscii;
using testing::StreamDirs;
using testing::CheckPattern;
using testing::FillPattern;

TEST(BlockAllocator, CoalescesNeighboursBackToOneBlock) {
  BlockAllocator a;
  a.AddSegment(0, 0, 1 << 20);
  std::vector<Block> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(*a.Reserve(64 << 10));
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_FALSE(a.Reserve(1).has_value());
  // Free every other block: 8 holes of 64 KiB, no 128 KiB block.
  for (int i = 0; i < 16; i += 2) a.Free(blocks[i]);
  EXPECT_EQ(a.free_bytes(), 8u * (64 << 10));
  EXPECT_EQ(a.largest_free_block(), 64u << 10);
  EXPECT_FALSE(a.Reserve(128 << 10).has_value());
  for (int i = 1; i < 16; i += 2) a.Free(blocks[i]);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free_block(), 1u << 20);
}

TEST(BlockAllocator, BestFitKeepsLargeBlocksWhole) {
  BlockAllocator a;
  a.AddSegment(0, 0, 1 << 20);
  a.AddSegment(1, 0, 64 << 10);
  auto small = a.Reserve(4096);
  ASSERT_TRUE(small.has_value());
  EXPECT_EQ(small->segment, 1u);  // the smaller free block that fits
  EXPECT_EQ(a.largest_free_block(), 1u << 20);
}

TEST(BlockAllocator, RandomReserveFreeKeepsAccounts) {
  BlockAllocator a;
  a.AddSegment(0, 0, 64 << 20);
  a.AddSegment(1, 0, 64 << 20);
  std::mt19937_64 rng(7);
  std::vector<Block> live;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      auto b = a.Reserve(4096 * (1 + rng() % 64));
      if (b) live.push_back(*b);
    } else {
      size_t k = rng() % live.size();
      a.Free(live[k]);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const auto& b : live) a.Free(b);
  EXPECT_EQ(a.free_bytes(), a.total_bytes());
  EXPECT_EQ(a.free_block_count(), 2u);
}

TensorDescriptor SampleDescriptor() {
  TensorDescriptor d;
  d.segment = "ea-stream-x-1-2-abcd-0";
  d.slot = 3;
  d.generation = 9;
  d.offset = 2 << 20;
  d.length = 4096;
  d.dtype = "bf16";
  d.shape = {2, 1024};
  d.key = "abc_1_2";
  return d;
}

TEST(TensorDescriptor, RoundTrips) {
  TensorDescriptor d = SampleDescriptor();
  d.spilled = true;
  ASSERT_OK_AND_ASSIGN(auto back, TensorDescriptor::Decode(d.Encode()));
  EXPECT_EQ(back.segment, d.segment);
  EXPECT_TRUE(back.spilled);
  EXPECT_EQ(back.slot, 3u);
  EXPECT_EQ(back.generation, 9u);
  EXPECT_EQ(back.offset, d.offset);
  EXPECT_EQ(back.length, d.length);
  EXPECT_EQ(back.dtype, "bf16");
  EXPECT_EQ(back.shape, d.shape);
  EXPECT_EQ(back.key, "abc_1_2");
}

TEST(TensorDescriptor, RefusesDamagedBytes) {
  std::string good = SampleDescriptor().Encode();
  auto refused = [](std::string bytes, const std::string& words) {
    auto r = TensorDescriptor::Decode(bytes);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().message();
  };
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  refused(bad_magic, "bad magic");
  std::string bad_version = good;
  bad_version[4] = 7;
  refused(bad_version, "version 7");
  refused(good.substr(0, good.size() - 1), "bytes but");
  std::string flipped = good;
  flipped[30] ^= 1;
  refused(flipped, "checksum");
  refused("", "size 0");
}

TEST(TensorDescriptor, RefusesNamesOutsideTheDirectory) {
  for (std::string name : {"../ea-stream-x", "ea-stream-a/../../etc/passwd", "/etc/passwd",
                           "ea-stream-..", "other-file", "ea-stream-"}) {
    TensorDescriptor d = SampleDescriptor();
    d.segment = name;
    auto r = TensorDescriptor::Decode(d.Encode());
    ASSERT_FALSE(r.ok()) << name;
    EXPECT_NE(r.status().message().find("segment name"), std::string::npos);
  }
}

TEST(StreamProducer, SizingFailsFastWhenTheCapCanNeverFit) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 1ull << 30;
  o.max_segments = 100000;
  auto p = StreamProducer::Create(o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(p.status().message().find("100000 segments"), std::string::npos)
      << p.status().message();
  EXPECT_TRUE(dirs.remaining().empty());
}

TEST(StreamProducer, RefusesBadOptions) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer("bad/name");
  EXPECT_EQ(StreamProducer::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = dirs.Producer("a..b");  // would make segment names consumers refuse
  EXPECT_EQ(StreamProducer::Create(o).status().code(), StatusCode::kInvalidArgument);
  o = dirs.Producer();
  o.segment_bytes = 3 << 20;
  EXPECT_EQ(StreamProducer::Create(o).status().code(), StatusCode::kInvalidArgument);
  // A device that names nothing (built by hand) is refused at create time, as Arena::Open
  // refuses it, not found at the first segment.
  o = dirs.Producer();
  o.gpu = GpuDevice{GpuBackend::kCuda, -3};
  auto typo = StreamProducer::Create(o);
  EXPECT_EQ(typo.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().message().find("cuda:-3"), std::string::npos) << typo.status().ToString();
  ConsumerOptions c = dirs.Consumer();
  c.gpu = GpuDevice{static_cast<GpuBackend>(9), 0};
  auto consumer = StreamConsumer::Create(c);
  EXPECT_EQ(consumer.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(consumer.status().message().find("unknown"), std::string::npos)
      << consumer.status().ToString();
}

TEST(StreamProducer, LogicalNamesMayHoldDashesAndDots) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer("prefill-0.v2")));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(5000);
  testing::FillPattern(data, "d");
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("d", data, {}));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "d"));
  EXPECT_NE(t.descriptor().segment.find("ea-stream-prefill-0.v2-"), std::string::npos);
}

// private_bytes(): the same bytes through the consumer's copy-on-write mapping. A write there
// never reaches the segment (bytes(), another consumer), and is dropped with the block's last
// view, so the block that reuses the place reads the producer's bytes.
TEST(StreamConsumer, PrivateBytesAreCopyOnWriteAndDroppedWithTheView) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  ASSERT_OK_AND_ASSIGN(auto other, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(30000);
  testing::FillPattern(data, "a");
  ASSERT_OK_AND_ASSIGN(auto first, producer.Put("a", data, {}, 2));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(first));
  ASSERT_OK_AND_ASSIGN(std::span<std::byte> mine, t.private_bytes());
  ASSERT_EQ(mine.size(), data.size());
  EXPECT_NE(mine.data(), t.bytes().data());
  EXPECT_TRUE(testing::CheckPattern(mine, "a"));
  std::fill(mine.begin(), mine.end(), std::byte{0xEE});
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "a"));
  ASSERT_OK_AND_ASSIGN(auto theirs, other.Open(first));
  EXPECT_TRUE(testing::CheckPattern(theirs.bytes(), "a"));
  ASSERT_OK_AND_ASSIGN(auto theirs_private, theirs.private_bytes());
  EXPECT_TRUE(testing::CheckPattern(theirs_private, "a"));
  theirs.Release();
  const uint64_t offset = t.descriptor().offset;
  t.Release();
  ASSERT_OK(producer.Reclaim());
  testing::FillPattern(data, "b");
  ASSERT_OK_AND_ASSIGN(auto second, producer.Put("b", data, {}));
  ASSERT_OK_AND_ASSIGN(auto u, consumer.Open(second));
  ASSERT_EQ(u.descriptor().offset, offset);  // the same place
  ASSERT_OK_AND_ASSIGN(auto u_private, u.private_bytes());
  EXPECT_TRUE(testing::CheckPattern(u_private, "b"));
}

// How many mappings of files named `name` this process has (/proc/self/maps).
int MappingsOf(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.size() > name.size() && line.ends_with("/" + name)) ++n;
  }
  return n;
}

// The copy-on-write mapping is made by the first private_bytes() of a segment's blocks, once:
// a consumer that reads bytes() only never maps a segment twice.
TEST(StreamConsumer, PrivateMappingIsMadeOnFirstUse) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(30000);
  testing::FillPattern(data, "a");
  ASSERT_OK_AND_ASSIGN(auto first, producer.Put("a", data, {}));
  testing::FillPattern(data, "b");
  ASSERT_OK_AND_ASSIGN(auto second, producer.Put("b", data, {}));
  ASSERT_OK_AND_ASSIGN(auto d, TensorDescriptor::Decode(first));
  const int producers = MappingsOf(d.segment);
  ASSERT_GE(producers, 1);
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(first));
  ASSERT_OK_AND_ASSIGN(auto u, consumer.Open(second));
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "a"));
  EXPECT_EQ(MappingsOf(d.segment), producers + 1);  // the consumer's shared mapping only
  ASSERT_OK_AND_ASSIGN(auto mine, t.private_bytes());
  EXPECT_TRUE(testing::CheckPattern(mine, "a"));
  EXPECT_EQ(MappingsOf(d.segment), producers + 2);
  // The same segment's other blocks, and the same block again, reuse that mapping.
  ASSERT_OK_AND_ASSIGN(auto theirs, u.private_bytes());
  EXPECT_TRUE(testing::CheckPattern(theirs, "b"));
  ASSERT_OK_AND_ASSIGN(auto again, t.private_bytes());
  EXPECT_EQ(again.data(), mine.data());
  EXPECT_EQ(MappingsOf(d.segment), producers + 2);
  t.Release();
  EXPECT_FALSE(t.private_bytes().ok());  // released: refused, never a dangling span
}

// Threads taking the first private bytes of blocks of one segment at once map it once.
TEST(StreamConsumer, PrivateMappingOnFirstUseIsThreadSafe) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  constexpr int kThreads = 8;
  std::vector<StreamTensor> tensors;
  std::string segment;
  for (int i = 0; i < kThreads; ++i) {
    std::vector<std::byte> data(10000);
    testing::FillPattern(data, "t" + std::to_string(i));
    ASSERT_OK_AND_ASSIGN(auto d, producer.Put("t" + std::to_string(i), data, {}));
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
    segment = t.descriptor().segment;
    tensors.push_back(std::move(t));
  }
  const int before = MappingsOf(segment);
  std::vector<std::span<std::byte>> got(kThreads);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto bytes = tensors[i].private_bytes();
      if (!bytes.ok() || !testing::CheckPattern(*bytes, "t" + std::to_string(i))) ++failures;
      if (bytes.ok()) got[i] = *bytes;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(MappingsOf(segment), before + 1);
  for (int i = 0; i < kThreads; ++i) {
    // One mapping: each block's private bytes lie where its offset says, from one base.
    EXPECT_EQ(got[i].data() - tensors[i].descriptor().offset,
              got[0].data() - tensors[0].descriptor().offset);
  }
}

// Descriptors that decode but do not match the segment: refused by Open with the reason.
TEST(StreamConsumer, RefusesHostileDescriptors) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(10000);
  testing::FillPattern(data, "k");
  ASSERT_OK_AND_ASSIGN(auto encoded, producer.Put("k", data, {}));
  ASSERT_OK_AND_ASSIGN(auto good, TensorDescriptor::Decode(encoded));
  auto expect_refused = [&](TensorDescriptor d, const std::string& words) {
    auto r = consumer.Open(d.Encode());
    ASSERT_FALSE(r.ok()) << words;
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().message();
  };
  TensorDescriptor d = good;
  d.offset = 1ull << 40;
  expect_refused(d, "outside the data region");
  d = good;
  d.length = 1ull << 40;
  expect_refused(d, "outside the data region");
  d = good;
  d.offset = 0;  // the header region
  expect_refused(d, "outside the data region");
  d = good;
  d.slot = 1 << 30;
  expect_refused(d, "past the");
  d = good;
  d.generation += 1;
  expect_refused(d, "stale descriptor");
  d = good;
  d.offset += 4096;
  expect_refused(d, "differ");
  d = good;
  d.segment = "ea-stream-not-there-1-2-3-4";
  expect_refused(d, "No such file");
  // The good one still works, and its bytes are the producer's.
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(encoded));
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "k"));
}

TEST(StreamProducer, WarnsWhenFragmentationFailsAReserve) {
  StreamDirs dirs;
  std::ostringstream logged;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(logged);
  auto logger = std::make_shared<spdlog::logger>("stream-frag-test", sink);
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 1;
  o.logger = logger;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<Reservation> held;
  for (int i = 0; i < 32; ++i) {
    std::string key = "k";  // appended, not "k" + ...: g++ 12 -O3 false -Wrestrict (GCC PR 105651)
    key += std::to_string(i);
    ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve(key, 64 << 10));
    held.push_back(std::move(r));
  }
  std::vector<Reservation> kept;
  for (int i = 0; i < 32; ++i) {
    if (i % 2 == 1) kept.push_back(std::move(held[i]));
  }
  held.clear();  // frees every other block: 1 MiB free in 64 KiB pieces
  StreamStats before = producer.Stats().value();
  EXPECT_EQ(before.free_bytes, 1u << 20);
  EXPECT_EQ(before.largest_free_block, 64u << 10);
  ASSERT_OK_AND_ASSIGN(auto big, producer.Reserve("big", 256 << 10));
  EXPECT_TRUE(big.spilled());
  logger->flush();
  EXPECT_NE(logged.str().find("fragmentation"), std::string::npos) << logged.str();
  StreamStats after = producer.Stats().value();
  EXPECT_EQ(after.fragmentation_failures, 1u);
  EXPECT_EQ(after.spills, 1u);
}

// Counts the lines of `text` that contain `what`.
size_t CountLines(const std::string& text, const std::string& what) {
  size_t n = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) n += line.find(what) != std::string::npos;
  return n;
}

TEST(StreamProducer, FragmentationWarningIsRateLimitedAndTheCounterCountsEvery) {
  StreamDirs dirs;
  std::ostringstream logged;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(logged);
  auto logger = std::make_shared<spdlog::logger>("stream-frag-rate-test", sink);
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 1;
  o.logger = logger;
  o.warning_interval_seconds = 0.5;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<Reservation> held;
  for (int i = 0; i < 32; ++i) {
    std::string key = "k";  // appended, not "k" + ...: g++ 12 -O3 false -Wrestrict (GCC PR 105651)
    key += std::to_string(i);
    ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve(key, 64 << 10));
    held.push_back(std::move(r));
  }
  std::vector<Reservation> kept;
  for (int i = 0; i < 32; ++i) {
    if (i % 2 == 1) kept.push_back(std::move(held[i]));
  }
  held.clear();  // 1 MiB free in 64 KiB pieces: every 256 KiB reserve fails and spills
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 50; ++i) {
    ASSERT_OK_AND_ASSIGN(auto big, producer.Reserve("big" + std::to_string(i), 256 << 10));
    EXPECT_TRUE(big.spilled());
  }
  logger->flush();
  const std::string first = logged.str();
  EXPECT_EQ(producer.Stats()->fragmentation_failures, 50u);
  if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(400)) {
    // All 50 within the interval: one line, for the first.
    EXPECT_EQ(CountLines(first, "fragmentation"), 1u) << first;
    EXPECT_NE(first.find("fragmentation (1 so far)"), std::string::npos) << first;
  } else {
    // A very slow machine: at most one line per interval anyway.
    EXPECT_LE(CountLines(first, "fragmentation"), 3u) << first;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  ASSERT_OK_AND_ASSIGN(auto last, producer.Reserve("last", 256 << 10));
  logger->flush();
  const std::string all = logged.str();
  EXPECT_EQ(CountLines(all, "fragmentation"), CountLines(first, "fragmentation") + 1) << all;
  EXPECT_NE(all.find("fragmentation (51 so far"), std::string::npos) << all;
  EXPECT_NE(all.find("more since the last warning"), std::string::npos) << all;
  StreamStats stats = producer.Stats().value();
  EXPECT_EQ(stats.fragmentation_failures, 51u);
  EXPECT_EQ(stats.spills, 51u);
}

TEST(StreamProducer, GrowsAheadInTheBackgroundAndWaitsForItInsteadOfGrowingTwice) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 8 << 20;
  o.max_segments = 3;
  o.grow_ahead = true;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<Reservation> held;
  // 4 MiB leaves 4 MiB free, less than a quarter segment + 4 MiB: the grower starts.
  ASSERT_OK_AND_ASSIGN(auto a, producer.Reserve("a", 4 << 20));
  ASSERT_OK_AND_ASSIGN(auto b, producer.Reserve("b", 4 << 20));  // fills segment 0
  // Needs a new segment now: it waits for the grower's (or takes it when it is there).
  ASSERT_OK_AND_ASSIGN(auto c, producer.Reserve("c", 4 << 20));
  EXPECT_FALSE(c.spilled());
  StreamStats s = producer.Stats().value();
  EXPECT_EQ(s.segments, 2u);
  EXPECT_EQ(s.segments_grown_ahead, 1u);
  held.push_back(std::move(a));
  held.push_back(std::move(b));
  held.push_back(std::move(c));
  // Fill up to the cap: never more than max_segments, then a spill.
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve("d" + std::to_string(i), 4 << 20));
    EXPECT_FALSE(r.spilled()) << i;
    held.push_back(std::move(r));
  }
  ASSERT_OK_AND_ASSIGN(auto e, producer.Reserve("e", 4 << 20));
  EXPECT_TRUE(e.spilled());
  s = producer.Stats().value();
  EXPECT_EQ(s.segments, 3u);
  EXPECT_EQ(s.spills, 1u);
  EXPECT_GE(s.segments_grown_ahead, 1u);
}

TEST(StreamProducer, WithoutGrowAheadGrowsOnlyWhenAReserveNeedsIt) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 8 << 20;
  o.max_segments = 3;
  o.grow_ahead = false;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ASSERT_OK_AND_ASSIGN(auto a, producer.Reserve("a", 6 << 20));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(producer.Stats()->segments, 1u);
  ASSERT_OK_AND_ASSIGN(auto b, producer.Reserve("b", 6 << 20));
  StreamStats s = producer.Stats().value();
  EXPECT_EQ(s.segments, 2u);
  EXPECT_EQ(s.segments_grown_ahead, 0u);
}

TEST(StreamProducer, DestroyedWhileGrowingAheadLeavesNoFiles) {
  StreamDirs dirs;
  for (int i = 0; i < 5; ++i) {
    StreamOptions o = dirs.Producer();
    o.segment_bytes = 32 << 20;
    o.max_segments = 2;
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
    ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve("a", 30 << 20));  // starts the grower
  }  // the producer goes at once, the grower perhaps still making its segment
  EXPECT_TRUE(dirs.remaining().empty());
}

TEST(StreamProducer, SegmentsOnTwoMiBPagesCarryTheBytesToOtherMappings) {
  // Plain tmpfs: the segment is a sized, unallocated file that MADV_COLLAPSE fills with 2 MiB
  // pages (see segment_file.cc).
  // What one mapping writes must be what another mapping and read(2) see.
  StreamDirs dirs;
  std::ostringstream logged;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(logged);
  auto logger = std::make_shared<spdlog::logger>("stream-huge-test", sink);
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 16 << 20;
  o.max_segments = 2;
  o.huge = HugePages::kOn;
  o.logger = logger;
  o.non_temporal_copy_from = 1 << 20;  // the streaming-store copy too
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::string> descriptors;
  for (uint64_t size : {uint64_t{1}, uint64_t{4097}, uint64_t{3 << 20} + 77, uint64_t{10 << 20}}) {
    std::vector<std::byte> bytes(size);
    const std::string key = "huge" + std::to_string(size);
    testing::FillPattern(bytes, key);
    ASSERT_OK_AND_ASSIGN(auto d, producer.Put(key, bytes, {"u8", {size}}));
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
    EXPECT_TRUE(testing::CheckPattern(t.bytes(), key)) << size;
    ASSERT_OK_AND_ASSIGN(auto desc, TensorDescriptor::Decode(d));
    ASSERT_OK_AND_ASSIGN(auto fd, platform::OpenFile(dirs.shm() + "/" + desc.segment, {}));
    std::vector<std::byte> read_back(size);
    ASSERT_OK(platform::ReadFull(fd, desc.offset, read_back));
    EXPECT_TRUE(testing::CheckPattern(read_back, key)) << size;
    if (size == (10 << 20)) {
      auto fs = platform::StatFilesystem(dirs.shm());
      auto blocks = platform::FreeHugeBlocks();
      logger->flush();
      if (fs.ok() && fs->kind == platform::FsKind::kTmpfs && fs->tmpfs_huge == "never" &&
          platform::ShmemHugeSetting() != "force" && platform::ShmemHugeSetting() != "deny" &&
          blocks.ok() && *blocks * (2 << 20) >= (36u << 20)) {
        EXPECT_NE(logged.str().find("MADV_COLLAPSE"), std::string::npos) << logged.str();
        EXPECT_EQ(logged.str().find("MADV_COLLAPSE failed"), std::string::npos) << logged.str();
        auto huge = platform::HugeBytesInRange(t.bytes().data(), t.bytes().size());
        ASSERT_OK(huge.status());
        EXPECT_GT(*huge, 0u) << "the consumer's mapping of a collapsed segment is on 4 KiB pages";
      } else {
        std::printf("2 MiB page check skipped: not plain tmpfs, or too few free 2 MiB blocks\n");
      }
    }
    t.Release();
  }
}

TEST(StreamProducer, AbortRefusesAPublishInFlightAndLeavesOtherKeys) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto writing, producer.Reserve("abc", 4096));
  ASSERT_OK_AND_ASSIGN(auto other, producer.Reserve("abc_1_2", 4096));
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("abc"));
  EXPECT_EQ(marked, 1u);
  auto published = writing.Publish({});
  ASSERT_FALSE(published.ok());
  EXPECT_EQ(published.status().code(), StatusCode::kBusy);
  ASSERT_OK(other.Publish({}));
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);
}

// Assigning over an unpublished reservation gives its space back at once and keeps the one
// moved in (an engine that re-reserves into the same variable must not leak the first block).
TEST(StreamProducer, MoveAssigningAReservationGivesTheOldSpaceBack) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto first, producer.Reserve("first", 4096));
  ASSERT_OK_AND_ASSIGN(auto second, producer.Reserve("second", 8192));
  EXPECT_EQ(producer.Stats()->live_blocks, 2u);
  first = std::move(second);
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);
  EXPECT_EQ(first.bytes().size(), 8192u);
  ASSERT_OK(first.Publish({}));
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("second"));
  EXPECT_EQ(marked, 1u);
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// Writers on several threads put tensors of their own keys while another thread aborts keys
// of one writer: the other writers' tensors are never touched, and everything comes back.
TEST(StreamProducer, AbortIsSafeWhileOtherKeysAreWritten) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.max_segments = 8;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  constexpr int kWriters = 3;
  constexpr int kPerWriter = 300;
  std::vector<std::vector<std::string>> descs(kWriters);
  std::atomic<bool> done{false};
  std::atomic<int> aborted_keys{0};
  std::thread aborter([&] {
    int i = 0;
    while (!done.load()) {
      auto r = producer.Abort("victim_" + std::to_string(i++ % kPerWriter));
      if (r.ok() && *r > 0) aborted_keys.fetch_add(1);
    }
  });
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      std::mt19937_64 rng(w);
      for (int i = 0; i < kPerWriter; ++i) {
        // Appended piece by piece: g++ 12 -O3 false -Wrestrict (GCC PR 105651).
        std::string key = w == 0 ? "victim_" : "w";
        if (w != 0) key += std::to_string(w) + "_";
        key += std::to_string(i);
        std::vector<std::byte> data(1 + rng() % 60000);
        testing::FillPattern(data, key);
        auto d = producer.Put(key, data, {});
        if (d.ok()) {
          descs[w].push_back(*d);
        } else {
          EXPECT_EQ(w, 0) << d.status().ToString();  // only victims may be refused
        }
      }
    });
  }
  for (auto& t : writers) t.join();
  done = true;
  aborter.join();
  for (int w = 1; w < kWriters; ++w) {
    ASSERT_EQ(descs[w].size(), static_cast<size_t>(kPerWriter));
    for (const auto& d : descs[w]) {
      ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
      EXPECT_TRUE(testing::CheckPattern(t.bytes(), t.descriptor().key)) << t.descriptor().key;
    }
  }
  for (int i = 0; i < kPerWriter; ++i) ASSERT_OK(producer.Abort("victim_" + std::to_string(i)));
  ASSERT_OK(producer.Reclaim());
  StreamStats s = producer.Stats().value();
  EXPECT_EQ(s.live_blocks, 0u);
  EXPECT_EQ(s.free_bytes, s.total_bytes);
}

// A consumer refuses a segment of another user unless allow_foreign_owner opts in.
TEST(StreamConsumer, RefusesAnotherUsersSegment) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a segment to another user";
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(4096);
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("k", data, {}));
  for (const auto& path : producer.SegmentPaths()) ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  auto refused = consumer.Open(d);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kPermission);
  EXPECT_NE(refused.status().message().find("uid 65534"), std::string::npos);
  ConsumerOptions o = dirs.Consumer();
  o.allow_foreign_owner = true;
  ASSERT_OK_AND_ASSIGN(auto trusting, StreamConsumer::Create(o));
  ASSERT_OK(trusting.Open(d));
}

// Sizing against a real small filesystem: a cap that fits the filesystem but not what is free
// now is a warning at creation; growth that then hits ENOSPC spills instead of failing.
TEST(StreamProducer, WarnsWhenFreeSpaceIsShortAndSpillsWhenGrowthHitsIt) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kTmpfsHuge, 64 << 20);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  StreamDirs dirs;
  std::string filler = mount.dir() + "/filler";
  {
    std::vector<char> mib(1 << 20, 'x');
    FILE* f = std::fopen(filler.c_str(), "w");
    ASSERT_NE(f, nullptr);
    for (int i = 0; i < 48; ++i) std::fwrite(mib.data(), 1, mib.size(), f);
    std::fclose(f);
  }
  std::ostringstream logged;
  auto logger = std::make_shared<spdlog::logger>(
      "stream-sizing-test", std::make_shared<spdlog::sinks::ostream_sink_mt>(logged));
  StreamOptions o = dirs.Producer();
  o.directory = mount.dir();
  o.segment_bytes = 4 << 20;  // 6 MiB files
  o.max_segments = 8;         // 48 MiB: fits the 64 MiB filesystem, not its 16 MiB free
  o.logger = logger;
  {
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
    logger->flush();
    EXPECT_NE(logged.str().find("free now"), std::string::npos) << logged.str();
    std::vector<std::byte> data(4 << 20);
    for (int i = 0; i < 4; ++i) ASSERT_OK(producer.Put("t" + std::to_string(i), data, {}));
    StreamStats s = producer.Stats().value();
    EXPECT_GE(s.spills, 1u);
    EXPECT_LT(s.segments, 4u);
    logger->flush();
    EXPECT_NE(logged.str().find("cannot grow"), std::string::npos) << logged.str();
  }
  std::remove(filler.c_str());
}

// A hugetlbfs mounted without size= (the pool is its limit) takes a producer whose cap fits the
// pool; one whose cap the pool cannot hold is refused naming the pool's size.
TEST(StreamProducer, RunsOnAHugetlbfsWithoutASizeLimit) {
  testing::ScopedMount mount(testing::ScopedMount::Kind::kHugetlbfsNoSize, 16 << 20);
  if (!mount.ok()) GTEST_SKIP() << mount.skip_reason();
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.directory = mount.dir();
  o.segment_bytes = 4 << 20;  // 6 MiB files
  o.max_segments = 2;
  {
    ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
    std::vector<std::byte> data(1 << 20);
    FillPattern(data, "h");
    ASSERT_OK_AND_ASSIGN(auto d, producer.Put("h", data, {}));
    ConsumerOptions c = dirs.Consumer();
    c.directory = mount.dir();
    ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(c));
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
    EXPECT_TRUE(CheckPattern(t.bytes(), "h"));
  }
  o.max_segments = 1u << 20;  // 6 TiB: no pool here holds it
  auto refused = StreamProducer::Create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(refused.status().message().find("hugetlbfs"), std::string::npos)
      << refused.status().message();
}

// Asking for a GPU on a machine without one (or a build without the backend) is reported and
// skipped, never fatal; nothing is pinned.
TEST(StreamProducer, GpuRegistrationWithoutADeviceIsSkipped) {
  ASSERT_OK_AND_ASSIGN(GpuDevice cuda, ParseGpuDevice("cuda"));
  if (gpu::WhyDeviceUnusable(cuda).empty()) {
    GTEST_SKIP() << "a CUDA device is here: gpu_test.cc checks its registration";
  }
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.gpu = cuda;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ConsumerOptions c = dirs.Consumer();
  c.gpu = cuda;
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(c));
  std::vector<std::byte> data(4096);
  ASSERT_OK_AND_ASSIGN(auto d, producer.Put("k", data, {}));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(d));
  // Skipped, not failed: the bytes flow, nothing is pinned on either side.
  EXPECT_EQ(t.bytes().size(), data.size());
  EXPECT_EQ(producer.Stats()->pinned_bytes, 0u);
  EXPECT_EQ(consumer.Stats().pinned_bytes, 0u);
}

// Field lesson 004: cleanup("0") swept chunk 0 of every request (suffix match) and cleanup("abc")
// swept abc_1_2's chunks (prefix match). Abort owns keys exactly: no suffix, no infix, no
// prefix, and a second abort of the same key marks nothing.
TEST(StreamProducer, AbortMatchesNoSuffixNoInfixAndIsIdempotent) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  const std::vector<std::string> keys = {"0", "abc_1_2_0_0", "x_0", "abc", "abc_1_2", "1_2", "ab"};
  std::map<std::string, std::string> descs;
  for (const auto& key : keys) {
    std::vector<std::byte> data(20000);
    testing::FillPattern(data, key);
    ASSERT_OK_AND_ASSIGN(descs[key], producer.Put(key, data, {}));
  }
  ASSERT_OK_AND_ASSIGN(uint64_t zero, producer.Abort("0"));
  EXPECT_EQ(zero, 1u);
  ASSERT_OK_AND_ASSIGN(uint64_t again, producer.Abort("0"));
  EXPECT_EQ(again, 0u);
  ASSERT_OK_AND_ASSIGN(uint64_t infix, producer.Abort("1_2"));
  EXPECT_EQ(infix, 1u);
  for (const char* absent : {"", "a", "abc_1", "abc_1_2_0", "_0", "2_0_0"}) {
    ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort(absent));
    EXPECT_EQ(marked, 0u) << "'" << absent << "'";
  }
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, keys.size() - 2);
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  for (const auto& [key, desc] : descs) {
    auto t = consumer.Open(desc);
    if (key == "0" || key == "1_2") {
      EXPECT_FALSE(t.ok()) << key;
      continue;
    }
    ASSERT_OK(t.status());
    EXPECT_TRUE(testing::CheckPattern(t->bytes(), key)) << key;
  }
}

// Field lesson 004: a second cleanup of a request id could cancel a new request that reused the id.
// An abort marks the blocks the key owns now; a later Put of the same key is a new block that
// the earlier abort (and the release of the aborted block) leaves alone.
TEST(StreamProducer, AKeyReusedAfterItsAbortIsANewRequest) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(30000);
  testing::FillPattern(data, "r");
  ASSERT_OK_AND_ASSIGN(auto first, producer.Put("r", data, {}));
  ASSERT_OK_AND_ASSIGN(auto held, consumer.Open(first));  // keeps the aborted block alive
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("r"));
  EXPECT_EQ(marked, 1u);
  ASSERT_OK_AND_ASSIGN(auto second, producer.Put("r", data, {}));
  held.Release();
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 1u);  // the aborted block went, the new one stays
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(second));
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "r"));
  t.Release();
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
}

// Field lesson 004: per-request bookkeeping on the sender grew on the success path and a stale
// entry is a hazard. Once a key's blocks are all released its entry is gone: an abort of that
// finished key marks nothing, even when another key's block took over the same slot and bytes.
TEST(StreamProducer, AbortOfAFinishedKeyNeverTakesTheBlockThatReusedItsSlot) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(40000);
  testing::FillPattern(data, "old");
  ASSERT_OK_AND_ASSIGN(auto old_desc, producer.Put("old", data, {}));
  {
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(old_desc));
  }  // released: the request finished normally
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
  testing::FillPattern(data, "new");
  ASSERT_OK_AND_ASSIGN(auto new_desc, producer.Put("new", data, {}));
  ASSERT_OK_AND_ASSIGN(auto o, TensorDescriptor::Decode(old_desc));
  ASSERT_OK_AND_ASSIGN(auto n, TensorDescriptor::Decode(new_desc));
  // The case that matters: the new block sits where the old one was.
  EXPECT_EQ(n.segment, o.segment);
  EXPECT_EQ(n.slot, o.slot);
  EXPECT_EQ(n.offset, o.offset);
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("old"));
  EXPECT_EQ(marked, 0u);
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(new_desc));
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "new"));
}

// Field lesson 000: growth is by whole segments so that existing mappings (device registrations,
// consumers' open views, a half-written reservation) never move. A reservation and a view taken
// in the first segment stay valid while the producer grows to its cap.
TEST(StreamProducer, GrowthNeverMovesALiveReservationOrView) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 4;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(512 << 10);
  testing::FillPattern(data, "viewed");
  ASSERT_OK_AND_ASSIGN(auto viewed_desc, producer.Put("viewed", data, {}));
  ASSERT_OK_AND_ASSIGN(auto view, consumer.Open(viewed_desc));
  ASSERT_OK_AND_ASSIGN(auto writing, producer.Reserve("writing", 512 << 10));
  std::span<std::byte> before = writing.bytes();
  const std::byte* view_before = view.bytes().data();
  std::vector<std::string> more;
  for (int i = 0; i < 10; ++i) {  // 5 MiB more: three segments
    std::string key = "grow" + std::to_string(i);
    testing::FillPattern(data, key);
    ASSERT_OK_AND_ASSIGN(auto d, producer.Put(key, data, {}));
    more.push_back(d);
  }
  EXPECT_GE(producer.Stats()->segments, 3u);
  EXPECT_EQ(writing.bytes().data(), before.data());
  EXPECT_EQ(view.bytes().data(), view_before);
  testing::FillPattern(before, "writing");  // through the pointer taken before the growth
  ASSERT_OK_AND_ASSIGN(auto written_desc, writing.Publish({}));
  ASSERT_OK_AND_ASSIGN(auto written, consumer.Open(written_desc));
  EXPECT_TRUE(testing::CheckPattern(written.bytes(), "writing"));
  EXPECT_TRUE(testing::CheckPattern(view.bytes(), "viewed"));
  for (size_t i = 0; i < more.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(more[i]));
    EXPECT_TRUE(testing::CheckPattern(t.bytes(), "grow" + std::to_string(i)));
  }
}

// Field lesson 000: in spill mode every tensor at the cap paid the whole backpressure grace as dead
// time (the acknowledgements could not arrive meanwhile). Without strict mode the producer
// spills at once: a strict bound of an hour here would turn a wait into a test timeout.
TEST(StreamProducer, AtTheCapSpillsWithoutWaitingOutTheStrictBound) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 1;
  o.strict = false;
  o.strict_wait_seconds = 3600;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<std::byte> data(2 << 20);
  ASSERT_OK(producer.Put("fill", data, {}));
  ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve("more", 1 << 20));
  EXPECT_TRUE(r.spilled());
  EXPECT_EQ(producer.Stats()->spills, 1u);
}

// PutMany hands out one descriptor per item, in order, each with its own dtype and shape.
TEST(StreamProducer, PutManyPublishesEveryItemWithItsInfo) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::vector<std::byte>> data;
  for (uint64_t n : {uint64_t{100}, uint64_t{64} << 10, uint64_t{3} << 20}) {
    data.emplace_back(n);
    FillPattern(data.back(), "item" + std::to_string(n));
  }
  std::vector<std::string> keys = {"item100", "item65536", "item3145728"};
  std::vector<PutItem> items;
  items.push_back({keys[0], data[0], {"u8", {100}}});
  items.push_back({keys[1], data[1], {"f32", {128, 128}}});
  items.push_back({keys[2], data[2], {"bf16", {1536, 1024}}});
  ASSERT_OK_AND_ASSIGN(auto descriptors, producer.PutMany(items, 2));
  ASSERT_EQ(descriptors.size(), 3u);
  for (int reader = 0; reader < 2; ++reader) {
    for (size_t i = 0; i < 3; ++i) {
      ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(descriptors[i]));
      EXPECT_EQ(t.descriptor().key, keys[i]);
      EXPECT_EQ(t.descriptor().dtype, items[i].info.dtype);
      EXPECT_EQ(t.descriptor().shape, items[i].info.shape);
      ASSERT_EQ(t.bytes().size(), data[i].size());
      EXPECT_TRUE(CheckPattern(t.bytes(), keys[i])) << keys[i];
    }
  }
  ASSERT_OK(producer.Reclaim());
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);  // two readers each released every item
  ASSERT_OK_AND_ASSIGN(auto none, producer.PutMany({}));
  EXPECT_TRUE(none.empty());
}

// All or nothing: a batch whose third tensor does not fit (strict mode at the cap) publishes
// nothing, gives the first two blocks back, and says which item failed.
TEST(StreamProducer, PutManyThatFailsPartWayPublishesNothing) {
  StreamDirs dirs;
  StreamOptions o = dirs.Producer();
  o.segment_bytes = 2 << 20;
  o.max_segments = 1;
  o.strict = true;
  o.strict_wait_seconds = 0.05;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(o));
  std::vector<std::byte> mib(1 << 20);
  std::vector<PutItem> items = {{"a", mib, {}}, {"b", std::span(mib).first(512 << 10), {}},
                                {"c", mib, {}}};
  auto failed = producer.PutMany(items);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(failed.status().message().find("item 2 of 3"), std::string::npos)
      << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("nothing of the batch was published"),
            std::string::npos);
  StreamStats st = producer.Stats().value();
  EXPECT_EQ(st.live_blocks, 0u);
  EXPECT_EQ(st.free_bytes, st.total_bytes);
  // The keys of the refused batch own nothing: an abort finds no block.
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort("a"));
  EXPECT_EQ(marked, 0u);
  // A bad key later in a batch is refused before anything is reserved.
  std::vector<PutItem> bad = {{"ok", mib, {}}, {"bad\nkey", mib, {}}};
  auto refused = producer.PutMany(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("item 1 of 2"), std::string::npos)
      << refused.status().ToString();
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);
  // The batch that fits goes through whole.
  ASSERT_OK_AND_ASSIGN(auto fits, producer.PutMany(std::span(items).first(2)));
  EXPECT_EQ(fits.size(), 2u);
  EXPECT_EQ(producer.Stats()->live_blocks, 2u);
}

// ---- peers' strings in messages --------------------------------------------------------------

// A key is what consumers' messages print. The producer refuses, before it reserves anything,
// a key that is empty, holds a control byte or is longer than a descriptor carries (which no
// consumer could decode), and its message quotes the key escaped, never raw.
TEST(StreamProducer, RefusesEmptyKeysAndKeysWithControlBytesBeforeReserving) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  const std::vector<std::string> segments = producer.SegmentPaths();
  std::vector<std::byte> data(5000);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "key \"\" is empty"},
      {"req\x1b[31m", "key \"req\\x1b[31m\" holds the control byte 0x1b at byte 3 of 8"},
      {std::string("a\0b", 3), "key \"a\\x00b\" holds the control byte 0x00 at byte 1 of 3"},
      {"req-1\nWARN forged", "holds the control byte 0x0a at byte 5 of 17"},
      {"del\x7f", "holds the control byte 0x7f at byte 3 of 4"},
      {std::string(1025, 'k'), "is 1025 bytes, more than the 1024 a descriptor carries"},
  };
  for (const auto& [key, words] : bad) {
    for (bool put : {true, false}) {
      Status s = put ? producer.Put(key, data, {}).status() : producer.Reserve(key, 5000).status();
      ASSERT_FALSE(s.ok()) << EscapeForMessage(key);
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
      EXPECT_EQ(s.message().rfind(put ? "stream put: key " : "stream reserve: key ", 0), 0u)
          << s.message();
      EXPECT_NE(s.message().find(words), std::string::npos) << EscapeForMessage(s.message());
      EXPECT_TRUE(PrintableAscii(s.message())) << EscapeForMessage(s.message());
    }
  }
  StreamStats stats = producer.Stats().value();
  EXPECT_EQ(stats.live_blocks, 0u);
  EXPECT_EQ(stats.spills, 0u);
  EXPECT_EQ(producer.SegmentPaths(), segments);

  // Every other key works and is owned exactly: spaces, slashes, quotes, UTF-8, the longest.
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  for (const std::string& key :
       {std::string("abc"), std::string("abc_1_2"), std::string("req 17/chunk:0"),
        std::string("caf\xc3\xa9"), std::string("quote\"back\\slash"), std::string(1024, 'k')}) {
    testing::FillPattern(data, key);
    ASSERT_OK_AND_ASSIGN(auto encoded, producer.Put(key, data, {}));
    ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(encoded));
    EXPECT_EQ(t.descriptor().key, key);
    EXPECT_TRUE(testing::CheckPattern(t.bytes(), key)) << EscapeForMessage(key);
  }
}

// The dtype and shape travel in the descriptor too: refused by Put before it reserves, and by
// Publish with the reservation still unpublished, so the caller can publish it fixed.
TEST(StreamProducer, RefusesADtypeOrShapeNoDescriptorCarries) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(5000);
  auto put = producer.Put("k", data, {.dtype = "bf16\x1b[2J"});
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(put.status().message().find(
                "stream put of key \"k\": dtype \"bf16\\x1b[2J\" holds the control byte 0x1b"),
            std::string::npos)
      << EscapeForMessage(put.status().message());
  EXPECT_TRUE(PrintableAscii(put.status().message()));
  put = producer.Put("k", data, {.dtype = "f32", .shape = std::vector<uint64_t>(17, 1)});
  ASSERT_FALSE(put.ok());
  EXPECT_NE(put.status().message().find("17 dimensions"), std::string::npos)
      << put.status().message();
  EXPECT_EQ(producer.Stats()->live_blocks, 0u);

  ASSERT_OK_AND_ASSIGN(auto r, producer.Reserve("k", data.size()));
  testing::FillPattern(r.bytes(), "k");
  auto published = r.Publish({.dtype = std::string(1025, 'd')});
  ASSERT_FALSE(published.ok());
  EXPECT_NE(published.status().message().find("stream publish of key \"k\": dtype"),
            std::string::npos)
      << published.status().message();
  ASSERT_OK_AND_ASSIGN(auto encoded, r.Publish({.dtype = "bf16", .shape = {2500}}));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(encoded));
  EXPECT_EQ(t.descriptor().dtype, "bf16");
  EXPECT_TRUE(testing::CheckPattern(t.bytes(), "k"));
}

// A hostile peer's descriptor whose strings hold control bytes (an escape sequence that would
// drive the operator's terminal, a newline that would forge a log line) is refused by Decode,
// so by Open before anything is mapped, and the refusal quotes the string escaped, never raw.
TEST(TensorDescriptor, RefusesControlBytesInPeerStringsAndQuotesThemEscaped) {
  auto refused = [](const TensorDescriptor& d, const std::string& words) {
    auto r = TensorDescriptor::Decode(d.Encode());
    ASSERT_FALSE(r.ok()) << words;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(words), std::string::npos)
        << EscapeForMessage(r.status().message());
    EXPECT_TRUE(PrintableAscii(r.status().message())) << EscapeForMessage(r.status().message());
  };
  TensorDescriptor d = SampleDescriptor();
  d.key = "req\x1b]0;owned\x07";
  refused(d, "key \"req\\x1b]0;owned\\x07\" holds the control byte 0x1b at byte 3 of 13");
  d.key = "req-1\nWARN forged";
  refused(d, "key \"req-1\\x0aWARN forged\" holds the control byte 0x0a at byte 5 of 17");
  d.key = "";
  refused(d, "key \"\" is empty");
  d = SampleDescriptor();
  d.dtype = "bf16\x1b[2J";
  refused(d, "dtype \"bf16\\x1b[2J\" holds the control byte 0x1b at byte 4 of 8");
  d = SampleDescriptor();
  d.segment = "ea-stream-\x1b[2J";
  refused(d, "segment name \"ea-stream-\\x1b[2J\" is not");
  d.segment = "ea-stream-caf\xc3\xa9";
  refused(d, "segment name \"ea-stream-caf\\xc3\\xa9\" is not");
  // Bytes of 0x80 and up are no control bytes: a UTF-8 key and dtype decode as they are.
  d = SampleDescriptor();
  d.key = "caf\xc3\xa9";
  d.dtype = "\xce\xbc-float";
  ASSERT_OK_AND_ASSIGN(auto back, TensorDescriptor::Decode(d.Encode()));
  EXPECT_EQ(back.key, d.key);
  EXPECT_EQ(back.dtype, d.dtype);
}

// The same through a consumer: a hostile key is refused before the segment is mapped, and the
// messages of Open that name a (valid) key quote it escaped.
TEST(StreamConsumer, RefusesAKeyWithAnEscapeByteAndQuotesKeysEscaped) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> data(5000);
  const std::string key = "caf\xc3\xa9";
  testing::FillPattern(data, key);
  ASSERT_OK_AND_ASSIGN(auto encoded, producer.Put(key, data, {}));
  ASSERT_OK_AND_ASSIGN(auto hostile, TensorDescriptor::Decode(encoded));
  hostile.key = "k\x1b[2J\x1b[H";
  auto r = consumer.Open(hostile.Encode());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("key \"k\\x1b[2J\\x1b[H\" holds the control byte 0x1b"),
            std::string::npos)
      << EscapeForMessage(r.status().message());
  EXPECT_EQ(r.status().message().find('\x1b'), std::string::npos);
  EXPECT_TRUE(PrintableAscii(r.status().message()));
  EXPECT_EQ(consumer.Stats().mapped_segments, 0u);  // refused before anything was mapped

  ASSERT_OK_AND_ASSIGN(auto held, consumer.Open(encoded));  // keeps the aborted block
  ASSERT_OK_AND_ASSIGN(uint64_t marked, producer.Abort(key));
  EXPECT_EQ(marked, 1u);
  auto aborted = consumer.Open(encoded);
  ASSERT_FALSE(aborted.ok());
  EXPECT_NE(aborted.status().message().find("for key \"caf\\xc3\\xa9\": its key "
                                            "\"caf\\xc3\\xa9\" was aborted"),
            std::string::npos)
      << EscapeForMessage(aborted.status().message());
  EXPECT_TRUE(PrintableAscii(aborted.status().message()));
}

// A segment header is another process's bytes too: a logical name with a control byte (or
// none NUL-terminated) makes the file no segment this build reads (for `info`, sweeps and
// consumers), and the problem quotes the name escaped. Bytes of 0x80 and up are left to the
// tools, which escape them.
TEST(StreamSegment, RefusesAHeaderWhoseLogicalNameHoldsAControlByte) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  std::vector<std::byte> data(5000);
  ASSERT_OK_AND_ASSIGN(auto encoded, producer.Put("k", data, {}));
  const std::string path = producer.SegmentPaths().at(0);
  testing::WriteLogicalName(path, "x\x1b[2J");
  ASSERT_OK_AND_ASSIGN(SegmentInfo info, InspectSegment(path));
  EXPECT_FALSE(info.ours);
  EXPECT_NE(info.problem.find("logical name \"x\\x1b[2J\" holds the control byte 0x1b at byte 1 "
                              "of 5"),
            std::string::npos)
      << EscapeForMessage(info.problem);
  EXPECT_TRUE(PrintableAscii(info.problem));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  auto r = consumer.Open(encoded);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(PrintableAscii(r.status().message())) << EscapeForMessage(r.status().message());

  testing::WriteLogicalName(path, std::string(64, 'n'));
  ASSERT_OK_AND_ASSIGN(info, InspectSegment(path));
  EXPECT_FALSE(info.ours);
  EXPECT_NE(info.problem.find("not NUL-terminated"), std::string::npos) << info.problem;

  testing::WriteLogicalName(path, "caf\xc3\xa9");
  ASSERT_OK_AND_ASSIGN(info, InspectSegment(path));
  EXPECT_TRUE(info.ours) << info.problem;
  EXPECT_EQ(info.logical_name, "caf\xc3\xa9");
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(encoded));
}

TEST(StreamConsumer, ReleasedOrMovedFromTensorIsEmptyNotACrash) {
  StreamDirs dirs;
  ASSERT_OK_AND_ASSIGN(auto producer, StreamProducer::Create(dirs.Producer()));
  ASSERT_OK_AND_ASSIGN(auto consumer, StreamConsumer::Create(dirs.Consumer()));
  std::vector<std::byte> bytes(4096);
  testing::FillPattern(bytes, "released");
  ASSERT_OK_AND_ASSIGN(auto encoded, producer.Put("released", bytes, {.dtype = "u8"}));
  ASSERT_OK_AND_ASSIGN(auto t, consumer.Open(encoded));
  EXPECT_EQ(t.bytes().size(), bytes.size());
  EXPECT_EQ(t.descriptor().key, "released");
  StreamTensor moved = std::move(t);
  EXPECT_TRUE(t.bytes().empty());
  EXPECT_TRUE(t.descriptor().key.empty());
  moved.Release();
  EXPECT_TRUE(moved.bytes().empty());
  EXPECT_EQ(moved.bytes().data(), nullptr);
  EXPECT_TRUE(moved.descriptor().key.empty());
  EXPECT_EQ(moved.descriptor().length, 0u);
  EXPECT_FALSE(moved.private_bytes().ok());
}

}  // namespace
}  // namespace expert_arena
