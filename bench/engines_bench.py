"""Real engines on one host, with and without expert-arena, in one run (issue 28 D).

  (a) vLLM (CPU build): two plain engines (default loader) started at once, one plain engine
      alone, then two engines with --load-format expert_arena started at once on a fresh arena
      directory, then a third plugin engine started alone after them (the restart);
  (b) Hugging Face transformers: the same with plain from_pretrained processes and processes
      through expert_arena.shared_module.

All on the same random Qwen3-MoE checkpoint made here with transformers' own classes (as
tests/python/test_vllm.py makes its own, only larger). For each engine: time to ready (the
engine's own clock, from before it imports vLLM or torch to the model ready), its Pss from
/proc/PID/smaps_rollup while all engines of the phase are alive, the Pss of its arena mappings
(/proc/PID/smaps) and the checkpoint bytes it read. Bytes read are /proc/PID/io read_bytes
(bytes this process made the kernel fetch from the block device) after the checkpoint's pages
were dropped from the page cache (posix_fadvise DONTNEED) before each phase, so a read of the
checkpoint shows as disk bytes whoever else reads it later; rchar is not used (safetensors maps
the file, so its reads are page faults that rchar never counts, and rchar does count every .py
file an import reads). read_bytes counts any file, so it also shows modules and caches an
engine reads from disk; what is the checkpoint's alone is its page-cache residency after each
phase (fincore; dropped before it): the bytes of it that the phase's engines read, together.
The library's own count (report["bytes_read"]) is shown beside them.

    .venv-vllm/bin/python bench/engines_bench.py [--hidden 768 --experts 16 --layers 6]

Prints a Markdown table and the command. Removes its checkpoint and arena files at the end.
Not part of CI.
"""

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_ENGINE = os.path.join(ROOT, "tests", "python", "vllm_engine.py")
MIB = 1024 * 1024

HF_ENGINE = textwrap.dedent("""
    import json, os, sys, time
    started = time.monotonic()
    import warnings
    warnings.simplefilter("ignore")
    import torch, transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    import expert_arena

    path, model_dir, mode = sys.argv[1:4]
    if mode == "plain":
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        result = {"role": "private"}
    else:
        config = AutoConfig.from_pretrained(model_dir)
        m = expert_arena.shared_module(
            path, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32),
            lambda _: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            identity="transformers %s f32" % transformers.__version__, files=[model_dir],
            quiet=True).eval()
        start, size = m.expert_arena.data_range()
        tensors = list(m.parameters()) + list(m.buffers())
        report = m.expert_arena.report
        result = {"role": report["role"], "path": report["path"],
                  "bytes_read": report["bytes_read"], "data_bytes": report["data_bytes"],
                  "in_arena": all(start <= t.data_ptr() < start + size for t in tensors)}
    result["ready_seconds"] = time.monotonic() - started
    with torch.no_grad():
        out = m.generate(torch.tensor([[1, 5, 9, 2, 7]]), max_new_tokens=8, do_sample=False)
    result["tokens"] = out[0].tolist()
    result["pid"] = os.getpid()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdin.read()  # held, alive, until the bench has measured every engine of the phase
""")


def make_checkpoint(out, hidden, experts, layers, moe_intermediate, vocab):
    """A random Qwen3-MoE checkpoint of transformers' own class and a WordLevel tokenizer,
    made here (nothing from the network); as tests/python/test_vllm.py, larger."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    heads = max(4, hidden // 128)
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(2, heads // 4), head_dim=hidden // heads,
        vocab_size=vocab, max_position_embeddings=256, num_experts=experts,
        num_experts_per_tok=2, moe_intermediate_size=moe_intermediate,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={"t%d" % i: i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)
    return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
               if f.endswith(".safetensors"))


def drop_from_page_cache(model_dir):
    """Drops the checkpoint's clean pages from the page cache, so that the next read of them
    is a disk read that /proc/PID/io read_bytes counts; returns the bytes still cached."""
    for f in os.listdir(model_dir):
        fd = os.open(os.path.join(model_dir, f), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return cached_bytes(model_dir)


def cached_bytes(model_dir):
    """Bytes of the checkpoint's safetensors files in the page cache (fincore), or None."""
    files = [os.path.join(model_dir, f) for f in os.listdir(model_dir)
             if f.endswith(".safetensors")]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES"] + files,
                             capture_output=True, text=True, check=True).stdout
        return sum(int(x) for x in out.split())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def child_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache per engine
               VLLM_CPU_OMP_THREADS_BIND="nobind",  # engines at once share the cores
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine is this one process
    return env


