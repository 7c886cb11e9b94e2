"""Time to first token of a vLLM decode engine that takes a prompt's KV from a prefill engine,
against the same engine recomputing the prompt, for each KV connector between two real vLLM
CPU engines (each its own process) on one host, in one run:

  recompute  a plain decode engine (no connector): it computes the whole prompt;
  segments   expert_arena.vllm_kv, transfer "segments" (the prefill engine's stream segments);
  cache      expert_arena.vllm_kv, transfer "cache" (read from the prefill engine's KV cache,
             which lives in a shared file);
  segments-4k, cache-4k  the same with huge_pages false: the decode engine's own KV cache
             left on the pages torch gave it (4 KiB where transparent huge pages are
             "madvise"); without -4k it is moved onto 2 MiB pages, and timed once it is;
  example    vLLM's ExampleConnector (safetensors files in --example-directory);
  nixl       vLLM's NixlConnector (UCX, kv_buffer_device "cpu"; the prefill engine's
             kv_transfer_params handed to the decode engine, as vLLM's proxy does); needs
             --nixl DIR, a folder holding PyPI's `nixl` 1.5.1 and `nixl-cu13` 1.5.1 (the meta
             package picks the wheel of the CUDA torch was built for, 13 in .venv-vllm; no
             nixl-cu13 1.5.2 exists):
                 pip download nixl==1.5.1 nixl-cu13==1.5.1 --no-deps -d W
                 for w in W/*.whl; do unzip -q -o "$w" -d DIR; done

The model is a random Qwen3-MoE made here with transformers' class (bf16; --layers, --kv-heads,
--head-size set the KV bytes per token, --hidden the compute). A prefill engine computes each
prompt (max_tokens 1) and stays alive; then a decode engine, after one warm-up prompt, runs each
prompt with max_tokens 1 and is timed around llm.generate (its load, its last block's compute
and the first token), and its prompt tokens cached (vLLM's num_cached_tokens; NixlConnector's
loads are not counted there) and its first token (against recompute's) are shown. Prompts are
random, one set per length (--prompts of each), the same set for every connector.

    .venv-vllm/bin/python bench/kv_engine_bench.py [--tokens 1024 4096 16384] [--prompts 3]
        [--connectors recompute,segments,cache,example,nixl] [--nixl DIR] [--layers 8]
        [--kv-heads 8] [--head-size 128] [--hidden 256] [--threads 2]

Prints a Markdown table (medians, seconds; the KV bytes a prompt carries) and the command.
Not part of CI (a 16k-token prompt's recompute takes minutes on two cores).
"""

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_BLOCK = 128


def _model(out, args):
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    config = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.kv_heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_size, vocab_size=1024,
        max_position_embeddings=max(args.tokens) + 256, moe_intermediate_size=args.hidden // 2,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
        torch_dtype="bfloat16")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={"t%d" % i: i for i in range(1024)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one engine (this script with --engine JSON) -----------------------------------------

def _transfer_config(job):
    connector, role = job["connector"], job["role"]
    transfer, _, pages = connector.partition("-")
    if transfer in ("segments", "cache"):
        return {"kv_connector": "ExpertArenaConnector",
                "kv_connector_module_path": "expert_arena.vllm_kv",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_connector_extra_config": {"directory": job["directory"],
                                              "spill_directory": job["directory"],
                                              "name": "bench", "transfer": transfer,
                                              "load": job["load"],
                                              "huge_pages": pages != "4k",
                                              "segment_bytes": 256 << 20,
                                              "max_segments": 16}}
    if connector == "example":
        return {"kv_connector": "ExampleConnector",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_connector_extra_config": {"shared_storage_path": job["directory"]}}
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                "kv_buffer_device": "cpu"}
    return None


def _engine(job):
    from vllm import LLM, SamplingParams
    extra = {}
    config = _transfer_config(job)
    if config is not None:
        extra["kv_transfer_config"] = config
    llm = LLM(model=job["model"], dtype="bfloat16", enforce_eager=True,
              max_model_len=job["max_model_len"], max_num_seqs=4, seed=0, block_size=_BLOCK,
              max_num_batched_tokens=4096, distributed_executor_backend="uni",
              enable_prefix_caching=True, **extra)

    def run(prompt, params):
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        return time.perf_counter() - start, out

    result = {"seconds": [], "cached": [], "params": [], "first": []}
    if job["role"] == "decode":  # one prompt first: the engine's first forward is slower
        run(job["warmup"], None)
        if job["connector"] in ("segments", "cache"):
            # Its KV cache on 2 MiB pages (huge_pages): timed once the thread is done.
            from vllm.distributed.kv_transfer import get_kv_transfer_group
            result["pages"] = get_kv_transfer_group().kv_cache_pages(600)
    for i, prompt in enumerate(job["prompts"]):
        params = job["params"][i] if job.get("params") else None
        if job["role"] == "prefill" and job["connector"] == "nixl":
            params = {"do_remote_decode": True}
        seconds, out = run(prompt, params)
        result["seconds"].append(seconds)
        result["cached"].append(out.num_cached_tokens)
        result["params"].append(out.kv_transfer_params)
        result["first"].append(out.outputs[0].token_ids[0])
    return llm, result


def _engine_main(job):
    llm, result = _engine(job)  # noqa: F841 (a prefill engine lives while it holds)
    print("RESULT " + json.dumps(result), flush=True)
    if job["role"] == "prefill":
        sys.stdin.read()  # alive until the bench closes stdin
    sys.stdout.flush()
    os._exit(0)  # NIXL 1.5.1's UCX plugin can crash in exit handlers; nothing is left to do


# ---- the bench -----------------------------------------------------------------------------

