"""Decode speed of vLLM's CPU build with and without the arena, alternating in one run.

Each round starts one engine per setting, each a process of its own, one after another (each
round begins with the next setting, so that going first falls on each alike): plain vLLM
(--load-format auto), the arena with dense_gemm "shared" (the default: torch's linear on the
arena's dense weights) and the arena with dense_gemm "packed" (each engine packs its dense
weights privately for vLLM's CPU GEMM, as plain vLLM does; the experts stay shared), each
with the loader's default pages (on 4 KiB tmpfs the 2 MiB pages made after the build), or
"before": "shared" with huge_after_build false (each piece's 2 MiB pages made before it is
written), "after": "shared" with huge_after_build true. The first
arena engine builds the arena, every later one attaches. Each engine warms up, then decodes
`--tokens` tokens greedily (ignore_eos) for one prompt (batch 1) and for 16 prompts at once
(batch 16): tokens/s is batch x tokens over the wall time of that generate call. The engine
also reports its Pss (/proc/self/smaps_rollup) and the private bytes of the arena's
Arena.memory() once it is ready. Prints every round, the medians, each arena setting's ratio
to plain (of the medians, and the median of the per-round ratios), and the command.

The checkpoint is a random Qwen3-MoE made here with transformers' own classes (bfloat16,
hidden 2048, 10 layers, 40 experts, moe_intermediate 768: 3.99 GB by default) on --work-dir,
or --model DIR, a checkpoint made before (kept).

    .venv-vllm/bin/python bench/vllm_decode_bench.py [--rounds 3] [--tokens 64]
        [--hidden 2048 --layers 10 --experts 40 --moe-intermediate 768] [--work-dir DIR]
        [--settings plain,shared,packed] [--model DIR] [--arena-root DIR] [--rebuild]
        [--profile N] [--settle S]

Needs PYTHONPATH=build/python and the package installed in vLLM's environment (its plugin
entry point), as the vLLM tests do. Not part of CI. Removes its checkpoint and arenas.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

ENGINE = textwrap.dedent("""
    import json, os, sys, time
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    model_dir, arena_dir, setting, tokens, profile, settle = sys.argv[1:7]
    tokens, profile, settle = int(tokens), int(profile), float(settle)
    extra = {}
    if setting != "plain":
        config = {"arena_dir": arena_dir,
                  "dense_gemm": "shared" if setting in ("before", "after") else setting}
        if setting in ("before", "after"):
            config["huge_after_build"] = setting == "after"
        extra = {"load_format": "expert_arena", "model_loader_extra_config": config}
    import threading
    def held():
        # This engine's private memory and the arena's pages (which RSS would count once per
        # mapping): what a memory limit sees of the start.
        size = 0
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                size = int(line.split()[1]) * 1024
        for name in os.listdir(arena_dir) if setting != "plain" else ():
            try:
                size += os.stat(os.path.join(arena_dir, name)).st_blocks * 512
            except OSError:
                pass
        return size
    peak, started_up = [0], threading.Event()
    def watch():
        while not started_up.wait(0.01):
            peak[0] = max(peak[0], held())
    threading.Thread(target=watch, daemon=True).start()
    started = time.monotonic()
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256,
              max_num_seqs=16, seed=0, **extra)
    ready = time.monotonic() - started
    started_up.set()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    def prompts(n):
        return [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 3 for j in range(8)]}
                for i in range(n)]
    llm.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    result = {"ready_s": ready, "start_peak_gib": peak[0] / 2**30}
    for batch in (1, 16):
        t = time.monotonic()
        llm.generate(prompts(batch), params, use_tqdm=False)
        result["tok_s_%d" % batch] = batch * tokens / (time.monotonic() - t)
    def pmd_mapped():
        # This process's mappings of the arena's file on 2 MiB page table entries: the
        # largest (the views' mapping once the arena's own left the page tables).
        sizes, inside = [0], False
        for line in open("/proc/self/smaps"):
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = setting != "plain" and line.rstrip().split(" ")[-1].startswith(
                    arena_dir)
                sizes.append(0)
            elif inside and head[0] in ("FilePmdMapped:", "ShmemPmdMapped:"):
                sizes[-1] += int(head[1]) * 1024
        return max(sizes)
    result["arena_pmd_mib"] = pmd_mapped() / 2**20
    if settle:
        # Decoded again once the arena's 2 MiB pages had time to be made (on 4 KiB tmpfs an
        # engine-made arena gets them after its build, in the background).
        time.sleep(settle)
        # Warmed up again as at the start: what the first decodes paid (pages faulted back
        # in where a 2 MiB page replaced them) is not counted.
        llm.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        for batch in (1, 16):
            t = time.monotonic()
            llm.generate(prompts(batch), params, use_tqdm=False)
            result["settled_tok_s_%d" % batch] = batch * tokens / (time.monotonic() - t)
        result["settled_arena_pmd_mib"] = pmd_mapped() / 2**20
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                result["pss_mib"] = int(line.split()[1]) / 1024
    def memory(model):
        arena = getattr(model, "expert_arena", None)
        if arena is None:
            return {}
        m = arena.memory()
        out = {"role": arena.report["role"], "arena_private_mib": m["private_bytes"] / 2**20}
        out.update({k: v for k, v in getattr(model, "expert_arena_start", {}).items()
                    if k != "ready_s"})
        return out
    result.update(llm.apply_model(memory)[0])
    if profile:
        # One more batch-1 decode under torch's profiler: the operators by their own CPU time.
        import torch
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts(1), params, use_tqdm=False)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:profile]
        result["profile"] = [[e.key, e.self_cpu_time_total / 1e3, e.count] for e in ops]
    print("RESULT " + json.dumps(result), flush=True)
