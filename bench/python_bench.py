#!/usr/bin/env python3
"""python_bench: the Python package against the C++ library and against what a Python engine
uses today, in one run (docs/python.md "Benchmark" has results and how to read them).

1. Attach: an engine attaching to a published arena, from Python (expert_arena.open with the
   model, wall time around the call, and expert_arena.attach without it) vs the C++ attach
   (`expert-arena load` of the same model and arena: the report's seconds, Arena::Open to
   ready). Median of --attach-runs. Goal: Python within 5 ms of C++.
2. Stream round, on the field's shapes (32 x 64 KiB, 4 x 2 MiB, 1 x 64 MiB): a producer process
   puts every tensor of the shape and sends the descriptors over a multiprocessing pipe; a
   consumer process opens each as a NumPy view, releases it, and acknowledges the round.
   - "fresh": each round's tensors are new (torch.empty + fill_, made before the clock
     starts; with --fresh-source numpy-thp, torch over NumPy memory, which NumPy puts on
     transparent huge pages), as an engine hands over new activations; the peer, a torch.multiprocessing
     queue in the same two processes, carries the same fresh tensors (put -> get, then the
     same ack; the queue moves each new tensor's storage into shared memory). The queue's
     rounds are interleaved with the stream's (one after every fifth for the small shapes),
     so that both medians come from the same stretch of a machine whose speed drifts.
     Goal: the stream >= 20x faster than the queue for every shape.
   - "in place": each round's fresh tensors are made in reservations (producer.reserve, the
     fill not timed, then publish): no copy; against the same queue, also with the making
     (torch.empty + fill_ for the queue, reserve + fill_ for the stream) in the time.
     "in place, torch views": the same with the consumer taking torch views
     (open_many(view="torch")) and indexing each once, as a torch engine reads them.
   - "reused": the producer puts the same source tensor each time, as `stream_bench` does,
     with put_many + open_many(view="numpy") (one call per batch each side) and with one
     put/open/numpy/release per tensor; compared with the C++ `stream_bench` zero-copy view round measured in the same
     run. Goal: within 1.5x of C++.

    flock /tmp/expert-arena-bench.lock /usr/bin/python3 bench/python_bench.py \\
        [--bin build/bin] [--dir /dev/shm] [--rounds-scale 1] [--skip-cxx] \\
        [--fresh-source torch|numpy-thp] [--copy-threads N]

Needs the package on PYTHONPATH (build/python) and torch (python3-torch).
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import expert_arena

SHAPES = [("32 x 64 KiB", 32, 64 << 10, 150), ("4 x 2 MiB", 4, 2 << 20, 100),
          ("1 x 64 MiB", 1, 64 << 20, 20)]
PEER_ROUNDS = {"32 x 64 KiB": 30, "4 x 2 MiB": 30, "1 x 64 MiB": 8}
WARMUP = 3


def median_ms(xs):
    return statistics.median(xs) * 1e3


# ---- attach ------------------------------------------------------------------------------

def bench_attach(bin_dir, runs, directory):
    work = tempfile.mkdtemp(prefix="ea-pybench-")
    model = os.path.join(work, "model.gguf")
    arena = os.path.join(directory, "ea-pybench-%d.arena" % os.getpid())
    try:
        subprocess.run([os.path.join(bin_dir, "expert-arena"), "gen-model", "--format", "gguf",
                        "--out", model, "--layers", "8", "--experts", "16", "--hidden", "512",
                        "--ffn", "1024", "--dtype", "f16"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        loaded = expert_arena.open(model, shared_path=arena, quiet=True)
        size = loaded.report["tensor_bytes"]
        tensors = loaded.report["tensors"]
        loaded.close()
        cxx, py_open, py_open_inner, py_attach = [], [], [], []
        for _ in range(runs + 1):
            out = subprocess.run([os.path.join(bin_dir, "expert-arena"), "load", "--model", model,
                                  "--arena", arena, "--json"], check=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            j = json.loads(out.stdout)
            assert j["role"] == "attached", j
            cxx.append(j["seconds"])
            t0 = time.perf_counter()
            a = expert_arena.open(model, shared_path=arena, quiet=True)
            t1 = time.perf_counter()
            assert a.report["role"] == "attached"
            py_open_inner.append(a.report["seconds"])
            a.close()
            py_open.append(t1 - t0)
            t0 = time.perf_counter()
            b = expert_arena.attach(arena)
            t1 = time.perf_counter()
            b.close()
            py_attach.append(t1 - t0)
        # The first run of each warms the page cache of the model's header.
        cxx, py_open, py_open_inner, py_attach = (x[1:] for x in
                                                  (cxx, py_open, py_open_inner, py_attach))
        return {"tensor_bytes": size, "tensors": tensors, "runs": runs,
                "cxx_ms": median_ms(cxx), "py_open_ms": median_ms(py_open),
                "py_open_report_ms": median_ms(py_open_inner),
                "py_attach_ms": median_ms(py_attach)}
    finally:
        for f in (arena, model):
            if os.path.exists(f):
                os.unlink(f)
        os.rmdir(work)


# ---- stream rounds -----------------------------------------------------------------------

def stream_consumer(conn, directory):
    consumer = expert_arena.StreamConsumer(directory, quiet=True)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        many, batch = msg
        if many == "torch":
            # read-only tensors, each read once by indexing (what an engine does next)
            views = consumer.open_many(batch, view="torch")
            for v in views:
                v[0]
            del views
        elif many:
            # read-only arrays; each gives its reader's share back when it is dropped
            views = consumer.open_many(batch, view="numpy")
            del views
        else:
            for d in batch:
                t = consumer.open(d)
                view = t.numpy()
                del view
                t.release()
        conn.send(b"k")


def queue_consumer(queue, conn):
    import torch  # noqa: F401  (registers the tensor reducers)
    while True:
        n = conn.recv()
        if n is None:
            return
        for _ in range(n):
            t = queue.get()
            del t
        conn.send(b"k")


def bench_stream(directory, scale, fresh_source="torch", copy_threads=0):
    import torch

    def make_fresh(nbytes, value):
        if fresh_source == "numpy-thp":
            # NumPy asks for transparent huge pages (madvise) for arrays of 4 MiB and more;
            # torch 1.13's allocator does not: see docs/python.md on the fresh-source put.
            return torch.from_numpy(np.empty(nbytes, np.uint8)).fill_(value)
        return torch.empty(nbytes, dtype=torch.uint8).fill_(value)
    import torch.multiprocessing as tmp
    ctx = mp.get_context("spawn")
    results = {}
    producer = expert_arena.StreamProducer(directory, "pybench", segment_bytes=128 << 20,
                                           max_segments=2, spill_directory=directory,
                                           copy_threads=copy_threads, quiet=True)
    here, there = ctx.Pipe()
    consumer = ctx.Process(target=stream_consumer, args=(there, directory))
    consumer.start()
    tctx = tmp.get_context("spawn")
    queue = tctx.Queue()
    qhere, qthere = tctx.Pipe()
    qconsumer = tctx.Process(target=queue_consumer, args=(queue, qthere))
    qconsumer.start()
    seq = 0

    def queue_round(r, count, nbytes):
        """One round of the peer: (the hand-over, the hand-over with the making) seconds."""
        tm = time.perf_counter()
        fresh = [make_fresh(nbytes, r & 0xFF) for _ in range(count)]
        t0 = time.perf_counter()
        qhere.send(count)
        for x in fresh:
            queue.put(x)
        qhere.recv()
        t1 = time.perf_counter()
        return t1 - t0, t1 - tm

    try:
        for name, count, nbytes, rounds in SHAPES:
            source = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
            fresh_t, inplace_t, inplace_make_t, reused_t, reused_one_t = [], [], [], [], []
            inplace_torch_t = []
            queue_t, queue_make_t = [], []
            for r in range(rounds * scale + WARMUP):
                # fresh tensors copied in by put() (made before the clock starts)
                fresh = [make_fresh(nbytes, r & 0xFF) for _ in range(count)]
                t0 = time.perf_counter()
                batch = []
                for x in fresh:
                    batch.append(producer.put("f%d" % seq, x))
                    seq += 1
                here.send((False, batch))
                here.recv()
                t1 = time.perf_counter()
                del fresh
                # fresh tensors made in place: reserve (timed), fill (the making, timed
                # apart), publish + hand over (timed)
                t2 = time.perf_counter()
                held = [producer.reserve("p%d" % (seq + k), (nbytes,), torch.uint8)
                        for k in range(count)]
                seq += count
                t3 = time.perf_counter()
                for h in held:
                    h.torch().fill_(r & 0xFF)
                t4 = time.perf_counter()
                here.send((True, [h.publish() for h in held]))
                here.recv()
                t5 = time.perf_counter()
                del held
                # the same, the consumer taking torch views (open_many(view="torch")) and
                # indexing each once
                t2b = time.perf_counter()
                held = [producer.reserve("q%d" % (seq + k), (nbytes,), torch.uint8)
                        for k in range(count)]
                seq += count
                t3b = time.perf_counter()
                for h in held:
                    h.torch().fill_(r & 0xFF)
                t4b = time.perf_counter()
                here.send(("torch", [h.publish() for h in held]))
                here.recv()
                t5b = time.perf_counter()
                del held
                # the same source tensor each time (what stream_bench puts): one batch call
                # each side, then one call per tensor
                t6 = time.perf_counter()
                batch = producer.put_many([("r%d" % (seq + k), source) for k in range(count)])
                seq += count
                here.send((True, batch))
                here.recv()
                t7 = time.perf_counter()
                batch = []
                for _ in range(count):
                    batch.append(producer.put("s%d" % seq, source))
                    seq += 1
                here.send((False, batch))
                here.recv()
                t8 = time.perf_counter()
                # The queue's rounds are interleaved with the stream's (one after every
                # `every`-th), so that both see the same stretch of this machine's speed.
                every = max(1, rounds // PEER_ROUNDS[name])
                if r < WARMUP or (r - WARMUP) % every == 0:
                    q, qm = queue_round(r, count, nbytes)
                    if r >= WARMUP:
                        queue_t.append(q)
                        queue_make_t.append(qm)
                if r >= WARMUP:
                    fresh_t.append(t1 - t0)
                    inplace_t.append((t3 - t2) + (t5 - t4))
                    inplace_make_t.append(t5 - t2)
                    inplace_torch_t.append((t3b - t2b) + (t5b - t4b))
                    reused_t.append(t7 - t6)
                    reused_one_t.append(t8 - t7)
            results[name] = {"fresh_ms": median_ms(fresh_t), "inplace_ms": median_ms(inplace_t),
                             "inplace_make_ms": median_ms(inplace_make_t),
                             "inplace_torch_ms": median_ms(inplace_torch_t),
                             "reused_ms": median_ms(reused_t),
                             "reused_one_call_ms": median_ms(reused_one_t),
                             "queue_ms": median_ms(queue_t),
                             "queue_make_ms": median_ms(queue_make_t), "rounds": len(fresh_t),
                             "queue_rounds": len(queue_t)}
    finally:
        here.send(None)
        qhere.send(None)
        consumer.join(60)
        qconsumer.join(60)
        producer.close()
    return results


def bench_cxx_stream(bin_dir, directory):
    out = subprocess.run([os.path.join(bin_dir, "stream_bench"), "--dir", directory,
                          "--skip-growth"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, timeout=900)
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\| (\d+ x \d+ [KM]iB) \| (\d+) us \| (\d+) us \| (\d+) us \|", line)
        if m and m.group(1) not in rows:
            rows[m.group(1)] = int(m.group(2)) / 1e3  # the zero-copy view round, ms
    return rows, out.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="build/bin")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--attach-runs", type=int, default=15)
    parser.add_argument("--rounds-scale", type=int, default=1)
    parser.add_argument("--skip-cxx", action="store_true", help="no stream_bench run")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--fresh-source", choices=("torch", "numpy-thp"), default="torch",
                        help="how the fresh tensors (stream and queue alike) are made: "
                             "torch.empty (default) or torch over NumPy memory (huge pages)")
    parser.add_argument("--copy-threads", type=int, default=0,
                        help="the producer's copy_threads (0: the library's choice)")
    args = parser.parse_args()

    print("python_bench: expert_arena %s, Python %s, NumPy %s, %s, %d CPUs, %s"
          % (expert_arena.__version__, platform.python_version(), np.__version__,
             platform.platform(), os.cpu_count(), time.strftime("%Y-%m-%d %H:%M UTC",
                                                                time.gmtime())))
    attach = bench_attach(args.bin, args.attach_runs, args.dir)
    print("\nAttach to a published arena (%d tensors, %.0f MiB), median of %d:\n"
          % (attach["tensors"], attach["tensor_bytes"] / 2**20, attach["runs"]))
    print("| C++ (expert-arena load, report seconds) | Python open() wall | Python open() "
          "report seconds | Python attach() wall | Python open() - C++ |")
    print("|---|---|---|---|---|")
    print("| %.2f ms | %.2f ms | %.2f ms | %.2f ms | %+.2f ms (goal: within 5 ms) |"
          % (attach["cxx_ms"], attach["py_open_ms"], attach["py_open_report_ms"],
             attach["py_attach_ms"], attach["py_open_ms"] - attach["cxx_ms"]))

    stream = bench_stream(args.dir, args.rounds_scale, args.fresh_source, args.copy_threads)
    cxx, cxx_raw = ({}, "") if args.skip_cxx else bench_cxx_stream(args.bin, args.dir)
    print("\nStream round, producer and consumer in two processes, descriptors over a pipe "
          "(median per round; fresh tensors made by %s):\n"
          % ("torch.empty" if args.fresh_source == "torch" else
             "torch.from_numpy(numpy.empty), huge pages"))
    print("Fresh tensors against a torch.multiprocessing queue carrying the same fresh tensors "
          "(goal: queue / stream >= 20x). put() copies a tensor made elsewhere; in place, the "
          "tensor is made in a reservation (reserve + publish timed, the fill not):\n")
    print("| shape | queue | stream, put() | queue / put() | stream, in place | "
          "queue / in place | in place, torch views | queue / torch views | "
          "queue incl. making | in place incl. making | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, _, _, _ in SHAPES:
        s = stream[name]
        print("| %s | %.2f ms | %.3f ms | %.0fx | %.3f ms | %.0fx | %.3f ms | %.0fx | %.2f ms | "
              "%.3f ms | %.0fx |"
              % (name, s["queue_ms"], s["fresh_ms"], s["queue_ms"] / s["fresh_ms"],
                 s["inplace_ms"], s["queue_ms"] / s["inplace_ms"], s["inplace_torch_ms"],
                 s["queue_ms"] / s["inplace_torch_ms"], s["queue_make_ms"],
                 s["inplace_make_ms"], s["queue_make_ms"] / s["inplace_make_ms"]))
    print("\nThe same source each round, against C++ `stream_bench`'s zero-copy view round in "
          "the same run (goal: Python / C++ <= 1.5x):\n")
    print("| shape | C++ view round | Python, put_many + open_many | Python / C++ | "
          "Python, one put/open per tensor | Python / C++ |")
    print("|---|---|---|---|---|---|")
    for name, _, _, _ in SHAPES:
        s = stream[name]
        c = cxx.get(name)
        print("| %s | %s | %.3f ms | %s | %.3f ms | %s |"
              % (name, "%.3f ms" % c if c else "-", s["reused_ms"],
                 "%.2fx" % (s["reused_ms"] / c) if c else "-", s["reused_one_call_ms"],
                 "%.2fx" % (s["reused_one_call_ms"] / c) if c else "-"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"attach": attach, "stream": stream, "cxx_stream_view_ms": cxx}, f,
                      indent=1)
    if cxx_raw:
        print("\nstream_bench output (same run):\n")
        print(cxx_raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
