// A flat hash map from names (string_views into storage that outlives the map) to small
// values, for the checks planning makes once per tensor: duplicate names in a header, the
// index's keys, which shard holds a name. One array of slots (open addressing, linear
// probing, xxh3-64 of the name kept in the slot), so an insert allocates nothing once the map
// is sized for its names, where std::unordered_set allocates a node per name (at 90k tensors,
// four such sets were a tenth of a plan).
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace expert_arena {

template <typename V>
class NameMap {
 public:
  explicit NameMap(size_t expected = 0) { Reset(expected); }

  // Inserts name -> value unless the name is present: {the value stored under the name,
  // whether it was inserted}. The pointer is valid until the next insert.
  std::pair<V*, bool> Insert(std::string_view name, V value = V()) {
    if ((size_ + 1) * 2 > slots_.size()) Grow();
    const uint64_t hash = XXH3_64bits(name.data(), name.size());
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      Slot& slot = slots_[i];
      if (!slot.used) {
        slot.name = name;
        slot.hash = hash;
        slot.value = std::move(value);
        slot.used = true;
        ++size_;
        return {&slot.value, true};
      }
      if (slot.hash == hash && slot.name == name) return {&slot.value, false};
    }
  }

  // The value stored under the name; null when absent.
  const V* Find(std::string_view name) const {
    const uint64_t hash = XXH3_64bits(name.data(), name.size());
    for (size_t i = hash & mask_;; i = (i + 1) & mask_) {
      const Slot& slot = slots_[i];
      if (!slot.used) return nullptr;
      if (slot.hash == hash && slot.name == name) return &slot.value;
    }
  }

  bool Contains(std::string_view name) const { return Find(name) != nullptr; }
  size_t size() const { return size_; }

 private:
  struct Slot {
    std::string_view name;
    uint64_t hash = 0;
    V value{};
    bool used = false;
  };

  void Reset(size_t expected) {
    size_t capacity = 16;
    while (capacity < expected * 2 + 2) capacity <<= 1;
    slots_ = std::vector<Slot>(capacity);
    mask_ = capacity - 1;
    size_ = 0;
  }

  void Grow() {
    std::vector<Slot> old = std::move(slots_);
    Reset(old.size());  // twice the slots
    for (Slot& slot : old) {
      if (!slot.used) continue;
      for (size_t i = slot.hash & mask_;; i = (i + 1) & mask_) {
        if (!slots_[i].used) {
          slots_[i] = std::move(slot);
          ++size_;
          break;
        }
      }
    }
  }

  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace expert_arena
