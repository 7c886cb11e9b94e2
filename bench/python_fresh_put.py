#!/usr/bin/env python3
"""python_fresh_put: does a freshly made source tensor make StreamProducer.put slower?

One process, one 64 MiB put at a time (opened and released right after), the put alone timed,
with the page faults (ru_minflt) and involuntary context switches (ru_nivcsw) the put took:
  fresh       torch.empty + fill_ just before the put (what python_bench's "fresh" round puts)
  reused      one source tensor made at the start, put again and again
  fresh_aged  made, then 50 ms of sleep before the put
  np_fresh    numpy.empty + fill just before the put
  fresh_read  made, then read once (sum) before the put
See docs/python.md "Benchmark" for the results and how they were read.

    flock /tmp/expert-arena-bench.lock env PYTHONPATH=build/python /usr/bin/python3 \\
        bench/python_fresh_put.py [--rounds 12] [--dir /dev/shm]
"""

import argparse
import resource
import statistics
import sys
import time

import numpy as np
import torch

import expert_arena

N = 64 << 20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    producer = expert_arena.StreamProducer(args.dir, "freshput", segment_bytes=128 << 20,
                                           max_segments=2, spill_directory=args.dir, quiet=True)
    consumer = expert_arena.StreamConsumer(args.dir, quiet=True)
    source = torch.empty(N, dtype=torch.uint8).fill_(7)
    kinds = ("fresh", "reused", "fresh_aged", "np_fresh", "fresh_read")
    times = {k: [] for k in kinds}
    faults = {k: [] for k in kinds}
    switches = {k: [] for k in kinds}
    seq = 0

    def put(kind, x):
        nonlocal seq
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        d = producer.put("k%d" % seq, x)
        t1 = time.perf_counter()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        seq += 1
        t = consumer.open(d)
        t.numpy()
        t.release()
        times[kind].append(t1 - t0)
        faults[kind].append(r1.ru_minflt - r0.ru_minflt)
        switches[kind].append(r1.ru_nivcsw - r0.ru_nivcsw)

    try:
        for r in range(args.rounds + 2):
            x = torch.empty(N, dtype=torch.uint8).fill_(r)
            put("fresh", x)
            del x
            put("reused", source)
            x = torch.empty(N, dtype=torch.uint8).fill_(r)
            time.sleep(0.05)
            put("fresh_aged", x)
            del x
            x = np.empty(N, dtype=np.uint8)
            x.fill(r)
            put("np_fresh", x)
            del x
            x = torch.empty(N, dtype=torch.uint8).fill_(r)
            x.sum()
            put("fresh_read", x)
            del x
    finally:
        producer.close()
    print("| source | put median (64 MiB) | page faults in the put | involuntary switches |")
    print("|---|---|---|---|")
    for k in kinds:
        print("| %s | %.2f ms | %d | %d |" % (k, statistics.median(times[k][2:]) * 1e3,
                                             statistics.median(faults[k][2:]),
                                             statistics.median(switches[k][2:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
