#include "source/synthetic_model.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "platform/file.h"
#include "source/dtypes.h"
#include "source/gguf_writer.h"
#include "source/safetensors_writer.h"

namespace expert_arena::source {
namespace {

constexpr uint64_t kVocab = 64;

enum class Role { kEmbedding, kNorm, kRouter, kExpert };

struct SynthTensor {
  std::string name;
  Role role;
  std::string dtype;            // f32, f16, bf16, q8_0
  std::vector<uint64_t> shape;  // GGUF: ne order; safetensors: header order
  uint64_t seed = 0;
};

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float ValueFor(const SynthTensor& t, uint64_t index) {
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

std::vector<SynthTensor> PlanTensors(const SyntheticModelOptions& o, bool gguf) {
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
  if (o.dtype != "f32" && o.dtype != "f16" && o.dtype != "bf16" && o.dtype != "q8_0") {
    return InvalidArgument("--dtype must be f32, f16, bf16 or q8_0, not " + o.dtype);
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
    if (t.role == Role::kExpert) {
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
    if (tensors[i].role == Role::kExpert) {
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

Result<SyntheticModelReport> WriteSyntheticModel(const SyntheticModelOptions& options) {
  EA_RETURN_IF_ERROR(CheckOptions(options));
  if (options.layout != "synthetic") {
    if (options.format != "gguf") {
      return InvalidArgument("--layout " + options.layout +
                             " is written as GGUF here; use --format gguf");
    }
    return WriteLayoutGguf(options);
  }
  return options.format == "gguf" ? WriteGguf(options) : WriteSafetensors(options);
}

}  // namespace expert_arena::source
