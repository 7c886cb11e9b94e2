#include "forward.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <thread>

namespace expert_arena::moe {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A float in [-1, 1) with 24 random bits: exact, so no rounding mode can change it.
float UnitFloat(uint64_t& state) {
  return static_cast<float>(SplitMix64(state) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

void RmsNorm(const float* x, uint64_t n, float* out) {
  float ss = Dot(x, x, n);
  float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + 1e-6f);
  for (uint64_t i = 0; i < n; ++i) out[i] = x[i] * scale;
}

// The router projection of one layer: experts x hidden, scaled so scores stay O(1).
std::vector<float> RouterProjection(uint64_t seed, uint64_t layer, uint64_t experts,
                                    uint64_t hidden) {
  std::vector<float> r(experts * hidden);
  uint64_t state = seed ^ (0x726f75746572ull + layer * 0x100000001b3ull);
  float scale = 1.0f / std::sqrt(static_cast<float>(hidden));
  for (float& v : r) v = UnitFloat(state) * scale;
  return r;
}

// Per-thread buffers for one token's expert evaluation.
struct Scratch {
  std::vector<float> xn, scores, gate, up, out;
  std::vector<uint32_t> order;
};

// One layer for tokens [begin, end): reads and updates states[t * hidden ...].
void LayerForTokens(const ExpertTable& table, uint64_t layer, const std::vector<float>& router,
                    uint64_t top_k, uint64_t begin, uint64_t end, std::vector<float>& states,
                    std::vector<uint32_t>& chosen, Scratch& s) {
  const uint64_t h = table.hidden(), f = table.ffn(), e = table.experts();
  s.xn.resize(h);
  s.scores.resize(e);
  s.gate.resize(f);
  s.up.resize(f);
  s.out.resize(h);
  s.order.resize(e);
  for (uint64_t t = begin; t < end; ++t) {
    float* x = &states[t * h];
    RmsNorm(x, h, s.xn.data());
    for (uint64_t j = 0; j < e; ++j) s.scores[j] = Dot(&router[j * h], s.xn.data(), h);
    std::iota(s.order.begin(), s.order.end(), 0u);
    // Highest score first; equal scores go to the lower expert index.
    std::partial_sort(s.order.begin(), s.order.begin() + static_cast<ptrdiff_t>(top_k),
                      s.order.end(), [&](uint32_t a, uint32_t b) {
                        return s.scores[a] != s.scores[b] ? s.scores[a] > s.scores[b] : a < b;
                      });
    float top = s.scores[s.order[0]];
    float weights[64];
    float total = 0;
    for (uint64_t k = 0; k < top_k; ++k) {
      weights[k] = std::exp(s.scores[s.order[k]] - top);
      total += weights[k];
    }
    for (uint64_t k = 0; k < top_k; ++k) {
      uint32_t expert = s.order[k];
      chosen[t * top_k + k] = expert;
      const ExpertWeights& w = table.at(layer, expert);
      MatVec(w.gate, s.xn.data(), s.gate.data());
      MatVec(w.up, s.xn.data(), s.up.data());
      for (uint64_t i = 0; i < f; ++i) s.gate[i] = Silu(s.gate[i]) * s.up[i];
      MatVec(w.down, s.gate.data(), s.out.data());
      float weight = weights[k] / total;
      for (uint64_t i = 0; i < h; ++i) x[i] += weight * s.out[i];
    }
  }
}

}  // namespace

std::vector<float> InitialState(uint64_t seed, uint64_t token, uint64_t hidden) {
  std::vector<float> x(hidden);
  uint64_t state = seed ^ (token * 0x9e3779b97f4a7c15ull + 0x746f6b656eull);
  for (float& v : x) v = UnitFloat(state);
  return x;
}

Result<ForwardResult> RunForward(const ExpertTable& table, const ForwardOptions& options) {
  if (options.top_k == 0 || options.top_k > table.experts() || options.top_k > 64) {
    return InvalidArgument("top-k " + std::to_string(options.top_k) + " must be between 1 and " +
                           std::to_string(std::min<uint64_t>(64, table.experts())) +
                           " (the model has " + std::to_string(table.experts()) + " experts)");
  }
  if (options.tokens > (1ull << 24)) {
    return InvalidArgument("--tokens " + std::to_string(options.tokens) + " is more than 2^24");
  }
  auto start = std::chrono::steady_clock::now();
  const uint64_t h = table.hidden(), n = options.tokens, k = options.top_k;
  ForwardResult result;
  std::vector<float>& states = result.outputs;
  states.resize(n * h);
  for (uint64_t t = 0; t < n; ++t) {
    std::vector<float> x = InitialState(options.seed, t, h);
    std::copy(x.begin(), x.end(), states.begin() + static_cast<ptrdiff_t>(t * h));
  }
  result.expert_hits.assign(table.layers() * table.experts(), 0);
  unsigned threads = std::max(1u, std::min<unsigned>(options.threads, n > 0 ? n : 1));
  std::vector<Scratch> scratch(threads);
  std::vector<uint32_t> chosen(n * k);
  for (uint64_t l = 0; l < table.layers(); ++l) {
    std::vector<float> router = RouterProjection(options.seed, l, table.experts(), h);
    // Contiguous token ranges per thread: each token's arithmetic is the same whichever
    // thread runs it, so the result does not depend on the thread count.
    std::vector<std::thread> workers;
    for (unsigned i = 1; i < threads; ++i) {
      workers.emplace_back([&, i] {
        LayerForTokens(table, l, router, k, n * i / threads, n * (i + 1) / threads, states, chosen,
                       scratch[i]);
      });
    }
    LayerForTokens(table, l, router, k, 0, n / threads, states, chosen, scratch[0]);
    for (auto& w : workers) w.join();
    for (uint32_t expert : chosen) {
      ++result.expert_hits[l * table.experts() + expert];
      result.weight_bytes_read += table.ExpertBytes(l, expert);
    }
  }
  for (uint32_t hits : result.expert_hits) result.experts_used += hits > 0 ? 1 : 0;
  result.expert_calls = n * k * table.layers();
  result.checksum = XXH3_64bits(states.data(), states.size() * sizeof(float));
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace expert_arena::moe
