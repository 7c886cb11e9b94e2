"""One vLLM engine (CPU, offline, this one process) for test_vllm_kv.py, with or without the
expert_arena.vllm_kv connector. Reads a JSON request on its first argument, prints one JSON
line (RESULT ...) and, with "hold", waits alive until its stdin closes; with --serve, engines
one after another, each request a line of stdin (engine_procs.serve, EngineHost).

    python vllm_kv_engine.py '{"model": DIR, "role": "plain"|"kv_producer"|"kv_consumer",
                               "directory": D, "spill_directory": S, "prompts": [[ids]...],
                               "block_size": 32, "max_tokens": 8, "hold": false, "ttl_seconds": 600,
                               "readers": 1,
                               "abort_at": null | [steps per prompt], "kill_in_save": null | N,
                               "listen": ADDR, "listen_token": T, "remote_token": T,
                               "remote_producers": [ADDR], "transfer_params": [{...}|null],
                               "load": "async"|"sync", "transfer": "cache"|"segments",
                               "num_blocks": null | N, "ignore_eos": false,
                               "prefix_caching": true|false (vLLM's default: true),
                               "hf_overrides": null | {...},
                               "then": [[ids]...]}'

Every engine greedy-decodes each prompt; "abort_at" instead adds the prompts together, aborts
prompt i after abort_at[i] engine steps, then runs one short prompt to the end (the step that
tells the connector's worker about the aborts), then greedy-decodes the prompts of "then" (their
tokens and cached counts under "then"; without "abort_at" too, after the prompts);
"kill_in_save" runs the prompts one after another and SIGKILLs the engine at the connector's
N-th save_kv_layer call that has blocks to save (the layers before it written, its own and the
ones after it not)."""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tools", "python"))
import vllm_families  # noqa: E402  (ENGINE_ARGS: what a family's engines get)


# The connector's options for prefill and decode engines on two hosts, and how the decode
# engine loads, passed on as given.
_PASSED_ON = ("listen", "listen_token", "remote_token", "remote_producers", "load",
              "transfer", "huge_pages")


def _engine(args):
    from vllm import LLM
    extra = {}
    if args["role"] != "plain":
        extra["kv_transfer_config"] = {
            "kv_connector": "ExpertArenaConnector",
            "kv_connector_module_path": "expert_arena.vllm_kv",
            "kv_role": args["role"],
            # A block that cannot be loaded is computed (vLLM's default fails the request).
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"directory": args["directory"],
                                          "spill_directory": args["spill_directory"],
                                          "name": "pytest",
                                          "ttl_seconds": args.get("ttl_seconds", 600),
                                          "readers": args.get("readers", 1),
                                          **{k: args[k] for k in _PASSED_ON if k in args}},
        }
    if args.get("num_blocks"):  # a KV cache this small: vLLM preempts requests
        extra["num_gpu_blocks_override"] = args["num_blocks"]
    if "prefix_caching" in args:  # off: a freed block goes to the next request as it is
        extra["enable_prefix_caching"] = args["prefix_caching"]
    if args.get("hf_overrides"):  # another configuration of the same checkpoint
        extra["hf_overrides"] = args["hf_overrides"]
    return LLM(model=args["model"], dtype=args.get("dtype", "float32"), enforce_eager=True,
               max_model_len=256, max_num_seqs=16, seed=0, block_size=args.get("block_size", 32),
               distributed_executor_backend="uni", **extra,
               **vllm_families.engine_args(args["model"]))


def _connector():
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    return get_kv_transfer_group() if has_kv_transfer_group() else None


