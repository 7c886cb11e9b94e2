// moe-engine's arithmetic and expert discovery, without processes: dtype decoding, the
// matrix-vector product for every weight dtype, the expert table from GGUF and safetensors
// names, and the forward pass against a reference computed here in double precision.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "expert_table.h"
#include "forward.h"
#include "kernels.h"
#include "test_util.h"

namespace expert_arena::moe {
namespace {

// ---- encoders for test weights (values chosen exactly representable) --------------------

uint16_t FloatToHalfExact(float f) {
  // Only for values that are normal halves with <= 11 significant bits.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t sign = (bits >> 16) & 0x8000u;
  if ((bits & 0x7fffffffu) == 0) return static_cast<uint16_t>(sign);
  int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = (bits >> 13) & 0x3ffu;
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(exponent) << 10 | mantissa);
}

uint16_t FloatToBf16Exact(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// Encodes rows x cols values (row-major) in `dtype`. For q8_0 every block's scale is 1/8 and
// values are q/8 for integer q in [-127, 127]; other dtypes get the values as given.
std::vector<std::byte> Encode(Dtype dtype, const std::vector<float>& values, uint64_t rows,
                              uint64_t cols) {
  uint64_t row_bytes = *RowBytes(dtype, cols);
  std::vector<std::byte> out(rows * row_bytes);
  for (uint64_t r = 0; r < rows; ++r) {
    std::byte* p = out.data() + r * row_bytes;
    for (uint64_t c = 0; c < cols; ++c) {
      float v = values[r * cols + c];
      switch (dtype) {
        case Dtype::kF32:
          std::memcpy(p + 4 * c, &v, 4);
          break;
        case Dtype::kF16: {
          uint16_t h = FloatToHalfExact(v);
          std::memcpy(p + 2 * c, &h, 2);
          break;
        }
        case Dtype::kBF16: {
          uint16_t b = FloatToBf16Exact(v);
          std::memcpy(p + 2 * c, &b, 2);
          break;
        }
        case Dtype::kQ8_0: {
          std::byte* block = p + (c / 32) * kQ8_0BlockBytes;
          uint16_t d = FloatToHalfExact(0.125f);
          std::memcpy(block, &d, 2);
          auto q = static_cast<int8_t>(std::lround(v * 8));
          std::memcpy(block + 2 + c % 32, &q, 1);
          break;
        }
      }
    }
  }
  return out;
}

// Values k/8 with |k| <= 127: exact in every dtype above.
std::vector<float> SmallValues(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-127, 127);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(dist(rng)) / 8.0f;
  return v;
}

TEST(KernelsTest, HalfAndBf16Decode) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
  EXPECT_EQ(HalfToFloat(0x8000), -0.0f);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc040), -3.0f);
}

// The F16C path (when the CPU has it) and the table give the same bits for every half.
TEST(KernelsTest, EveryHalfDecodesToTheSameBitsInARow) {
  std::vector<uint16_t> halves(65536);
  for (uint32_t i = 0; i < 65536; ++i) halves[i] = static_cast<uint16_t>(i);
  Matrix m{reinterpret_cast<const std::byte*>(halves.data()), Dtype::kF16, 1, 65536, 65536 * 2};
  std::vector<float> row(65536);
  DecodeRow(m, 0, row.data());
  for (uint32_t i = 0; i < 65536; ++i) {
    float expected = HalfToFloat(static_cast<uint16_t>(i));
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(row[i])) << std::hex << i;
    } else {
      ASSERT_EQ(std::memcmp(&row[i], &expected, 4), 0) << std::hex << i;
    }
  }
}

TEST(KernelsTest, DtypeNamesAndRowBytes) {
  EXPECT_EQ(ParseDtype("f16"), Dtype::kF16);
  EXPECT_EQ(ParseDtype("F16"), Dtype::kF16);
  EXPECT_EQ(ParseDtype("BF16"), Dtype::kBF16);
  EXPECT_EQ(ParseDtype("q8_0"), Dtype::kQ8_0);
  EXPECT_EQ(ParseDtype("F32"), Dtype::kF32);
  EXPECT_FALSE(ParseDtype("q4_0").has_value());
  EXPECT_EQ(RowBytes(Dtype::kF32, 10), 40u);
  EXPECT_EQ(RowBytes(Dtype::kBF16, 10), 20u);
  EXPECT_EQ(RowBytes(Dtype::kQ8_0, 64), 68u);
  EXPECT_FALSE(RowBytes(Dtype::kQ8_0, 33).has_value());
  EXPECT_FALSE(RowBytes(Dtype::kF32, UINT64_MAX / 2).has_value());
}

