"""The data path of expert_arena.vllm_kv against a plain memcpy and against the data path of
vLLM's ExampleConnector (safetensors files on disk), for one prompt's KV of L layers.

A prompt of N tokens in blocks of B tokens lives in each layer's KV cache, laid out as vLLM
0.32's CPU attention backend lays it out: (num_blocks, kv_heads, B, 2 * head_size), its blocks
scattered over twice as many. Each way moves those blocks from the prefill engine's cache into
other blocks of the decode engine's cache:

  memcpy       dst.copy_(src) of one contiguous buffer of the same bytes, per layer (the floor
               of any transfer: the bytes once through memory, no gather, no scatter);
  private      gather (index_select) into private memory, scatter from it (a copy_ per run of
               blocks): what a connector costs that moves nothing between processes;
  stream       what the connector does: a producer reserves a segment block per layer and
               gathers into it (index_select out=), publishes it; a consumer in another
               process opens it zero-copy, scatters it into its cache (scatter_blocks, the
               connector's own) and releases it (the consumer's time is measured there);
  example      ExampleConnector's I/O: the gathered layer saved with safetensors' save_file,
               read back with load_file and scattered, per layer, in a directory (default
               /tmp, the connector's default).

    .venv-vllm/bin/python bench/kv_connector_bench.py [--tokens 1024 4096 16384] [--layers 8]
        [--kv-heads 8] [--head-size 128] [--dtype bfloat16] [--repeat 5]

Prints a Markdown table (median of --repeat rounds, GiB/s of the KV's bytes) and the command.
Not part of CI.
"""

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import expert_arena
from expert_arena.vllm_kv import scatter_blocks


def _cache(args, num_blocks):
    return [torch.randn(num_blocks, args.kv_heads, args.block, 2 * args.head_size)
            .to(args.dtype) for _ in range(args.layers)]


def _consume(conn, directory, args, num_blocks):
    """The decode engine's side, in its own process: open, scatter, release."""
    torch.set_num_threads(args.threads)
    caches = _cache(args, num_blocks)
    consumer = expert_arena.StreamConsumer(directory, quiet=True)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        descriptors, dst = msg
        start = time.perf_counter()
        views = consumer.open_many(descriptors)
        for cache, view in zip(caches, views):
            with view:
                src = view.torch()
                scatter_blocks(cache, 0, dst, src)
                del src
        conn.send(time.perf_counter() - start)
    consumer.close()


def _median_seconds(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args, tokens, directory, example_dir):
    blocks = tokens // args.block
    num_blocks = blocks * 2
    src_caches = _cache(args, num_blocks)
    dst_caches = _cache(args, num_blocks)
    gen = torch.Generator().manual_seed(tokens)
    src_ids = torch.randperm(num_blocks, generator=gen)[:blocks]
    dst_ids = torch.randperm(num_blocks, generator=gen)[:blocks]
    dst_list = dst_ids.tolist()
    per_layer = (blocks, args.kv_heads, args.block, 2 * args.head_size)
    nbytes = args.layers * src_caches[0][:blocks].numel() * src_caches[0].element_size()
    results = {}

    flat_src = [torch.empty(per_layer, dtype=args.dtype) for _ in src_caches]
    flat_dst = [torch.empty(per_layer, dtype=args.dtype) for _ in src_caches]

    def memcpy():
        for s, d in zip(flat_src, flat_dst):
            d.copy_(s)
    results["memcpy"] = _median_seconds(memcpy, args.repeat)

    def private():
        for s, d in zip(src_caches, dst_caches):
            staged = torch.index_select(s, 0, src_ids)
            scatter_blocks(d, 0, dst_list, staged)
    results["private"] = _median_seconds(private, args.repeat)

    producer = expert_arena.StreamProducer(directory, logical_name="kvbench",
                                           segment_bytes=max(64 << 20, 2 * nbytes),
                                           max_segments=8, quiet=True)
    parent, child = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("spawn")
    consumer = ctx.Process(target=_consume, args=(child, directory, args, num_blocks))
    consumer.start()
    put_times, open_times = [], []
    try:
        for r in range(args.repeat):
            start = time.perf_counter()
            descriptors = []
            for i, cache in enumerate(src_caches):
                res = producer.reserve("req-%d/layer-%d" % (r, i), per_layer, args.dtype)
                torch.index_select(cache, 0, src_ids, out=res.torch())
                descriptors.append(res.publish())
            put_times.append(time.perf_counter() - start)
            parent.send((descriptors, dst_ids.tolist()))
            open_times.append(parent.recv())
    finally:
        parent.send(None)
        consumer.join()
        producer.close()
    results["stream"] = statistics.median(p + o for p, o in zip(put_times, open_times))
    results["stream put"] = statistics.median(put_times)
    results["stream load"] = statistics.median(open_times)

    from safetensors.torch import load_file, save_file

    def example():
        for i, (s, d) in enumerate(zip(src_caches, dst_caches)):
            path = os.path.join(example_dir, "layer-%d.safetensors" % i)
            save_file({"kv_cache": torch.index_select(s, 0, src_ids)}, path)
        for i, d in enumerate(dst_caches):
            path = os.path.join(example_dir, "layer-%d.safetensors" % i)
            scatter_blocks(d, 0, dst_list, load_file(path)["kv_cache"])
            os.unlink(path)
    results["example"] = _median_seconds(example, args.repeat)
    return nbytes, results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--directory", default="/dev/shm")
    parser.add_argument("--example-directory", default="/tmp")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    directory = tempfile.mkdtemp(prefix="ea-kvbench-", dir=args.directory)
    example_dir = tempfile.mkdtemp(prefix="ea-kvbench-", dir=args.example_directory)
    try:
        rows = [(t,) + run(args, t, directory, example_dir) for t in args.tokens]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(example_dir, ignore_errors=True)
    print("| tokens | KV bytes | memcpy | private gather+scatter | stream (put + load) | "
          "stream / memcpy | example (safetensors) |")
    print("|---|---|---|---|---|---|---|")
    for tokens, nbytes, r in rows:
        def cell(name):
            return "%.1f ms (%.1f GiB/s)" % (r[name] * 1e3, nbytes / r[name] / 2**30)
        print("| %d | %.0f MiB | %s | %s | %s (%.1f + %.1f ms) | %.2fx | %s |" % (
            tokens, nbytes / 2**20, cell("memcpy"), cell("private"), cell("stream"),
            r["stream put"] * 1e3, r["stream load"] * 1e3, r["memcpy"] / r["stream"],
            cell("example")))
    print("\n    " + " ".join([os.path.basename(sys.executable)] + sys.argv))


if __name__ == "__main__":
    main()