class _Engine:
    def __init__(self, job, env):
        self.err = tempfile.TemporaryFile()
        self.lines = []  # vLLM's log (stdout)
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine",
                                   json.dumps(job)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)

    def result(self):
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            self.lines.append(line)
        self.p.wait()
        self.err.seek(0)
        raise RuntimeError("engine exited %s:\n%s" % (self.p.returncode,
                                                     self.err.read().decode()[-4000:]))

    def log(self):
        self.err.seek(0)
        return "".join(self.lines) + self.err.read().decode(errors="replace")

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _env(args, side_port):
    env = dict(os.environ)
    path = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python")]
    if args.nixl:
        path.append(os.path.abspath(args.nixl))
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS=str(args.threads), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
               VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port), UCX_TLS="tcp,self",
               UCX_NET_DEVICES="lo")
    return env


def _measure(args, connector, model, prompts, warmup):
    job = {"model": model, "connector": connector, "max_model_len": max(args.tokens) + 256,
           "load": args.load,
           "prompts": prompts, "warmup": warmup}
    if connector == "recompute":
        decode = _Engine(dict(job, role="decode"), _env(args, _free_port()))
        try:
            return decode.result()
        finally:
            decode.close()
    directory = tempfile.mkdtemp(prefix="ea-kvengine-",
                                 dir=args.example_directory if connector == "example"
                                 else args.directory)
    job["directory"] = directory
    prefill = _Engine(dict(job, role="prefill"), _env(args, _free_port()))
    try:
        produced = prefill.result()
        if args.logs:
            with open(os.path.join(args.logs, "%s-params.json" % connector), "w") as f:
                json.dump(produced, f)
        decode = _Engine(dict(job, role="decode", params=produced["params"]
                              if connector == "nixl" else None),
                         _env(args, _free_port()))
        try:
            return decode.result()
        finally:
            decode.close()
            if args.logs:
                for side, engine in (("prefill", prefill), ("decode", decode)):
                    with open(os.path.join(args.logs, "%s-%s.log" % (connector, side)),
                              "w") as f:
                        f.write(engine.log())
    finally:
        prefill.close()
        shutil.rmtree(directory, ignore_errors=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--engine":
        _engine_main(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--connectors", default="recompute,segments,cache,example,nixl")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--directory", default="/dev/shm")
    parser.add_argument("--example-directory", default="/tmp")
    parser.add_argument("--load", default="async", choices=("async", "sync"),
                        help="how expert_arena.vllm_kv's decode engine loads (its `load`)")
    parser.add_argument("--logs", metavar="DIR", help="write each engine's log there")
    parser.add_argument("--nixl", metavar="DIR", help="a folder holding nixl and nixl_cu13 "
                        "(module docstring)")
    args = parser.parse_args()
    connectors = args.connectors.split(",")
    if "nixl" in connectors and not args.nixl:
        connectors.remove("nixl")
        print("nixl left out: no --nixl DIR (module docstring)", file=sys.stderr)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1024) for _ in range(t)]
               for t in args.tokens for _ in range(args.prompts)]
    warmup = [rng.randrange(3, 1024) for _ in range(300)]
    workdir = tempfile.mkdtemp(prefix="ea-kvengine-model-")
    try:
        model = os.path.join(workdir, "model")
        _model(model, args)
        results = {}
        for connector in connectors:
            started = time.perf_counter()
            try:
                results[connector] = _measure(args, connector, model, prompts, warmup)
            except RuntimeError as e:  # an engine that failed: its last line in the table
                lines = [l for l in str(e).splitlines() if l.strip()]
                results[connector] = {"failed": lines[-1][-160:] if lines else "?"}
            print("%s: %.0f s %s" % (connector, time.perf_counter() - started,
                                     results[connector]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    kv_per_token = 2 * args.layers * args.kv_heads * args.head_size * 2
    print("| tokens | KV bytes | " + " | ".join(
        "%s TTFT%s" % (c, "" if c == "recompute" else " (cached tokens)")
        for c in connectors) + " | " + " | ".join(
        "recompute / %s" % c for c in connectors if c != "recompute") + " |")
    print("|---|---|" + "---|" * (2 * len(connectors) - ("recompute" in connectors)))
    for k, tokens in enumerate(args.tokens):
        rows = slice(k * args.prompts, (k + 1) * args.prompts)
        med = {c: statistics.median(results[c]["seconds"][rows]) for c in connectors
               if "failed" not in results[c]}
        cells = []
        for c in connectors:
            if "failed" in results[c]:
                cells.append("failed: %s" % results[c]["failed"])
                continue
            cached = results[c]["cached"][rows]
            cells.append("%.3f s" % med[c] + ("" if c == "recompute" else
                                              " (%s)" % "/".join(map(str, cached))))
            if "recompute" in med and (results[c]["first"][rows]
                                           != results["recompute"]["first"][rows]):
                cells[-1] += " **first token differs from recompute's**"
        ratios = ["%.1fx" % (med["recompute"] / med[c]) if c in med else "-"
                  for c in connectors if c != "recompute" and "recompute" in med]
        print("| %d | %.0f MiB | %s | %s |" % (tokens, tokens * kv_per_token / 2**20,
                                              " | ".join(cells), " | ".join(ratios)))
    for c in connectors:
        pages = results[c].get("pages")
        if pages:
            print("\n%s: the decode engine's KV cache, %d of %d MiB on 2 MiB pages in %.1f s "
                  "(timed after)%s" % (c, pages["huge_bytes"] >> 20, pages["bytes"] >> 20,
                                        pages["seconds"] or -1,
                                        "" if pages["error"] is None else ": " + pages["error"]))
    print("\n    " + " ".join([os.path.basename(sys.executable)] + sys.argv))


if __name__ == "__main__":
    main()
