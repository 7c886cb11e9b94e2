// The forward pass of moe-engine: a deterministic stream of tokens routed top-k over the
// experts of every layer, each chosen expert's FFN computed on the CPU from the arena:
//
//   for each layer l:   xn = rmsnorm(x)
//                       scores = R_l xn        (R_l: a fixed seeded E x H projection; router
//                                               tensors are not in the arena by default)
//                       top-k experts, weights = softmax of their scores
//                       x += sum_k w_k * down( silu(gate xn) * (up xn) )
//
// Hidden states start as seeded pseudo-random values per token index. The output checksum
// (xxh3-64 of every token's final float state) is bit-identical wherever the same weights
// are read: the summation order is fixed and tokens are split between threads without
// changing any token's arithmetic.
//
// Thread-safety: RunForward is reentrant; it starts and joins its own worker threads.
#pragma once

#include <cstdint>
#include <vector>

#include "expert_arena/status.h"
#include "expert_table.h"

namespace expert_arena::moe {

struct ForwardOptions {
  uint64_t tokens = 32;
  uint64_t top_k = 2;      // experts per token and layer; 1 <= top_k <= experts
  uint64_t seed = 0x5eed;  // hidden states and router projections
  unsigned threads = 1;    // tokens are split between this many threads
};

struct ForwardResult {
  std::vector<float> outputs;         // tokens x hidden, each token's final state
  uint64_t checksum = 0;              // xxh3-64 of `outputs`
  std::vector<uint32_t> expert_hits;  // layers x experts: tokens routed to each expert
  uint64_t experts_used = 0;          // distinct (layer, expert) pairs with a hit
  uint64_t expert_calls = 0;          // FFN evaluations
  uint64_t weight_bytes_read = 0;     // arena bytes the FFNs read (per evaluation)
  double seconds = 0;
};

// Fails only on options that cannot work with this table (no tokens is fine: an empty
// output); the error names the option.
Result<ForwardResult> RunForward(const ExpertTable& table, const ForwardOptions& options);

// The hidden state a token starts from, for tests: `hidden` values in [-1, 1).
std::vector<float> InitialState(uint64_t seed, uint64_t token, uint64_t hidden);

}  // namespace expert_arena::moe
