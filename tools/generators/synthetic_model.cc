#include "generators/synthetic_model.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>

#include "generators/gguf_writer.h"
#include "generators/safetensors_writer.h"
#include "platform/file.h"
#include "format/dtypes.h"

namespace expert_arena::source {
namespace {

constexpr uint64_t kVocab = 64;
// FP8 values are the synthetic values times 448 / 0.05 (E4M3's range), scales the inverse.
constexpr float kFp8Scale = 448.0f / 0.05f;
constexpr float kFp8ScaleInv = 0.05f / 448.0f;

// kOther: attention projections, shared experts, dense MLPs (not selected by default).
enum class Role { kEmbedding, kNorm, kRouter, kExpert, kExpertScale, kScale, kOther };

bool IsExpert(Role r) { return r == Role::kExpert || r == Role::kExpertScale; }

struct SynthTensor {
  std::string name;
  Role role;
  std::string dtype;            // f32, f16, bf16, q8_0, f8_e4m3
  std::vector<uint64_t> shape;  // GGUF: ne order; safetensors: header order
  uint64_t seed = 0;
};

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float ValueFor(const SynthTensor& t, uint64_t index) {
  if (t.role == Role::kScale || t.role == Role::kExpertScale) return kFp8ScaleInv;
  float v = SyntheticValue(t.seed, index);
  return t.role == Role::kNorm ? 1.0f + v : v;
}

// Fills bytes [offset, offset + out.size()) of tensor t.
void FillTensor(const SynthTensor& t, uint64_t offset, std::span<std::byte> out) {
  std::byte* p = out.data();
  if (t.dtype == "f32") {
    uint64_t first = offset / 4;
    size_t n = out.size() / 4;
    for (size_t k = 0; k < n; ++k) {
      float v = ValueFor(t, first + k);
      std::memcpy(p + 4 * k, &v, 4);
    }
  } else if (t.dtype == "f16" || t.dtype == "bf16") {
    bool half = t.dtype == "f16";
    uint64_t first = offset / 2;
    size_t n = out.size() / 2;
    for (size_t k = 0; k < n; ++k) {
      float v = ValueFor(t, first + k);
      uint16_t h = half ? FloatToHalf(v) : FloatToBFloat16(v);
      std::memcpy(p + 2 * k, &h, 2);
    }
  } else if (t.dtype == "f8_e4m3") {
    for (size_t k = 0; k < out.size(); ++k) {
      p[k] = static_cast<std::byte>(FloatToE4M3(ValueFor(t, offset + k) * kFp8Scale));
    }
  } else {  // q8_0: 34-byte blocks of an f16 scale and 32 int8
    uint64_t first_block = offset / 34;
    size_t blocks = out.size() / 34;
    for (size_t b = 0; b < blocks; ++b) {
      float x[32];
      float amax = 0;
      for (int k = 0; k < 32; ++k) {
        x[k] = ValueFor(t, (first_block + b) * 32 + k);
        amax = std::max(amax, std::fabs(x[k]));
      }
      float d = amax / 127.0f;
      float id = d != 0 ? 1.0f / d : 0.0f;
      uint16_t dh = FloatToHalf(d);
      std::byte* block = p + 34 * b;
      std::memcpy(block, &dh, 2);
      for (int k = 0; k < 32; ++k) {
        int q = static_cast<int>(std::lround(x[k] * id));
        block[2 + k] = static_cast<std::byte>(static_cast<int8_t>(std::clamp(q, -127, 127)));
      }
    }
  }
}

struct LayoutInfo {
  const char* name;
  uint64_t layers, experts, hidden, ffn;
  const char* dtype;
};

// The releases' own sizes (config.json of DeepSeek-V3, Qwen3-235B-A22B, Mixtral-8x7B).
constexpr LayoutInfo kLayouts[] = {
    {"deepseek-v3", 61, 256, 7168, 2048, "f8_e4m3"},
    {"qwen3-moe", 94, 128, 4096, 1536, "bf16"},
    {"mixtral", 32, 8, 4096, 14336, "bf16"},
};
// The data of a named layout is tiny unless asked: its metadata is what tests and benches want.
constexpr uint64_t kLayoutDefaultHidden = 16;
constexpr uint64_t kLayoutDefaultFfn = 16;
constexpr uint64_t kLayoutDefaultGgufHidden = 64;

const LayoutInfo* FindLayout(const std::string& name) {
  for (const LayoutInfo& l : kLayouts) {
    if (name == l.name) return &l;
  }
  return nullptr;
}

// The named layouts (see synthetic_model.h): real names, dtypes and shape rules, every real
// dimension scaled by hidden / the family's hidden.
std::vector<SynthTensor> PlanLayoutTensors(const SyntheticModelOptions& o) {
  const LayoutInfo& info = *FindLayout(o.layout);
  const uint64_t H = o.hidden, F = o.ffn, E = o.experts;
  auto dim = [&](uint64_t real) {
    return std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<unsigned __int128>(real) * H /
                                                       info.hidden));
  };
  std::vector<SynthTensor> out;
  const bool fp8 = o.dtype == "f8_e4m3";
  auto add = [&](std::string name, Role role, std::string dtype, std::vector<uint64_t> shape) {
    uint64_t seed = SyntheticTensorSeed(name, o.seed);
    out.push_back({std::move(name), role, std::move(dtype), std::move(shape), seed});
  };
  // A 2-D projection [out, in]; FP8 ones get their 128x128-block scale_inv beside them.
  auto proj = [&](const std::string& name, Role role, uint64_t rows, uint64_t cols) {
    add(name, role, o.dtype, {rows, cols});
    if (fp8) add(name + "_scale_inv", role == Role::kExpert ? Role::kExpertScale : Role::kScale, "f32",
                 {(rows + 127) / 128, (cols + 127) / 128});
  };
  const std::string norm_dtype = o.dtype == "f32" ? "f32" : "bf16";
  add("model.embed_tokens.weight", Role::kEmbedding, norm_dtype, {kVocab, H});
  for (uint64_t l = 0; l < o.layers; ++l) {
    const std::string layer = "model.layers." + std::to_string(l) + ".";
    add(layer + "input_layernorm.weight", Role::kNorm, norm_dtype, {H});
    add(layer + "post_attention_layernorm.weight", Role::kNorm, norm_dtype, {H});
    const std::string attn = layer + "self_attn.";
    if (o.layout == "deepseek-v3") {
      // MLA: q_lora_rank 1536, kv_lora_rank 512, 128 heads of 128 + 64 (rope) dims, v 128.
      proj(attn + "q_a_proj.weight", Role::kOther, dim(1536), H);
      add(attn + "q_a_layernorm.weight", Role::kNorm, norm_dtype, {dim(1536)});
      proj(attn + "q_b_proj.weight", Role::kOther, dim(128 * 192), dim(1536));
      proj(attn + "kv_a_proj_with_mqa.weight", Role::kOther, dim(512 + 64), H);
      add(attn + "kv_a_layernorm.weight", Role::kNorm, norm_dtype, {dim(512)});
      proj(attn + "kv_b_proj.weight", Role::kOther, dim(128 * 256), dim(512));
      proj(attn + "o_proj.weight", Role::kOther, H, dim(128 * 128));
      const uint64_t first_dense = o.layers > 3 ? 3 : 0;
      const std::string mlp = layer + "mlp.";
      if (l < first_dense) {
        // Dense FFN: intermediate 18432 = 9 x the expert's 2048.
        proj(mlp + "gate_proj.weight", Role::kOther, 9 * F, H);
        proj(mlp + "up_proj.weight", Role::kOther, 9 * F, H);
        proj(mlp + "down_proj.weight", Role::kOther, H, 9 * F);
        continue;
      }
      add(mlp + "gate.weight", Role::kRouter, norm_dtype, {E, H});
      add(mlp + "gate.e_score_correction_bias", Role::kRouter, "f32", {E});
      for (uint64_t e = 0; e < E; ++e) {
        const std::string expert = mlp + "experts." + std::to_string(e) + ".";
        proj(expert + "gate_proj.weight", Role::kExpert, F, H);
        proj(expert + "up_proj.weight", Role::kExpert, F, H);
        proj(expert + "down_proj.weight", Role::kExpert, H, F);
      }
      proj(mlp + "shared_experts.gate_proj.weight", Role::kOther, F, H);
      proj(mlp + "shared_experts.up_proj.weight", Role::kOther, F, H);
      proj(mlp + "shared_experts.down_proj.weight", Role::kOther, H, F);
    } else if (o.layout == "qwen3-moe") {
      // 64 query heads, 4 key/value heads, head_dim 128.
      proj(attn + "q_proj.weight", Role::kOther, dim(64 * 128), H);
      proj(attn + "k_proj.weight", Role::kOther, dim(4 * 128), H);
      proj(attn + "v_proj.weight", Role::kOther, dim(4 * 128), H);
      proj(attn + "o_proj.weight", Role::kOther, H, dim(64 * 128));
      add(attn + "q_norm.weight", Role::kNorm, norm_dtype, {dim(128)});
      add(attn + "k_norm.weight", Role::kNorm, norm_dtype, {dim(128)});
      const std::string mlp = layer + "mlp.";
      add(mlp + "gate.weight", Role::kRouter, norm_dtype, {E, H});
      for (uint64_t e = 0; e < E; ++e) {
        const std::string expert = mlp + "experts." + std::to_string(e) + ".";
        proj(expert + "gate_proj.weight", Role::kExpert, F, H);
        proj(expert + "up_proj.weight", Role::kExpert, F, H);
        proj(expert + "down_proj.weight", Role::kExpert, H, F);
      }
    } else {  // mixtral: 32 heads, 8 key/value heads, head_dim 128
      proj(attn + "q_proj.weight", Role::kOther, H, H);
      proj(attn + "k_proj.weight", Role::kOther, dim(8 * 128), H);
      proj(attn + "v_proj.weight", Role::kOther, dim(8 * 128), H);
      proj(attn + "o_proj.weight", Role::kOther, H, H);
      const std::string moe = layer + "block_sparse_moe.";
      add(moe + "gate.weight", Role::kRouter, norm_dtype, {E, H});
      for (uint64_t e = 0; e < E; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        proj(expert + "w1.weight", Role::kExpert, F, H);
        proj(expert + "w2.weight", Role::kExpert, H, F);
        proj(expert + "w3.weight", Role::kExpert, F, H);
      }
    }
  }
  add("model.norm.weight", Role::kNorm, norm_dtype, {H});
  add("lm_head.weight", Role::kEmbedding, norm_dtype, {kVocab, H});
  return out;
}

