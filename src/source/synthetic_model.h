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
  std::string format;  // "gguf" or "safetensors"
  std::string out;     // a file, or a directory for sharded safetensors
  uint64_t layers = 0;
  uint64_t experts = 0;
  uint64_t hidden = 0;
  uint64_t ffn = 0;
  std::string dtype = "f32";  // f32, f16, bf16, q8_0 (GGUF only)
  uint32_t shards = 1;        // safetensors only
  uint64_t seed = 0;
  // "synthetic" (the naming above), or a model family's GGUF layout: "qwen3-moe", "mixtral"
  // (layout_gguf.h).
  std::string layout = "synthetic";
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

}  // namespace expert_arena::source
