#!/usr/bin/env python3
"""vllm_families.py: which MoE families vLLM's build here runs with --load-format expert_arena.

For each MoE architecture of vLLM's model registry whose class transformers has (or those
named with --families), it makes a tiny random checkpoint with transformers' own classes
(`tiny_checkpoint`: the class's default configuration shrunk to hidden 128, 8 experts, 2
layers, a WordLevel tokenizer made here; nothing comes from the network) and runs four engines,
each a process of its own: plain vLLM (the reference), a building engine, an attaching engine
started while the builder is alive, and a restart after both exited. It compares their greedy
tokens and prints one table row per family:

    works                    every engine gave plain vLLM's tokens (the attacher and the
                             restart "attached", every tensor in the arena)
    refused: MESSAGE         the loader refused it, with its message
    FAILED: WHAT             the loader ran but gave other tokens, or crashed
    vLLM cannot run it here  plain vLLM itself failed (its error)

A family named ARCH:fp8 is that checkpoint quantized as DeepSeek-V3's FP8 release
(quantize_fp8_block: block-quantized weights with weight_scale_inv).

    .venv-vllm/bin/python tools/python/vllm_families.py [--families A,B] [--markdown]
                          [--workdir DIR] [--list]

Needs vLLM and this package (PYTHONPATH=build/python, with the package installed in vLLM's
environment for its plugin entry point). Each engine start takes tens of seconds on 2 cores:
the whole registry takes a while; --families picks some. Exit code 0 when no row says FAILED.
"""

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

PROMPT = [5, 9, 2, 7, 11]
TOKENS = 8

# The sizes a tiny checkpoint gets, for every one of these keys its configuration class has.
TINY = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256,
    num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2,
    moe_topk=2, n_shared_experts=1, num_shared_experts=1, kv_lora_rank=32, q_lora_rank=64,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1,
    first_k_dense_replace=1, tie_word_embeddings=False, sliding_window=64,
    # Qwen3-Next's linear attention (gated delta net)
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4,
    # Llama 4 text
    intermediate_size_mlp=256, interleave_moe_layer_step=1, attention_chunk_size=128,
    no_rope_layers=[1, 1],
    rope_theta=10000.0,
)

# What a family needs beyond TINY (by architecture).
EXTRA = {
    # vLLM's CPU attention kernels take head sizes from 64 up (not 32).
    "Qwen3NextForCausalLM": dict(layer_types=["linear_attention", "full_attention"],
                                 full_attention_interval=2, head_dim=64,
                                 linear_key_head_dim=64, linear_value_head_dim=64),
    "GptOssForCausalLM": dict(layer_types=["sliding_attention", "full_attention"],
                              num_key_value_heads=2, head_dim=32),
    # vLLM's CPU MLA kernel runs only kv_lora_rank + qk_rope_head_dim = 576 (DeepSeek's own).
    "DeepseekV2ForCausalLM": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
                                  qk_rope_head_dim=64),
    "DeepseekV3ForCausalLM": dict(num_key_value_heads=4, topk_method="noaux_tc",
                                  kv_lora_rank=512, qk_rope_head_dim=64),
    "Glm4MoeForCausalLM": dict(first_k_dense_replace=1, partial_rotary_factor=0.5, head_dim=32),
    # Llama 4 routes each token to one expert (vLLM's fused MoE weighs the input by the router
    # only for top-1); its chunked attention takes whole KV blocks (128 on the CPU).
    "Llama4ForCausalLM": dict(moe_layers=[0, 1], layer_types=["full_attention"] * 2,
                              num_experts_per_tok=1),
}

# The dtype a family runs in on vLLM's CPU build (float32 where not named): Qwen3-Next's gated
# delta net runs only in bfloat16 there ("CPU GDN attention requires BF16").
DTYPE = {"Qwen3NextForCausalLM": "bfloat16"}

# Engine arguments a family gets beyond the defaults: DeepSeek's MLA on vLLM's reference CPU
# backend on every CPU, so that the table is the same on each. Where the CPU has AMX vLLM would
# take its AMX MLA backend (bfloat16 only; it packs W_UK and W_UV into its impl object and
# empties kv_b_proj): tests/python/test_vllm.py runs that one there.
ENGINE_ARGS = {"DeepseekV2ForCausalLM": {"attention_backend": "CPU_MLA"},
               "DeepseekV3ForCausalLM": {"attention_backend": "CPU_MLA"}}