std::vector<SynthTensor> PlanTensors(const SyntheticModelOptions& o, bool gguf) {
  if (o.layout != "synthetic") return PlanLayoutTensors(o);
  const uint64_t H = o.hidden, F = o.ffn, E = o.experts;
  std::vector<SynthTensor> out;
  auto add = [&](std::string name, Role role, std::string dtype, std::vector<uint64_t> shape) {
    uint64_t seed = SyntheticTensorSeed(name, o.seed);
    out.push_back({std::move(name), role, std::move(dtype), std::move(shape), seed});
  };
  if (gguf) {
    add("token_embd.weight", Role::kEmbedding, "f32", {H, kVocab});
    for (uint64_t l = 0; l < o.layers; ++l) {
      std::string blk = "blk." + std::to_string(l) + ".";
      add(blk + "attn_norm.weight", Role::kNorm, "f32", {H});
      add(blk + "ffn_gate_inp.weight", Role::kRouter, "f32", {H, E});
      add(blk + "ffn_gate_exps.weight", Role::kExpert, o.dtype, {H, F, E});
      add(blk + "ffn_up_exps.weight", Role::kExpert, o.dtype, {H, F, E});
      add(blk + "ffn_down_exps.weight", Role::kExpert, o.dtype, {F, H, E});
    }
    return out;
  }
  add("model.embed_tokens.weight", Role::kEmbedding, "f32", {kVocab, H});
  for (uint64_t l = 0; l < o.layers; ++l) {
    std::string layer = "model.layers." + std::to_string(l) + ".";
    add(layer + "input_layernorm.weight", Role::kNorm, "f32", {H});
    add(layer + "mlp.gate.weight", Role::kRouter, "f32", {E, H});
    for (uint64_t e = 0; e < E; ++e) {
      std::string expert = layer + "mlp.experts." + std::to_string(e) + ".";
      add(expert + "gate_proj.weight", Role::kExpert, o.dtype, {F, H});
      add(expert + "up_proj.weight", Role::kExpert, o.dtype, {F, H});
      add(expert + "down_proj.weight", Role::kExpert, o.dtype, {H, F});
    }
  }
  return out;
}