class Engine:
    def __init__(self, label, args):
        self.label = label
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=child_env(),
                                  process_group=0)
        self.answers = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.result = None

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                self.answers.put(json.loads(line[len("RESULT "):]))
        self.answers.put(None)

    def log(self):
        self.err.seek(0)
        return self.err.read()[-4000:]

    def answer(self, deadline):
        try:
            self.result = self.answers.get(timeout=max(1, deadline - time.monotonic()))
        except queue.Empty:
            raise SystemExit("%s: no answer in time:\n%s" % (self.label, self.log()))
        if self.result is None:
            raise SystemExit("%s exited (%s) without an answer:\n%s"
                             % (self.label, self.p.wait(), self.log()))
        return self.result

    def measure(self):
        """Pss of the process and of its arena mappings, and its disk reads, while alive."""
        pid = self.p.pid
        rollup = {}
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    rollup[parts[0][:-1]] = int(parts[1]) * 1024
        io = {}
        with open("/proc/%d/io" % pid) as f:
            for line in f:
                k, v = line.split(":")
                io[k] = int(v)
        path = self.result.get("path")
        self.result.update(pss=rollup["Pss"], pss_anon=rollup.get("Pss_Anon", 0),
                           arena_pss=arena_pss(pid, path) if path else 0,
                           read_bytes=io["read_bytes"], rchar=io["rchar"])

    def finish(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            return self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.p.wait()

    def kill(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def arena_pss(pid, path):
    """Pss of every mapping of the arena file in process `pid`, in bytes."""
    total, inside = 0, False
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Pss", "Rss")):
                inside = line.rstrip("\n").endswith(path)
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024
    return total


def phase(name, commands, model_dir, timeout, alive):
    """Starts the engines of `commands` at once (with the checkpoint out of the page cache),
    waits for all of them, measures each while all are alive, then closes them."""
    left = drop_from_page_cache(model_dir)
    engines = [Engine("%s #%d" % (name, i + 1), c) for i, c in enumerate(commands)]
    alive.extend(engines)
    deadline = time.monotonic() + timeout
    try:
        for e in engines:
            e.answer(deadline)
        for e in engines:
            e.measure()
    finally:
        codes = [e.finish() for e in engines]
        for e in engines:
            alive.remove(e)
    if any(codes):
        raise SystemExit("%s: exit codes %s:\n%s" % (name, codes, engines[0].log()))
    after = cached_bytes(model_dir)
    for e in engines:
        e.result["cached_before"], e.result["cached_after"] = left, after
    return [e.result for e in engines]


def mib_or_none(n):
    return None if n is None else round(n / MIB, 1)


def mib(n):
    return "%.1f" % (n / MIB)


def rows_of(engine, results_by_phase, reference):
    rows = []
    for label, results in results_by_phase:
        for r in sorted(results, key=lambda r: r["ready_seconds"]):
            lib_read = r.get("bytes_read")
            rows.append("| %s | %s | %s | %.1f | %s | %s | %s | %s | %s |" % (
                engine, label, r["role"], r["ready_seconds"], mib(r["pss"]), mib(r["pss_anon"]),
                mib(r["arena_pss"]) if r.get("path") else "-", mib(r["read_bytes"]),
                mib(lib_read) if lib_read is not None else "-",
            ) + (" yes |" if r["tokens"] == reference else " **no** |"))
    return rows


def ratios(engine, plain, alone, shared, restart, checkpoint):
    """The plugin against plain vLLM or transformers, same run: a dict of figures and one
    Markdown row."""
    builder = next(r for r in shared if r["role"] == "loaded")
    attacher = next(r for r in shared if r["role"] == "attached")
    plain_ready = sum(r["ready_seconds"] for r in plain) / len(plain)
    pss_plain = sum(r["pss"] for r in plain)
    pss_shared = sum(r["pss"] for r in shared)
    # An engine whose weights are all the arena's: its Pss outside the arena mappings is the
    # engine without weights (libraries, heap, KV cache). What each engine of a pair holds
    # beyond that, summed, is the pair's weight memory (plain: its private copies and any
    # checkpoint pages it keeps mapped; the arena pair: the arena once and whatever the
    # builder's load left behind).
    base = attacher["pss"] - attacher["arena_pss"]
    weights_plain = pss_plain - len(plain) * base
    weights_shared = pss_shared - len(shared) * base
    out = {
        "plain_pair_ready_s": [round(r["ready_seconds"], 1) for r in plain],
        "plain_alone_ready_s": round(alone["ready_seconds"], 1),
        "builder_ready_s": round(builder["ready_seconds"], 1),
        "attacher_ready_s": round(attacher["ready_seconds"], 1),
        "restart_ready_s": round(restart["ready_seconds"], 1),
        "pair_pss_mib": [round(pss_shared / MIB), round(pss_plain / MIB)],
        "pair_weights_pss_mib": [round(weights_shared / MIB), round(weights_plain / MIB)],
        "arena_pss_sum_mib": round(sum(r["arena_pss"] for r in shared) / MIB, 1),
        "weights_mib": round(builder["data_bytes"] / MIB, 1),
        "pair_disk_read_mib": [round(sum(r["read_bytes"] for r in shared) / MIB, 1),
                               round(sum(r["read_bytes"] for r in plain) / MIB, 1)],
        "attacher_disk_read_mib": round(attacher["read_bytes"] / MIB, 1),
        "restart_disk_read_mib": [round(restart["read_bytes"] / MIB, 1),
                                  round(alone["read_bytes"] / MIB, 1)],
        # The checkpoint's bytes in the page cache after each phase (dropped before it): what
        # the phase's engines read of the checkpoint, all of them together.
        "checkpoint_cached_after_mib": {
            "plain pair": mib_or_none(plain[0]["cached_after"]),
            "plain alone": mib_or_none(alone["cached_after"]),
            "arena pair": mib_or_none(shared[0]["cached_after"]),
            "restart": mib_or_none(restart["cached_after"])},
        "checkpoint_cached_before_mib": mib_or_none(plain[0]["cached_before"]),
        "checkpoint_mib": round(checkpoint / MIB, 1),
    }
    row = ("| %s | %.1f s / %.1f s: %.2fx | %.1f s / %.1f s: %.2fx | %.1f s / %.1f s: %.2fx "
           "| %d / %d MiB: %.2fx | %d / %d MiB: %.2fx (arena %d MiB) "
           "| %.1f / %.1f MiB; attacher %.1f, restart %.1f / %.1f MiB |") % (
        engine, builder["ready_seconds"], plain_ready, builder["ready_seconds"] / plain_ready,
        attacher["ready_seconds"], plain_ready, attacher["ready_seconds"] / plain_ready,
        restart["ready_seconds"], alone["ready_seconds"],
        restart["ready_seconds"] / alone["ready_seconds"],
        pss_shared / MIB, pss_plain / MIB, pss_shared / pss_plain,
        weights_shared / MIB, weights_plain / MIB, weights_shared / weights_plain,
        out["arena_pss_sum_mib"],
        sum(r["read_bytes"] for r in shared) / MIB, sum(r["read_bytes"] for r in plain) / MIB,
        attacher["read_bytes"] / MIB, restart["read_bytes"] / MIB, alone["read_bytes"] / MIB)
    return out, row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per phase")
    ap.add_argument("--work-dir", default=None,
                    help="where the checkpoint goes (a disk-backed file system, so that "
                    "read_bytes means disk reads; default: a new directory in $TMPDIR)")
    ap.add_argument("--arena-root", default="/dev/shm", help="where each fresh arena "
                    "directory is made")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    command = " ".join([os.path.relpath(sys.executable, ROOT)
                        if sys.executable.startswith(ROOT) else sys.executable,
                        os.path.relpath(os.path.abspath(__file__), ROOT)] + sys.argv[1:])

    work = tempfile.mkdtemp(prefix="ea-engines-bench-", dir=args.work_dir)
    made = [work]
    alive = []
    try:
        # The interpreter's own files into the page cache first: no engine is charged with
        # reading vLLM's or torch's modules from disk.
        warm = "import torch, transformers" + ("" if args.skip_vllm else ", vllm")
        subprocess.run([sys.executable, "-c", warm], check=True, env=child_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        model_dir = os.path.join(work, "qwen3_moe")
        checkpoint = make_checkpoint(model_dir, args.hidden, args.experts, args.layers,
                                     args.moe_intermediate, args.vocab)
        print("checkpoint: Qwen3-MoE hidden %d, %d experts, %d layers, moe_intermediate %d, "
              "vocab %d, float32: %.1f MiB of safetensors" % (
                  args.hidden, args.experts, args.layers, args.moe_intermediate, args.vocab,
                  checkpoint / MIB), flush=True)
        header = ["| engine | loader, phase | role | ready s | Pss MiB | Pss anon MiB | "
                  "arena Pss MiB | disk read MiB | library bytes_read MiB | tokens = plain |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        rows, summary = [], []

        def run_engine(name, plain_cmd, shared_cmd):
            arena_dir = tempfile.mkdtemp(prefix="ea-engines-bench-", dir=args.arena_root)
            made.append(arena_dir)
            t0 = time.monotonic()
            plain = phase(name + " plain", [plain_cmd(arena_dir)] * 2, model_dir,
                          args.timeout, alive)
            alone = phase(name + " plain alone", [plain_cmd(arena_dir)], model_dir,
                          args.timeout, alive)[0]
            shared = phase(name + " arena", [shared_cmd(arena_dir)] * 2, model_dir,
                           args.timeout, alive)
            restart = phase(name + " restart", [shared_cmd(arena_dir)], model_dir,
                            args.timeout, alive)[0]
            print("%s: %.0f s for its four phases" % (name, time.monotonic() - t0),
                  flush=True)
            reference = plain[0]["tokens"]
            rows.extend(rows_of(name, [("plain, 2 at once", plain), ("plain, alone", [alone]),
                                       ("expert_arena, 2 at once", shared),
                                       ("expert_arena, restart", [restart])], reference))
            summary.append((name,) + ratios(name, plain, alone, shared, restart, checkpoint))
            shutil.rmtree(arena_dir, ignore_errors=True)

        if not args.skip_vllm:
            run_engine(
                "vLLM %s" % __import__("importlib.metadata").metadata.version("vllm-cpu"),
                lambda d: [sys.executable, VLLM_ENGINE, model_dir, "auto", d, "float32",
                           "--hold"],
                lambda d: [sys.executable, VLLM_ENGINE, model_dir, "expert_arena", d,
                           "float32", "--hold"])
        if not args.skip_transformers:
            run_engine(
                "transformers %s" % __import__("transformers").__version__,
                lambda d: [sys.executable, "-c", HF_ENGINE, os.path.join(d, "hf.arena"),
                           model_dir, "plain"],
                lambda d: [sys.executable, "-c", HF_ENGINE, os.path.join(d, "hf.arena"),
                           model_dir, "shared"])

        print()
        print("\n".join(header + rows))
        print()
        print("| engine | ready, builder / plain (2 at once) | attacher / plain (2 at once) | "
              "restart / plain alone | Pss of the pair, arena / plain | weight memory of the "
              "pair, arena / plain | disk reads, arena pair / plain pair |")
        print("|---|---|---|---|---|---|---|")
        for _, _, row in summary:
            print(row)
        print()
        for name, figures, _ in summary:
            print("- %s: %s" % (name, json.dumps(figures)))
        print()
        print("command: `%s` (%s UTC, %d CPUs, load %.1f)" % (
            command, time.strftime("%Y-%m-%d %H:%M", time.gmtime()), os.cpu_count(),
            os.getloadavg()[0]))
    finally:
        for e in alive:
            e.kill()
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