def engine_args(model_dir):
    """ENGINE_ARGS of the architecture the checkpoint at model_dir names ({} for others)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return {}
    return dict(ENGINE_ARGS.get(archs[0], {})) if archs else {}


# What a family's configuration derives itself (left out of TINY for it).
DERIVED = {
    "DeepseekV2ForCausalLM": ("head_dim",),
    "DeepseekV3ForCausalLM": ("head_dim",),
}

# Keys of a configuration that hold an expert count: what makes an architecture MoE here.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _transformers_classes(arch):
    """(config class, model class) of a vLLM architecture name in transformers, or None."""
    import transformers
    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        return None
    config_cls = getattr(model_cls, "config_class", None)
    if config_cls is None or config_cls is transformers.PretrainedConfig:
        return None
    return config_cls, model_cls


def moe_architectures():
    """The architectures of vLLM's text-generation registry that transformers has and whose
    default configuration counts experts."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS
    out = []
    for arch in sorted(_TEXT_GENERATION_MODELS):
        classes = _transformers_classes(arch)
        if classes is None:
            continue
        try:
            config = classes[0]()
        except Exception:
            continue
        text = getattr(config, "text_config", None) or config
        if any(getattr(text, k, None) for k in EXPERT_KEYS):
            out.append(arch)
    return out


