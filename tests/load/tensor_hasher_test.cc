// TensorHasher: pieces that arrive in any order on any thread, some hashed hot (BeginPiece,
// HashBlock, EndPiece) and some after they arrived (PieceArrived), give each tensor the
// XXH3_64bits of its bytes.
#include "load/tensor_hasher.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "test_util.h"

namespace expert_arena::load {
namespace {

// Tensors of the given sizes, back to back, cut into pieces of at most `piece` bytes.
ReadPlan MakePlan(const std::vector<uint64_t>& sizes, uint64_t piece) {
  ReadPlan plan;
  uint64_t offset = 0;
  for (uint32_t t = 0; t < sizes.size(); ++t) {
    plan.tensor_first.push_back(plan.pieces.size());
    for (uint64_t at = 0; at < sizes[t]; at += piece) {
      ReadPiece p;
      p.tensor = t;
      p.arena_offset = offset + at;
      p.source_offset = offset + at;
      p.bytes = std::min(piece, sizes[t] - at);
      plan.pieces.push_back(p);
    }
    offset += sizes[t];
  }
  plan.tensor_first.push_back(plan.pieces.size());
  plan.total_bytes = offset;
  return plan;
}

TEST(TensorHasherTest, HotAndLateHashingInAnyOrderOnAnyThreadGiveXxh3) {
  const std::vector<uint64_t> sizes = {1, 4097, 100000, 0, 65536, 250001, 7, 131072, 99999};
  const ReadPlan plan = MakePlan(sizes, 16384 + 3);
  std::vector<std::byte> data(plan.total_bytes);
  std::mt19937_64 rng(42);
  for (auto& b : data) b = std::byte(rng());
  format::ArenaTable table;
  uint64_t offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    format::TensorRecord r;
    std::string name = "t";  // appended, not "t" + ...: g++ 12 -O3 false -Wrestrict (GCC PR 105651)
    name += std::to_string(t);
    r.name = std::move(name);
    r.bytes = sizes[t];
    r.arena_offset = offset;
    offset += sizes[t];
    table.tensors.push_back(r);
  }

  for (int round = 0; round < 200; ++round) {
    std::vector<size_t> order(plan.pieces.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    // Mostly in order (the loader's case), sometimes shuffled.
    if (round % 2 == 1) std::shuffle(order.begin(), order.end(), rng);
    TensorHasher hasher(plan, data);
    std::atomic<size_t> next{0};
    const unsigned threads = 1 + round % 4;
    const uint64_t seed = rng();
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < threads; ++w) {
      pool.emplace_back([&, w] {
        std::mt19937_64 mine(seed + w);
        for (size_t i; (i = next.fetch_add(1)) < order.size();) {
          const size_t piece = order[i];
          const ReadPiece& p = plan.pieces[piece];
          if (mine() % 3 != 0 && hasher.BeginPiece(piece)) {
            const uint64_t block = 1 + mine() % 5000;
            for (uint64_t at = 0; at < p.bytes; at += block) {
              hasher.HashBlock(piece, data.data() + p.arena_offset + at,
                               std::min(block, p.bytes - at));
            }
            hasher.EndPiece(piece);
          } else {
            hasher.PieceArrived(piece);
          }
        }
      });
    }
    for (auto& t : pool) t.join();
    ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> checksums, hasher.Finish(table));
    for (size_t t = 0; t < sizes.size(); ++t) {
      ASSERT_EQ(checksums[t], XXH3_64bits(data.data() + table.tensors[t].arena_offset, sizes[t]))
          << "round " << round << " tensor " << t;
    }
  }
}

// Whole tensors of one piece hashed at once (HashWhole, the loader's batches of tiny tensors)
// beside tensors hashed piece by piece: every checksum is XXH3_64bits of its bytes, and a
// tensor never hashed is still reported.
TEST(TensorHasherTest, WholeTinyTensorsHashedAtOnce) {
  const std::vector<uint64_t> sizes = {256, 4, 0, 1, 70000, 256, 4};
  const ReadPlan plan = MakePlan(sizes, 16384);
  std::vector<std::byte> data(plan.total_bytes);
  std::mt19937_64 rng(7);
  for (auto& b : data) b = std::byte(rng());
  format::ArenaTable table;
  table.tensors.resize(sizes.size());
  table.tensors[6].name = "last";
  TensorHasher hasher(plan, data);
  for (size_t t = 0; t < sizes.size(); ++t) {
    const size_t first = plan.tensor_first[t], end = plan.tensor_first[t + 1];
    if (t == 6) continue;  // never hashed
    if (end - first == 1) {
      hasher.HashWhole(first);
    } else {
      for (size_t p = first; p < end; ++p) hasher.PieceArrived(p);
    }
  }
  auto missing = hasher.Finish(table);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("last"), std::string::npos);
  hasher.HashWhole(plan.tensor_first[6]);
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> checksums, hasher.Finish(table));
  uint64_t offset = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    EXPECT_EQ(checksums[t], XXH3_64bits(data.data() + offset, sizes[t])) << t;
    offset += sizes[t];
  }
}

TEST(TensorHasherTest, MissingPieceIsAnError) {
  const ReadPlan plan = MakePlan({100, 200}, 64);
  std::vector<std::byte> data(300);
  format::ArenaTable table;
  table.tensors.resize(2);
  table.tensors[1].name = "second";
  TensorHasher hasher(plan, data);
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    if (i != 3) hasher.PieceArrived(i);
  }
  auto got = hasher.Finish(table);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("second"), std::string::npos);
}

}  // namespace
}  // namespace expert_arena::load