class MatVecTest : public ::testing::TestWithParam<Dtype> {};

TEST_P(MatVecTest, MatchesDoublePrecisionReference) {
  const uint64_t rows = 24, cols = 96;
  std::vector<float> w = SmallValues(rows * cols, 7);
  std::vector<float> x = SmallValues(cols, 8);
  std::vector<std::byte> bytes = Encode(GetParam(), w, rows, cols);
  Matrix m{bytes.data(), GetParam(), rows, cols, *RowBytes(GetParam(), cols)};
  std::vector<float> row(cols);
  DecodeRow(m, 5, row.data());
  for (uint64_t c = 0; c < cols; ++c) ASSERT_EQ(row[c], w[5 * cols + c]) << c;
  std::vector<float> y(rows);
  MatVec(m, x.data(), y.data());
  for (uint64_t r = 0; r < rows; ++r) {
    double ref = 0;
    for (uint64_t c = 0; c < cols; ++c) ref += double(w[r * cols + c]) * double(x[c]);
    // Products of k/8 values are multiples of 1/64 and the sums stay far below 2^24/64, so
    // float arithmetic is exact here whatever the order.
    EXPECT_EQ(y[r], static_cast<float>(ref)) << "row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, MatVecTest,
                         ::testing::Values(Dtype::kF32, Dtype::kF16, Dtype::kBF16, Dtype::kQ8_0),
                         [](const auto& info) { return std::string(DtypeName(info.param)); });

TEST(KernelsTest, DotOrderIsFixed) {
  std::vector<float> a(1000), b(1000);
  for (int i = 0; i < 1000; ++i) {
    a[i] = 1.0f / static_cast<float>(i + 1);
    b[i] = static_cast<float>(i % 7) - 3.1f;
  }
  float first = Dot(a.data(), b.data(), a.size());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Dot(a.data(), b.data(), a.size()), first);
}

// ---- expert tables from views ------------------------------------------------------------

