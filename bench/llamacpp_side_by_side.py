#!/usr/bin/python3
"""N engines on one MoE GGUF: the real llama.cpp (mmap, no-mmap) against moe-engine
--shared-expert-arena (/dev/shm, tmpfs huge=always, hugetlbfs). Driven by
bench/llamacpp_side_by_side.sh, which makes the model, the mounts and the peer install, and
cleans up; this part starts the engines, times them and reads their memory from /proc.

Per (way, cache, N): N engines started at once; each is "ready" when it printed its JSON line
(llama.cpp: model loaded, context made, prompt evaluated to a finite next-token distribution;
moe-engine: arena loaded or attached, tokens routed through the experts). Then, with all N
holding: PSS summed over the N processes (smaps_rollup; hugetlb pages, which PSS leaves out,
added once), what free(1) says (used and buff/cache deltas against just before the start) and
MemAvailable's drop, VmPTE per engine, the share of the weight mapping on 2 MiB pages
(AnonHugePages, ShmemPmdMapped, FilePmdMapped, Shared/Private_Hugetlb of that mapping in
smaps), and (warm runs) the time for one engine to restart while the others keep running.
cold: page cache dropped (echo 3 > drop_caches) and no arena; warm: what the previous run left
(the model in the page cache; for the arena ways also the published arena).
"""
import argparse
import csv
import json
import os
import selectors
import signal
import subprocess
import sys
import time

GIB = 1 << 30


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024 if v.strip().endswith("kB") else int(v.split()[0])
    return out


def free_view(m):
    # procps free: buff/cache = Buffers + Cached + SReclaimable; used = total - free - buff/cache
    buffcache = m["Buffers"] + m["Cached"] + m["SReclaimable"]
    return {"used": m["MemTotal"] - m["MemFree"] - buffcache, "buffcache": buffcache,
            "available": m["MemAvailable"]}


def kv_file(path):
    out = {}
    with open(path) as f:
        for line in f:
            if ":" not in line:
                continue
            k, v = line.split(":", 1)
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


HUGE_FIELDS = ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb",
               "Private_Hugetlb")


def weight_mapping(pid, way, model, arena):
    """(bytes mapped, bytes on 2 MiB pages, hugetlb bytes) of the mapping(s) holding weights."""
    mapped = huge = hugetlb = 0
    current = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5] if len(head) > 5 else ""
                size = hi - lo
                if way.startswith("llama"):
                    take = (path == model) if way == "llama-mmap" else (
                        path == "" and size >= 64 << 20)
                else:
                    take = path == arena
                current = take
                if take:
                    mapped += size
                continue
            if current and head and head[0].rstrip(":") in HUGE_FIELDS:
                v = int(head[1]) * 1024
                huge += v
                if "Hugetlb" in head[0]:
                    hugetlb += v
    return mapped, huge, hugetlb


