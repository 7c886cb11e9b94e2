#!/usr/bin/env python3
"""python_view_bench: the per-op cost of an arena view against a plain tensor holding the same
values (docs/python.md "Benchmark"). Goal: a view within 1.2x of the plain tensor for indexing,
.float(), F.linear and matmul.

Three tensors of the same expert weight: a plain tensor (a clone), the default view
(`arena.torch(name)`, an ArenaTensor over the copy-on-write mapping: a torch.Tensor subclass whose
__torch_function__ is torch's disabled one, so no Python runs in its ops), and the guarded view
(`arena.torch(name, guard=True)`, a ReadOnlyTensor whose ops pass through __torch_function__).
Each op runs --number times per sample, the three tensors' samples taken in turn; the table gives
the best of --repeat samples per op. Short samples, many of them (60 x 500 calls, about 0.5 ms
each): this VM's speed changes for seconds at a time, and a sample short enough to fall in a
quiet stretch gives the same figure run after run. The default weight is small (8 experts of
128 x 64), so that the per-call overhead, which is what a view could add, is most of each op's
time.

    flock /tmp/expert-arena-bench.lock /usr/bin/python3 bench/python_view_bench.py \\
        [--bin build/bin] [--dir /dev/shm] [--dtype f32] [--repeat 60] [--number 500] [--hidden 64] [--ffn 128]

Needs the package on PYTHONPATH (build/python) and torch (python3-torch).
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import expert_arena


def per_op_us(fns, repeat, number):
    """The best per-call microseconds of each of `fns` (the least disturbed sample, as timeit
    advises), sampled in turn (a load change on the
    machine hits all of them alike)."""
    samples = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            samples[i].append(timeit.timeit(fn, number=number))
    return [min(x) / number * 1e6 for x in samples]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="build/bin")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--dtype", default="f32", choices=("f32", "f16", "bf16"))
    parser.add_argument("--repeat", type=int, default=60)
    parser.add_argument("--number", type=int, default=500)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("python_view_bench: expert_arena %s, torch %s, Python %s, %s, %d CPUs, %s"
          % (expert_arena.__version__, torch.__version__, platform.python_version(),
             platform.platform(), os.cpu_count(),
             time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    work = tempfile.mkdtemp(prefix="ea-viewbench-", dir=args.dir)
    model = os.path.join(work, "m.gguf")
    path = os.path.join(work, "m.arena")
    try:
        subprocess.run([os.path.join(args.bin, "expert-arena"), "gen-model", "--format", "gguf",
                        "--out", model, "--layers", "1", "--experts", "8", "--hidden",
                        str(args.hidden), "--ffn", str(args.ffn), "--dtype", args.dtype],
                       check=True, stdout=subprocess.DEVNULL)
        with expert_arena.open(model, shared_path=path, quiet=True) as arena:
            name = [n for n in arena.names() if "up" in n][0]
            view = arena.torch(name)
            guarded = arena.torch(name, guard=True)
            plain = view.clone()
            x = torch.randn(4, view.shape[-1]).to(view.dtype)
            xf = x.float()
            ops = [
                ("W[3]", lambda t: t[3]),
                (".float()", lambda t: t.float()),
                ("F.linear(x, W[3])", lambda t: F.linear(x, t[3])),
                ("matmul(x, W[3].t())", lambda t: torch.matmul(x, t[3].t())),
                ("F.linear(x, W[3].float())", lambda t: F.linear(xf, t[3].float())),
            ]
            print("\nPer-op cost, %s expert weight %s (best of %d x %d, one torch thread):\n"
                  % (args.dtype, list(view.shape), args.repeat, args.number))
            print("| op | plain tensor | view | view / plain | guarded view | guarded / plain |")
            print("|---|---|---|---|---|---|")
            for label, op in ops:
                try:
                    op(plain)
                except RuntimeError as e:  # f16 matmul on a CPU torch that lacks it
                    print("| %s | (%s) | | | | |" % (label, str(e).splitlines()[0][:60]))
                    continue
                p, v, g = per_op_us([lambda: op(plain), lambda: op(view), lambda: op(guarded)],
                                    args.repeat, args.number)
                print("| %s | %.2f us | %.2f us | %.2fx | %.2f us | %.2fx |"
                      % (label, p, v, v / p, g, g / p))
                assert torch.equal(op(plain), op(view))
    finally:
        for f in (model, path):
            if os.path.exists(f):
                os.unlink(f)
        os.rmdir(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
