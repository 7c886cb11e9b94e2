// ExpertTable: the routed experts of a MoE model, found by name and shape among an arena's
// tensor views. It needs nothing but the views (names, dtypes, shapes, bytes), so an engine
// that attached to an arena without reading the model gets the same table as the loader.
//
// Two naming families (docs/moe-engine.md, `expert-arena gen-model`):
//   GGUF         blk.L.ffn_gate_exps.weight  ggml ne=[H, F, E]  (ne0 first, as TensorView says)
//                blk.L.ffn_up_exps.weight    ne=[H, F, E]
//                blk.L.ffn_down_exps.weight  ne=[F, H, E]
//                expert e's gate matrix is the e-th contiguous slab of F rows of H values.
//   safetensors  model.layers.L.mlp.experts.E.{gate,up}_proj.weight  [F, H]  (rows first)
//                model.layers.L.mlp.experts.E.down_proj.weight        [H, F]
//
// Thread-safety: immutable after Build; it points into the views' memory, which the caller
// keeps alive (the Arena).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "expert_arena/arena.h"
#include "expert_arena/status.h"
#include "kernels.h"

namespace expert_arena::moe {

// One expert's FFN: gate and up have F rows of H values, down has H rows of F values.
struct ExpertWeights {
  Matrix gate;
  Matrix up;
  Matrix down;
};

class ExpertTable {
 public:
  // Finds the expert tensors among `views` and checks them: every layer 0..L-1 has every
  // expert 0..E-1, the three matrices agree on H and F, dtypes are f32/f16/bf16/q8_0, and
  // each tensor's byte size is exactly what its shape and dtype need. The error names the
  // tensor and what is wrong; with no expert tensor at all it says which names it expected.
  static Result<ExpertTable> Build(std::span<const TensorView> views);

  uint64_t layers() const { return layers_; }
  uint64_t experts() const { return experts_; }
  uint64_t hidden() const { return hidden_; }
  uint64_t ffn() const { return ffn_; }
  // "gguf" or "safetensors".
  const std::string& naming() const { return naming_; }
  // The dtype of the weights, or "mixed".
  const std::string& dtype_name() const { return dtype_name_; }
  const ExpertWeights& at(uint64_t layer, uint64_t expert) const {
    return weights_[layer * experts_ + expert];
  }
  // Bytes of one expert's three matrices.
  uint64_t ExpertBytes(uint64_t layer, uint64_t expert) const;
  // Bytes of all experts.
  uint64_t TotalBytes() const;

 private:
  uint64_t layers_ = 0;
  uint64_t experts_ = 0;
  uint64_t hidden_ = 0;
  uint64_t ffn_ = 0;
  std::string naming_;
  std::string dtype_name_;
  std::vector<ExpertWeights> weights_;  // layer-major
};

// The byte range of a matrix (what a GPU copy of it moves).
inline std::span<const std::byte> MatrixBytes(const Matrix& m) {
  return {m.data, m.rows * m.row_bytes};
}

}  // namespace expert_arena::moe
