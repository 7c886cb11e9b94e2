#!/usr/bin/env python3
"""moe_engine.py: the Python example engine (PyTorch on the CPU) over expert_arena.

The same MoE forward as the C++ `moe-engine` (tools/moe-engine/forward.cc): hidden states start
as seeded pseudo-random values per token; per layer, x is RMS-normalised, scored against a
seeded router projection (E x H), the top-k experts are chosen (highest score first, ties to
the lower index), softmax-weighted over those k, and each expert's FFN
down(silu(gate(xn)) * up(xn)) is added to x in rank order. Experts are read from the arena's
zero-copy torch views (f32 directly; f16/bf16/q8_0 decoded per expert as it is first used).

    moe_engine.py --model model.gguf [--shared-expert-arena /dev/shm/model.arena]
                  [--tokens 32] [--top-k 2] [--seed 24301] [--json] [--outputs FILE]

It prints the arena's start line and an output checksum (xxh3-64 of the final states,
tokens x hidden float32): the same with and without --shared-expert-arena, whether this engine
loaded or attached. Against `moe-engine` on the same model, seed and tokens the states agree
to a relative tolerance of 1e-4 (max |a - b| <= 1e-4 x max(1, max |b|)), not bit for bit:
torch sums dot products in another order than moe-engine's kernels. A Python engine and
`moe-engine` share one arena file: whichever starts first loads, the other attaches.

Exit codes: 0 success, 1 a refusal or failure (the message says which), 2 bad usage.
"""

import argparse
import json
import os
import re
import sys
import time

import numpy as np

import expert_arena

try:
    import torch
except ImportError:
    sys.exit("moe_engine.py: needs PyTorch: install python3-torch (Debian) or `pip install torch`")

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
GGUF_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
ST_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def unit_floats(state, n):
    """n values of forward.cc's UnitFloat from a SplitMix64 stream starting at `state`."""
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(state) + i * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    # 24 random bits times 2^-23, minus 1: exact in float32, as in the C++.
    return ((z >> np.uint64(40)).astype(np.float64) * (2.0 / 16777216.0) - 1.0).astype(np.float32)


def initial_states(seed, tokens, hidden):
    rows = [unit_floats(seed ^ ((t * GOLDEN + 0x746F6B656E) & MASK64), hidden)
            for t in range(tokens)]
    return torch.from_numpy(np.stack(rows) if rows else np.zeros((0, hidden), np.float32))


def router_projection(seed, layer, experts, hidden):
    state = seed ^ ((0x726F75746572 + layer * 0x100000001B3) & MASK64)
    scale = np.float32(1.0) / np.sqrt(np.float32(hidden))
    r = unit_floats(state, experts * hidden) * scale
    return torch.from_numpy(r.reshape(experts, hidden))