std::string SafetensorsDtypeName(const std::string& dtype) {
  if (dtype == "f32") return "F32";
  if (dtype == "f16") return "F16";
  if (dtype == "f8_e4m3") return "F8_E4M3";
  return "BF16";
}

Status CheckOptions(const SyntheticModelOptions& o) {
  if (o.format != "gguf" && o.format != "safetensors") {
    return InvalidArgument("--format must be gguf or safetensors, not " + o.format);
  }
  if (o.out.empty()) return InvalidArgument("--out is required");
  if (o.layers == 0 || o.experts == 0 || o.hidden == 0 || o.ffn == 0) {
    return InvalidArgument("--layers, --experts, --hidden and --ffn must be at least 1");
  }
  if (o.dtype != "f32" && o.dtype != "f16" && o.dtype != "bf16" && o.dtype != "q8_0" &&
      o.dtype != "f8_e4m3") {
    return InvalidArgument("--dtype must be f32, f16, bf16, q8_0 or f8_e4m3, not " + o.dtype);
  }
  if (o.dtype == "f8_e4m3" && o.layout != "deepseek-v3") {
    return InvalidArgument("--dtype f8_e4m3 (with weight_scale_inv) is the deepseek-v3 layout's");
  }
  if (o.format == "safetensors" && o.dtype == "q8_0") {
    return InvalidArgument(
        "--dtype q8_0 is a GGUF (ggml) block format; safetensors models take f32, f16 or bf16");
  }
  if (o.dtype == "q8_0" && (o.hidden % 32 != 0 || o.ffn % 32 != 0)) {
    return InvalidArgument("--dtype q8_0 needs --hidden and --ffn to be multiples of 32 (got " +
                           std::to_string(o.hidden) + " and " + std::to_string(o.ffn) + ")");
  }
  if (o.shards == 0) return InvalidArgument("--shards must be at least 1");
  if (o.format == "gguf" && o.shards != 1) {
    return InvalidArgument("--shards is for safetensors models; GGUF is written as one file");
  }
  if (o.format == "gguf") {
    for (uint64_t v : {o.layers, o.experts, o.hidden, o.ffn}) {
      if (v > UINT32_MAX) return InvalidArgument("GGUF dimensions are written as u32; too large");
    }
  }
  // Every size must fit 64 bits: H * F * E * 4 bytes per layer, times three, times layers.
  auto bytes = CheckedMul(o.hidden, o.ffn);
  if (bytes) bytes = CheckedMul(*bytes, o.experts);
  if (bytes) bytes = CheckedMul(*bytes, 12);
  if (bytes) bytes = CheckedMul(*bytes, o.layers);
  if (!bytes) return InvalidArgument("the model would exceed 2^64 bytes");
  return Status::Ok();
}

