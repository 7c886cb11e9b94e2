// GGUFs of real MoE families for `gen-model --layout qwen3-moe|mixtral`: every hyperparameter
// key, attention, norms, router, experts, output and a minimal vocabulary, named and shaped as
// llama.cpp's loader expects (llama-model.cpp: LLM_ARCH_QWEN3MOE, and LLM_ARCH_LLAMA with
// experts for Mixtral), so llama.cpp loads these files and evaluates tokens with them.
//
// Shapes (ggml order, ne[0] first; H hidden, F expert ffn, E experts, D head size, V vocab):
//   token_embd.weight [H, V] f32, output_norm.weight [H] f32, output.weight [H, V] f32
//   blk.l.attn_norm.weight [H] f32            blk.l.ffn_norm.weight [H] f32
//   blk.l.attn_q.weight [H, D*heads]          blk.l.attn_output.weight [D*heads, H]
//   blk.l.attn_k.weight / attn_v.weight [H, D*kv_heads]
//   blk.l.attn_q_norm.weight / attn_k_norm.weight [D] f32   (qwen3-moe only)
//   blk.l.ffn_gate_inp.weight [H, E] f32
//   blk.l.ffn_gate_exps.weight / ffn_up_exps.weight [H, F, E], ffn_down_exps.weight [F, H, E]
// Attention and expert matrices take --dtype. D is 128, 64 or 32 (the largest dividing H);
// heads = H / D; kv_heads = heads / 4 when that divides, else heads.
//
// Vocabulary: a SentencePiece ("llama") vocabulary of V = 512 tokens: <unk>, <s>, </s>, the 256
// byte tokens <0x00>..<0xFF>, then filler pieces, with scores and token types, so the
// tokenizer finds its special and newline tokens.
//
// The values are the synthetic ones of synthetic_model.h (uniform in [-0.05, 0.05), norms
// 1 + that): small and finite, so the forward pass of llama.cpp yields finite logits.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "generators/gguf_writer.h"
#include "generators/synthetic_model.h"
#include "format/dtypes.h"

namespace expert_arena::source {
namespace {

constexpr uint32_t kLayoutVocab = 512;
constexpr uint32_t kContextLength = 4096;

struct LayoutTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> ne;
  bool norm = false;
  bool expert = false;
};

struct Family {
  const char* arch;     // general.architecture and the key prefix
  bool qk_norm;         // attn_q_norm / attn_k_norm per block (Qwen3)
  bool expert_ffn_key;  // expert_feed_forward_length (Qwen3) or feed_forward_length (Llama)
};

Result<Family> FamilyFor(const std::string& layout) {
  if (layout == "qwen3-moe") return Family{"qwen3moe", true, true};
  if (layout == "mixtral") return Family{"llama", false, false};
  return InvalidArgument("--layout " + layout +
                         " has no GGUF writer; GGUF layouts are synthetic, qwen3-moe, mixtral");
}

GgufValue StringArray(std::vector<std::string> values) {
  std::vector<GgufValue> elements;
  elements.reserve(values.size());
  for (std::string& v : values) elements.push_back(GgufWriter::String(std::move(v)));
  return GgufWriter::Array(GgufValueType::kString, std::move(elements));
}

void AddVocabulary(GgufWriter& writer) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<GgufValue> scores, types;
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof piece, "<0x%02X>", b);
    tokens.emplace_back(piece);
  }
  while (tokens.size() < kLayoutVocab) {
    tokens.push_back("\xe2\x96\x81t" + std::to_string(tokens.size()));  // "▁tN"
  }
  for (uint32_t i = 0; i < kLayoutVocab; ++i) {
    // llama_token_type: 1 normal, 2 unknown, 3 control, 6 byte.
    int32_t type = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
    types.push_back(GgufWriter::Scalar(GgufValueType::kI32, 0, type));
    scores.push_back(
        GgufWriter::Scalar(GgufValueType::kF32, 0, 0, i < 259 ? 0.0 : -static_cast<double>(i)));
  }
  writer.AddString("tokenizer.ggml.model", "llama");
  writer.Add("tokenizer.ggml.tokens", StringArray(std::move(tokens)));
  writer.Add("tokenizer.ggml.scores", GgufWriter::Array(GgufValueType::kF32, std::move(scores)));
  writer.Add("tokenizer.ggml.token_type", GgufWriter::Array(GgufValueType::kI32, std::move(types)));
  writer.AddU32("tokenizer.ggml.unknown_token_id", 0);
  writer.AddU32("tokenizer.ggml.bos_token_id", 1);
  writer.AddU32("tokenizer.ggml.eos_token_id", 2);
  writer.AddBool("tokenizer.ggml.add_bos_token", true);
}

}  // namespace

