"""One vLLM engine (CPU, offline) for test_vllm.py: generates greedy tokens for a fixed prompt
and prints one JSON line; with --hold it then waits, alive, until its stdin closes.

    python vllm_engine.py MODEL_DIR LOAD_FORMAT ARENA_DIR DTYPE [--hold] [--tp N]
                          [--cpu-offload-gb GIB] [--compile] [--fail-first-forward MESSAGE]
                          [--hf-overrides JSON] [--prompt-len N]

The prompt is 5 fixed token ids, or N of them (--prompt-len; max_model_len grows to fit).

With one rank the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor), so its model's memory is this pid's; with --tp N its ranks are vLLM's worker
processes, and "ranks" lists what each one found."""

import json
import os
import signal
import sys
import time


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
    outside = [e.name for e in entries if not start <= e.tensor.data_ptr() < start + size]
    return {"role": report["role"], "path": report["path"], "bytes_read": report["bytes_read"],
            "data_bytes": report["data_bytes"], "tensors": len(tensors),
            "attributes": sorted(e.name for e in entries if e.kind == "attribute"),
            "outside": outside, "in_arena": not outside,
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


def main():
    model_dir, load_format, arena_dir, dtype = sys.argv[1:5]
    tp = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
    offload = float(sys.argv[sys.argv.index("--cpu-offload-gb") + 1]) \
        if "--cpu-offload-gb" in sys.argv else 0
    if "--fail-first-forward" in sys.argv:
        fail_first_forward(sys.argv[sys.argv.index("--fail-first-forward") + 1])
    overrides = json.loads(sys.argv[sys.argv.index("--hf-overrides") + 1]) \
        if "--hf-overrides" in sys.argv else None
    prompt_len = int(sys.argv[sys.argv.index("--prompt-len") + 1]) \
        if "--prompt-len" in sys.argv else 5
    prompt = [5, 9, 2, 7, 11] if prompt_len == 5 else [(7 * i + 3) % 500 + 3
                                                      for i in range(prompt_len)]
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    extra = {"model_loader_extra_config": {"arena_dir": arena_dir}} \
        if load_format == "expert_arena" else {}
    llm = LLM(model=model_dir, load_format=load_format, dtype=dtype,
              enforce_eager="--compile" not in sys.argv,
              max_model_len=max(128, prompt_len + 16), max_num_seqs=4,
              hf_overrides=overrides, seed=0, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp", cpu_offload_gb=offload,
              **extra)
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
    print("RESULT " + json.dumps(result), flush=True)
    if "--hold" in sys.argv:
        sys.stdin.read()


if __name__ == "__main__":
    if "--tp" not in sys.argv:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