Result<SyntheticModelReport> WriteGguf(const SyntheticModelOptions& o) {
  std::vector<SynthTensor> tensors = PlanTensors(o, true);
  GgufWriter writer(3);
  writer.AddString("general.architecture", "synthmoe");
  writer.AddString("general.name", "synthmoe (expert-arena gen-model)");
  writer.SetAlignment(32);
  writer.AddU32("synthmoe.block_count", static_cast<uint32_t>(o.layers));
  writer.AddU32("synthmoe.expert_count", static_cast<uint32_t>(o.experts));
  writer.AddU32("synthmoe.expert_used_count",
                static_cast<uint32_t>(std::min<uint64_t>(2, o.experts)));
  writer.AddU32("synthmoe.embedding_length", static_cast<uint32_t>(o.hidden));
  writer.AddU32("synthmoe.expert_feed_forward_length", static_cast<uint32_t>(o.ffn));
  writer.AddU64("synthmoe.seed", o.seed);
  SyntheticModelReport report;
  for (const SynthTensor& t : tensors) {
    EA_RETURN_IF_ERROR(writer.AddTensor(t.name, *FindGgmlTypeByName(t.dtype), t.shape));
    const GgufTensorInfo& info = writer.tensors().back();
    report.tensor_bytes += info.bytes;
    if (IsExpert(t.role)) {
      report.expert_tensors++;
      report.expert_bytes += info.bytes;
    }
  }
  EA_RETURN_IF_ERROR(
      writer.WriteFile(o.out, [&](size_t i, uint64_t offset, std::span<std::byte> out) {
        FillTensor(tensors[i], offset, out);
        return Status::Ok();
      }));
  report.files.push_back(o.out);
  report.file_bytes = writer.file_bytes();
  report.tensors = tensors.size();
  return report;
}