def tiny_checkpoint(arch, out, **overrides):
    """A random checkpoint of transformers' own class `arch` (its default configuration with
    TINY's sizes, EXTRA's and `overrides`) and a WordLevel tokenizer, saved to `out`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    config_cls, model_cls = _transformers_classes(arch)
    default = config_cls()
    values = {k: v for k, v in TINY.items() if hasattr(default, k)}
    values.update(EXTRA.get(arch, {}))
    values.update(overrides)
    for k in DERIVED.get(arch, ()):
        values.pop(k, None)
    # Through the constructor, so that what a configuration derives from these is derived.
    config = config_cls(**values)
    config.architectures = [arch]
    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={"t%d" % i: i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)
    return out


ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


def _quantize(model_dir, targets, quantize, quantization_config):
    """Rewrites the checkpoint at model_dir in place: each linear weight whose name holds one
    of `targets` is replaced by quantize(layer, weight) (a dict of the layer's new tensors),
    and config.json gets quantization_config(the names of the linear modules left as they
    were: per layer, the experts as one module, as vLLM matches them)."""
    import json as _json
    from safetensors.torch import load_file, save_file
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    out, kept = {}, set()
    for name, tensor in tensors.items():
        layer = name[:-len(".weight")]
        if name.endswith(".weight") and any(t in layer for t in targets):
            out.update(quantize(layer, tensor))
            continue
        out[name] = tensor
        if name.endswith(".weight") and ".layers." in name:
            module = layer.split(".layers.", 1)[1].split(".", 1)[1]
            if ".experts." in module:
                module = module[:module.index(".experts.") + len(".experts")]
            kept.add(module)
    save_file(out, path, metadata={"format": "pt"})
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = _json.load(f)
    config["quantization_config"] = quantization_config(sorted(kept))
    with open(config_path, "w") as f:
        _json.dump(config, f, indent=2)
    return model_dir


def quantize_awq(model_dir, targets=ATTENTION, group_size=64, seed=0):
    """Turns a checkpoint made by tiny_checkpoint into an AWQ one (4 bits, zero points, GEMM
    layout) in place: each linear weight whose name holds one of `targets` becomes random
    packed AWQ tensors (qweight int32 [in, out/8], qzeros int32 [in/group, out/8], scales
    float16 [in/group, out]); the rest stays as it was. Any packed bits are a valid AWQ weight:
    plain vLLM's tokens on the result are the reference."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    info = torch.iinfo(torch.int32)

    def quantize(layer, weight):
        n, k = weight.shape

        def packed(rows):
            return torch.randint(info.min, info.max, (rows, n // 8), dtype=torch.int32,
                                 generator=generator)
        scales = torch.rand((k // group_size, n), generator=generator) * 0.01 + 0.001
        return {layer + ".qweight": packed(k), layer + ".qzeros": packed(k // group_size),
                layer + ".scales": scales.to(torch.float16)}

    # What stays unquantized is named (vLLM would otherwise take the MoE layers for AWQ ones,
    # which its CPU build cannot run: "No WNA16 MoE backend supports the deployment
    # configuration").
    return _quantize(model_dir, targets, quantize, lambda kept: {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": kept})


def quantize_w8a8(model_dir, targets=ATTENTION):
    """Turns a checkpoint made by tiny_checkpoint into a compressed-tensors W8A8 one in place
    (int8 weights with a float32 scale per output channel, activations quantized per token at
    run time, as llm-compressor writes them): each linear weight whose name holds one of
    `targets` becomes int8 [out, in] and weight_scale [out, 1]; everything else is in
    "ignore". vLLM's CPU build runs it with oneDNN's int8 GEMM."""
    import torch

    def quantize(layer, weight):
        scale = weight.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-8) / 127
        return {layer + ".weight": torch.round(weight.float() / scale).clamp(-127, 127)
                .to(torch.int8), layer + ".weight_scale": scale}

    scheme = {"num_bits": 8, "type": "int", "symmetric": True}
    return _quantize(model_dir, targets, quantize, lambda kept: {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": dict(scheme, strategy="channel", dynamic=False),
            "input_activations": dict(scheme, strategy="token", dynamic=True)}},
        # The rest stays in the checkpoint's dtype: the router, the experts, the head.
        "ignore": ["lm_head"] + ["re:.*%s($|\\.)" % re.escape(m) for m in kept]})


# Every linear weight of DeepSeek-V3's layers that its FP8 checkpoint stores in FP8: attention,
# dense MLP, shared and routed experts; the router (mlp.gate), norms, embeddings and the head
# stay as they are.
DEEPSEEK_LINEAR = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
                   "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                   "gate_proj", "up_proj", "down_proj")


def quantize_fp8_block(model_dir, targets=DEEPSEEK_LINEAR, block=128):
    """Turns a checkpoint made by tiny_checkpoint into one laid out as DeepSeek-V3's own FP8
    release, in place: each linear weight whose name holds one of `targets` becomes float8_e4m3fn
    [out, in] with `weight_scale_inv` float32 [ceil(out/block), ceil(in/block)] (the weight is
    the FP8 values times the scale of their block), and config.json gets `quant_method: fp8`,
    dynamic activations, `weight_block_size: [block, block]`."""
    import torch
    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def quantize(layer, weight):
        n, k = weight.shape
        rows, cols = -(-n // block), -(-k // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:n, :k] = weight.float()
        blocks = padded.view(rows, block, cols, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fp8_max
        values = (blocks / scale[:, None, :, None]).view(rows * block, cols * block)[:n, :k]
        return {layer + ".weight": values.to(torch.float8_e4m3fn),
                layer + ".weight_scale_inv": scale.contiguous()}

    def config(kept):
        out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [block, block]}
        if kept:
            # vLLM's fp8 names the layers it leaves alone in full (per layer).
            with open(os.path.join(model_dir, "config.json")) as f:
                layers = json.load(f)["num_hidden_layers"]
            out["ignored_layers"] = ["model.layers.%d.%s" % (i, m) for i in range(layers)
                                     for m in kept]
        return out

    return _quantize(model_dir, targets, quantize, config)


def quantize_fp8_attention(model_dir):
    """quantize_fp8_block of the attention projections only, the MLPs and experts as they were
    (vLLM's CPU build has no FP8 MoE kernel)."""
    return quantize_fp8_block(model_dir, DEEPSEEK_LINEAR[:6])


# A family's checkpoint in another form, named ARCH:VARIANT (--families DeepseekV3ForCausalLM:fp8):
# (sizes beyond TINY, the rewrite, the dtype it runs in). vLLM splits the block scales of a
# merged layer (gate and up, MLA's q_a and kv_a) at each part's size and dequantizes kv_b_proj
# by whole blocks, so those sizes are whole blocks.
FP8_SIZES = dict(q_lora_rank=128, moe_intermediate_size=128, intermediate_size=256,
                 qk_nope_head_dim=64, v_head_dim=64)
VARIANTS = {"fp8": (FP8_SIZES, quantize_fp8_block, "bfloat16"),
            "fp8-attention": (FP8_SIZES, quantize_fp8_attention, "bfloat16")}


def make_checkpoint(family, out):
    """The tiny checkpoint of `family` (ARCH or ARCH:VARIANT) at `out`; returns the dtype it
    runs in."""
    arch, _, variant = family.partition(":")
    sizes, rewrite, dtype = VARIANTS[variant] if variant else ({}, None, None)
    tiny_checkpoint(arch, out, **sizes)
    if rewrite:
        rewrite(out)
    return dtype or DTYPE.get(arch, "float32")


def inspect(model):
    """Runs in the engine's worker (here: its process): where the model's tensors lie. A
    derived buffer the model replaced itself (a rotary cache it converted) is left out."""
    arena = getattr(model, "expert_arena", None)
    if arena is None:
        return {"role": "private"}
    from expert_arena import _binder
    start, size = arena.data_range()
    published = _binder.manifest(arena)
    outside = [e.name for e in _binder.module_tensors(model)
               if (e.kind != "attribute" or e.arena_name in published) and
               e.tensor.numel() > 0 and not start <= e.tensor.data_ptr() < start + size]
    return {"role": arena.report["role"], "path": arena.report["path"], "outside": outside,
            "in_arena": not outside}


def engine(model_dir, load_format, arena_dir, hold, dtype):
    """The engine role (a process of its own): greedy tokens for PROMPT as one JSON line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    extra = {"model_loader_extra_config": {"arena_dir": arena_dir}} \
        if load_format == "expert_arena" else {}
    llm = LLM(model=model_dir, load_format=load_format, dtype=dtype, enforce_eager=True,
              max_model_len=128, max_num_seqs=4, seed=0, **extra, **engine_args(model_dir))
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0.0, max_tokens=TOKENS), use_tqdm=False)
    result = {"tokens": list(out[0].outputs[0].token_ids)}
    result.update(llm.apply_model(inspect)[0])
    print("RESULT " + json.dumps(result), flush=True)
    if hold:
        sys.stdin.read()


class Engine:
    """An engine process of this script (the engine role) and its answer."""

    def __init__(self, model_dir, load_format, arena_dir, dtype, hold=False):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--engine", model_dir, load_format,
             arena_dir, dtype] + (["--hold"] if hold else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        self.answers = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                self.answers.put(json.loads(line[len("RESULT "):]))
        self.answers.put(None)

    def answer(self, timeout):
        """The engine's answer, or {"error": its last error line}."""
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            self.p.kill()
            answer = None
        if answer is None:
            return {"error": self.error()}
        return answer

    def error(self):
        self.err.seek(0)
        lines = [x.strip() for x in self.err.read().splitlines() if x.strip()]
        for line in reversed(lines):
            if "Error" in line or "error" in line:
                return line[-400:]
        return (lines[-1] if lines else "exited %s" % self.p.poll())[-400:]

    def finish(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def run_family(arch, workdir, timeout):
    """(verdict, detail) of one architecture."""
    model_dir = os.path.join(workdir, arch)
    arena_dir = os.path.join(workdir, arch + "-arenas")
    os.makedirs(arena_dir, exist_ok=True)
    try:
        dtype = make_checkpoint(arch, model_dir)
    except Exception as e:
        return "not made", "could not make it: %s" % str(e).splitlines()[0][:200]
    plain = Engine(model_dir, "auto", arena_dir, dtype)
    reference = plain.answer(timeout)
    plain.finish()
    if "error" in reference:
        return "vLLM cannot run it here", reference["error"]
    builder = Engine(model_dir, "expert_arena", arena_dir, dtype, hold=True)
    built = builder.answer(timeout)
    attached = {"error": "not started: the building engine failed"}
    if "error" not in built:
        attacher = Engine(model_dir, "expert_arena", arena_dir, dtype)
        attached = attacher.answer(timeout)
        attacher.finish()
    builder.finish()
    restart = Engine(model_dir, "expert_arena", arena_dir, dtype)
    restarted = restart.answer(timeout)
    restart.finish()
    results = {"building": built, "attaching": attached, "restart": restarted}
    errors = ["%s: %s" % (k, r["error"]) for k, r in results.items() if "error" in r]
    if errors:
        refused = [e for e in errors if "expert_arena" in e]
        return ("refused" if refused and len(refused) == len(errors) else "FAILED"), \
            "; ".join(errors)
    roles = [r["role"] for r in results.values()]
    wrong = [k for k, r in results.items() if r["tokens"] != reference["tokens"]]
    if roles != ["loaded", "attached", "attached"] or wrong or \
            not all(r["in_arena"] for r in results.values()):
        return "FAILED", "roles %s, tokens differ in %s (plain %s)" % (
            roles, wrong, reference["tokens"])
    return "works", "plain vLLM's tokens from all three"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(sys.argv[2], sys.argv[3], sys.argv[4], "--hold" in sys.argv, sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="architectures, comma-separated (default: all)")
    parser.add_argument("--list", action="store_true", help="list the architectures and exit")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--workdir", help="where checkpoints and arenas go (default: a "
                        "temporary folder under /dev/shm, removed)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per engine")
    args = parser.parse_args()
    archs = args.families.split(",") if args.families else moe_architectures()
    if args.list:
        print("\n".join(archs))
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="ea-vllm-families-", dir="/dev/shm")
    failed = False
    if args.markdown:
        print("| family | result | detail |\n|---|---|---|", flush=True)
    try:
        for arch in archs:
            started = time.monotonic()
            verdict, detail = run_family(arch, workdir, args.timeout)
            failed |= verdict == "FAILED"
            if args.markdown:
                print("| %s | %s | %s |" % (arch, verdict, detail.replace("|", "\\|")),
                      flush=True)
            else:
                print("%-32s %-24s %5.0f s  %s" % (arch, verdict, time.monotonic() - started,
                                                   detail), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
