"""One vLLM engine (CPU, offline) for test_vllm.py: generates greedy tokens for a fixed prompt
and prints one JSON line; with --hold it then waits, alive, until its stdin closes.

    python vllm_engine.py MODEL_DIR LOAD_FORMAT ARENA_DIR DTYPE [--hold] [--tp N]
                          [--cpu-offload-gb GIB] [--compile] [--fail-first-forward MESSAGE]
                          [--hf-overrides JSON] [--prompt-len N]

    python vllm_engine.py --serve

The prompt is 5 fixed token ids, or N of them (--prompt-len; max_model_len grows to fit).
--serve runs engines one after another in one process, each asked for by a JSON line on stdin
(engine_procs.serve): vLLM's import, most of an engine's start on 2 cores, is paid once.

With one rank the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor), so its model's memory is this pid's; with --tp N its ranks are vLLM's worker
processes, and "ranks" lists what each one found."""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tools", "python"))
import vllm_families  # noqa: E402  (ENGINE_ARGS: what a family's engines get)


def inspect(model):
    """Runs in the worker (here: this process): where the model's tensors lie (parameters,
    buffers and the modules' tensor attributes, as the loader's binder finds them)."""
    arena = getattr(model, "expert_arena", None)
    tensors = list(model.parameters()) + list(model.buffers())
    if arena is None:
        return {"role": "private", "tensors": len(tensors)}
    from expert_arena import _binder
    start, size = arena.data_range()
    report = arena.report
    # What the arena holds (a tensor attribute vLLM sets later, the KV cache, is run-time
    # state, not published).
    published = _binder.manifest(arena)
    entries = [e for e in _binder.module_tensors(model)
               if e.kind != "attribute" or e.arena_name in published]
    # (An emptied weight, AMX MLA's kv_b_proj, holds no byte anywhere.)
    outside = [e.name for e in entries
               if e.tensor.numel() > 0 and not start <= e.tensor.data_ptr() < start + size]
    import torch
    packed = sum(1 for m in model.modules() if getattr(m, "cpu_linear", None)
                 not in (None, torch.nn.functional.linear))
    # The fused-MoE kernels run as the building engine's did (the state it recorded with the
    # weights: which kernel, so which layout of the weights).
    from expert_arena import vllm as arena_loader
    kernels = arena_loader.kernel_state(model)
    recorded = (_binder.engine_record(arena) or {}).get("kernels")
    return {"role": report["role"], "path": report["path"], "bytes_read": report["bytes_read"],
            "data_bytes": report["data_bytes"], "tensors": len(tensors),
            "kernels": len(kernels), "kernels_as_built": kernels == recorded,
            "attributes": sorted(e.name for e in entries if e.kind == "attribute"),
            "outside": outside, "in_arena": not outside, "packed_layers": packed,
            "loader": type(model).__module__}


def fail_first_forward(message):
    """Fault injection: the model the expert_arena loader returns raises RuntimeError(message)
    at its first forward (vLLM's warm-up), as a kernel that fails on this host would, after
    the arena was filled."""
    from expert_arena import vllm as arena_loader
    cls = arena_loader._loader_class()
    load_model = cls.load_model

    def failing(self, *args, **kwargs):
        model = load_model(self, *args, **kwargs)

        def fail(module, args):
            if message == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(message)

        model.register_forward_pre_hook(fail)
        return model

    cls.load_model = failing


def options(argv):
    """The engine's settings from its command line (the form in this module's docstring)."""
    def value(flag, default, kind=str):
        return kind(argv[argv.index(flag) + 1]) if flag in argv else default
    model_dir, load_format, arena_dir, dtype = argv[:4]
    return dict(model_dir=model_dir, load_format=load_format, arena_dir=arena_dir, dtype=dtype,
                tp=value("--tp", 1, int), offload=value("--cpu-offload-gb", 0, float),
                compile="--compile" in argv, fail=value("--fail-first-forward", None),
                overrides=value("--hf-overrides", None, json.loads),
                prompt_len=value("--prompt-len", 5, int), hold="--hold" in argv)


def run(opts):
    """Starts one engine with `opts`, generates, inspects: (the LLM, the result)."""
    prompt_len = opts["prompt_len"]
    prompt = [5, 9, 2, 7, 11] if prompt_len == 5 else [(7 * i + 3) % 500 + 3
                                                      for i in range(prompt_len)]
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    extra = {"model_loader_extra_config": dict(opts.get("loader_options") or {},
                                               arena_dir=opts["arena_dir"])} \
        if opts["load_format"] == "expert_arena" else {}
    tp = opts["tp"]
    llm = LLM(model=opts["model_dir"], load_format=opts["load_format"], dtype=opts["dtype"],
              enforce_eager=not opts["compile"],
              max_model_len=max(128, prompt_len + 16), max_num_seqs=4,
              hf_overrides=opts["overrides"], seed=0, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp",
              cpu_offload_gb=opts["offload"], **extra,
              **dict(vllm_families.engine_args(opts["model_dir"]), **(opts.get("engine") or {})))
    ready = time.monotonic() - started
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    result = {"tokens": list(out[0].outputs[0].token_ids), "ready_seconds": ready,
              "pid": os.getpid()}
    # By its module's name, which vLLM's worker processes import (this file's directory is on
    # the path they inherit): a function of __main__ does not pickle across to them.
    import vllm_engine
    ranks = llm.apply_model(vllm_engine.inspect)
    result.update(ranks[0])
    result["ranks"] = ranks
    return llm, result


def main():
    if sys.argv[1:] == ["--serve"]:
        import engine_procs
        engine_procs.serve(run)
        return
    opts = options(sys.argv[1:])
    if opts["fail"]:
        fail_first_forward(opts["fail"])
    llm, result = run(opts)
    print("RESULT " + json.dumps(result), flush=True)
    if opts["hold"]:
        sys.stdin.read()


if __name__ == "__main__":
    if "--tp" not in sys.argv:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
