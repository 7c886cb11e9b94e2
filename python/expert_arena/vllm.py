"""vLLM model loader `expert_arena`: engines on one host share one copy of their post-processed
weights in an engine-made arena (docs/engines.md).

    vllm serve MODEL --load-format expert_arena \\
        --model-loader-extra-config '{"arena_dir": "/dev/shm"}'

The package's `vllm.general_plugins` entry point (`register`) registers the loader in every
vLLM process. The engine that wins the arena's FILL lock loads with vLLM's DefaultModelLoader
and post-processing (`process_weights_after_loading`: fused and repacked experts), publishes
everything the processed model holds (parameters, buffers, tensor attributes: the binder,
expert_arena._binder) into the arena of its identity, and binds the model to the arena's
read-only views. Every other engine (now or after a restart) builds the
model on the meta device and binds it, reading no checkpoint tensor (only the files' headers,
for the fingerprint) and transforming nothing; `process_weights_after_loading` runs again
under vLLM's `weights_already_processed()` (as vLLM's own IPC weight-cache loader does), which
rebuilds only the kernels' Python-side state.

The identity of an arena is the library's fingerprint of the checkpoint files vLLM would read
(path, size, mtime, safetensors header) with the effective configuration (the whole hf_config
after hf_overrides) and the settings a backend reads when it post-processes (identity_fields;
docs/engines.md lists them): another dtype, rank or configuration is another arena file under
`arena_dir`, and the file name hashes the checkpoint folder's real path.

CPU engines compute on the arena's pages: no private copy. vLLM's CPU backend packs dense
GEMM weights into private oneDNN/sgl-kernel buffers and drops the parameter; the plugin keeps
them as parameters and computes with torch's linear on the shared bytes instead (the MoE
experts keep vLLM's prepacked layout, which is published). A parameter whose storage is
replaced after binding (by a backend's repack, at load or during the warm-up) is refused,
naming it, and so is one written in place (its pages private copies that differ from the
arena's, found in the page tables at each of the first forwards): the engine never keeps a
private copy silently.

GPU engines: the arena is the host copy, registered with the GPU, that every engine's
parameters are copied from at start (one host copy for N engines instead of N checkpoint
reads and N post-processings). With `--cpu-offload-gb` the parameters vLLM's UVA offloader
chooses (the same ones, by its rules: module order, the byte budget, `--cpu-offload-params`)
stay in the arena: the GPU reads them in place through the registered pages, where each engine
would otherwise pin a private host copy of them. The prefetch offloader
(`--offload-group-size`) and UVA turned off (`VLLM_WEIGHT_OFFLOADING_DISABLE_UVA`) keep private
copies by design and are refused.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import time
from contextlib import contextmanager

LOAD_FORMAT = "expert_arena"

# Bumped whenever what this loader publishes changes for the same vLLM and settings.
LAYOUT_VERSION = 2  # 2: the tensors of attention backends' impl objects (AMX MLA)

_OPTIONS = {
    "arena_dir": "directory of the arena files (tmpfs or hugetlbfs; default /dev/shm)",
    "huge": "2 MiB pages: auto, on or off (default auto)",
    "wait_timeout": "seconds to wait for an engine that is building (default 600)",
    "file_mode": "mode of a new arena file, e.g. \"0640\" (default 0600)",
    "allow_foreign_owner": "attach to an arena file owned by another user (default false)",
    "allow_world_writable": "create (file_mode 0666) or attach to an arena file every user "
                            "may write (default false)",
    "gpu": "register the host copy with a GPU: auto, none, cuda[:N], hip[:N] (default auto)",
    "dense_gemm": "CPU engines: shared (torch's linear on the arena's dense weights) or packed "
                  "(each engine packs its dense 2-D weights privately for vLLM's CPU GEMM, as "
                  "plain vLLM does; the experts stay shared) (default shared)",
    "huge_after_build": "on tmpfs on 4 KiB pages: write the arena into 4 KiB pages and make "
                        "its 2 MiB pages after the build, in the background (a shorter build "
                        "where they are slow to make, reads slowed until done); false: make "
                        "them before each piece is written (default true)",
}


def register():
    """The `vllm.general_plugins` entry point: registers the loader (vLLM calls it in every
    process it starts; registering twice is harmless)."""
    from vllm.model_executor.model_loader import register_model_loader
    register_model_loader(LOAD_FORMAT)(_loader_class())


@dataclasses.dataclass(frozen=True)
class Settings:
    """The loader's options (--model-loader-extra-config), checked."""

    arena_dir: str = "/dev/shm"
    huge: str = "auto"
    wait_timeout: float = 600.0
    file_mode: int = 0o600
    allow_foreign_owner: bool = False
    gpu: str = "auto"
    allow_world_writable: bool = False
    dense_gemm: str = "shared"
    huge_after_build: bool = True

    @classmethod
    def parse(cls, extra):
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                "Unexpected extra config keys for load format %s: %s (it takes %s)"
                % (LOAD_FORMAT, unknown, "; ".join("%s: %s" % kv for kv in _OPTIONS.items())))
        mode = extra.get("file_mode", 0o600)
        if isinstance(mode, str):
            mode = int(mode, 8)
        huge = str(extra.get("huge", "auto"))
        if huge not in ("auto", "on", "off"):
            raise ValueError("%s: huge is auto, on or off, got %r" % (LOAD_FORMAT, huge))
        timeout = float(extra.get("wait_timeout", 600.0))
        if not timeout >= 0:
            raise ValueError("%s: wait_timeout must be >= 0 seconds, got %r"
                             % (LOAD_FORMAT, timeout))
        if mode & ~0o666:
            raise ValueError("%s: file_mode %s has bits outside 0o666 (setuid, setgid, sticky "
                             "or execute): an arena file holds data, never a program"
                             % (LOAD_FORMAT, oct(mode)))
        world = extra.get("allow_world_writable", False)
        if not isinstance(world, bool):
            raise ValueError("%s: allow_world_writable must be true or false, got %r"
                             % (LOAD_FORMAT, world))
        allow = extra.get("allow_foreign_owner", False)
        if not isinstance(allow, bool):
            raise ValueError("%s: allow_foreign_owner must be true or false, got %r"
                             % (LOAD_FORMAT, allow))
        after = extra.get("huge_after_build", True)
        if not isinstance(after, bool):
            raise ValueError("%s: huge_after_build must be true or false, got %r"
                             % (LOAD_FORMAT, after))
        dense = str(extra.get("dense_gemm", "shared"))
        if dense not in ("shared", "packed"):
            raise ValueError("%s: dense_gemm is shared or packed, got %r" % (LOAD_FORMAT, dense))
        return cls(arena_dir=os.fspath(extra.get("arena_dir", "/dev/shm")), huge=huge,
                   wait_timeout=timeout, file_mode=int(mode), allow_foreign_owner=allow,
                   gpu=str(extra.get("gpu", "auto")), allow_world_writable=world,
                   dense_gemm=dense, huge_after_build=after)