Result<SyntheticModelReport> WriteSafetensors(const SyntheticModelOptions& o) {
  std::vector<SynthTensor> tensors = PlanTensors(o, false);
  if (o.shards > tensors.size()) {
    return InvalidArgument("--shards " + std::to_string(o.shards) + " exceeds the " +
                           std::to_string(tensors.size()) + " tensors of the model");
  }
  SyntheticModelReport report;
  std::vector<uint64_t> bytes(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string dtype = SafetensorsDtypeName(tensors[i].dtype);
    std::string why;
    auto b = SafetensorsTensorBytes(*FindSafetensorsDtype(dtype), tensors[i].shape, &why);
    if (!b) return InvalidArgument("tensor " + tensors[i].name + ": " + why);
    bytes[i] = *b;
    report.tensor_bytes += *b;
    if (IsExpert(tensors[i].role)) {
      report.expert_tensors++;
      report.expert_bytes += *b;
    }
  }
  // Contiguous runs of tensors of about equal bytes, at least one per shard: a tensor goes to
  // the shard its starting byte falls in, never skipping a shard, leaving one for each shard
  // still to fill.
  std::vector<size_t> shard_of(tensors.size());
  {
    const size_t n = tensors.size(), k = o.shards;
    unsigned __int128 cumulative = 0;
    size_t prev = 0;
    for (size_t i = 0; i < n; ++i) {
      size_t want = report.tensor_bytes == 0 ? 0
                                             : static_cast<size_t>(std::min<unsigned __int128>(
                                                   k - 1, cumulative * k / report.tensor_bytes));
      want = std::max(want, k - std::min(k, n - i));
      want = std::min(want, i == 0 ? size_t{0} : prev + 1);
      want = std::max(want, prev);
      shard_of[i] = prev = want;
      cumulative += bytes[i];
    }
  }
  std::vector<std::string> shard_paths;
  if (o.shards == 1) {
    std::error_code ec;
    std::string path = std::filesystem::is_directory(o.out, ec)
                           ? (std::filesystem::path(o.out) / "model.safetensors").string()
                           : o.out;
    shard_paths.push_back(path);
  } else {
    EA_RETURN_IF_ERROR(platform::MakeDirectories(o.out, 0755));
    for (uint32_t s = 0; s < o.shards; ++s) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05u-of-%05u.safetensors", s + 1, o.shards);
      shard_paths.push_back((std::filesystem::path(o.out) / name).string());
    }
  }
  std::map<std::string, std::string> weight_map;
  for (uint32_t s = 0; s < o.shards; ++s) {
    SafetensorsWriter writer;
    writer.AddMetadata("format", "pt");
    writer.AddMetadata("generator", "expert-arena gen-model (synthmoe)");
    std::vector<size_t> members;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (shard_of[i] != s) continue;
      members.push_back(i);
      EA_RETURN_IF_ERROR(writer.AddTensor(tensors[i].name, SafetensorsDtypeName(tensors[i].dtype),
                                          tensors[i].shape));
      weight_map[tensors[i].name] = std::filesystem::path(shard_paths[s]).filename().string();
    }
    EA_RETURN_IF_ERROR(
        writer.WriteFile(shard_paths[s], [&](size_t k, uint64_t offset, std::span<std::byte> out) {
          FillTensor(tensors[members[k]], offset, out);
          return Status::Ok();
        }));
    report.files.push_back(shard_paths[s]);
    report.file_bytes += writer.file_bytes();
  }
  if (o.shards > 1) {
    std::string index = (std::filesystem::path(o.out) / kSafetensorsIndexName).string();
    EA_RETURN_IF_ERROR(WriteSafetensorsIndex(index, report.tensor_bytes, weight_map));
    report.files.push_back(index);
  }
  report.tensors = tensors.size();
  return report;
}

}  // namespace