// Owns the bytes, names and shapes behind a list of TensorViews.
struct FakeTensors {
  struct Tensor {
    std::string name, dtype;
    std::vector<uint64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Tensor> tensors;
  void Add(std::string name, std::string dtype, std::vector<uint64_t> shape,
           std::vector<std::byte> bytes) {
    tensors.push_back({std::move(name), std::move(dtype), std::move(shape), std::move(bytes)});
  }
  std::vector<TensorView> Views() const {
    std::vector<TensorView> views;
    for (const auto& t : tensors) {
      TensorView v;
      v.name = t.name;
      v.dtype = t.dtype;
      v.shape = t.shape;
      v.bytes = t.bytes;
      views.push_back(v);
    }
    return views;
  }
};

// A GGUF-named model; expert e of layer l has every weight equal to `value(l, e)`.
FakeTensors GgufModel(uint64_t layers, uint64_t experts, uint64_t h, uint64_t f, Dtype dtype,
                      float (*value)(uint64_t, uint64_t)) {
  FakeTensors m;
  const char* dt = DtypeName(dtype);
  for (uint64_t l = 0; l < layers; ++l) {
    std::vector<float> gate(h * f * experts), down(f * h * experts);
    for (uint64_t e = 0; e < experts; ++e) {
      std::fill_n(gate.begin() + static_cast<ptrdiff_t>(e * h * f), h * f, value(l, e));
      std::fill_n(down.begin() + static_cast<ptrdiff_t>(e * h * f), h * f, value(l, e));
    }
    std::string p = "blk." + std::to_string(l) + ".ffn_";
    m.Add(p + "gate_exps.weight", dt, {h, f, experts}, Encode(dtype, gate, f * experts, h));
    m.Add(p + "up_exps.weight", dt, {h, f, experts}, Encode(dtype, gate, f * experts, h));
    m.Add(p + "down_exps.weight", dt, {f, h, experts}, Encode(dtype, down, h * experts, f));
  }
  m.Add("token_embd.weight", "f32", {h, 4}, std::vector<std::byte>(h * 16));
  return m;
}

float ByExpert(uint64_t l, uint64_t e) { return static_cast<float>(l * 4 + e + 1) / 8.0f; }

TEST(ExpertTableTest, GgufNamingSlabsPerExpert) {
  FakeTensors m = GgufModel(2, 3, 32, 64, Dtype::kQ8_0, ByExpert);
  auto views = m.Views();
  ASSERT_OK_AND_ASSIGN(ExpertTable table, ExpertTable::Build(views));
  EXPECT_EQ(table.naming(), "gguf");
  EXPECT_EQ(table.layers(), 2u);
  EXPECT_EQ(table.experts(), 3u);
  EXPECT_EQ(table.hidden(), 32u);
  EXPECT_EQ(table.ffn(), 64u);
  EXPECT_EQ(table.dtype_name(), "q8_0");
  for (uint64_t l = 0; l < 2; ++l) {
    for (uint64_t e = 0; e < 3; ++e) {
      const ExpertWeights& w = table.at(l, e);
      EXPECT_EQ(w.gate.rows, 64u);
      EXPECT_EQ(w.gate.cols, 32u);
      EXPECT_EQ(w.down.rows, 32u);
      EXPECT_EQ(w.down.cols, 64u);
      std::vector<float> row(64);
      DecodeRow(w.down, 31, row.data());
      EXPECT_EQ(row[63], ByExpert(l, e)) << l << "/" << e;
      DecodeRow(w.gate, 0, row.data());
      EXPECT_EQ(row[0], ByExpert(l, e));
    }
  }
  EXPECT_EQ(table.TotalBytes(), 2 * 3 * 3 * 64 * 34u);
}

TEST(ExpertTableTest, SafetensorsNaming) {
  FakeTensors m;
  const uint64_t h = 16, f = 8;
  for (uint64_t l = 0; l < 2; ++l) {
    for (uint64_t e = 0; e < 4; ++e) {
      std::string p = "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e);
      std::vector<float> v(h * f, ByExpert(l, e));
      m.Add(p + ".gate_proj.weight", "BF16", {f, h}, Encode(Dtype::kBF16, v, f, h));
      m.Add(p + ".up_proj.weight", "BF16", {f, h}, Encode(Dtype::kBF16, v, f, h));
      m.Add(p + ".down_proj.weight", "BF16", {h, f}, Encode(Dtype::kBF16, v, h, f));
    }
  }
  auto views = m.Views();
  ASSERT_OK_AND_ASSIGN(ExpertTable table, ExpertTable::Build(views));
  EXPECT_EQ(table.naming(), "safetensors");
  EXPECT_EQ(table.layers(), 2u);
  EXPECT_EQ(table.experts(), 4u);
  EXPECT_EQ(table.hidden(), h);
  EXPECT_EQ(table.ffn(), f);
  EXPECT_EQ(table.dtype_name(), "bf16");
  std::vector<float> row(h);
  DecodeRow(table.at(1, 3).up, 7, row.data());
  EXPECT_EQ(row[15], ByExpert(1, 3));
}

TEST(ExpertTableTest, ErrorsNameTheTensor) {
  {
    FakeTensors m = GgufModel(3, 2, 32, 32, Dtype::kF16, ByExpert);
    m.tensors.erase(m.tensors.begin() + 4);  // blk.1.ffn_up_exps.weight
    auto views = m.Views();
    auto t = ExpertTable::Build(views);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("blk.1.ffn_up_exps.weight is missing"), std::string::npos)
        << t.status().message();
  }
  {
    FakeTensors m = GgufModel(1, 2, 32, 32, Dtype::kF16, ByExpert);
    m.tensors[2].bytes.resize(m.tensors[2].bytes.size() - 2);
    auto views = m.Views();
    auto t = ExpertTable::Build(views);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("blk.0.ffn_down_exps.weight"), std::string::npos)
        << t.status().message();
  }
  {
    FakeTensors m = GgufModel(1, 2, 32, 32, Dtype::kF16, ByExpert);
    m.tensors[1].shape = {32, 16, 2};
    auto views = m.Views();
    auto t = ExpertTable::Build(views);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("blk.0.ffn_up_exps.weight: shape [32, 16, 2]"),
              std::string::npos)
        << t.status().message();
  }
  {
    FakeTensors m = GgufModel(1, 2, 32, 32, Dtype::kF16, ByExpert);
    m.tensors[0].dtype = "q4_k";
    auto views = m.Views();
    auto t = ExpertTable::Build(views);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("q4_k"), std::string::npos) << t.status().message();
  }
  {
    FakeTensors m;
    m.Add("model.safetensors", "u8", {100}, std::vector<std::byte>(100));
    auto views = m.Views();
    auto t = ExpertTable::Build(views);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
    EXPECT_NE(t.status().message().find("model.safetensors"), std::string::npos);
  }
}

// ---- the forward pass -------------------------------------------------------------------

double RefRms(const std::vector<double>& x) {
  double ss = 0;
  for (double v : x) ss += v * v;
  return 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + 1e-6);
}

