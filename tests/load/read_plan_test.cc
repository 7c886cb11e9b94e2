// How tensors are cut into reads, and the in-order hashing of pieces that arrive in any order.
#include "load/read_plan.h"

#include <xxhash.h>

#include <algorithm>
#include <random>
#include <thread>

#include "common/fast_xxh3.h"
#include "common/fast_xxh3_build.h"
#include "load/tensor_hasher.h"
#include "test_util.h"

namespace expert_arena::load {
namespace {

format::ArenaTable OneTensor(uint64_t source_offset, uint64_t bytes, uint64_t arena_offset = 0) {
  format::ArenaTable table;
  table.sources.push_back({"/m", source_offset + bytes + 4096, 0});
  format::TensorRecord t;
  t.name = "t";
  t.source_offset = source_offset;
  t.arena_offset = arena_offset;
  t.bytes = bytes;
  table.tensors.push_back(t);
  return table;
}

SourceAccess Direct(uint32_t memory, uint32_t offset) {
  SourceAccess a;
  a.direct = {memory, offset};
  return a;
}

TEST(ReadPlanTest, AlignedTensorIsReadDirectInChunks) {
  auto table = OneTensor(8192, 10 * 4096);
  SourceAccess access = Direct(512, 512);
  ReadPlan plan = PlanReads(table, {&access, 1}, 0x200000, 16384);
  ASSERT_EQ(plan.pieces.size(), 3u);  // 16 KiB + 16 KiB + 8 KiB
  for (const ReadPiece& p : plan.pieces) EXPECT_TRUE(p.direct);
  EXPECT_EQ(plan.direct_bytes, 10u * 4096);
  EXPECT_EQ(plan.total_bytes, 10u * 4096);
}

TEST(ReadPlanTest, MisalignedHeadAndTailAreBuffered) {
  // Source offset 512 + 100 with 512-byte alignment: the body starts 412 bytes in, which is
  // not 512-aligned in the arena, so the whole tensor is read direct through a bounce buffer
  // covering the aligned superset [512, 5632).
  auto table = OneTensor(612, 5000);
  SourceAccess access = Direct(512, 512);
  ReadPlan plan = PlanReads(table, {&access, 1}, 0x200000, 1 << 20);
  ASSERT_EQ(plan.pieces.size(), 1u);
  EXPECT_TRUE(plan.pieces[0].direct);
  EXPECT_TRUE(plan.pieces[0].bounce);
  EXPECT_EQ(plan.bounce_bytes, 5000u);
  BounceRange range = BounceRangeOf(plan.pieces[0], 512);
  EXPECT_EQ(range.first, 512u);
  EXPECT_EQ(range.bytes, 5120u);
  // With a 4-byte memory alignment (NVMe) the body is direct and head/tail are not.
  SourceAccess nvme = Direct(4, 512);
  plan = PlanReads(table, {&nvme, 1}, 0x200000, 1 << 20);
  ASSERT_EQ(plan.pieces.size(), 3u);
  EXPECT_EQ(plan.bounce_bytes, 0u);
  EXPECT_FALSE(plan.pieces[0].direct);
  EXPECT_EQ(plan.pieces[0].bytes, 412u);
  EXPECT_TRUE(plan.pieces[1].direct);
  EXPECT_EQ(plan.pieces[1].source_offset % 512, 0u);
  EXPECT_EQ(plan.pieces[1].bytes % 512, 0u);
  EXPECT_FALSE(plan.pieces[2].direct);
  EXPECT_EQ(plan.pieces[0].bytes + plan.pieces[1].bytes + plan.pieces[2].bytes, 5000u);
  EXPECT_EQ(plan.pieces[2].source_offset + plan.pieces[2].bytes, 612u + 5000);
}

TEST(ReadPlanTest, CachedPagesAndNoDirectAreBuffered) {
  auto table = OneTensor(0, 8 * 4096);
  SourceAccess cached = Direct(512, 512);
  cached.resident.assign(9, 1);
  ReadPlan plan = PlanReads(table, {&cached, 1}, 0x200000, 4096 * 4);
  EXPECT_EQ(plan.direct_bytes, 0u);
  EXPECT_TRUE(plan.pieces[0].cached);
  // Half cached: the uncached chunk goes direct.
  cached.resident = {1, 1, 1, 1, 0, 0, 0, 0, 0};
  plan = PlanReads(table, {&cached, 1}, 0x200000, 4096 * 4);
  ASSERT_EQ(plan.pieces.size(), 2u);
  EXPECT_FALSE(plan.pieces[0].direct);
  EXPECT_TRUE(plan.pieces[1].direct);
  SourceAccess none;
  plan = PlanReads(table, {&none, 1}, 0x200000, 4096 * 4);
  EXPECT_EQ(plan.direct_bytes, 0u);
  // An arena address that is not aligned for the device: bounced.
  SourceAccess access = Direct(4096, 4096);
  plan = PlanReads(table, {&access, 1}, 0x200000 + 512, 4096 * 4);
  EXPECT_EQ(plan.bounce_bytes, 8u * 4096);
}

// Reads from the device go in larger pieces than copies from the page cache: an uncached
// range is cut at direct_chunk_bytes (a multiple of the alignment), a cached one at
// chunk_bytes, and buffered reads of a source without O_DIRECT stay at chunk_bytes.
TEST(ReadPlanTest, UncachedDirectRangesTakeLargerPieces) {
  auto table = OneTensor(0, 16 * 4096);
  SourceAccess access = Direct(512, 512);
  access.resident.assign(17, 0);
  for (int p = 0; p < 4; ++p) access.resident[p] = 1;  // the first 16 KiB are cached
  ReadPlan plan = PlanReads(table, {&access, 1}, 0x200000, 4096 * 4, 4096 * 8);
  ASSERT_EQ(plan.pieces.size(), 3u);  // 16 KiB cached, then 32 KiB + 16 KiB direct
  EXPECT_TRUE(plan.pieces[0].cached);
  EXPECT_FALSE(plan.pieces[0].direct);
  EXPECT_EQ(plan.pieces[0].bytes, 4096u * 4);
  EXPECT_TRUE(plan.pieces[1].direct);
  EXPECT_EQ(plan.pieces[1].bytes, 4096u * 8);
  EXPECT_TRUE(plan.pieces[2].direct);
  EXPECT_EQ(plan.pieces[2].bytes, 4096u * 4);
  EXPECT_EQ(plan.largest_piece, 4096u * 8);
  // A direct chunk that is not a multiple of the alignment is rounded down to one.
  SourceAccess cold = Direct(512, 8192);
  cold.resident.assign(17, 0);
  plan = PlanReads(table, {&cold, 1}, 0x200000, 4096 * 2, 4096 * 7);
  EXPECT_EQ(plan.largest_piece, 4096u * 6);
  for (const ReadPiece& p : plan.pieces) {
    EXPECT_TRUE(p.direct);
    EXPECT_EQ(p.bytes % 8192, 0u) << p.bytes;
  }
  SourceAccess none;
  plan = PlanReads(table, {&none, 1}, 0x200000, 4096 * 4, 4096 * 8);
  EXPECT_EQ(plan.largest_piece, 4096u * 4);
}

TEST(ReadPlanTest, EmptyTensorsHaveNoPieces) {
  auto table = OneTensor(0, 0);
  SourceAccess none;
  ReadPlan plan = PlanReads(table, {&none, 1}, 0, 4096);
  EXPECT_TRUE(plan.pieces.empty());
  ASSERT_EQ(plan.tensor_first.size(), 2u);
  TensorHasher hasher(plan, {});
  ASSERT_OK_AND_ASSIGN(auto sums, hasher.Finish(table));
  EXPECT_EQ(sums[0], XXH3_64bits(nullptr, 0));
}

// Pieces of three tensors arrive in a random order on four threads: every checksum equals the
// one-shot XXH3 of the tensor's bytes.
TEST(TensorHasherTest, AnyArrivalOrderGivesTheOneShotHash) {
  format::ArenaTable table;
  table.sources.push_back({"/m", 1 << 24, 0});
  uint64_t arena = 0;
  for (uint64_t bytes : {uint64_t{1000}, uint64_t{300000}, uint64_t{4096 * 37 + 5}}) {
    format::TensorRecord t;
    std::string name = "t";  // appended, not "t" + ...: g++ 12 -O3 false -Wrestrict (GCC PR 105651)
    name += std::to_string(bytes);
    t.name = std::move(name);
    t.bytes = bytes;
    t.arena_offset = arena;
    t.source_offset = arena;
    arena += (bytes + 4095) / 4096 * 4096;
    table.tensors.push_back(t);
  }
  std::vector<std::byte> data(arena);
  std::mt19937_64 rng(7);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  SourceAccess none;
  ReadPlan plan = PlanReads(table, {&none, 1}, 0, 4096);
  for (int round = 0; round < 20; ++round) {
    std::vector<size_t> order(plan.pieces.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    TensorHasher hasher(plan, data);
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    for (int w = 0; w < 4; ++w) {
      threads.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < order.size();) hasher.PieceArrived(order[i]);
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_OK_AND_ASSIGN(auto sums, hasher.Finish(table));
    for (size_t t = 0; t < table.tensors.size(); ++t) {
      EXPECT_EQ(sums[t],
                XXH3_64bits(data.data() + table.tensors[t].arena_offset, table.tensors[t].bytes));
    }
  }
}

// Every XXH3 build this CPU can run (the library's, AVX2, AVX-512) gives the library's
// values, one-shot and streamed in uneven pieces; FastXxh3 runs the chosen one.
TEST(TensorHasherTest, FastXxh3MatchesTheLibrary) {
  std::vector<std::byte> data(3 * 1024 * 1024 + 17);
  std::mt19937_64 rng(3);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  std::vector<const Xxh3Build*> builds = {&Xxh3LibraryBuild(), &ChosenXxh3Build()};
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) builds.push_back(&Xxh3Avx2Build());
  if (__builtin_cpu_supports("avx512f")) builds.push_back(&Xxh3Avx512Build());
#endif
  EXPECT_STREQ(ChosenXxh3Build().name, FastXxh3Variant());
  for (const Xxh3Build* build : builds) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{17}, size_t{128}, size_t{129},
                     size_t{240}, size_t{241}, size_t{1024}, size_t{100000}, data.size()}) {
      EXPECT_EQ(build->one_shot(data.data(), n), XXH3_64bits(data.data(), n))
          << build->name << " " << n;
      void* s = build->create();
      build->reset(s);
      for (size_t at = 0; at < n;) {
        size_t step = std::min<size_t>(n - at, 1 + rng() % 70000);
        build->update(s, data.data() + at, step);
        at += step;
      }
      EXPECT_EQ(build->digest(s), XXH3_64bits(data.data(), n)) << build->name << " " << n;
      build->free(s);
    }
  }
  EXPECT_EQ(FastXxh3(data.data(), data.size()), XXH3_64bits(data.data(), data.size()));
  RecordProperty("variant", FastXxh3Variant());
}

TEST(TensorHasherTest, AMissingPieceIsAnError) {
  auto table = OneTensor(0, 3 * 4096);
  SourceAccess none;
  ReadPlan plan = PlanReads(table, {&none, 1}, 0, 4096);
  std::vector<std::byte> data(3 * 4096);
  TensorHasher hasher(plan, data);
  hasher.PieceArrived(0);
  hasher.PieceArrived(2);
  auto sums = hasher.Finish(table);
  ASSERT_FALSE(sums.ok());
  EXPECT_NE(sums.status().message().find("tensor t"), std::string::npos);
}

}  // namespace
}  // namespace expert_arena::load
