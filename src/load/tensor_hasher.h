// xxh3-64 checksums of tensors computed while their pieces arrive, on whichever reader thread
// brought the piece that lets a tensor's hash advance.
//
// XXH3 is a streaming hash, not a combinable one, and the stored checksum must equal
// XXH3_64bits of the tensor's bytes (what `expert-arena verify` recomputes). So each tensor
// has one streaming state fed in order: a thread whose piece is the tensor's next one hashes
// it, then every following piece that already arrived; a piece that arrives early waits for
// the thread that hashes its predecessor. The hand-off needs no thread to block: a thread that
// finds the tensor busy leaves, and the busy thread re-checks after it lets go.
//
// Hot hashing: a thread about to copy a piece from the page cache asks BeginPiece; when the
// tensor's hash has reached exactly that piece, the thread owns the tensor's state, hashes
// each small block right after copying it (while it is in L1/L2, instead of re-reading the
// piece from memory later) and hands the tensor back with EndPiece. Otherwise it copies the
// piece and calls PieceArrived as for any other read.
//
// Thread-safety: PieceArrived from any number of threads; Finish from one, after the readers
// stopped.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "expert_arena/status.h"
#include "common/fast_xxh3.h"
#include "load/read_plan.h"

namespace expert_arena::load {

class TensorHasher {
 public:
  TensorHasher(const ReadPlan& plan, std::span<const std::byte> data);
  ~TensorHasher();
  TensorHasher(const TensorHasher&) = delete;
  TensorHasher& operator=(const TensorHasher&) = delete;

  // Piece `piece` of the plan is in place in `data`.
  void PieceArrived(size_t piece);

  // Hot hashing of piece `piece` (see above). BeginPiece: true when the caller now owns the
  // tensor's hash, which stands at the start of this piece; it must then feed the piece's
  // bytes in order with HashBlock and call EndPiece once they are all in place. false: copy
  // the piece and call PieceArrived.
  bool BeginPiece(size_t piece);
  void HashBlock(size_t piece, const std::byte* block, size_t bytes);
  void EndPiece(size_t piece);

  // Piece `piece` is in place and is its tensor's only piece, and no other thread hashes the
  // tensor (the caller claimed it): hashes it now, in one call, with no streaming state.
  void HashWhole(size_t piece);

  // Completes every hash (all pieces must have arrived) and returns one checksum per tensor;
  // kInternal naming the tensor if a piece never arrived.
  Result<std::vector<uint64_t>> Finish(const format::ArenaTable& table);

 private:
  struct alignas(64) TensorState {
    std::atomic<bool> busy{false};
    size_t next = 0;                 // the next piece to hash (guarded by busy)
    FastXxh3State* state = nullptr;  // for tensors of more than one piece
    uint64_t checksum = 0;
    bool done = false;
  };

  // Hashes tensor t's arrived pieces in order; the caller holds its busy flag.
  void Advance(size_t t);
  // Lets go of tensor t's busy flag, taking it again to hash pieces that arrived meanwhile.
  void Release(size_t t);

  const ReadPlan& plan_;
  std::span<const std::byte> data_;
  std::unique_ptr<std::atomic<uint8_t>[]> arrived_;
  std::unique_ptr<TensorState[]> tensors_;
  size_t tensor_count_;
};

}  // namespace expert_arena::load