def _digest(value):
    """sha256 of a JSON form of `value` (keys sorted; what JSON cannot hold by its str())."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def effective_config(model_config):
    """The model's configuration as vLLM uses it, `hf_overrides` applied: the whole hf_config
    as a dict (its to_dict, which nests the text and vision configs), keys sorted."""
    hf = model_config.hf_config
    try:
        config = hf.to_dict()
    except Exception:  # a config class of a custom model without to_dict
        config = dict(vars(hf))
    return json.dumps(config, sort_keys=True, default=str)


def identity_fields(vllm_config, model_config):
    """What makes this engine's processed weights what they are beyond the checkpoint's bytes,
    as (key, value) pairs (docs/engines.md lists them and why): the effective model
    configuration and every setting a backend reads when it builds and post-processes the
    model. Computed before anything is loaded (post-processing may change the model's
    quantization config)."""
    import torch
    import vllm
    from vllm.distributed import get_dp_group, get_pp_group
    from vllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
    from vllm.platforms import current_platform
    hf = model_config.hf_config
    quant = getattr(hf, "quantization_config", None)
    pp, dp = get_pp_group(), get_dp_group()
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    cpu = torch.backends.cpu.get_cpu_capability() if current_platform.is_cpu() else "-"
    return [
        ("vllm", vllm.__version__),
        ("loader", "%s %d" % (LOAD_FORMAT, LAYOUT_VERSION)),
        ("platform", "%s %s" % (current_platform.device_type, cpu)),
        ("arch", ",".join(getattr(hf, "architectures", None) or [])),
        ("hf_config", _digest(effective_config(model_config))[:32]),
        ("model_impl", str(getattr(model_config, "model_impl", "-"))),
        ("dtype", str(model_config.dtype)),
        ("quantization", str(model_config.quantization)),
        ("quant_config", _digest(quant)[:16]),
        ("kv_cache_dtype", str(getattr(cache, "cache_dtype", "-"))),
        ("revision", str(model_config.revision)),
        ("tp", "%d/%d" % (get_tensor_model_parallel_rank(),
                          get_tensor_model_parallel_world_size())),
        ("pp", "%d/%d" % (pp.rank_in_group, pp.world_size)),
        ("dp", "%d/%d" % (dp.rank_in_group, dp.world_size)),
        ("dcp", str(getattr(parallel, "decode_context_parallel_size", 1))),
        ("ep", str(bool(getattr(parallel, "enable_expert_parallel", False)))),
        ("eplb", "%s/%s" % (bool(getattr(parallel, "enable_eplb", False)),
                            getattr(getattr(parallel, "eplb_config", None),
                                    "num_redundant_experts", 0))),
        ("lora", str(vllm_config.lora_config is not None)),
        # The attention backend asked for, and the CPU features vLLM's CPU build chooses its
        # post-processing by: AMX (its AMX MLA backend), AVX-512 BF16 (the conv weights of
        # gated delta nets prepacked): arenas travel between hosts (peer fill).
        ("attention_backend", str(getattr(getattr(vllm_config, "attention_config", None),
                                          "backend", None))),
        ("cpu_features", _cpu_features() if current_platform.is_cpu() else "-"),
        ("cpu_gemm", "torch-linear-on-arena" if current_platform.is_cpu() else "-"),
        ("cpu_moe", _cpu_moe_kernel() if current_platform.is_cpu() else "-"),
    ]


def _cpu_features():
    import torch
    return "amx=%d avx512_bf16=%d" % (
        bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()))


def _cpu_moe_kernel():
    """Whose fused MoE vLLM's CPU experts choose here (they decide in their post-processing,
    and it decides the experts' layout): zentorch's, on unpacked weights, where vLLM finds it
    (a Zen CPU with zentorch), else vLLM's own, on prepacked ones."""
    try:
        from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op
        return "zentorch" if has_zentorch_op(["zentorch_fused_moe"]) else "vllm"
    except (ImportError, AttributeError):
        return "vllm"