TEST(ForwardTest, IdenticalExpertsMatchReference) {
  // Every expert is the same FFN, so routing weights (which sum to 1) do not change the
  // result: out = x + down(silu(gate xn) * (up xn)).
  const uint64_t h = 64, f = 32;
  std::vector<float> gate = SmallValues(f * h, 1), up = SmallValues(f * h, 2),
                     down = SmallValues(h * f, 3);
  for (float& v : gate) v /= 16;
  for (float& v : up) v /= 16;
  for (float& v : down) v /= 16;
  FakeTensors m;
  const uint64_t experts = 4;
  std::vector<float> gates, ups, downs;
  for (uint64_t e = 0; e < experts; ++e) {
    gates.insert(gates.end(), gate.begin(), gate.end());
    ups.insert(ups.end(), up.begin(), up.end());
    downs.insert(downs.end(), down.begin(), down.end());
  }
  m.Add("blk.0.ffn_gate_exps.weight", "f32", {h, f, experts},
        Encode(Dtype::kF32, gates, f * experts, h));
  m.Add("blk.0.ffn_up_exps.weight", "f32", {h, f, experts},
        Encode(Dtype::kF32, ups, f * experts, h));
  m.Add("blk.0.ffn_down_exps.weight", "f32", {f, h, experts},
        Encode(Dtype::kF32, downs, h * experts, f));
  auto views = m.Views();
  ASSERT_OK_AND_ASSIGN(ExpertTable table, ExpertTable::Build(views));
  ForwardOptions options;
  options.tokens = 3;
  options.top_k = 2;
  ASSERT_OK_AND_ASSIGN(ForwardResult result, RunForward(table, options));
  ASSERT_EQ(result.outputs.size(), 3 * h);
  EXPECT_EQ(result.expert_calls, 6u);
  for (uint64_t t = 0; t < 3; ++t) {
    std::vector<float> x0 = InitialState(options.seed, t, h);
    std::vector<double> x(x0.begin(), x0.end());
    double scale = RefRms(x);
    std::vector<double> xn(h), a(f);
    for (uint64_t i = 0; i < h; ++i) xn[i] = x[i] * scale;
    for (uint64_t r = 0; r < f; ++r) {
      double g = 0, u = 0;
      for (uint64_t c = 0; c < h; ++c) {
        g += gate[r * h + c] * xn[c];
        u += up[r * h + c] * xn[c];
      }
      a[r] = g / (1 + std::exp(-g)) * u;
    }
    for (uint64_t r = 0; r < h; ++r) {
      double y = 0;
      for (uint64_t c = 0; c < f; ++c) y += down[r * f + c] * a[c];
      EXPECT_NEAR(result.outputs[t * h + r], x[r] + y, 1e-3 * (1 + std::fabs(x[r] + y)))
          << "token " << t << " value " << r;
    }
  }
}

TEST(ForwardTest, ChecksumIndependentOfThreadsAndDtypeDecodesConsistently) {
  FakeTensors m = GgufModel(3, 8, 64, 96, Dtype::kF16,
                            [](uint64_t l, uint64_t e) { return (float(e) - 3.5f) / 64 + l; });
  auto views = m.Views();
  ASSERT_OK_AND_ASSIGN(ExpertTable table, ExpertTable::Build(views));
  ForwardOptions options;
  options.tokens = 17;
  ASSERT_OK_AND_ASSIGN(ForwardResult one, RunForward(table, options));
  options.threads = 3;
  ASSERT_OK_AND_ASSIGN(ForwardResult three, RunForward(table, options));
  EXPECT_EQ(one.checksum, three.checksum);
  EXPECT_EQ(one.outputs, three.outputs);
  EXPECT_EQ(one.expert_hits, three.expert_hits);
  uint64_t hits = 0;
  for (uint32_t h : one.expert_hits) hits += h;
  EXPECT_EQ(hits, 17u * 2 * 3);
  EXPECT_GT(one.experts_used, 2u);  // the router spreads tokens over experts
  for (float v : one.outputs) ASSERT_TRUE(std::isfinite(v));
  options.seed = 99;
  ASSERT_OK_AND_ASSIGN(ForwardResult other_seed, RunForward(table, options));
  EXPECT_NE(other_seed.checksum, one.checksum);
}

TEST(ForwardTest, RejectsBadTopK) {
  FakeTensors m = GgufModel(1, 2, 32, 32, Dtype::kF32, ByExpert);
  auto views = m.Views();
  ASSERT_OK_AND_ASSIGN(ExpertTable table, ExpertTable::Build(views));
  ForwardOptions options;
  options.top_k = 3;
  auto r = RunForward(table, options);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("top-k 3"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace expert_arena::moe