def q8_0_to_float(raw, rows, cols):
    """ggml q8_0 rows (blocks of an f16 scale and 32 int8) to float32: d * q, as ggml."""
    blocks = raw.reshape(rows, cols // 32, 34)
    d = blocks[:, :, :2].contiguous().view(torch.float16).float()
    q = blocks[:, :, 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(rows, cols)


class ExpertTable:
    """gate/up/down matrices per (layer, expert) over the arena's torch views."""

    def __init__(self, arena):
        self.views = {}
        gguf, st = {}, {}
        for name in arena.names():
            m = GGUF_NAME.match(name)
            if m:
                gguf[(int(m.group(1)), m.group(2))] = name
                continue
            m = ST_NAME.match(name)
            if m:
                st[(int(m.group(1)), int(m.group(2)), m.group(3))] = name
        if not gguf and not st:
            raise ValueError("no routed-expert tensors (blk.N.ffn_{gate,up,down}_exps.weight or "
                             "model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight) among "
                             "%d tensors" % len(arena))
        if gguf and st:
            raise ValueError("expert tensors of both GGUF and safetensors naming in one arena")
        self.arena = arena
        self.cache = {}
        if gguf:
            self.naming = "gguf"
            self.layers = 1 + max(l for l, _ in gguf)
            first = arena.info(gguf[(0, "gate")])
            self.hidden, self.ffn, self.experts = first["shape"]
            self.names = gguf
        else:
            self.naming = "safetensors"
            self.layers = 1 + max(l for l, _, _ in st)
            self.experts = 1 + max(e for _, e, _ in st)
            first = arena.info(st[(0, 0, "gate")])
            self.ffn, self.hidden = first["shape"]
            self.names = st
        self.dtype = first["dtype"].lower()
        if self.dtype not in ("f32", "f16", "bf16", "q8_0"):
            raise ValueError("tensor %s: dtype %s is not one moe_engine.py computes with "
                             "(f32, f16, bf16, q8_0)" % (first["name"], first["dtype"]))

    def _matrix(self, name, index, rows, cols):
        t = self.arena.torch(name)
        if index is not None:
            t = t[index]
        if self.dtype == "q8_0":
            return q8_0_to_float(t, rows, cols)
        return t.reshape(rows, cols).float()  # f32: the view itself; f16/bf16: decoded

    def weights(self, layer, expert):
        key = (layer, expert)
        w = self.cache.get(key)
        if w is None:
            h, f = self.hidden, self.ffn
            if self.naming == "gguf":
                names = [self.names.get((layer, k)) for k in ("gate", "up", "down")]
                idx = expert
            else:
                names = [self.names.get((layer, expert, k)) for k in ("gate", "up", "down")]
                idx = None
            if None in names:
                raise ValueError("layer %d expert %d: a gate, up or down tensor is missing"
                                 % (layer, expert))
            w = (self._matrix(names[0], idx, f, h), self._matrix(names[1], idx, f, h),
                 self._matrix(names[2], idx, h, f))
            self.cache[key] = w
        return w


def forward(table, tokens, top_k, seed):
    h, e = table.hidden, table.experts
    if not 1 <= top_k <= min(64, e):
        raise ValueError("top-k %d must be between 1 and %d (the model has %d experts)"
                         % (top_k, min(64, e), e))
    x = initial_states(seed, tokens, h)
    hits = np.zeros((table.layers, e), dtype=np.int64)
    for layer in range(table.layers):
        router = router_projection(seed, layer, e, h)
        xn = x * torch.rsqrt((x * x).sum(dim=1, keepdim=True) / h + 1e-6)
        scores = xn @ router.t()
        # Highest score first, ties to the lower expert index (a stable sort of -score).
        order = torch.sort(-scores, dim=1, stable=True).indices[:, :top_k]
        top = torch.gather(scores, 1, order)
        weights = torch.exp(top - top[:, :1])
        weights = weights / weights.sum(dim=1, keepdim=True)
        for k in range(top_k):  # rank order, as moe-engine adds them
            chosen = order[:, k]
            for expert in torch.unique(chosen).tolist():
                rows = (chosen == expert).nonzero(as_tuple=True)[0]
                gate, up, down = table.weights(layer, expert)
                a = xn[rows]
                act = torch.nn.functional.silu(a @ gate.t()) * (a @ up.t())
                x[rows] += weights[rows, k:k + 1] * (act @ down.t())
                hits[layer, expert] += rows.numel()
    return x, hits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True,
                        help="model file (repeat for shards or a split GGUF)")
    parser.add_argument("--shared-expert-arena", metavar="PATH",
                        help="share one RAM copy of the experts through this arena file")
    parser.add_argument("--arena-wait-timeout", type=float, default=600.0)
    parser.add_argument("--arena-huge", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--gpu", default="none", help="register the arena with this device")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0x5EED)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--outputs", help="write the final states (float32) to this file")
    parser.add_argument("--hold", action="store_true",
                        help="after printing, keep the arena mapped until stdin closes")
    args = parser.parse_args()
    if not 0 <= args.tokens <= 1 << 24:
        parser.error("--tokens must be between 0 and 2^24")
    torch.set_num_threads(max(1, args.threads))

    try:
        arena = expert_arena.open(args.model, shared_path=args.shared_expert_arena,
                                  gpu=args.gpu, huge=args.arena_huge,
                                  wait_timeout=args.arena_wait_timeout, quiet=True)
    except (OSError, ValueError) as e:
        print("moe_engine.py: %s" % e, file=sys.stderr)
        return 1
    with arena:
        report = arena.report
        try:
            table = ExpertTable(arena)
            start = time.monotonic()
            x, hits = forward(table, args.tokens, args.top_k, args.seed)
            seconds = time.monotonic() - start
        except (ValueError, KeyError) as e:
            print("moe_engine.py: %s" % e, file=sys.stderr)
            return 1
        outputs = x.numpy()
        checksum = "%016x" % expert_arena.xxh3_64(outputs)
        if args.outputs:
            outputs.tofile(args.outputs)
        if args.json:
            print(json.dumps({
                "role": report["role"], "checksum": checksum, "seconds": report["seconds"],
                "bytes_read": report["bytes_read"], "huge_bytes": report["huge_bytes"],
                "arena": report["path"], "tensors": report["tensors"],
                "tensor_bytes": report["tensor_bytes"], "naming": table.naming,
                "layers": table.layers, "experts": table.experts, "hidden": table.hidden,
                "ffn": table.ffn, "dtype": table.dtype, "tokens": args.tokens,
                "top_k": args.top_k, "experts_used": int((hits > 0).sum()),
                "compute_seconds": seconds, "pid": os.getpid(),
                "start_line": report["start_line"]}))
        else:
            print("moe_engine.py: %s" % report["start_line"])
            print("moe_engine.py: %s model, %d layers x %d experts, hidden %d, ffn %d, %s"
                  % (table.naming, table.layers, table.experts, table.hidden, table.ffn,
                     table.dtype))
            print("moe_engine.py: %d tokens, top-%d: %d of %d experts used in %.3f s"
                  % (args.tokens, args.top_k, int((hits > 0).sum()), table.layers * table.experts,
                     seconds))
            print("moe_engine.py: checksum %s" % checksum)
        sys.stdout.flush()
        if args.hold:
            sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