def arena_path(settings, model_config, identity, checkpoint):
    """The arena file of this identity and checkpoint under arena_dir: the model's name, the
    rank, and a hash of the identity and of the checkpoint folder's real path (so another
    dtype, rank or configuration is another file, two checkpoints in folders of the same name
    are two files, and a restart finds its own)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(
        os.path.normpath(str(model_config.model))))[:64] or "model"
    rank = re.search(r"tp=(\d+)/(\d+)", identity)
    digest = hashlib.sha256(("%s\ncheckpoint=%s" % (identity, checkpoint)).encode(
        "utf-8", "surrogateescape")).hexdigest()[:12]
    return os.path.join(settings.arena_dir, "vllm-%s-tp%sof%s-%s.arena" % (
        base, rank.group(1), rank.group(2), digest))


@contextmanager
def _gemm_on_shared_weights():
    """During post-processing: vLLM's CPU GEMM dispatch would pack each dense 2-D weight into a
    private oneDNN or sgl-kernel buffer and drop the parameter. Here the layer keeps its
    weight and computes with torch's linear on it, so that the arena's bytes are what runs."""
    import torch
    from vllm.model_executor.layers import utils as layer_utils
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight):
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear
            return
        original(layer, remove_weight)

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


def pack_dense_weights(model):
    """dense_gemm "packed": each dense 2-D weight that _gemm_on_shared_weights left on torch's
    linear gets vLLM's CPU GEMM dispatch (oneDNN or sgl-kernel), which packs it into a private
    buffer of this engine; the parameter stays the arena's view (published, bound, checked), the
    layer computes on the packed copy. A layer whose dispatch would replace a bound tensor (a
    bias converted to float32) keeps torch's linear. Returns (layers, bytes of their weights)."""
    import torch
    from vllm.model_executor.layers import utils as layer_utils
    count = size = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(module, "cpu_linear", None) is not torch.nn.functional.linear or \
                weight is None or weight.ndim != 2 or weight.is_meta:
            continue
        bias = getattr(module, "bias", None)
        bias_data = bias.data if bias is not None else None
        layer_utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        if bias is not None and bias.data_ptr() != bias_data.data_ptr():
            bias.data = bias_data  # the arena's view again, and the layer as it was
            module.cpu_linear = torch.nn.functional.linear
            continue
        count += 1
        size += weight.numel() * weight.element_size()
    return count, size


