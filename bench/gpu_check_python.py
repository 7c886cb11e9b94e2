#!/usr/bin/env python3
"""The Python step of bench/gpu_check.sh: an arena opened with gpu="cuda" from Python is
registered host memory, so torch sees it as pinned and
`arena.torch(name).to("cuda", non_blocking=True)` is an asynchronous DMA copy. (Python views
point into the arena's copy-on-write mapping, which the library registers read-only with the
same device; "not pinned" here means the device refused that registration.) Timed against
the same copy from pageable memory (a clone of the tensor in ordinary process memory), and
the device copy is compared with the host bytes. Then a device tensor is streamed in place:
copied into a reservation of a producer registered with the device (a DMA copy, timed against
the same copy into pageable memory) and copied back to the device from the consumer's view.

    PYTHONPATH=BUILD/python python3 bench/gpu_check_python.py --bin BUILD/bin [--device cuda:0]
        [--size-mib 512] [--dir /dev/shm]

Without torch, a CUDA build of torch or a device it prints "python step: skipped: <reason>"
and exits 0. Exit 1 when a check fails (not pinned, bytes differ), 2 when it cannot run.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def skip(why):
    print("python step: skipped: %s" % why)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    try:
        import expert_arena
    except ImportError as e:
        return skip("expert_arena does not import (%s); build with -DEXPERT_ARENA_PYTHON=ON" % e)
    try:
        import torch
    except ImportError:
        return skip("torch is not installed (python3-torch, or a CUDA build from pip)")
    if not torch.cuda.is_available():
        return skip("torch %s sees no CUDA device (a CPU-only build, or no GPU)"
                    % torch.__version__)

    work = tempfile.mkdtemp(prefix="ea-gpu-py-")
    model = os.path.join(work, "model.gguf")
    arena_path = os.path.join(args.dir, "ea-gpu-py-%d.arena" % os.getpid())
    # One layer of f16 experts, hidden 2048: each of the 3 tensors is a third of the size.
    ffn = 2048
    experts = max(1, args.size_mib * (1 << 20) // (3 * 2048 * ffn * 2))
    try:
        subprocess.run([os.path.join(args.bin, "expert-arena"), "gen-model", "--format", "gguf",
                        "--out", model, "--layers", "1", "--experts", str(experts), "--hidden",
                        "2048", "--ffn", str(ffn), "--dtype", "f16"], check=True,
                       stdout=subprocess.DEVNULL)
        with expert_arena.open(model, shared_path=arena_path, gpu=args.device,
                               gpu_required=True, quiet=True) as arena:
            r = arena.report
            print("python step: %s" % r["start_line"])
            name = max(arena.names(), key=lambda n: arena.info(n)["bytes"])
            host = arena.torch(name)
            nbytes = arena.info(name)["bytes"]
            pinned = host.is_pinned()
            pageable = host.clone()  # ordinary process memory, same bytes
            device = torch.device(args.device)

            def timed(src):
                times, calls = [], []
                out = None
                for _ in range(args.reps + 1):
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    out = src.to(device, non_blocking=True)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize(device)
                    t2 = time.perf_counter()
                    calls.append(t1 - t0)
                    times.append(t2 - t0)
                return statistics.median(times[1:]), statistics.median(calls[1:]), out

            reg_s, reg_call, on_device = timed(host)
            page_s, page_call, _ = timed(pageable)
            same = bool(torch.equal(on_device.cpu(), pageable))
            gbps = lambda s: nbytes / s / 1e9  # noqa: E731
            print("python step: %s, %.0f MiB tensor %s (%s):" % (args.device, nbytes / 2**20,
                                                                 name, host.dtype))
            print("| source | torch sees pinned | .to(device, non_blocking=True) returns | "
                  "copy done | GB/s |")
            print("|---|---|---|---|---|")
            print("| arena (registered) | %s | %.2f ms | %.2f ms | %.1f |"
                  % (pinned, reg_call * 1e3, reg_s * 1e3, gbps(reg_s)))
            print("| pageable clone | %s | %.2f ms | %.2f ms | %.1f |"
                  % (pageable.is_pinned(), page_call * 1e3, page_s * 1e3, gbps(page_s)))
            print("python step: registered / pageable throughput %.2fx; device bytes %s"
                  % (page_s / reg_s, "equal the host's" if same else "DIFFER"))
            if not pinned:
                print("python step: FAILED: torch does not see the registered arena as pinned "
                      "(report gpu: %s)" % r["gpu"])
                return 1
            if not same:
                print("python step: FAILED: the device copy differs from the host bytes")
                return 1
        return stream_step(expert_arena, torch, args)
    except (OSError, ValueError, subprocess.CalledProcessError) as e:
        print("python step: could not run: %s" % e)
        return 2
    finally:
        for p in (arena_path, model):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(work)


def stream_step(expert_arena, torch, args):
    """A device tensor handed over in place: the producer's segments are registered
    (gpu=DEVICE), so copying a device tensor into a reservation is a DMA copy; the consumer
    (gpu=DEVICE too) copies it back to the device from the segment. Timed against the same
    device-to-host copy into pageable memory; the round trip is compared byte for byte."""
    device = torch.device(args.device)
    nbytes = min(args.size_mib, 256) << 20
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    directory = tempfile.mkdtemp(prefix="ea-gpu-py-stream-", dir=args.dir)
    try:
        with expert_arena.StreamProducer(directory, "gpucheck", segment_bytes=nbytes + (2 << 20),
                                         max_segments=2, gpu=args.device,
                                         spill_directory=directory, quiet=True) as producer, \
                expert_arena.StreamConsumer(directory, spill_directory=directory,
                                            gpu=args.device, quiet=True) as consumer:
            times, page_times, descriptor, pinned = [], [], None, False
            for rep in range(args.reps + 1):
                with producer.reserve("d2h-%d" % rep, (nbytes,), torch.uint8) as r:
                    host = r.torch()
                    pinned = host.is_pinned()
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    host.copy_(source, non_blocking=True)
                    torch.cuda.synchronize(device)  # before publish: the bytes are written
                    times.append(time.perf_counter() - t0)
                    del host
                    if rep == args.reps:
                        descriptor = r.publish()
                pageable = torch.empty(nbytes, dtype=torch.uint8)
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                pageable.copy_(source, non_blocking=True)
                torch.cuda.synchronize(device)
                page_times.append(time.perf_counter() - t0)
            t = consumer.open(descriptor)
            back = t.torch().to(device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            t.release_after(copied)  # released once the copy has read the bytes
            del t
            torch.cuda.synchronize(device)
            consumer.poll_releases()
            same = bool(torch.equal(back, source))
            reg_s, page_s = statistics.median(times[1:]), statistics.median(page_times[1:])
            print("python step: stream, %.0f MiB device tensor copied into a reservation: "
                  "pinned %s, %.2f ms (%.1f GB/s) against %.2f ms (%.1f GB/s) into pageable "
                  "memory, %.2fx; back to the device from the consumer's view: bytes %s"
                  % (nbytes / 2**20, pinned, reg_s * 1e3, nbytes / reg_s / 1e9, page_s * 1e3,
                     nbytes / page_s / 1e9, page_s / reg_s, "equal" if same else "DIFFER"))
            if not pinned:
                print("python step: FAILED: torch does not see the stream segment as pinned")
                return 1
            if not same:
                print("python step: FAILED: the streamed bytes differ on the device")
                return 1
            return 0
    except (OSError, ValueError) as e:
        print("python step: stream part could not run: %s" % e)
        return 2
    finally:
        for f in os.listdir(directory):
            os.unlink(os.path.join(directory, f))
        os.rmdir(directory)


if __name__ == "__main__":
    sys.exit(main())
