#include "load/tensor_hasher.h"

namespace expert_arena::load {

TensorHasher::TensorHasher(const ReadPlan& plan, std::span<const std::byte> data)
    : plan_(plan),
      data_(data),
      arrived_(new std::atomic<uint8_t>[plan.pieces.size()]),
      tensors_(new TensorState[plan.tensor_first.size() - 1]),
      tensor_count_(plan.tensor_first.size() - 1) {
  for (size_t p = 0; p < plan.pieces.size(); ++p) arrived_[p].store(0, std::memory_order_relaxed);
  for (size_t t = 0; t < tensor_count_; ++t) tensors_[t].next = plan.tensor_first[t];
}

TensorHasher::~TensorHasher() {
  for (size_t t = 0; t < tensor_count_; ++t) {
    if (tensors_[t].state != nullptr) FastXxh3Free(tensors_[t].state);
  }
}

void TensorHasher::Advance(size_t t) {
  TensorState& s = tensors_[t];
  const size_t first = plan_.tensor_first[t];
  const size_t end = plan_.tensor_first[t + 1];
  if (s.done) return;
  if (end - first <= 1) {
    if (first == end || arrived_[first].load()) {
      const ReadPiece* p = first == end ? nullptr : &plan_.pieces[first];
      s.checksum =
          p == nullptr ? FastXxh3(nullptr, 0) : FastXxh3(data_.data() + p->arena_offset, p->bytes);
      s.next = end;
      s.done = true;
    }
    return;
  }
  while (s.next < end && arrived_[s.next].load()) {
    if (s.next == first) {
      s.state = FastXxh3Create();
      FastXxh3Reset(s.state);
    }
    const ReadPiece& p = plan_.pieces[s.next];
    FastXxh3Update(s.state, data_.data() + p.arena_offset, p.bytes);
    ++s.next;
  }
  if (s.next == end) {
    s.checksum = FastXxh3Digest(s.state);
    FastXxh3Free(s.state);
    s.state = nullptr;
    s.done = true;
  }
}

void TensorHasher::PieceArrived(size_t piece) {
  arrived_[piece].store(1);
  const size_t t = plan_.pieces[piece].tensor;
  TensorState& s = tensors_[t];
  bool expected = false;
  // Strong CAS (no spurious failure): if it fails, another thread holds the tensor and
  // re-checks our piece after it lets go (seq_cst orders our store before its re-check).
  if (!s.busy.compare_exchange_strong(expected, true)) return;
  Advance(t);
  Release(t);
}

void TensorHasher::Release(size_t t) {
  TensorState& s = tensors_[t];
  const size_t end = plan_.tensor_first[t + 1];
  for (;;) {
    const size_t next = s.next;
    s.busy.store(false);
    if (next >= end || !arrived_[next].load()) return;
    bool expected = false;
    if (!s.busy.compare_exchange_strong(expected, true)) return;
    Advance(t);
  }
}

bool TensorHasher::BeginPiece(size_t piece) {
  const size_t t = plan_.pieces[piece].tensor;
  TensorState& s = tensors_[t];
  bool expected = false;
  if (!s.busy.compare_exchange_strong(expected, true)) return false;
  if (s.next != piece) {
    // An earlier piece is not hashed yet (still being read): this one is hashed after it.
    Release(t);
    return false;
  }
  if (piece == plan_.tensor_first[t]) {
    s.state = FastXxh3Create();
    FastXxh3Reset(s.state);
  }
  return true;
}

void TensorHasher::HashBlock(size_t piece, const std::byte* block, size_t bytes) {
  FastXxh3Update(tensors_[plan_.pieces[piece].tensor].state, block, bytes);
}

void TensorHasher::EndPiece(size_t piece) {
  const size_t t = plan_.pieces[piece].tensor;
  TensorState& s = tensors_[t];
  arrived_[piece].store(1);
  s.next = piece + 1;
  if (s.next == plan_.tensor_first[t + 1]) {
    s.checksum = FastXxh3Digest(s.state);
    FastXxh3Free(s.state);
    s.state = nullptr;
    s.done = true;
  }
  Release(t);
}

void TensorHasher::HashWhole(size_t piece) {
  TensorState& s = tensors_[plan_.pieces[piece].tensor];
  const ReadPiece& p = plan_.pieces[piece];
  arrived_[piece].store(1, std::memory_order_relaxed);
  s.checksum = FastXxh3(data_.data() + p.arena_offset, p.bytes);
  s.next = piece + 1;
  s.done = true;
}

Result<std::vector<uint64_t>> TensorHasher::Finish(const format::ArenaTable& table) {
  std::vector<uint64_t> checksums(tensor_count_);
  for (size_t t = 0; t < tensor_count_; ++t) {
    Advance(t);
    if (!tensors_[t].done) {
      return Internal("tensor " + table.tensors[t].name + ": a piece was never read");
    }
    checksums[t] = tensors_[t].checksum;
  }
  return checksums;
}

}  // namespace expert_arena::load
