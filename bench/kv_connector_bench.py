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
  cache        what the connector does with transfer "cache": the prefill engine's cache
               tensors live in a shared file (_SharedCache, as vLLM's are moved there), nothing
               is copied on that side; a consumer in another process copies the blocks straight
               from the file into its cache (copy_cache_blocks out of the file mapped once,
               as the connector does, one call for all runs; --cache-copy adds pread: the
               consumer's time, opening the file included; the first load, which maps the
               file, is printed apart);
  example      ExampleConnector's I/O: the gathered layer saved with safetensors' save_file,
               read back with load_file and scattered, per layer, in a directory (default
               /tmp, the connector's default);
  nixl         NixlConnector's data path (with --nixl): the decode side's NIXL agent (UCX
               backend, DRAM) READs each block of each layer from the prefill side's
               registered cache straight into its own cache's blocks, as NixlConnector does
               (descriptor lists prepared once per cache, one make_prepped_xfer per request).
               --nixl names a folder holding nixl-cu12's files (`nixl_cu12`), imported
               directly (vLLM's NixlConnector itself, through PyPI's `nixl` meta package
               with nixl-cu13: bench/kv_engine_bench.py).

The decode engine's own cache is on 2 MiB pages, as the connector's huge_pages (its default)
puts it; --dst-pages 2m 4k adds the cache way into one left as torch allocated it (4 KiB pages
where transparent huge pages are "madvise").

    .venv-vllm/bin/python bench/kv_connector_bench.py [--tokens 1024 4096 16384] [--layers 8]
        [--kv-heads 8] [--head-size 128] [--dtype bfloat16] [--repeat 5] [--dst-pages 2m 4k]
        [--cache-copy mapped pread] [--nixl DIR]

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
from expert_arena.vllm_kv import (_HostPages, _Options, _SharedCache, copy_cache_blocks,
                                  scatter_blocks)


def _cache(args, num_blocks):
    return [torch.randn(num_blocks, args.kv_heads, args.block, 2 * args.head_size)
            .to(args.dtype) for _ in range(args.layers)]


def _decode_cache(args, num_blocks, pages):
    """The decode engine's own cache, where the connector puts it: on 2 MiB pages ("2m", its
    huge_pages option, the default) or as torch allocated it ("4k")."""
    caches = _cache(args, num_blocks)
    if pages == "2m":
        moved = _HostPages({i: (c, 0) for i, c in enumerate(caches)}).start()
        moved.wait()
        if moved.huge_bytes != moved.total:
            print("the decode cache: only %d of %d MiB on 2 MiB pages (%s)" % (
                moved.huge_bytes >> 20, moved.total >> 20, moved.error), file=sys.stderr)
    return caches


def _consume(conn, directory, args, num_blocks):
    """The decode engine's side, in its own process: open, scatter, release."""
    torch.set_num_threads(args.threads)
    caches = _decode_cache(args, num_blocks, args.dst_pages[0])
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


def _cache_reader(conn, args, num_blocks, pages, how):
    """The decode engine's side of transfer "cache", in its own process: open the prefill
    engine's cache file, copy the blocks into its own cache: out of the file mapped once
    (`how` "mapped", as the connector does: the first load maps it, a thread maps its pages
    in) or with pread ("pread", the connector's way where a file cannot be mapped)."""
    torch.set_num_threads(args.threads)
    caches = _decode_cache(args, num_blocks, pages)
    sources = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        path, layers, src, dst = msg
        start = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        source = None
        if how == "mapped":
            source = sources.get(path)
            if source is None:
                source = sources[path] = expert_arena._core.MappedFile(fd, path)
        for cache, desc in zip(caches, layers):
            copy_cache_blocks(fd, desc, src, cache, 0, dst, source=source)
        os.close(fd)
        conn.send(time.perf_counter() - start)


def _shared_cache(args, directory, src_caches, src_ids, dst_ids, num_blocks):
    """Median seconds of the consumer's copy out of a shared cache holding src_caches, for
    each way (decode cache pages, copy) of args.cache_ways (one reader each, in turns), and
    each way's first load."""
    # vLLM's zeroed buffer, moved into the file, then written (as the prefill engine does).
    buf = torch.zeros(len(src_caches) * src_caches[0].numel(), dtype=src_caches[0].dtype)
    caches = {"layer-%d" % i: (buf[i * c.numel():(i + 1) * c.numel()].view(c.shape), 0)
              for i, c in enumerate(src_caches)}
    shared = _SharedCache(_Options({"directory": directory, "name": "kvbench"}), caches)
    for (t, _), c in zip(caches.values(), src_caches):
        t.copy_(c)
    shared.sync_edges()
    shared._collapser.join()  # the engine's start goes on meanwhile; timed after it
    args.cache_huge.append("%d/%d MiB" % (shared.huge_bytes >> 20, shared.total >> 20))
    readers = {}
    for way in args.cache_ways:
        parent, child = multiprocessing.Pipe()
        reader = multiprocessing.get_context("spawn").Process(
            target=_cache_reader, args=(child, args, num_blocks) + way)
        reader.start()
        readers[way] = (parent, reader)
    times = {way: [] for way in args.cache_ways}
    try:
        layers = [shared.layers["layer-%d" % i] for i in range(len(src_caches))]
        for _ in range(args.repeat):
            for way, (parent, _) in readers.items():
                parent.send((shared.path, layers, src_ids, dst_ids))
                times[way].append(parent.recv())
    finally:
        for parent, reader in readers.values():
            parent.send(None)
            reader.join()
        shared.close()
    return {way: (statistics.median(t), t[0]) for way, t in times.items()}


def _nixl_api(path):
    sys.path.insert(0, path)
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def _block_descs(caches, ids):
    """(address, bytes, device 0) of each block `ids` of each layer, layer after layer."""
    out = []
    for cache in caches:
        size = cache[0].numel() * cache.element_size()
        base = cache.data_ptr()
        out += [(base + i * size, size, 0) for i in ids]
    return out


def _nixl_read(conn, args, num_blocks, nixl_path):
    """The decode engine's side of the NIXL way, in its own process: READ every block."""
    torch.set_num_threads(args.threads)
    nixl_agent, nixl_agent_config = _nixl_api(nixl_path)
    caches = _cache(args, num_blocks)
    agent = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(caches)
    remote_meta, remote_descs = conn.recv()
    remote = agent.add_remote_agent(remote_meta)
    everything = list(range(num_blocks))
    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_descs(caches, everything),
                                       "DRAM")
    remote_side = agent.prep_xfer_dlist(remote, remote_descs, "DRAM")
    # One block first, untimed: UCX connects at the first transfer (NixlConnector's handshake
    # has happened before its first request).
    handle = agent.make_prepped_xfer("READ", local_side, [0], remote_side, [0])
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        src_ids, dst_ids = msg
        local = [layer * num_blocks + b for layer in range(args.layers) for b in dst_ids]
        theirs = [layer * num_blocks + b for layer in range(args.layers) for b in src_ids]
        start = time.perf_counter()
        handle = agent.make_prepped_xfer("READ", local_side, local, remote_side, theirs)
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        conn.send(elapsed if state == "DONE" else None)
    conn.close()
    os._exit(0)  # NIXL 1.5.1's UCX plugin segfaults in its exit handlers (rtnl_tc_unregister)


def _nixl(args, src_caches, src_ids, dst_ids, num_blocks):
    """Median seconds of the decode side's READ of the prompt's blocks (NixlConnector's data
    path); the prefill side registers its cache and waits, as NixlConnector's does."""
    nixl_agent, nixl_agent_config = _nixl_api(args.nixl)
    agent = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(src_caches)
    parent, child = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("spawn")
    reader = ctx.Process(target=_nixl_read, args=(child, args, num_blocks, args.nixl))
    reader.start()
    times = []
    try:
        parent.send((agent.get_agent_metadata(),
                     _block_descs(src_caches, range(num_blocks))))
        assert parent.recv() == "ready"
        for _ in range(args.repeat):
            parent.send((src_ids, dst_ids))
            elapsed = parent.recv()
            if elapsed is None:
                raise RuntimeError("a NIXL transfer ended in ERR")
            times.append(elapsed)
    finally:
        parent.send(None)
        reader.join()
    return statistics.median(times)


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

    # Real bytes on both sides, written before: a source never written reads the kernel's one
    # zero page (from the CPU's cache), which made this floor 1.2-1.3x too fast until
    # 2026-12-07.
    flat_src = [c[:blocks].clone() for c in src_caches]
    flat_dst = [torch.zeros(per_layer, dtype=args.dtype) for _ in src_caches]

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

    cache = _shared_cache(args, directory, src_caches, src_ids.tolist(), dst_list, num_blocks)
    results["cache"], results["cache first"] = cache[args.cache_ways[0]]
    for way in args.cache_ways[1:]:
        results["cache %s %s" % way] = cache[way][0]

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
    if args.nixl:
        results["nixl"] = _nixl(args, src_caches, src_ids.tolist(), dst_list, num_blocks)
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
    parser.add_argument("--dst-pages", nargs="+", choices=["2m", "4k"], default=["2m"],
                        help="the decode engine's own cache on 2 MiB pages (the connector's "
                        "huge_pages, the default) or 4 KiB ones; the first for every way, "
                        "the others for cache too (an extra column each)")
    parser.add_argument("--cache-copy", nargs="+", choices=["mapped", "pread"],
                        default=["mapped", "pread"], help="how the decode engine copies out "
                        "of the shared cache: the connector's mapping of the file, or pread; "
                        "the first for the table, the others an extra line each")
    parser.add_argument("--nixl", metavar="DIR", help="a folder holding nixl-cu12's files "
                        "(`nixl_cu12`): adds NIXL's READ of the blocks (module docstring)")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    args.cache_huge = []  # how much of each shared cache was on 2 MiB pages
    args.cache_ways = ([(args.dst_pages[0], c) for c in args.cache_copy] +
                       [(p, args.cache_copy[0]) for p in args.dst_pages[1:]])
    torch.set_num_threads(args.threads)
    directory = tempfile.mkdtemp(prefix="ea-kvbench-", dir=args.directory)
    example_dir = tempfile.mkdtemp(prefix="ea-kvbench-", dir=args.example_directory)
    try:
        rows = [(t,) + run(args, t, directory, example_dir) for t in args.tokens]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(example_dir, ignore_errors=True)
    nixl = bool(args.nixl)
    print("| tokens | KV bytes | memcpy | private gather+scatter | stream (put + load) | "
          "stream / memcpy | cache (load) | cache / memcpy | example (safetensors) |"
          + (" nixl READ | stream / nixl | cache / nixl |" if nixl else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if nixl else ""))
    for tokens, nbytes, r in rows:
        def cell(name):
            return "%.1f ms (%.1f GiB/s)" % (r[name] * 1e3, nbytes / r[name] / 2**30)
        print("| %d | %.0f MiB | %s | %s | %s (%.1f + %.1f ms) | %.2fx | %s | %.2fx | %s |" % (
            tokens, nbytes / 2**20, cell("memcpy"), cell("private"), cell("stream"),
            r["stream put"] * 1e3, r["stream load"] * 1e3, r["memcpy"] / r["stream"],
            cell("cache"), r["memcpy"] / r["cache"], cell("example"))
            + (" %s | %.2fx | %.2fx |" % (cell("nixl"), r["nixl"] / r["stream"],
                                          r["nixl"] / r["cache"]) if nixl else ""))
    print("\nshared caches on 2 MiB pages: %s (directory %s)" % (", ".join(args.cache_huge),
                                                               args.directory))
    print("the table's cache (load) is %s into a decode cache on %s pages; its first load "
          "(the file mapped then): %s" % (args.cache_ways[0][1], args.cache_ways[0][0], ", ".join(
              "%.1f ms" % (r["cache first"] * 1e3) for _, _, r in rows)))
    for way in args.cache_ways[1:]:
        print("\ncache (load), %s into a decode cache on %s pages:" % (way[1], way[0]))
        for tokens, nbytes, r in rows:
            t = r["cache %s %s" % way]
            print("  %d tokens: %.1f ms, %.2fx of memcpy; the table's %.2fx of it" % (
                tokens, t * 1e3, r["memcpy"] / t, t / r["cache"]))
    print("\n    " + " ".join([os.path.basename(sys.executable)] + sys.argv))
    if args.nixl:
        sys.stdout.flush()
        os._exit(0)  # NIXL 1.5.1's UCX plugin segfaults in its exit handlers


if __name__ == "__main__":
    main()
