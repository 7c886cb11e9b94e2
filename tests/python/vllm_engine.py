"""One vLLM engine (CPU, offline) for test_vllm.py: generates greedy tokens for a fixed prompt
and prints one JSON line; with --hold it then waits, alive, until its stdin closes.

    python vllm_engine.py MODEL_DIR LOAD_FORMAT ARENA_DIR DTYPE [--hold] [--tp N]
                          [--cpu-offload-gb GIB] [--compile] [--fail-first-forward MESSAGE]

With one rank the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor), so its model's memory is this pid's; with --tp N its ranks are vLLM's worker
processes, and "ranks" lists what each one found."""

import json
import os
import signal
import sys
import time


def inspect(model):
    """Runs in the worker (here: this process): where the model's tensors lie."""
    arena = getattr(model, "expert_arena", None)
    tensors = list(model.parameters()) + list(model.buffers())
    if arena is None:
        return {"role": "private", "tensors": len(tensors)}
    start, size = arena.data_range()
    report = arena.report
    return {"role": report["role"], "path": report["path"], "bytes_read": report["bytes_read"],
            "data_bytes": report["data_bytes"], "tensors": len(tensors),
            "in_arena": all(start <= t.data_ptr() < start + size for t in tensors),
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
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    extra = {"model_loader_extra_config": {"arena_dir": arena_dir}} \
        if load_format == "expert_arena" else {}
    llm = LLM(model=model_dir, load_format=load_format, dtype=dtype,
              enforce_eager="--compile" not in sys.argv,
              max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp", cpu_offload_gb=offload,
              **extra)
    ready = time.monotonic() - started
    out = llm.generate([{"prompt_token_ids": [5, 9, 2, 7, 11]}],
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