def _checkpoint_files(load_config, model_config):
    """The real path of the folder vLLM's default loader reads this model from (resolved the
    way it resolves it: a local directory is only listed), and the files it reads with the
    folder's JSON files, for the fingerprint."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    loader = DefaultModelLoader(load_config)
    folder, weights, _, _ = loader._prepare_weights(
        model_config.model, None, model_config.revision, True, None)
    files = sorted(set(weights) | set(glob.glob(os.path.join(folder, "*.json"))))
    return os.path.realpath(folder), files


class OffloadPlan:
    """The parameters vLLM's UVA offloader (--cpu-offload-gb) would put on the host, chosen by
    its rules (vLLM 0.32, UVAOffloader._maybe_offload_to_cpu: the modules in the order
    make_layers hands them over, each one's parameters in order, until the byte budget is
    spent; only names matching --cpu-offload-params when given) without moving anything:
    on the meta device there is nothing to move, and the arena holds the bytes. Each chosen
    module gets `_expert_arena_host`, the names of its chosen parameters."""

    def __init__(self, max_bytes, params):
        self.max_bytes = max_bytes
        self.params = set(params or ())
        self.bytes = 0

    def wrap_modules(self, modules_generator, prefix=""):
        modules = list(modules_generator)
        head = prefix + "." if prefix else ""
        for module in modules:
            chosen = []
            for name, p in module.named_parameters():
                if self.bytes >= self.max_bytes:
                    break
                if self.params and not any(".%s." % x in ".%s%s." % (head, name)
                                           for x in self.params):
                    continue
                chosen.append(name)
                self.bytes += p.numel() * p.element_size()
            if chosen:
                module._expert_arena_host = list(getattr(module, "_expert_arena_host", ())) + \
                    chosen
        return modules


def host_names(model):
    """Full names of the parameters an OffloadPlan chose in `model`."""
    out = set()
    for prefix, module in model.named_modules():
        for name in getattr(module, "_expert_arena_host", ()):
            out.add(prefix + "." + name if prefix else name)
    return out


def check_offloader(offloader, on_cpu):
    """The engine's weight offloader, as the loader can honour it: None when it offloads
    nothing here (none, or a CPU engine, whose parameters are all on the host already), the
    UVAOffloader otherwise; ValueError for the offloaders that keep a private host copy."""
    from vllm.model_executor.offloader import PrefetchOffloader, UVAOffloader
    if isinstance(offloader, PrefetchOffloader):
        raise ValueError(
            "%s: the prefetch weight offloader (--offload-group-size) copies each offloaded "
            "layer into private pinned memory of every engine; the arena cannot stand in for "
            "it. Use --cpu-offload-gb (vLLM's UVA offloader: the GPU reads the offloaded "
            "parameters in place from the arena) or no offloading with --load-format %s"
            % (LOAD_FORMAT, LOAD_FORMAT))
    if not isinstance(offloader, UVAOffloader) or on_cpu:
        return None
    if not offloader.uva_offloading:
        raise ValueError(
            "%s: --cpu-offload-gb without UVA (VLLM_WEIGHT_OFFLOADING_DISABLE_UVA=1, or no "
            "pinned memory on this platform) copies the offloaded parameters to the GPU at "
            "every forward from a private host copy; unset VLLM_WEIGHT_OFFLOADING_DISABLE_UVA "
            "so that the GPU reads them from the arena, or load without --load-format %s"
            % (LOAD_FORMAT, LOAD_FORMAT))
    return offloader


class ReplacedStorageError(RuntimeError):
    """A parameter or buffer no longer lies in the arena: a backend replaced its storage."""


def _derived(model, name):
    """Whether `name` is a buffer its module registered as non-persistent: state the model
    derives from its configuration (a rotary cache), not a weight of the checkpoint."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return leaf in owner._buffers and leaf in owner._non_persistent_buffers_set


def check_bound(model, views, when, replaced=None):
    """Every parameter, buffer and tensor attribute of `model` bound to the arena (`views`)
    must still be the arena's bytes, and no parameter or buffer may have come since (CPU
    engines); ReplacedStorageError naming the first ones otherwise. A non-persistent
    buffer (a rotary cache) that the model replaced itself, computed from the arena's bytes
    (GPT-OSS converts its float32 rotary cache to the compute dtype at its first forward), is
    allowed: its name goes into `replaced`."""
    from . import _binder
    moved, extra = [], []
    for name, t, kind, arena_name in _binder.module_tensors(model):
        view = views.get(arena_name)
        if view is not None and t.data_ptr() == view.data_ptr() and t.shape == view.shape:
            continue
        if view is not None and view.numel() == 0 and t.numel() == 0:
            continue  # an emptied weight holds no byte (AMX MLA's kv_b_proj, set again)
        if replaced is not None and view is not None and kind == "buffer" and \
                t.shape == view.shape and _derived(model, name):
            replaced.add(name)
        elif view is None:
            # A tensor attribute that came after binding is the engine's run-time state (the
            # KV cache vLLM hands each attention layer), not a weight.
            if kind != "attribute":
                extra.append(name)
        else:
            moved.append(name)
    if moved or extra:
        raise ReplacedStorageError(
            "%s: %s, vLLM replaced the storage of %s%s (a backend's repack or a private "
            "copy); refusing to run on a private copy of weights that are meant to be held "
            "once. Load this model without --load-format %s, or publish after the step that "
            "replaces them." % (LOAD_FORMAT, when, ", ".join(moved[:8]) or "-",
                                "; new tensors not in the arena: " + ", ".join(extra[:8])
                                if extra else "", LOAD_FORMAT))


def check_in_arena(model, arena):
    """Every tensor of `model` that the arena holds must still lie in its pages (CPU engines,
    after the first forward, before the arena is published); ReplacedStorageError naming the
    first ones otherwise. A non-persistent buffer the model replaced itself (a rotary cache
    converted at the first forward: check_bound) is this engine's own and passes."""
    from . import _binder
    start, size = arena.data_range()
    names = set(arena.names())
    moved = [name for name, t, kind, arena_name in _binder.module_tensors(model)
             if arena_name in names and t.numel() > 0 and
             not start <= t.data_ptr() < start + size and
             not (kind == "buffer" and _derived(model, name))]
    if moved:
        raise ReplacedStorageError(
            "%s: after the first forward, vLLM replaced the storage of %s (a backend's repack or "
            "a private copy); the arena is not published" % (LOAD_FORMAT, ", ".join(moved[:8])))


def check_at_first_forwards(model, views, count=3, on_replaced=None):
    """vLLM's profile and warm-up runs come after load_model: check_bound runs again before
    each of the model's first `count` forwards, then the hook goes. `on_replaced(names)` hears
    of the derived buffers the model replaced itself (kept private by this engine)."""
    calls = [0]
    replaced = set()

    def hook(module, args):
        calls[0] += 1
        if calls[0] >= count:
            handle.remove()
        before = len(replaced)
        check_bound(module, views, "at forward %d" % calls[0], replaced)
        if len(replaced) > before and on_replaced is not None:
            on_replaced(sorted(replaced))
        check_private_copies(module, "at forward %d" % calls[0])

    handle = model.register_forward_pre_hook(hook)
    return handle