""")


def make_checkpoint(out, args):
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    config = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
        head_dim=128, vocab_size=512, max_position_embeddings=512,
        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
        num_experts_per_tok=8, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    torch.set_default_dtype(torch.float32)
    tok = Tokenizer(models.WordLevel(vocab={"t%d" % i: i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)
    return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
               if f.endswith(".safetensors"))


def run_engine(model_dir, arena_dir, setting, tokens, timeout, profile=0, settle=0):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE="2")
    p = subprocess.run([sys.executable, "-c", ENGINE, model_dir, arena_dir, setting,
                        str(tokens), str(profile), str(settle)], capture_output=True,
                        text=True, env=env,
                       timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("the %s engine gave no result (exit %d):\n%s"
                       % (setting, p.returncode, p.stderr[-4000:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--experts", type=int, default=40)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--work-dir", default=None, help="where the checkpoint goes (default: a "
                    "temporary folder under /var/tmp)")
    ap.add_argument("--model", default=None, help="a checkpoint directory to use instead of "
                    "making one (kept afterwards)")
    ap.add_argument("--arena-root", default="/dev/shm")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine")
    ap.add_argument("--settings", default="plain,shared,packed", help="comma-separated, "
                    "from plain, shared, packed, before, after (shared with huge_after_build "
                    "false / true; plain is always run: the ratios are to it)")
    ap.add_argument("--rebuild", action="store_true", help="remove the arenas before each "
                    "arena engine, so that every one builds (the builder's start, with where "
                    "its time went) instead of only the first")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="the last round's "
                    "engines decode once more under torch's profiler: their N costliest "
                    "operators (own CPU time, ms) are printed side by side")
    ap.add_argument("--settle", type=float, default=0, metavar="S", help="each engine "
                    "decodes again S seconds after its first decodes (settled_tok_s_1/16): "
                    "an engine-made arena on 4 KiB tmpfs gets its 2 MiB pages after the build")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ea-decode-bench-", dir=args.work_dir or "/var/tmp")
    arenas = tempfile.mkdtemp(prefix="ea-decode-bench-", dir=args.arena_root)
    settings = ["plain"] + [s for s in args.settings.split(",") if s and s != "plain"]
    for s in settings:
        if s not in ("plain", "shared", "packed", "before", "after"):
            ap.error("unknown setting %r" % s)
    rows = {s: [] for s in settings}
    profiles = {}
    try:
        if args.model:
            model = args.model
            size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                       if f.endswith(".safetensors"))
        else:
            model = os.path.join(work, "qwen3_moe")
            size = make_checkpoint(model, args)
        print("checkpoint: %s, %.2f GB of safetensors" % (model, size / 1e9), flush=True)
        for r in range(args.rounds):
            # Each round starts with another setting (plain first, then shared, ...): what
            # running first or after another engine costs falls on each setting alike.
            for s in settings[r % len(settings):] + settings[:r % len(settings)]:
                last = r == args.rounds - 1
                if args.rebuild and s != "plain":
                    for name in os.listdir(arenas):
                        os.unlink(os.path.join(arenas, name))
                result = run_engine(model, arenas, s, args.tokens, args.timeout,
                                    args.profile if last else 0, args.settle)
                profiles[s] = result.pop("profile", [])
                rows[s].append(result)
                print("round %d %-6s %s" % (r + 1, s, json.dumps(result)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(arenas, ignore_errors=True)
    print("\n| setting | batch 1 tok/s | batch 16 tok/s | vs plain (1 / 16) | per-round ratio, "
          "median (1 / 16) | ready s | Pss MiB | arena private MiB |\n"
          "|---|---|---|---|---|---|---|---|")
    med = {s: {k: statistics.median(x[k] for x in rows[s]) for k in
               ("tok_s_1", "tok_s_16", "ready_s", "pss_mib", "start_peak_gib")} for s in settings}
    for s in settings:
        private = [x["arena_private_mib"] for x in rows[s] if "arena_private_mib" in x]
        per_round = ["%.2fx / %.2fx" % tuple(statistics.median(
            x[k] / p[k] for x, p in zip(rows[s], rows["plain"])) for k in ("tok_s_1", "tok_s_16"))]
        print("| %s | %.1f | %.1f | %.2fx / %.2fx | %s | %.1f | %.0f | %s |" % (
            s, med[s]["tok_s_1"], med[s]["tok_s_16"],
            med[s]["tok_s_1"] / med["plain"]["tok_s_1"],
            med[s]["tok_s_16"] / med["plain"]["tok_s_16"], per_round[0], med[s]["ready_s"],
            med[s]["pss_mib"], "%.0f" % statistics.median(private) if private else "-"))
    steps = ("load_and_process_s", "pages_s", "copy_s", "checksums_s", "bind_s")
    for s in settings:
        built = [x for x in rows[s] if x.get("role") == "loaded" and "pages_s" in x]
        if built:
            print("\n%s, %d building engine(s): ready %s s against plain's median %.1f s "
                  "(%.2fx); medians: %s; memory at the start's peak (private and the arena's "
                  "pages) %.2f GiB against plain's %.2f GiB" % (
                      s, len(built), ", ".join("%.1f" % x["ready_s"] for x in built),
                      med["plain"]["ready_s"],
                      statistics.median(x["ready_s"] for x in built) / med["plain"]["ready_s"],
                      ", ".join("%s %.2f" % (k[:-2], statistics.median(x[k] for x in built))
                                for k in steps),
                      statistics.median(x["start_peak_gib"] for x in built),
                      med["plain"]["start_peak_gib"]))
    for s in settings if args.settle else ():
        print("\n%s, %.0f s later: batch 1 / 16 %.1f / %.1f tok/s (%.2fx / %.2fx of plain's, "
              "per-round medians); arena on 2 MiB page table entries %.0f MiB, at the first "
              "decodes %.0f MiB" % (
                  s, args.settle, *(statistics.median(x["settled_tok_s_%d" % b] for x in rows[s])
                                    for b in (1, 16)),
                  *(statistics.median(x["settled_tok_s_%d" % b] / p["settled_tok_s_%d" % b]
                                      for x, p in zip(rows[s], rows["plain"])) for b in (1, 16)),
                  statistics.median(x["settled_arena_pmd_mib"] for x in rows[s]),
                  statistics.median(x["arena_pmd_mib"] for x in rows[s])))
    for s in settings if args.profile else ():
        print("\n%s, batch 1, %d tokens: operator, own CPU ms, calls" % (s, args.tokens))
        for name, ms, count in profiles[s]:
            print("  %-48s %9.1f %7d" % (name[:48], ms, count))
    print("\n(medians of %d rounds, engines alternating; %s)" % (args.rounds, " ".join(
        [os.path.relpath(sys.argv[0])] + sys.argv[1:])))


if __name__ == "__main__":
    main()
