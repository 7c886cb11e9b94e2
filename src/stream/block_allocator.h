// Variable-size block allocation inside the regular segments of one producer.
//
// Free blocks are kept twice: ordered by (size, segment, offset) for best-fit reserve, and
// per segment by offset for coalescing with the neighbours on free. Both are balanced trees,
// so Reserve and Free are O(log n) in the number of free blocks. Best fit (the smallest free
// block that is large enough, lowest address among equals) keeps large blocks whole, which
// the field asked for after watching first-fit fragment under mixed tensor sizes.
//
// Thread-safety: none; the producer serializes calls under its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>

namespace expert_arena::stream {

struct Block {
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
};

class BlockAllocator {
 public:
  // Adds [offset, offset+size) of `segment` as free space.
  void AddSegment(uint32_t segment, uint64_t offset, uint64_t size);
  // The best-fitting free block split to `size` bytes, or nullopt when none is large enough.
  std::optional<Block> Reserve(uint64_t size);
  // Gives a block back, merging it with free neighbours in its segment.
  void Free(const Block& block);

  uint64_t total_bytes() const { return total_; }
  uint64_t free_bytes() const { return free_; }
  uint64_t largest_free_block() const;
  uint64_t free_block_count() const { return by_size_.size(); }

 private:
  void Insert(uint32_t segment, uint64_t offset, uint64_t size);
  void Erase(uint32_t segment, uint64_t offset, uint64_t size);

  std::set<std::tuple<uint64_t, uint32_t, uint64_t>> by_size_;             // size, seg, offset
  std::unordered_map<uint32_t, std::map<uint64_t, uint64_t>> by_address_;  // offset -> size
  uint64_t total_ = 0;
  uint64_t free_ = 0;
};

}  // namespace expert_arena::stream