class Engine:
    def __init__(self, cmd):
        self.cmd = cmd
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        self.ready = None
        self.report = None
        self.buf = b""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_ready(engines, timeout=900):
    sel = selectors.DefaultSelector()
    for e in engines:
        os.set_blocking(e.proc.stdout.fileno(), False)
        sel.register(e.proc.stdout, selectors.EVENT_READ, e)
    deadline = time.monotonic() + timeout
    pending = set(id(e) for e in engines)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError("engines not ready in time: " + " ".join(engines[0].cmd))
        for key, _ in sel.select(1.0):
            e = key.data
            chunk = e.proc.stdout.read()
            now = time.monotonic()
            if not chunk:
                sel.unregister(e.proc.stdout)
                if e.ready is None:
                    raise RuntimeError(f"engine exited {e.proc.wait()} before ready: "
                                       + " ".join(e.cmd))
                continue
            e.buf += chunk
            if e.ready is None and b"\n" in e.buf:
                e.ready = now - e.start
                e.report = json.loads(e.buf.split(b"\n")[0])
                pending.discard(id(e))
    sel.close()


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--weight-bytes", type=int, required=True)
    ap.add_argument("--node-prefix", required=True)
    ap.add_argument("--node", default="node", help="node >= 20 for node-llama-cpp")
    ap.add_argument("--llama-peer", required=True)
    ap.add_argument("--moe-engine", required=True)
    ap.add_argument("--expert-arena", required=True)
    ap.add_argument("--way", action="append", required=True,
                    help="NAME=ARENA_PATH for arena ways, NAME for llama ways")
    ap.add_argument("--baseline-model", help="a tiny GGUF: the llama.cpp runtime's own memory")
    ap.add_argument("--ns", default="1,2,4")
    ap.add_argument("--tokens", default="8")
    ap.add_argument("--csv", required=True)
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    rows = []

    def command(way, arena):
        if way == "llama-runtime":  # node + node-llama-cpp + libllama with a 4 MiB model
            return [args.node, args.llama_peer, "--prefix", args.node_prefix, "--model",
                    args.baseline_model, "--mmap", "on", "--tokens", args.tokens, "--threads", "1",
                    "--hold"]
        if way.startswith("llama"):
            return [args.node, args.llama_peer, "--prefix", args.node_prefix, "--model", args.model,
                    "--mmap", "on" if way == "llama-mmap" else "off", "--tokens", args.tokens,
                    "--threads", "1", "--hold"]
        return [args.moe_engine, "--model", args.model, "--shared-expert-arena", arena,
                "--tokens", args.tokens, "--threads", "1", "--json", "--hold"]

    plan = []
    if args.baseline_model:
        plan.append(("llama-runtime", "", [1], ["warm"]))
    for spec in args.way:
        way, _, arena = spec.partition("=")
        plan.append((way, arena, ns, ["cold", "warm"]))
    for way, arena, way_ns, caches in plan:
        for n in way_ns:
            for cache in caches:
                need = (n if way == "llama-nommap" else 1) * args.weight_bytes + args.weight_bytes
                avail = meminfo()["MemAvailable"]
                if cache == "cold":
                    if arena:
                        subprocess.run([args.expert_arena, "rm", arena], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
                    drop_caches()
                elif arena and not os.path.exists(arena):
                    subprocess.run(command(way, arena)[:-1], stdout=subprocess.DEVNULL, check=True)
                if avail < need + GIB:
                    print(f"skip {way} N={n} {cache}: {avail / GIB:.1f} GiB available, "
                          f"{need / GIB:.1f} GiB needed", file=sys.stderr)
                    continue
                before = free_view(meminfo())
                engines = [Engine(command(way, arena)) for _ in range(n)]
                try:
                    wait_ready(engines)
                    readies = [e.ready for e in engines]
                    loads = [e.report.get("load_seconds" if way.startswith("llama") else "seconds",
                                          0.0) for e in engines]
                    time.sleep(0.5)
                    after = free_view(meminfo())
                    pss = sum(kv_file(f"/proc/{e.proc.pid}/smaps_rollup").get("Pss", 0)
                              for e in engines)
                    ptes = [kv_file(f"/proc/{e.proc.pid}/status").get("VmPTE", 0)
                            for e in engines]
                    maps = [weight_mapping(e.proc.pid, way, args.model, arena) for e in engines]
                    restart = None
                    if cache == "warm":
                        engines[0].stop()
                        engines[0] = Engine(command(way, arena))
                        wait_ready([engines[0]])
                        restart = engines[0].ready
                finally:
                    for e in engines:
                        e.stop()
                hugetlb = max(m[2] for m in maps)  # one arena, mapped whole by every engine
                huge_share = sum(m[1] for m in maps) / max(1, sum(m[0] for m in maps))
                row = {
                    "way": way, "cache": cache, "n": n,
                    "ready_mean_s": sum(readies) / n, "ready_max_s": max(readies),
                    # in-process: llama.cpp's model load (llama_model_load_from_file), or the
                    # arena's open (load or attach) in moe-engine
                    "load_mean_s": sum(loads) / n,
                    "host_gib": (pss + hugetlb) / GIB,
                    "free_used_delta_gib": (after["used"] - before["used"]) / GIB,
                    "free_buffcache_delta_gib": (after["buffcache"] - before["buffcache"]) / GIB,
                    "available_drop_gib": (before["available"] - after["available"]) / GIB,
                    "vmpte_kib": sum(ptes) / n / 1024,
                    "huge_pct": 100 * huge_share,
                    "restart_s": restart,
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                with open(args.csv, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
                    w.writeheader()
                    for r in rows:
                        w.writerow({k: (f"{v:.3f}" if isinstance(v, float) else
                                        ("" if v is None else v)) for k, v in r.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