Result<SyntheticModelReport> WriteLayoutGguf(const SyntheticModelOptions& o) {
  EA_ASSIGN_OR_RETURN(Family family, FamilyFor(o.layout));
  const uint64_t H = o.hidden, F = o.ffn, E = o.experts;
  uint64_t head = 0;
  for (uint64_t d : {128u, 64u, 32u}) {
    if (H % d == 0) {
      head = d;
      break;
    }
  }
  if (head == 0) {
    return InvalidArgument("--layout " + o.layout + " needs --hidden to be a multiple of 32 (got " +
                           std::to_string(H) + "): attention heads of 32, 64 or 128");
  }
  const uint64_t heads = H / head;
  const uint64_t kv_heads = heads % 4 == 0 ? heads / 4 : heads;
  const uint64_t used = std::min<uint64_t>(2, E);
  const std::string a = family.arch;

  GgufWriter writer(3);
  writer.AddString("general.architecture", a);
  writer.AddString("general.name", o.layout + " (expert-arena gen-model)");
  writer.SetAlignment(32);
  writer.AddU32(a + ".block_count", static_cast<uint32_t>(o.layers));
  writer.AddU32(a + ".context_length", kContextLength);
  writer.AddU32(a + ".embedding_length", static_cast<uint32_t>(H));
  if (family.expert_ffn_key) {
    writer.AddU32(a + ".feed_forward_length", static_cast<uint32_t>(F * used));
    writer.AddU32(a + ".expert_feed_forward_length", static_cast<uint32_t>(F));
  } else {
    writer.AddU32(a + ".feed_forward_length", static_cast<uint32_t>(F));
  }
  writer.AddU32(a + ".expert_count", static_cast<uint32_t>(E));
  writer.AddU32(a + ".expert_used_count", static_cast<uint32_t>(used));
  writer.AddU32(a + ".attention.head_count", static_cast<uint32_t>(heads));
  writer.AddU32(a + ".attention.head_count_kv", static_cast<uint32_t>(kv_heads));
  writer.AddU32(a + ".attention.key_length", static_cast<uint32_t>(head));
  writer.AddU32(a + ".attention.value_length", static_cast<uint32_t>(head));
  writer.AddF32(a + ".attention.layer_norm_rms_epsilon", 1e-6f);
  writer.AddU32(a + ".rope.dimension_count", static_cast<uint32_t>(head));
  writer.AddF32(a + ".rope.freq_base", 1000000.0f);
  writer.AddU32(a + ".vocab_size", kLayoutVocab);
  writer.AddU64("expert_arena.seed", o.seed);
  AddVocabulary(writer);

  std::vector<LayoutTensor> tensors;
  auto add = [&](std::string name, std::string dtype, std::vector<uint64_t> ne, bool norm = false,
                 bool expert = false) {
    tensors.push_back({std::move(name), std::move(dtype), std::move(ne), norm, expert});
  };
  add("token_embd.weight", "f32", {H, kLayoutVocab});
  add("output_norm.weight", "f32", {H}, true);
  add("output.weight", "f32", {H, kLayoutVocab});
  for (uint64_t l = 0; l < o.layers; ++l) {
    const std::string blk = "blk." + std::to_string(l) + ".";
    add(blk + "attn_norm.weight", "f32", {H}, true);
    add(blk + "attn_q.weight", o.dtype, {H, head * heads});
    add(blk + "attn_k.weight", o.dtype, {H, head * kv_heads});
    add(blk + "attn_v.weight", o.dtype, {H, head * kv_heads});
    add(blk + "attn_output.weight", o.dtype, {head * heads, H});
    if (family.qk_norm) {
      add(blk + "attn_q_norm.weight", "f32", {head}, true);
      add(blk + "attn_k_norm.weight", "f32", {head}, true);
    }
    add(blk + "ffn_norm.weight", "f32", {H}, true);
    add(blk + "ffn_gate_inp.weight", "f32", {H, E});
    add(blk + "ffn_gate_exps.weight", o.dtype, {H, F, E}, false, true);
    add(blk + "ffn_up_exps.weight", o.dtype, {H, F, E}, false, true);
    add(blk + "ffn_down_exps.weight", o.dtype, {F, H, E}, false, true);
  }

  SyntheticModelReport report;
  std::vector<uint64_t> seeds;
  for (const LayoutTensor& t : tensors) {
    const GgmlType* type = FindGgmlTypeByName(t.dtype);
    if (type == nullptr) return InvalidArgument("--dtype " + t.dtype + " is not a ggml type");
    EA_RETURN_IF_ERROR(writer.AddTensor(t.name, *type, t.ne));
    const GgufTensorInfo& info = writer.tensors().back();
    report.tensor_bytes += info.bytes;
    if (t.expert) {
      report.expert_tensors++;
      report.expert_bytes += info.bytes;
    }
    seeds.push_back(SyntheticTensorSeed(t.name, o.seed));
  }
  EA_RETURN_IF_ERROR(
      writer.WriteFile(o.out, [&](size_t i, uint64_t offset, std::span<std::byte> out) {
        FillSyntheticTensor(tensors[i].dtype, seeds[i], tensors[i].norm, offset, out);
        return Status::Ok();
      }));
  report.files.push_back(o.out);
  report.file_bytes = writer.file_bytes();
  report.tensors = tensors.size();
  return report;
}

}  // namespace expert_arena::source