uint64_t SyntheticTensorSeed(std::string_view name, uint64_t seed) {
  return XXH3_64bits_withSeed(name.data(), name.size(), seed);
}

float SyntheticValue(uint64_t tensor_seed, uint64_t index) {
  uint64_t r = Mix(tensor_seed + (index + 1) * 0x9e3779b97f4a7c15ull);
  double unit = static_cast<double>(r >> 40) * (1.0 / 16777216.0);  // [0, 1)
  return static_cast<float>(unit * 0.1 - 0.05);
}

uint16_t FloatToHalf(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t fexp = (x >> 23) & 0xff;
  uint32_t mant = x & 0x7fffff;
  if (fexp == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  const int32_t exp = static_cast<int32_t>(fexp) - 127 + 15;
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;  // a carry rounds up the exponent
  return static_cast<uint16_t>(half);
}

uint16_t FloatToBFloat16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -out : out;
  }
  uint32_t x = exp == 31 ? (sign | 0x7f800000 | (mant << 13))
                         : (sign | ((exp - 15 + 127) << 23) | (mant << 13));
  std::memcpy(&out, &x, 4);
  return out;
}

void FillSyntheticTensor(std::string_view dtype, uint64_t tensor_seed, bool norm, uint64_t offset,
                         std::span<std::byte> out) {
  SynthTensor t{"", norm ? Role::kNorm : Role::kExpert, std::string(dtype), {}, tensor_seed};
  FillTensor(t, offset, out);
}

uint8_t FloatToE4M3(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80);
  if (std::isnan(value)) return static_cast<uint8_t>(sign | 0x7f);
  float a = std::fabs(value);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);  // saturate (no infinity)
  if (a < std::ldexp(1.0f, -6)) {
    // Subnormal: steps of 2^-9; 8 steps round up into the smallest normal (exponent field 1).
    int m = static_cast<int>(std::nearbyint(a * 512.0f));
    return static_cast<uint8_t>(sign | m);
  }
  int e = 0;
  float frac = std::frexp(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  int exponent = e - 1;             // a = (2 * frac) * 2^exponent
  int mant = static_cast<int>(std::nearbyint((2.0f * frac - 1.0f) * 8.0f));
  if (mant == 8) {
    mant = 0;
    ++exponent;
  }
  int field = exponent + 7;
  if (field > 15 || (field == 15 && mant > 6)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (field << 3) | mant);
}

float E4M3ToFloat(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int field = (v >> 3) & 0xf;
  const int mant = v & 7;
  if (field == 15 && mant == 7) return std::numeric_limits<float>::quiet_NaN();
  if (field == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, field - 7);
}

Status ApplyLayoutDefaults(SyntheticModelOptions& o) {
  if (o.layout == "synthetic") {
    if (o.dtype.empty()) o.dtype = "f32";
    return Status::Ok();
  }
  const LayoutInfo* info = FindLayout(o.layout);
  if (info == nullptr) {
    return InvalidArgument("--layout must be synthetic, deepseek-v3, qwen3-moe or mixtral, not " +
                           o.layout);
  }
  if (o.layers == 0) o.layers = info->layers;
  if (o.experts == 0) o.experts = info->experts;
  // The GGUF writer (layout_gguf.cc) needs a hidden size that is a multiple of 32.
  const bool gguf = o.format == "gguf";
  if (o.hidden == 0) o.hidden = gguf ? kLayoutDefaultGgufHidden : kLayoutDefaultHidden;
  if (o.ffn == 0) o.ffn = gguf ? kLayoutDefaultGgufHidden : kLayoutDefaultFfn;
  if (o.dtype.empty()) o.dtype = gguf ? "f32" : info->dtype;
  return Status::Ok();
}

Result<SyntheticModelReport> WriteSyntheticModel(const SyntheticModelOptions& given) {
  SyntheticModelOptions options = given;
  EA_RETURN_IF_ERROR(ApplyLayoutDefaults(options));
  EA_RETURN_IF_ERROR(CheckOptions(options));
  if (options.format == "gguf") {
    return options.layout == "synthetic" ? WriteGguf(options) : WriteLayoutGguf(options);
  }
  return WriteSafetensors(options);
}

}  // namespace expert_arena::source