def anon_huge_bytes(ranges):
    """AnonHugePages of this process's mappings that lie inside one of `ranges` (smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                a, b = (int(x, 16) for x in head[0].split("-"))
                inside = any(a >= lo and b <= hi for lo, hi in ranges)
            elif inside and head[0] == "AnonHugePages:":
                total += int(head[1]) << 10
    return total


def _kv_cache_pages(connector, wait_seconds):
    """What the connector says of this engine's own KV cache's 2 MiB pages (after waiting up
    to wait_seconds for its thread), and what the kernel says: AnonHugePages of the mappings
    over those ranges (MADV_HUGEPAGE made each range a mapping of its own)."""
    pages = connector.kv_cache_pages(wait_seconds)
    pages["kernel_huge_bytes"] = anon_huge_bytes(connector._host_pages.ranges if pages else [])
    return pages


def _generate(llm, prompts, max_tokens, transfer_params=None, ignore_eos=False):
    """Greedy tokens; transfer_params[i]: prompt i's kv_transfer_params (what a prefill engine
    on another host returned for it)."""
    from vllm import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                             extra_args={"kv_transfer_params": transfer_params[i]}
                             if transfer_params and transfer_params[i] else None)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "transfer_params": [o.kv_transfer_params for o in outs]}


def _kill_in_save(connector, n):
    """Wraps the worker's connector: its n-th save_kv_layer call with blocks to save kills this
    process (SIGKILL: no exit handler, no close) before it saves anything."""
    save_kv_layer = connector.save_kv_layer
    calls = [0]

    def wrapper(layer_name, kv_layer, attn_metadata, **kwargs):
        if connector.has_connector_metadata() and connector._get_connector_metadata().saves:
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    connector.save_kv_layer = wrapper


def _abort_run(llm, prompts, abort_at, max_tokens):
    from vllm import SamplingParams
    engine = llm.llm_engine
    # ignore_eos: no request ends by itself before its abort (a random model's first token can
    # be its end-of-sequence token, and a finished prompt's KV stays for a decode engine).
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    live = {}
    for i, p in enumerate(prompts):
        engine.add_request("abort-%d" % i, {"prompt_token_ids": p}, params)
        live["abort-%d" % i] = abort_at[i]
    steps = 0
    while live:
        for req_id in [r for r, at in live.items() if at <= steps]:
            engine.abort_request([req_id])
            del live[req_id]
        if live:
            engine.step()
            steps += 1
    # The aborts reach the connector's worker with the next step's metadata.
    engine.add_request("drive", {"prompt_token_ids": [3, 4, 5]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return {"steps": steps}


def run(args):
    """Starts the engine of `args` and runs it: (the LLM, its answer). Its counters are what
    this engine's connectors did (in an engine host, engines before it counted too)."""
    from expert_arena import vllm_kv
    before = vllm_kv.counters()
    llm = _engine(args)
    if args.get("abort_at") is not None:
        result = _abort_run(llm, args["prompts"], args["abort_at"], args["max_tokens"])
        if args.get("then"):
            result["then"] = _generate(llm, args["then"], args["max_tokens"])
    elif args.get("kill_in_save") is not None:
        _kill_in_save(_connector(), args["kill_in_save"])
        for prompt in args["prompts"]:  # each its own steps: the kill falls in one prompt's
            _generate(llm, [prompt], args["max_tokens"])
        raise RuntimeError("kill_in_save %d: the engine saved fewer layers" % args["kill_in_save"])
    else:
        result = _generate(llm, args["prompts"], args["max_tokens"],
                           args.get("transfer_params"), args.get("ignore_eos", False))
        if args.get("then"):  # after the prompts have finished (their blocks are cached)
            result["then"] = _generate(llm, args["then"], args["max_tokens"])
    connector = _connector()
    if connector is not None and args.get("pages_wait"):
        result["kv_cache_pages"] = _kv_cache_pages(connector, args["pages_wait"])
    result["counters"] = {k: v - before[k] for k, v in vllm_kv.counters().items()}
    if connector is not None:
        stream = connector.stream_stats()
        result["pending"] = stream.get("pending", [])
        result["segments"] = stream.get("stats", {}).get("segments", 0)
    result["pid"] = os.getpid()
    result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    return llm, result


def main():
    if sys.argv[1:] == ["--serve"]:
        import engine_procs
        engine_procs.serve(run)
        return
    args = json.loads(sys.argv[1])
    llm, result = run(args)  # noqa: F841  (the engine lives while it holds)
    print("RESULT " + json.dumps(result), flush=True)
    if args.get("hold"):
        sys.stdin.read()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
