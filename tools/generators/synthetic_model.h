// Deterministic synthetic MoE models (`expert-arena gen-model`): the demo, the tests, the
// benchmarks and moe-engine all use them. Written as a stream, so any size from KiB to tens
// of GiB costs a few MiB of memory.
//
// Naming contract (moe-engine depends on it):
//  GGUF v3, general.alignment 32, general.architecture "synthmoe", u32 keys
//  synthmoe.{block_count, expert_count, expert_used_count (min(2, E)), embedding_length,
//  expert_feed_forward_length}; tensors (ggml order, ne[0] first):
//    token_embd.weight              [H, 64]     f32
//    blk.l.attn_norm.weight         [H]         f32
//    blk.l.ffn_gate_inp.weight      [H, E]      f32
//    blk.l.ffn_gate_exps.weight     [H, F, E]   dtype
//    blk.l.ffn_up_exps.weight       [H, F, E]   dtype
//    blk.l.ffn_down_exps.weight     [F, H, E]   dtype
//  safetensors (shapes as in the header, row-major):
//    model.embed_tokens.weight                          [64, H]  F32
//    model.layers.l.input_layernorm.weight              [H]      F32
//    model.layers.l.mlp.gate.weight                     [E, H]   F32
//    model.layers.l.mlp.experts.e.gate_proj.weight      [F, H]   dtype
//    model.layers.l.mlp.experts.e.up_proj.weight        [F, H]   dtype
//    model.layers.l.mlp.experts.e.down_proj.weight      [H, F]   dtype
//  sharded: model-0000i-of-0000K.safetensors + model.safetensors.index.json in a directory.
//
// Named layouts (--layout; as safetensors here, qwen3-moe and mixtral also as GGUF in
// layout_gguf.cc): the tensor names, dtypes and shape rules of real
// checkpoint families, so tests and benchmarks see the real metadata (tens of thousands of
// tensors, 100+ shards) at any data size. Every dimension of the real model is scaled by
// hidden / (the family's hidden size), at least 1: with the family's hidden and ffn the shapes
// are the release's own. layers and experts default to the release's.
//  deepseek-v3 (DeepSeek-V3/R1 FP8: 61 layers, 256 experts, H 7168, F 2048): layers
//    0..first_dense-1 (3, or fewer when layers < 4) have a dense mlp.{gate,up,down}_proj, the
//    others mlp.gate.weight [E, H] BF16 + mlp.gate.e_score_correction_bias [E] F32,
//    mlp.shared_experts.{gate,up,down}_proj and mlp.experts.e.{gate,up,down}_proj; MLA
//    attention (self_attn.q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
//    kv_a_layernorm, kv_b_proj, o_proj); every 2-D projection is F8_E4M3 with a
//    `<name>_scale_inv` F32 tensor [ceil(out/128), ceil(in/128)] beside it (128x128 blocks);
//    norms BF16; embed_tokens, norm, lm_head BF16. dtype bf16 writes the dequantized variant
//    (no scales).
//  qwen3-moe (Qwen3-235B-A22B: 94 layers, 128 experts, H 4096, F 1536): every layer
//    self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.gate.weight, mlp.experts.e.{gate,up,down}_proj.
//  mixtral (Mixtral-8x7B: 32 layers, 8 experts, H 4096, F 14336):
//    block_sparse_moe.gate.weight, block_sparse_moe.experts.e.{w1,w2,w3}.weight, self_attn.
// An FP8 value is E4M3(SyntheticValue * 448 / 0.05) (round to nearest even), its scale_inv
// 0.05 / 448, so value * scale_inv is the synthetic value to E4M3's precision.
//
// Values: element i of a tensor is SyntheticValue(SyntheticTensorSeed(name, seed), i), uniform
// in [-0.05, 0.05); norm weights are 1 + that. f16/bf16 round to nearest even; q8_0 blocks are
// ggml's block_q8_0 (f16 scale d = amax / 127, then 32 int8 round(x / d)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "expert_arena/status.h"

namespace expert_arena::source {

struct SyntheticModelOptions {
  std::string format;              // "gguf" or "safetensors"
  // "synthetic" (the naming above), or a model family's: "deepseek-v3" (safetensors),
  // "qwen3-moe", "mixtral" (safetensors here; GGUF in layout_gguf.cc).
  std::string layout = "synthetic";
  std::string out;                  // a file, or a directory for sharded safetensors
  // 0: the layout's default (synthetic has none: all four are required).
  uint64_t layers = 0;
  uint64_t experts = 0;
  uint64_t hidden = 0;
  uint64_t ffn = 0;
  // f32, f16, bf16, q8_0 (GGUF only), f8_e4m3 (deepseek-v3 only). Empty: the layout's
  // (f32 for synthetic and every GGUF, f8_e4m3 for deepseek-v3, bf16 for the others).
  std::string dtype;
  uint32_t shards = 1;        // safetensors only
  uint64_t seed = 0;
};

struct SyntheticModelReport {
  std::vector<std::string> files;  // the model files written (and the index, last)
  uint64_t file_bytes = 0;
  uint64_t tensors = 0;
  uint64_t tensor_bytes = 0;
  uint64_t expert_tensors = 0;
  uint64_t expert_bytes = 0;
};

// Checks the options (kInvalidArgument: bad usage, e.g. q8_0 with safetensors) and writes the
// model. Files appear complete or not at all (written under a temporary name, then renamed).
Result<SyntheticModelReport> WriteSyntheticModel(const SyntheticModelOptions& options);

// Bytes [offset, offset + out.size()) of a tensor of `dtype` (f32, f16, bf16, q8_0) holding the
// synthetic values of `tensor_seed` (1 + value for a norm weight).
void FillSyntheticTensor(std::string_view dtype, uint64_t tensor_seed, bool norm, uint64_t offset,
                         std::span<std::byte> out);

// A model family's GGUF (layout_gguf.cc); called by WriteSyntheticModel for a named layout.
Result<SyntheticModelReport> WriteLayoutGguf(const SyntheticModelOptions& options);

uint64_t SyntheticTensorSeed(std::string_view name, uint64_t seed);
float SyntheticValue(uint64_t tensor_seed, uint64_t index);

// IEEE half and bfloat16 from float, rounding to nearest even.
uint16_t FloatToHalf(float value);
uint16_t FloatToBFloat16(float value);
float HalfToFloat(uint16_t value);
// FP8 E4M3 (the "fn" variant: no infinities, max 448), rounding to nearest even, saturating.
uint8_t FloatToE4M3(float value);
float E4M3ToFloat(uint8_t value);

// The layouts gen-model knows, and a layout's defaults (layers, experts, hidden, ffn, dtype)
// when given as 0 / empty. Fails on an unknown layout.
Status ApplyLayoutDefaults(SyntheticModelOptions& options);

}  // namespace expert_arena::source
