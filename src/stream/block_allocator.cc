#include "stream/block_allocator.h"

namespace expert_arena::stream {

void BlockAllocator::AddSegment(uint32_t segment, uint64_t offset, uint64_t size) {
  total_ += size;
  Free({segment, offset, size});
}

void BlockAllocator::Insert(uint32_t segment, uint64_t offset, uint64_t size) {
  by_size_.emplace(size, segment, offset);
  by_address_[segment].emplace(offset, size);
  free_ += size;
}

void BlockAllocator::Erase(uint32_t segment, uint64_t offset, uint64_t size) {
  by_size_.erase({size, segment, offset});
  by_address_[segment].erase(offset);
  free_ -= size;
}

std::optional<Block> BlockAllocator::Reserve(uint64_t size) {
  if (size == 0) return std::nullopt;
  auto it = by_size_.lower_bound({size, 0, 0});
  if (it == by_size_.end()) return std::nullopt;
  auto [free_size, segment, offset] = *it;
  Erase(segment, offset, free_size);
  if (free_size > size) Insert(segment, offset + size, free_size - size);
  return Block{segment, offset, size};
}

void BlockAllocator::Free(const Block& block) {
  uint64_t offset = block.offset;
  uint64_t size = block.size;
  auto& free_here = by_address_[block.segment];
  auto next = free_here.lower_bound(offset);
  if (next != free_here.end() && offset + size == next->first) {
    uint64_t next_offset = next->first;
    uint64_t next_size = next->second;
    Erase(block.segment, next_offset, next_size);
    size += next_size;
  }
  next = free_here.lower_bound(offset);
  if (next != free_here.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      uint64_t prev_offset = prev->first;
      uint64_t prev_size = prev->second;
      Erase(block.segment, prev_offset, prev_size);
      offset = prev_offset;
      size += prev_size;
    }
  }
  Insert(block.segment, offset, size);
}

uint64_t BlockAllocator::largest_free_block() const {
  return by_size_.empty() ? 0 : std::get<0>(*by_size_.rbegin());
}

}  // namespace expert_arena::stream