def check_private_copies(model, when):
    """A write into a bound parameter or buffer keeps its address, so check_bound cannot see
    it, but the page it touched became this engine's private copy: refused when its bytes
    differ from the arena's, naming the tensors (expert_arena.check_private_copies; a write of
    the published value, as the attention layers' fill_(1.0) of their scales, passes)."""
    import expert_arena
    expert_arena.check_private_copies(model, "%s: %s" % (LOAD_FORMAT, when))


def _fused_experts(module):
    """The experts object of a layer's fused-MoE kernel (vLLM's modular kernel), or None."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def kernel_state(model):
    """{module name: state} of every fused-MoE kernel in `model`: its experts' class and their
    scalar attributes. vLLM's CPU experts decide there, in their own post-processing, which
    kernel runs and so in which layout the weights are left (`_use_zentorch`: zentorch's fused
    MoE on unpacked weights, else vLLM's on prepacked ones). The building engine records it in
    the arena with the weights; see restore_kernel_state."""
    out = {}
    for name, module in model.named_modules():
        experts = _fused_experts(module)
        if experts is None:
            continue
        state = {"class": "%s.%s" % (type(experts).__module__, type(experts).__qualname__)}
        for key, value in sorted(vars(experts).items()):
            if value is None or isinstance(value, (bool, int, float, str)):
                state[key] = value
        out[name] = state
    return out


def _zentorch_usable(module):
    try:
        from vllm.model_executor.kernels.linear.zentorch_utils import is_zentorch_moe_supported
    except ImportError:
        return False
    return bool(is_zentorch_moe_supported(module))


# Scalars of a kernel's experts that their own post-processing sets and that vLLM's rebuild on
# processed weights (weights_already_processed: the kernel is made anew, that step skipped)
# leaves at the class default: given the building engine's value here, when this engine can
# run it.
_RESTORED = {"_use_zentorch": _zentorch_usable}


def restore_kernel_state(model, recorded, where):
    """Gives each fused-MoE kernel of `model`, rebuilt by vLLM on weights that are already
    processed, the state the building engine's had (`recorded`: its kernel_state), or refuses:
    the weights lie in the layout that state chose, and a kernel of another class or state
    would compute on them silently wrong. BindingError naming each difference."""
    from . import _binder
    if not isinstance(recorded, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("class"), str) for v in recorded.values()):
        raise _binder.BindingError("%s: the arena's record of the building engine's fused-MoE "
                                   "kernels is damaged (%.200r); remove the file"
                                   % (where, recorded))
    mine = kernel_state(model)
    modules = dict(model.named_modules())
    problems = []
    for name in sorted(set(recorded) | set(mine)):
        theirs, state = recorded.get(name), mine.get(name)
        if theirs is None or state is None or state["class"] != theirs["class"]:
            problems.append("%s: %s in the building engine, %s here" % (
                name, theirs["class"] if theirs else "no fused-MoE kernel",
                state["class"] if state else "no fused-MoE kernel"))
            continue
        for key, value in sorted(theirs.items()):
            if key == "class" or (key in state and state[key] == value):
                continue
            usable = _RESTORED.get(key)
            if usable is not None and (not value or usable(modules[name])):
                setattr(_fused_experts(modules[name]), key, value)
            elif usable is not None:
                problems.append("%s: the building engine ran its experts with %s=%r (zentorch's "
                                "fused MoE, on weights left unpacked for it), which this engine "
                                "cannot run" % (name, key, value))
            else:
                problems.append("%s: %s=%r in the building engine, %r here" % (
                    name, key, value, state.get(key, "(absent)")))
    if problems:
        raise _binder.BindingError(
            "%s: its fused-MoE kernels differ from the building engine's, whose weights are in "
            "their layout: %s%s. Build this arena where the engines that use it run (another "
            "arena_dir), or load without --load-format %s" % (
                where, "; ".join(problems[:6]),
                " and %d more" % (len(problems) - 6) if len(problems) > 6 else "", LOAD_FORMAT))


def _loader_class():
    """The loader class, made on first use so that importing this module needs no vLLM."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import (initialize_model,
                                                        process_weights_after_loading)
    from vllm.model_executor.offloader import (BaseOffloader, get_offloader,
                                               set_offloader)
    from vllm.model_executor.utils import weights_already_processed
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    import expert_arena
    from . import _binder, _confirm_at_first_forward, _release_freed_memory

    # Under "vllm." so that vLLM's own handlers and format (VLLM_LOGGING_LEVEL) apply.
    logger = init_logger("vllm.expert_arena")

    class MetaOffloadPlan(OffloadPlan, BaseOffloader):
        """An OffloadPlan in the offloader's place while the model is built on the meta
        device (the real one would copy meta tensors to the host and fail)."""

    class ExpertArenaModelLoader(BaseModelLoader):
        """Loads through one shared arena per (checkpoint, vLLM, dtype, quantization, rank)
        identity: the first engine builds and publishes it with vLLM's default loader and
        post-processing, every other engine binds to it (see the module's documentation).

        Extra config keys (--model-loader-extra-config): arena_dir, huge, wait_timeout,
        file_mode, allow_foreign_owner, gpu."""

        def __init__(self, load_config):
            super().__init__(load_config)
            self.settings = Settings.parse(load_config.model_loader_extra_config)

        def _default_load_config(self):
            # DefaultModelLoader must not see this format or its extra config keys.
            return dataclasses.replace(self.load_config, load_format="auto",
                                       model_loader_extra_config={})

        def download_model(self, model_config):
            DefaultModelLoader(self._default_load_config()).download_model(model_config)

        def load_weights(self, model, model_config):
            raise NotImplementedError(
                "%s: weights are bound to a shared read-only arena at load_model(); an "
                "in-place reload into them is not supported" % LOAD_FORMAT)

        def load_model(self, vllm_config, model_config, prefix=""):
            started = time.monotonic()
            fields = identity_fields(vllm_config, model_config)
            identity = " ".join("%s=%s" % kv for kv in fields)
            checkpoint, files = _checkpoint_files(self._default_load_config(), model_config)
            path = arena_path(self.settings, model_config, identity, checkpoint)
            device = torch.device(vllm_config.device_config.device
                                  if self.load_config.device is None else self.load_config.device)
            on_cpu = device.type == "cpu"
            gpu = self.settings.gpu
            if gpu == "auto":
                gpu = "none" if on_cpu else "%s:%d" % (
                    "hip" if current_platform.is_rocm() else "cuda",
                    device.index if device.index is not None
                    else torch.accelerator.current_device_index())
            offloader = check_offloader(get_offloader(), on_cpu)
            built = {}
            marks = {}  # when the builder's steps ended (the start line's breakdown)

            def declare():
                marks["declare"] = time.monotonic()
                model, constructed = self._load_and_process(vllm_config, model_config, prefix)
                built["model"] = model
                marks["declared"] = time.monotonic()
                return _binder.declare(model, built, constructed,
                                       engine={"kernels": kernel_state(model)})

            def fill(writer):
                marks["fill"] = time.monotonic()
                # On the CPU the builder's tensors move onto the arena's bytes as they are
                # written (its own copies freed as it goes: the model held once, not twice).
                _binder.fill(built, writer, release=on_cpu)
                marks["filled"] = time.monotonic()

            os.makedirs(self.settings.arena_dir, exist_ok=True)
            try:
                arena = expert_arena.open_engine(
                    path, identity, declare, fill, files, gpu=gpu, huge=self.settings.huge,
                    wait_timeout=self.settings.wait_timeout, file_mode=self.settings.file_mode,
                    allow_foreign_owner=self.settings.allow_foreign_owner,
                    allow_world_writable=self.settings.allow_world_writable, quiet=True,
                    confirm_after_run=True, huge_after_build=self.settings.huge_after_build,
                    freed_as_written=lambda: built.get("freed", 0) if on_cpu else 0)
            except BaseException:
                _binder.forget_released(built)
                raise
            model = built.pop("model", None)
            freed = built.get("freed", 0) if on_cpu and model is not None else 0
            marks["kept"] = built.get("kept", 1) if model is not None else 0
            built.clear()
            marks["opened"] = time.monotonic()
            report = arena.report
            logger.info("%s: %s", LOAD_FORMAT, report["start_line"])
            if freed:
                logger.info("%s: the build freed %.2f GiB of this engine's own tensors as it "
                            "wrote them into the arena (the model held once, not twice)",
                            LOAD_FORMAT, freed / 2**30)
            try:
                return self._bind_and_run(vllm_config, model_config, prefix, arena, model,
                                          device, offloader, started, marks)
            except BaseException as e:
                # Publish only what runs: a build this engine could not bind itself to is
                # recorded as failed (the next engine rebuilds it once), never published.
                if arena.awaiting_confirm:
                    arena.abandon("%s: %s" % (type(e).__name__, e))
                raise

        def _bind_and_run(self, vllm_config, model_config, prefix, arena, model, device,
                          offloader, started, marks):
            on_cpu = device.type == "cpu"
            report = arena.report
            if model is None:
                # vLLM registers each attention layer by name once per process: only an engine
                # that did not build makes the model here.
                engine_offloader = get_offloader()
                plan = MetaOffloadPlan(
                    offloader.cpu_offload_max_bytes if offloader is not None else 0,
                    offloader.cpu_offload_params if offloader is not None else ())
                set_offloader(plan)
                try:
                    with set_default_torch_dtype(model_config.dtype):
                        with torch.device("meta"):
                            model = initialize_model(vllm_config=vllm_config,
                                                     model_config=model_config, prefix=prefix)
                finally:
                    set_offloader(engine_offloader)
                self._bind(model, model_config, arena, device, host_names(model))
            elif on_cpu:
                # The builder's private tensors give way to the views it published.
                self._bind(model, model_config, arena, device)
            elif offloader is not None:
                # A GPU engine that built keeps the device tensors it published from; what its
                # offloader pinned on the host gives way to the arena's registered pages.
                self._host_to_arena(model, arena)
            model.expert_arena = arena
            if on_cpu and self.settings.dense_gemm == "packed":
                layers, size = pack_dense_weights(model)
                logger.info("%s: dense_gemm packed: %d dense layers (%.1f MiB of weights) "
                            "packed privately for vLLM's CPU GEMM; the arena's views stay bound",
                            LOAD_FORMAT, layers, size / (1 << 20))
            if arena.awaiting_confirm:
                # The loader returns before vLLM's profile and warm-up runs: the arena is
                # published when the model's first forward returned on its views and left
                # them bound; a forward that raises records the failure (docs/engines.md).
                logger.info("%s: %s is published once this engine's first forward ran on it",
                            LOAD_FORMAT, report["path"])
                def ran_on_the_arena():
                    check_in_arena(model, arena)
                    check_private_copies(model, "after the first forward")
                _confirm_at_first_forward(model, arena, ran_on_the_arena if on_cpu else None)
            # An engine that attached built its model on the meta device: nothing to collect;
            # nor has a builder whose every tensor moved onto the arena's bytes as it was
            # written (a full collection of vLLM's heap took 0.42 s and freed nothing there).
            _release_freed_memory(collect=marks.get("kept", 0) > 0)
            ready = time.monotonic()
            steps = {}
            if "filled" in marks:
                # Where a build's time went: vLLM's own load and post-processing (as in plain
                # vLLM), the arena's file (its pages too where they are not made as written),
                # the copy, checksums and header, the binding.
                steps = {"load_and_process_s": marks["declared"] - marks["declare"],
                         "pages_s": marks["fill"] - marks["declared"],
                         "copy_s": marks["filled"] - marks["fill"],
                         "checksums_s": marks["opened"] - marks["filled"],
                         "bind_s": ready - marks["opened"]}
            model.expert_arena_start = dict(steps, ready_s=ready - started)
            logger.info("%s: model ready in %.2f s (%s): %s", LOAD_FORMAT, ready - started,
                        "built and published: vLLM's load and post-processing %.2f s, the "
                        "arena's file %.2f s, the copy (its pages made as it went) %.2f s, "
                        "checksums %.2f s, binding %.2f s"
                        % tuple(steps.values()) if steps else
                        "attached: no checkpoint tensor read, no transform run",
                        "its parameters and buffers are the arena's pages" if on_cpu else
                        "parameters copied to %s from the arena (%s)"
                        % (device, report.get("gpu")))
            return model.eval()

        def _load_and_process(self, vllm_config, model_config, prefix):
            """vLLM's default load and post-processing, CPU GEMMs kept on their weights; with
            the names of the tensors the model held before its post-processing."""
            loader = DefaultModelLoader(self._default_load_config())
            constructed = {}
            load_weights = loader.load_weights

            def load_and_list(model, model_config):
                load_weights(model, model_config)
                constructed.update(_binder.constructed_layouts(model))

            loader.load_weights = load_and_list
            with _gemm_on_shared_weights():
                model = loader.load_model(vllm_config=vllm_config, model_config=model_config,
                                          prefix=prefix)
            # A weight post-processing emptied after deriving state from it: published when
            # that state is (vLLM's AMX MLA packs W_UK and W_UV from kv_b_proj into its
            # backend's impl, published with the model: _binder.module_tensors), else an
            # engine that attaches could derive it from nothing: refused before anything is
            # published.
            derived = _binder.derived_by_helpers(model)
            released = sorted(e.name for e in _binder.module_tensors(model)
                              if e.tensor.numel() == 0 and e.name in constructed and
                              0 not in constructed[e.name]["shape"] and
                              e.name.rpartition(".")[0] not in derived)
            if released:
                raise RuntimeError(
                    "%s: vLLM's post-processing emptied %s after deriving its own state from "
                    "it (kept outside the model's modules: vLLM's AMX MLA attention backend "
                    "does this with kv_b_proj), so engines could not attach to the arena; "
                    "choose another attention backend (on the CPU: --attention-backend "
                    "CPU_MLA) or load this model without --load-format %s"
                    % (LOAD_FORMAT, ", ".join(released[:4]), LOAD_FORMAT))
            unsupported = sorted({
                type(m.quant_method).__name__ for m in model.modules()
                if getattr(m, "quant_method", None) is not None and
                hasattr(m.quant_method, "process_weights_after_loading") and
                not getattr(m.quant_method, "supports_pre_processed_weights", True)})
            if unsupported:
                # Refused before anything is published: an engine that attaches could not
                # rebuild these methods' state from processed weights.
                raise RuntimeError(
                    "%s: %s cannot run on weights that are already processed, so engines "
                    "could not attach to them; load this model without --load-format %s"
                    % (LOAD_FORMAT, ", ".join(unsupported), LOAD_FORMAT))
            return model, constructed

        def _host_to_arena(self, model, arena):
            """The builder's parameters vLLM's UVA offloader put in pinned host memory become
            device views of the arena's registered pages (the pinned copies are freed)."""
            from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor
            count = size = 0
            for name, t, kind, arena_name in _binder.module_tensors(model):
                if kind == "parameter" and getattr(t, "_vllm_is_uva_offloaded", False):
                    t.data = get_accelerator_view_from_cpu_tensor(arena.torch(arena_name))
                    count += 1
                    size += t.numel() * t.element_size()
            self._log_host(count, size)

        @staticmethod
        def _log_host(count, size):
            if count:
                logger.info("%s: %d parameters (%.2f GiB) offloaded by --cpu-offload-gb are "
                            "read by the GPU in place from the arena's registered pages (no "
                            "pinned copy of them in this engine)",
                            LOAD_FORMAT, count, size / 2**30)

        def _bind(self, model, model_config, arena, device, host=frozenset()):
            """Makes every parameter, buffer and tensor attribute of `model` (built on the meta
            device, or the builder's own) the arena's tensor of the same name (the binder
            checks name, dtype, shape and strides): its read-only view on the CPU, a copy on a
            GPU (a device view of the registered pages for the parameters in `host`, which
            --cpu-offload-gb keeps on the host); then lets vLLM rebuild its kernels' state on
            them, and binds the tensor attributes that rebuild makes (MLA's W_UV, W_UK_T) or
            skips."""
            where = "%s: the model vLLM builds (%s)" % (LOAD_FORMAT, arena.report["path"])
            hint = (" (vLLM or the model changed without changing the identity; remove the "
                    "file)")
            layouts = _binder.manifest(arena)
            # What vLLM's post-processing made (MLA's W_UV and W_UK_T, registered as
            # parameters by it) it makes again below, in place when it finds them: the
            # building engine lets go of its own, as an attaching one never had them.
            _binder.unbind_made(model, layouts)
            _binder.take_processed(model, layouts)
            entries = _binder.module_tensors(model)
            try:
                absent = _binder.check(entries, layouts, where, absent_kinds=())
            except _binder.BindingError as e:
                raise _binder.BindingError(str(e) + hint) from None
            on_host = {e.arena_name for e in entries
                       if e.kind == "parameter" and e.name in host}
            if device.type != "cpu" and on_host:
                from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

            def make_view(arena_name, kind, view):
                if device.type != "cpu" and arena_name in on_host:
                    return get_accelerator_view_from_cpu_tensor(view)
                if device.type != "cpu":
                    return view.to(device, non_blocking=True)
                if kind == "buffer" and view.numel() <= 1:
                    # vLLM's attention layers write their default KV-cache scales in place at
                    # every start (fill_(1.0), the value published): a plain tensor over the
                    # copy-on-write mapping takes the write, which copies that one page into
                    # this process.
                    return view.as_subclass(torch.Tensor)
                return view

            def make_parameter(arena_name, param):
                if device.type != "cpu" and arena_name in on_host:
                    param._vllm_is_uva_offloaded = True  # as vLLM's offloader marks

            views = _binder.bind(model, arena, entries, layouts, make_view, make_parameter)
            if device.type != "cpu":
                torch.accelerator.synchronize()
                self._log_host(len(on_host), sum(views[a].numel() * views[a].element_size()
                                                 for a in on_host))
            bound = {id(e.tensor) for e in _binder.module_tensors(model)}
            with set_default_torch_dtype(model_config.dtype), weights_already_processed(), \
                    _gemm_on_shared_weights(), _binder.helpers_made_from_arena(model, layouts):
                process_weights_after_loading(model, model_config, device)
            engine = _binder.engine_record(arena)
            if engine is not None:
                restore_kernel_state(model, engine.get("kernels") if isinstance(engine, dict)
                                     else engine, where)
            # What the kernels' rebuild made again from the bound weights (private tensors)
            # gives way to the arena's; what it did not make is set from the arena.
            # (A parameter or buffer the model was built with that it replaced is refused by
            # check_bound below: a backend's repack of the arena's bytes.)
            remade = [e for e in _binder.module_tensors(model) if id(e.tensor) not in bound
                      and (e.kind == "attribute" or layouts.get(e.arena_name, {}).get("made"))]
            _binder.check(remade, layouts, where, complete=False)
            views.update(_binder.bind(model, arena, remade, layouts, make_view))
            held = {e.arena_name for e in _binder.module_tensors(model)}
            views.update(_binder.bind_absent(model, arena, [n for n in absent if n not in held],
                                             layouts, where, make_view))
            if device.type == "cpu":
                check_bound(model, views, "after post-processing")
                check_at_first_forwards(model, views, on_replaced=self._log_replaced)

        @staticmethod
        def _log_replaced(names):
            logger.info("%s: the model replaced its derived buffer(s) %s itself (computed from "
                        "the arena's bytes: a dtype conversion); this engine keeps them "
                        "privately", LOAD_FORMAT, ", ".join(names[:4]) +
                        (" and %d more" % (len(names) - 4) if len(names) > 4 else ""))

    _LOADER = ExpertArenaModelLoader
    return _LOADER


_LOADER = None
