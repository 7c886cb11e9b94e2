"""The vLLM KV-transfer connector expert_arena.vllm_kv: a prefill engine and decode engines of
vLLM's CPU build, each its own process (tests/python/vllm_kv_engine.py), on a tiny random
Qwen3-MoE checkpoint; a plain engine's greedy tokens are the reference. Run with the
interpreter that has vLLM (scripts/test.sh: .venv-vllm); elsewhere the module skips, unless
EXPERT_ARENA_REQUIRE_VLLM=1 (CI) makes a missing vLLM fail."""

import contextlib
import copy
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

import engine_procs
import expert_arena
from conftest import IN_CI, child_env
from conftest import test_dir as stream_root

if os.environ.get("EXPERT_ARENA_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (it must be there)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed for this interpreter "
                        "(scripts/install-deps.sh makes .venv-vllm)")
import torch  # noqa: E402
import transformers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "vllm_kv_engine.py")
BLOCK = 32  # vLLM's CPU attention takes multiples of 32

# Several lengths: under one block (nothing to transfer), just over one, a multiple of the
# block size (its last block is computed by the decode engine, which needs the last token's
# logits), and longer ones.
_rng = random.Random(41)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 64, 96, 150)]
# Saved by the prefill engine too, loaded only after it was killed.
LATE_PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (50, 120)]
# Saved by a prefill engine killed in the middle of the second one's save.
KILLED_PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (70, 100)]
LAYERS = 2  # _tiny_qwen3_moe's num_hidden_layers


def _whole(prompt):
    """Tokens of the prompt's whole blocks before its last token: what names its entry."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def _loadable(prompt):
    """Tokens a decode engine loads: every one but the last (the last block partial), when
    the prompt has a whole block before its last token."""
    return len(prompt) - 1 if _whole(prompt) else 0


def _blocks(prompt):
    return -(-_loadable(prompt) // BLOCK)


def _tiny_qwen3_moe(out):
    """A random Qwen3-MoE checkpoint (hidden 128, 8 experts, 2 layers) of transformers' own
    class and a WordLevel tokenizer made here: nothing comes from the network."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    config = transformers.Qwen3MoeConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
        moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, head_dim=32,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(vocab={"t%d" % i: i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                                         bos_token="t2").save_pretrained(out)
    return out


def _env():
    env = child_env()
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache per engine
               VLLM_CPU_OMP_THREADS_BIND="nobind",  # engines at once share the cores
               OMP_NUM_THREADS="1",  # tiny models; engines together would spin on each other
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # the engine is this one process
    return env


def _start(**request):
    return engine_procs.start([ENGINE, json.dumps(request)], _env())


def _log(p):
    return engine_procs.log(p, tail=None)


def _answer(p, timeout=300):
    return engine_procs.answer(p, timeout)


def _finish(p, timeout=120):
    return engine_procs.finish(p, timeout)


@pytest.fixture(scope="module")
def hosts():
    """Two engine processes that run engines one after another (engine_procs.EngineHost): each
    engine after the first starts without importing vLLM again, and a prefill engine in one
    and a decode engine in the other are two processes to the connector. An engine killed on
    purpose runs in a process of its own (_start)."""
    pair = [engine_procs.EngineHost(ENGINE, _env()) for _ in range(2)]
    yield pair
    for host in pair:
        assert host.close() in (0, 3), _log(host.p)[-6000:]  # 3: its last engine failed


def _run(host, **request):
    """An engine of `host` run to its end: (its answer, what it logged)."""
    mark = host.log_mark()
    host.send(request)
    return host.result(timeout=300), host.log_since(mark)


@contextlib.contextmanager
def _holding(host, **request):
    """An engine of `host` alive while the with-block runs (yields its answer), ended after."""
    try:
        host.send(dict(request, hold=True))
        yield host.result(timeout=300)
    finally:
        host.release(timeout=300)


@pytest.fixture(scope="module")
def model():
    d = tempfile.mkdtemp(prefix="ea-pytest-vllm-kv-")
    yield _tiny_qwen3_moe(os.path.join(d, "qwen3_moe"))
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def dirs():
    """The stream directory (segments and the index, on the test tmpfs) and the spill
    directory; each must be empty when the engines are gone."""
    stream = tempfile.mkdtemp(prefix="ea-pytest-kv-", dir=stream_root())
    spill = tempfile.mkdtemp(prefix="ea-pytest-kv-spill-")
    yield stream, spill
    shutil.rmtree(stream, ignore_errors=True)
    shutil.rmtree(spill, ignore_errors=True)


def _entries(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("ea-kv-"))


def _assert_loaded(decoded, tokens, prompts):
    """A decode engine's answer: these tokens, every token but the last loaded."""
    assert decoded["tokens"] == tokens
    assert decoded["cached"] == [_loadable(p) for p in prompts], decoded
    counters = decoded["counters"]
    assert counters["loaded_blocks"] == sum(_blocks(p) for p in prompts)
    assert counters["loaded_requests"] == len([p for p in prompts if _loadable(p)])
    assert counters["load_error_blocks"] == 0, counters


def _assert_recomputed(decoded, tokens, prompts):
    """... these tokens, every block it would load reported unloadable (vLLM computed them)."""
    assert decoded["tokens"] == tokens
    assert decoded["counters"]["loaded_blocks"] == 0
    assert decoded["counters"]["load_error_blocks"] == \
        sum(_blocks(p) for p in prompts), decoded["counters"]


def _kill(process):
    """SIGKILL to a prefill engine's process group, if it still runs, and its end awaited."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _decode_late(host, common, reference):
    """A decode engine of LATE_PROMPTS after their prefill engine was killed: plain tokens,
    every block it would load reported unloadable and computed. Returns what it logged."""
    late, log = _run(host, role="kv_consumer", prompts=LATE_PROMPTS, **common)
    _assert_recomputed(late, reference["tokens"][len(PROMPTS):], LATE_PROMPTS)
    return log


def _segments(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("ea-stream-"))


@pytest.mark.parametrize("load", ["async", "sync"])
def test_decode_engine_loads_what_the_prefill_engine_computed(load, model, dirs, hosts):
    stream, spill = dirs
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=8, load=load)
    every = PROMPTS + LATE_PROMPTS
    # The prefill engine is killed below: a process of its own.
    prefill = _start(role="kv_producer", prompts=every, hold=True, **common)
    try:
        reference, _ = _run(hosts[0], role="plain", prompts=every, **common)
        produced = _answer(prefill)
        # The prefill engine's own tokens are plain vLLM's: saving reads the cache only.
        assert produced["tokens"] == reference["tokens"]
        saved = [p for p in every if _loadable(p)]
        assert produced["counters"]["saved_requests"] == len(saved), produced["counters"]
        assert produced["counters"]["saved_blocks"] == sum(_blocks(p) for p in saved)
        assert len(_entries(stream)) == len(saved), os.listdir(stream)
        assert _segments(stream)

        # A decode engine of another block size finds the entries and refuses them by name,
        # before copying anything; it leaves them to the engines they fit.
        other, log = _run(hosts[0], role="kv_consumer", prompts=PROMPTS, block_size=64,
                          **common)
        assert other["counters"]["refused"] > 0 and other["counters"]["loaded_blocks"] == 0
        assert "refusing the KV" in log and "block_size: 64 here, 32 in the producer" in log, \
            log[-6000:]
        assert len(_entries(stream)) == len(saved)

        # The decode engine: plain vLLM's tokens, every token but the last from
        # the prefill engine (vLLM counts them as cached: computed elsewhere).
        # Its own KV cache goes onto 2 MiB pages on a thread while it starts and loads.
        decoded, _ = _run(hosts[1], role="kv_consumer", prompts=PROMPTS, pages_wait=120,
                          **common)
        _assert_loaded(decoded, reference["tokens"][:len(PROMPTS)], PROMPTS)
        _assert_on_huge_pages(decoded)
        # Read once: the entries of the loaded prompts are gone, the late ones wait.
        assert len(_entries(stream)) == len(LATE_PROMPTS), _entries(stream)
    finally:
        _kill(prefill)  # holding the late prompts' blocks: its segments stay until a sweep
    assert _segments(stream) and _entries(stream)

    # The next engine sweeps the killed engine's segments; the entries it finds name blocks
    # that are gone: reported to vLLM as load errors, which recomputes them, and removed.
    log = _decode_late(hosts[0], common, reference)
    assert "recomputing" in log, log[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


# Why a host may make no 2 MiB page (said by name): none free, a busy page, an operator's "never".
_NO_HUGE_PAGES = ("Cannot allocate memory", "Resource temporarily unavailable",
                  "transparent huge pages are off on this host (enabled: never)")


def _assert_on_huge_pages(result):
    """A decode engine's own KV cache (1 GiB of vLLM's host memory) on 2 MiB pages, as its
    connector says and as the kernel's smaps says; on a host without 2 MiB blocks to spare,
    the reason named."""
    pages = result["kv_cache_pages"]
    assert pages["seconds"] is not None, pages  # the thread ended
    assert pages["bytes"] >= (1 << 30) - (4 << 20), pages
    assert pages["kernel_huge_bytes"] == pages["huge_bytes"], pages
    assert result["counters"]["kv_cache_huge_bytes"] == pages["huge_bytes"]
    if pages["error"] is None:
        assert pages["huge_bytes"] == pages["bytes"], pages
    else:
        assert pages["error"] in _NO_HUGE_PAGES, pages


def _cache_files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("ea-kvcache-"))


def test_decode_engine_copies_from_the_prefill_engines_shared_kv_cache(model, dirs, hosts):
    """transfer "cache": the prefill engine's KV cache is a file of the stream directory, and
    the decode engines copy each prompt's blocks straight out of it (no segment is made). The
    prefill engine holds the blocks of every published prompt until its readers (two decode
    engines started together, readers=2) have read them; its tokens and theirs are plain
    vLLM's. Killed, it leaves its file and the entries of the prompts nobody read: the next
    engine removes the file, and the entries' blocks are recomputed."""
    stream, spill = dirs
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=8,
                  transfer="cache")
    every = PROMPTS + LATE_PROMPTS
    saved = [p for p in every if _loadable(p)]
    prefill = _start(role="kv_producer", prompts=every, hold=True, readers=2, **common)
    try:
        reference, _ = _run(hosts[0], role="plain", prompts=every, **common)
        produced = _answer(prefill)
        assert produced["tokens"] == reference["tokens"]
        assert produced["counters"]["saved_requests"] == len(saved), produced["counters"]
        assert produced["counters"]["saved_blocks"] == sum(_blocks(p) for p in saved)
        assert len(_entries(stream)) == len(saved), os.listdir(stream)
        assert len(_cache_files(stream)) == 1 and _segments(stream) == [], os.listdir(stream)
        # Every published prompt's blocks are held for a decode engine.
        assert len(produced["pending"]) == len(saved), produced["pending"]

        for host in hosts:  # started together
            host.send(dict(role="kv_consumer", prompts=PROMPTS, **common))
        for decoded in [host.result(timeout=300) for host in hosts]:
            _assert_loaded(decoded, reference["tokens"][:len(PROMPTS)], PROMPTS)
            # Out of the prefill engine's file mapped in the decode engine (not pread).
            counters = decoded["counters"]
            assert counters["loaded_mapped_bytes"] == counters["loaded_bytes"] > 0, counters
        # Read by both: those entries and their claims are gone, the late ones wait.
        assert len(_entries(stream)) == len(LATE_PROMPTS), _entries(stream)
        assert _segments(stream) == []
    finally:
        _kill(prefill)
    assert _cache_files(stream) and _entries(stream)

    log = _decode_late(hosts[0], common, reference)
    assert "the prefill engine whose KV cache it was is gone" in log, log[-6000:]
    assert re.search(r"KV cache %s/ea-kvcache-\S+ is gone; recomputing" % re.escape(stream),
                     log), log[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_a_shared_prefix_is_one_copy_in_the_prefill_engines_cache_read_by_each_prompt(
        model, dirs, hosts):
    """transfer "cache": prompts that share a 96-token prefix, computed one after another by
    the prefill engine (vLLM's prefix caching gives the later ones the first one's blocks):
    their entries name the same three blocks of its KV cache for the prefix, so the prefix is
    held once, however many prompts and decode engines read it. A decode engine loads every
    prompt with plain vLLM's tokens."""
    stream, spill = dirs
    rng = random.Random(5)
    prefix = [rng.randrange(3, 512) for _ in range(3 * BLOCK)]
    first = prefix + [rng.randrange(3, 512) for _ in range(40)]
    later = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (20, 50)]
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=4,
                  transfer="cache")
    from expert_arena import vllm_kv
    with _holding(hosts[0], role="kv_producer", prompts=[first], then=later,
                  **common) as produced:
        blocks = []
        for p in [first] + later:
            digest = vllm_kv.prompt_digests(p[:_whole(p)])[-1]
            with open(os.path.join(stream, "ea-kv-pytest-%s-r0.json" % digest)) as f:
                blocks.append(json.load(f)["cache"]["blocks"])
        assert all(b[:3] == blocks[0][:3] for b in blocks), blocks
        # Each one's fourth block its own: a whole one, or the tail after the prefix.
        assert len({b[3] for b in blocks}) == 3, blocks
        assert produced["then"]["cached"] == [3 * BLOCK] * 2, produced["then"]
        decoded, _ = _run(hosts[1], role="kv_consumer", prompts=[first] + later, **common)
    assert decoded["tokens"] == produced["tokens"] + produced["then"]["tokens"]
    assert decoded["cached"] == [_loadable(p) for p in [first] + later], decoded
    assert decoded["counters"]["load_error_blocks"] == 0, decoded["counters"]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


@pytest.mark.parametrize("transfer", ["segments", "cache"])
def test_a_prompt_whose_whole_blocks_this_engine_has_loads_only_its_tail(transfer, model,
                                                                         dirs, hosts):
    """A decode engine that has a prompt's whole blocks in its own prefix cache (it decoded the
    prompt before) loads only the entry's tail, the partial block after them, and computes the
    last token alone: vLLM counts every token but the last cached, not only the whole blocks.
    Its tokens are the prefill engine's (plain vLLM's)."""
    stream, spill = dirs
    prompts = [p for p in PROMPTS + LATE_PROMPTS if _loadable(p) > _whole(p)]
    assert prompts
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=4,
                  transfer=transfer)
    with _holding(hosts[0], role="kv_producer", prompts=prompts, readers=2,
                  **common) as produced:
        decoded, log = _run(hosts[1], role="kv_consumer", prompts=prompts, then=prompts,
                            **common)
    assert decoded["tokens"] == produced["tokens"], log[-6000:]
    assert decoded["then"]["tokens"] == produced["tokens"], log[-6000:]
    assert decoded["cached"] == [_loadable(p) for p in prompts], decoded
    assert decoded["then"]["cached"] == [_loadable(p) for p in prompts], decoded["then"]
    counters = decoded["counters"]
    assert counters["loaded_requests"] == 2 * len(prompts), counters
    # The second time one block each: the tail.
    assert counters["loaded_blocks"] == sum(_blocks(p) + 1 for p in prompts), counters
    assert counters["load_error_blocks"] == 0, counters
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_a_preempted_request_withdraws_the_blocks_its_entry_named(model, dirs, hosts):
    """transfer "cache" in a prefill engine that goes on decoding in a KV cache of 16 blocks:
    vLLM preempts a request after its prompt was published and gives its blocks to others;
    its entry is withdrawn at the start of that step, before they are written again. The
    finished requests' blocks are held for decode engines up to half the cache: beyond, the
    oldest are let go of (counted as expired), and the engine does not wait ttl_seconds
    (600 here) for blocks of its own. A decode engine of the prompts then gives plain vLLM's
    tokens, loading what is still published."""
    stream, spill = dirs
    rng = random.Random(17)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(97, 128))] for _ in range(4)]
    common = dict(model=model, directory=stream, spill_directory=spill, transfer="cache",
                  prompts=prompts)
    reference, _ = _run(hosts[1], role="plain", max_tokens=8, **common)
    # (Without prefix caching a preempted request's blocks go to the next request at once,
    # rather than back to it at its resumption.)
    with _holding(hosts[0], role="kv_producer", max_tokens=100, ignore_eos=True,
                  num_blocks=16, prefix_caching=False, **common) as produced:
        assert produced["counters"]["saved_requests"] == len(prompts), produced["counters"]
        counters = produced["counters"]
        assert counters["withdrawn_requests"] > 0, counters  # preempted after their save
        assert counters["expired_requests"] > 0, counters  # held beyond half the cache
        decoded, log = _run(hosts[1], role="kv_consumer", max_tokens=8, **common)
    assert decoded["tokens"] == reference["tokens"], log[-6000:]
    assert decoded["counters"]["load_error_blocks"] == 0, decoded["counters"]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_damaged_shared_cache_entries_are_refused_by_name_and_the_prompts_computed(
        model, dirs, hosts):
    """Index entries of a shared KV cache that name another file, a layer past the file's
    end, blocks the cache does not have, another dtype or another layout: the decode engine
    reads nothing through them, names each, and gives plain vLLM's tokens (computed)."""
    stream, spill = dirs
    prompts = PROMPTS[1:] + LATE_PROMPTS
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=4,
                  prompts=prompts, transfer="cache")
    from expert_arena import vllm_kv

    def damaged(entry, i):
        layers = entry["layers"]
        first = sorted(layers)[0]
        one = lambda **c: dict(layers, **{first: dict(layers[first], **c)})  # noqa: E731
        cases = [
            (dict(entry, cache=dict(entry["cache"], file="../" + entry["cache"]["file"])),
             "not a KV cache file of this connector's name"),
            (dict(entry, cache=dict(entry["cache"], file="ea-kvcache-other-1-0123abcd")),
             "not a KV cache file of this connector's name"),
            (dict(entry, layers=one(offset=1 << 40)), "ends past the"),
            (dict(entry, cache=dict(entry["cache"], blocks=[1 << 40] * 8)), "is not one of the "
             "producer's"),
            (dict(entry, layers=one(dtype="f16")), "the producer's KV is 'f16'"),
            (dict(entry, layers=one(shape=[1] + layers[first]["shape"][1:])),
             "is not one of the producer's 1"),
        ]
        return cases[i]

    with _holding(hosts[0], role="kv_producer", **common) as produced:
        whys = []
        for i, p in enumerate(prompts):
            digest = vllm_kv.prompt_digests(p[:_whole(p)])[-1]
            path = os.path.join(stream, "ea-kv-pytest-%s-r0.json" % digest)
            with open(path) as f:
                entry, why = damaged(json.load(f), i)
            # Rewritten in place: the prefill engine's open file is this entry still.
            with open(path, "r+") as f:
                f.truncate(0)
                f.write(json.dumps(entry))
            whys.append(why)
        decoded, log = _run(hosts[1], role="kv_consumer", **common)
    assert decoded["tokens"] == produced["tokens"]
    counters = decoded["counters"]
    assert counters["loaded_blocks"] == 0, counters
    assert counters["load_error_blocks"] == sum(_blocks(p) for p in prompts), counters
    for why in whys:
        assert why in log, (why, log[-6000:])
    assert "Traceback" not in log, log[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


# (transformers 5 keeps rope_theta in rope_parameters, which is what vLLM reads.)
@pytest.mark.parametrize("overrides", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rms_norm_eps": 1e-3}])
def test_a_decode_engine_of_another_configuration_computes_the_prompts_itself(
        overrides, model, dirs, hosts):
    """The same checkpoint under hf_overrides (RoPE's theta, which shapes every key; a norm's
    epsilon, which shapes every layer's input) is another model: its decode engine refuses
    the prefill engine's KV by name and gives plain vLLM's tokens under the override. (A
    tiny random model's greedy tokens hardly depend on either: loading the KV is what the
    test catches.)"""
    stream, spill = dirs
    prompts = PROMPTS[1:3]
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=8,
                  prompts=prompts)
    reference, _ = _run(hosts[0], role="plain", hf_overrides=overrides, **common)
    with _holding(hosts[0], role="kv_producer", **common) as produced:
        assert produced["counters"]["saved_requests"] == len(prompts)
        decoded, log = _run(hosts[1], role="kv_consumer", hf_overrides=overrides, **common)
    assert decoded["tokens"] == reference["tokens"]
    assert decoded["counters"]["loaded_blocks"] == 0, decoded["counters"]
    assert re.search(r"refusing the KV of \S+ \(producer \S+\): config: '[0-9a-f]{32}' here, "
                     r"'[0-9a-f]{32}' in the producer", log), log[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_entries_and_caches_of_another_user_are_refused_and_the_prompts_computed(
        model, dirs, hosts):
    """Another user who can write to the directory (/dev/shm is everyone's) hands the decode
    engine nothing: an index entry of theirs, and an entry of ours naming a KV cache file of
    theirs (a copy of the prefill engine's), are refused by name before any byte is read; the
    prompts are computed, plain vLLM's tokens; no engine removes or sweeps their files."""
    if os.geteuid() != 0:
        pytest.skip("gives files to another user (root)")
    stream, spill = dirs
    prompts = PROMPTS[1:3]
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=4,
                  prompts=prompts, transfer="cache")
    from expert_arena import vllm_kv
    nobody = 65534
    with _holding(hosts[0], role="kv_producer", **common) as produced:
        paths = [os.path.join(stream, "ea-kv-pytest-%s-r0.json"
                              % vllm_kv.prompt_digests(p[:_whole(p)])[-1]) for p in prompts]
        os.chown(paths[0], nobody, -1)
        with open(paths[1]) as f:
            entry = json.load(f)
        theirs = "ea-kvcache-pytest-%d-0badf00d" % os.getpid()
        shutil.copyfile(os.path.join(stream, entry["cache"]["file"]),
                        os.path.join(stream, theirs))
        os.chown(os.path.join(stream, theirs), nobody, -1)
        entry["cache"]["file"] = theirs
        with open(paths[1], "r+") as f:  # in place: the prefill engine's open file
            f.truncate(0)
            f.write(json.dumps(entry))
        decoded, log = _run(hosts[1], role="kv_consumer", **common)
    assert decoded["tokens"] == produced["tokens"]
    assert decoded["counters"]["loaded_blocks"] == 0, decoded["counters"]
    assert "index entry %s belongs to uid %d, not to this engine's uid 0" % (
        paths[0], nobody) in log, log[-6000:]
    assert "the producer's KV cache %s belongs to uid %d" % (
        os.path.join(stream, theirs), nobody) in log, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    # The cache file no engine made stays (the prefill engine's exit removed the entries it
    # published, the one given away too, and its own cache file).
    assert os.listdir(stream) == [theirs]
    os.unlink(os.path.join(stream, theirs))


def test_a_prefill_engine_killed_in_a_save_leaves_nothing_to_load_and_nothing_behind(
        model, dirs, hosts):
    """The prefill engine is SIGKILLed inside the connector's save path: the first prompt
    published (its entry written), the second's first layer written into a segment and its
    second not. A decode engine of both prompts gives plain vLLM's tokens and loads nothing:
    the published prompt's blocks went with the killed engine's segments (load errors,
    recomputed), the half-saved prompt has no entry. What the killed engine left (segments, an
    entry, and a temporary entry as a kill inside an entry's write leaves it) is gone after the
    decode engine ran."""
    from expert_arena import vllm_kv
    stream, spill = dirs
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=8,
                  prompts=KILLED_PROMPTS)
    # Killed at the second prompt's second layer (the first prompt's layers were calls 1-2).
    killed = _start(role="kv_producer", kill_in_save=LAYERS + 2, **common)
    try:
        reference, _ = _run(hosts[0], role="plain", **common)
        code = killed.wait(timeout=300)
    finally:
        if killed.poll() is None:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
    assert code == -signal.SIGKILL, _log(killed)[-6000:]
    published, half = [vllm_kv.prompt_digests(p[:_whole(p)])[-1] for p in KILLED_PROMPTS]
    assert _entries(stream) == ["ea-kv-pytest-%s-r0.json" % published], os.listdir(stream)
    # Its segments hold the published prompt's layers and the half-saved prompt's first one.
    held = [expert_arena.inspect_segment(os.path.join(stream, s)) for s in _segments(stream)]
    assert held and not any(s["owner_alive"] for s in held), held
    assert sum(s["published_blocks"] for s in held) == LAYERS + 1, held
    # What a kill between an entry's write and its rename leaves (_write_entry's name).
    temporary = os.path.join(stream, "ea-kv-pytest-%s-r0.json.tmp-%d-%d" % (half, killed.pid,
                                                                            killed.pid))
    with open(temporary, "w") as f:
        f.write('{"version": 1, "tok')

    decoded, log = _run(hosts[1], role="kv_consumer", **common)
    assert decoded["tokens"] == reference["tokens"]
    counters = decoded["counters"]
    assert counters["loaded_blocks"] == 0, counters
    assert counters["load_error_blocks"] == _blocks(KILLED_PROMPTS[0]), counters
    assert "cannot be opened" in log and "removing %s" % temporary in log, log[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


@pytest.mark.parametrize("arch,transfer", [("Qwen3ForCausalLM", "segments"),
                                           ("DeepseekV3ForCausalLM", "segments"),
                                           ("DeepseekV3ForCausalLM", "cache")])
def test_a_dense_model_and_mla_decode_what_the_prefill_engine_computed(arch, transfer, dirs,
                                                                       tmp_path, hosts):
    """The layouts are taken from the KV caches vLLM registered: a dense model's, and
    DeepSeek-V3's MLA latent cache (one [blocks, block size, 576] tensor per layer instead of
    keys and values, in 16-token blocks). The decode engine gives plain vLLM's tokens with
    every token but the last loaded. With a shared KV cache too: MLA's layers
    bind views of their own (a squeeze of the registered tensor), which write into the file
    as well."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "python"))
    import vllm_families
    model_dir = vllm_families.tiny_checkpoint(arch, str(tmp_path / arch))
    stream, spill = dirs
    prompts = PROMPTS[1:4]
    common = dict(model=model_dir, directory=stream, spill_directory=spill, max_tokens=8,
                  prompts=prompts, transfer=transfer,
                  dtype=vllm_families.DTYPE.get(arch, "float32"))
    # The prefill engine computed every prompt itself: its tokens are plain vLLM's (saving
    # reads the cache only, as the Qwen3-MoE test checks against a plain engine).
    with _holding(hosts[0], role="kv_producer", **common) as produced:
        if transfer == "cache":  # shared, not fallen back to the segments
            assert len(_cache_files(stream)) == 1 and _segments(stream) == [], \
                os.listdir(stream)
        decoded, _ = _run(hosts[1], role="kv_consumer", **common)
    assert decoded["tokens"] == produced["tokens"], (decoded, produced)
    # (vLLM's CPU MLA runs 16-token blocks whatever the engine asked for.)
    block = decoded["block_size"]
    assert produced["block_size"] == block
    loadable = [len(p) - 1 if len(p) > block else 0 for p in prompts]
    assert decoded["cached"] == loadable, decoded
    assert decoded["counters"]["loaded_blocks"] == sum(-(-n // block) for n in loadable)
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_two_decode_engines_read_one_prefill_without_a_copy_each(model, dirs, hosts):
    """readers=2: one prefill's KV, in the prefill engine's segments once, is loaded by two
    decode engines started together (each copies it into its own KV cache); the blocks are
    freed when both have, and the entry goes with the second. (transfer "cache":
    test_decode_engine_copies_from_the_prefill_engines_shared_kv_cache.)"""
    stream, spill = dirs
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=8)
    prompts = PROMPTS[1:4]
    prefill = _start(role="kv_producer", prompts=prompts, readers=2, hold=True, **common)
    try:
        produced = _answer(prefill)
        saved_blocks = sum(_blocks(p) for p in prompts)
        assert produced["counters"]["saved_blocks"] == saved_blocks, produced["counters"]
        segments = _segments(stream)
        for host in hosts:  # started together
            host.send(dict(role="kv_consumer", prompts=prompts, **common))
        results = [host.result(timeout=300) for host in hosts]
        for r in results:
            assert r["tokens"] == produced["tokens"], (r, produced)
            assert r["cached"] == [_loadable(p) for p in prompts], r
            assert r["counters"]["loaded_blocks"] == saved_blocks, r["counters"]
            assert r["counters"]["load_error_blocks"] == 0, r["counters"]
        # Read by both: no entry, no claim left; the producer holds no block of them and made
        # no segment for the second reader.
        assert _entries(stream) == [], os.listdir(stream)
        assert _segments(stream) == segments
    finally:
        code = _finish(prefill)
    assert code == 0, _log(prefill)[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


@pytest.mark.parametrize("transfer", ["segments", "cache"])
def test_aborted_requests_leave_no_block_and_no_file(transfer, model, dirs, hosts):
    """(With a shared KV cache the prefill engine holds a published prompt's blocks for a
    decode engine: an abort withdraws its entry and lets go of them at the next step.)"""
    stream, spill = dirs
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(17, 120))]
               for _ in range(100)]
    # Aborted before they are scheduled, after their prefill, or a few tokens later.
    abort_at = [rng.randrange(0, 5) for _ in prompts]
    with _holding(hosts[0], model=model, role="kv_producer", directory=stream,
                  spill_directory=spill, prompts=prompts, abort_at=abort_at,
                  max_tokens=64, transfer=transfer) as result:
        counters = result["counters"]
        assert counters["saved_requests"] > 0, counters
        assert counters["aborted_requests"] == counters["saved_requests"], counters
        # Alive, the engine holds no block of them, and no entry names one.
        assert result["pending"] == [], result["pending"]
        assert _entries(stream) == []
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_requests_aborted_while_their_kv_loads_leave_the_engine_right(model, dirs, hosts):
    """A decode engine that aborts requests before, while and after their KV loads (on the
    connector's thread: vLLM keeps their blocks until the load is reported) goes on with
    plain vLLM's tokens for the prompts after them, loaded into blocks the aborted ones had."""
    stream, spill = dirs
    rng = random.Random(11)
    aborted = [[rng.randrange(3, 512) for _ in range(rng.randrange(70, 200))]
               for _ in range(12)]
    after = [[rng.randrange(3, 512) for _ in range(rng.randrange(40, 200))] for _ in range(6)]
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=8)
    reference, _ = _run(hosts[1], role="plain", prompts=after, **common)
    with _holding(hosts[0], role="kv_producer", prompts=aborted + after, **common) as produced:
        assert produced["counters"]["saved_requests"] == len(aborted + after)
        decoded, log = _run(hosts[1], role="kv_consumer", prompts=aborted,
                            abort_at=[i % 3 for i in range(len(aborted))], then=after,
                            **common)
        then = decoded["then"]
        assert then["tokens"] == reference["tokens"], log[-6000:]
        assert then["cached"] == [_loadable(p) for p in after], then
        counters = decoded["counters"]
        assert counters["loaded_requests"] >= len(after), counters
        assert counters["load_error_blocks"] == 0, counters
    assert os.listdir(stream) == [] and os.listdir(spill) == []


@pytest.mark.parametrize("transfer", ["segments", "cache"])
def test_blocks_no_decode_engine_loads_expire(transfer, model, dirs, hosts):
    stream, spill = dirs
    # ttl_seconds=0: what a step published has expired by the next step. Two tokens each: the
    # prefill step saves, the decode step after it finds the KV of the step before expired.
    with _holding(hosts[1], model=model, role="kv_producer", directory=stream,
                  spill_directory=spill, prompts=PROMPTS, max_tokens=2,
                  ttl_seconds=0, transfer=transfer) as result:
        counters = result["counters"]
        assert counters["saved_requests"] == len([q for q in PROMPTS if _loadable(q)])
        assert counters["expired_requests"] == counters["saved_requests"], counters
        assert result["pending"] == [] and _entries(stream) == []
    assert os.listdir(stream) == [] and os.listdir(spill) == []

def test_prompt_digests_name_prefixes_and_damaged_entries_are_refused_by_name(tmp_path):
    from expert_arena import vllm_kv
    a = list(range(100, 200))
    # Equal prefixes, equal digests; a prompt that differs in one token differs from there on.
    b = a[:40] + [7] + a[41:]
    da, db = vllm_kv.prompt_digests(a), vllm_kv.prompt_digests(b)
    assert len(da) == 100 // vllm_kv.HASH_TOKENS
    assert da[:2] == db[:2] and all(x != y for x, y in zip(da[2:], db[2:]))
    assert vllm_kv.prompt_digests(a[:64]) == da[:4]
    # An entry's tail (its last, partial block) is loaded only by a prompt whose tokens but
    # its last are the ones it was computed for.
    entry = {"tokens": 64, "tail": {"tokens": 20, "digest": vllm_kv.tail_digest(a[:84])}}
    assert vllm_kv._tail_tokens(entry, a[:85], 64, 32) == 20
    assert vllm_kv._tail_tokens(entry, b[:85], 64, 32) == 0  # b differs at token 40
    assert vllm_kv._tail_tokens(entry, a[:83] + [7, 8], 64, 32) == 0  # another tail
    assert vllm_kv._tail_tokens(entry, a[:86], 64, 32) == 0  # a longer prompt: whole blocks
    assert vllm_kv._tail_tokens(entry, a[:85], 32, 32) == 0  # found at another length
    assert vllm_kv._tail_tokens(entry, a[:85], 64, 16) == 0  # more than a block
    assert vllm_kv._tail_tokens({"tokens": 64}, a[:85], 64, 32) == 0

    # What the decode engine reads from the shared directory is checked, never trusted.
    cases = {"not-json.json": b"{\"version\": 1, ",
             "old.json": json.dumps({"version": 0}).encode(),
             "no-layers.json": json.dumps({"version": 1, "tokens": 32, "identity": {},
                                           "layers": {}}).encode(),
             "big.json": b" " * ((1 << 20) + 1),
             "deep.json": b"[" * 100000}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=str(tmp_path / name)):
            vllm_kv._read_entry(str(tmp_path / name))
    os.symlink(tmp_path / "old.json", tmp_path / "link.json")
    with pytest.raises(OSError):  # O_NOFOLLOW: another user's link is not followed
        vllm_kv._read_entry(str(tmp_path / "link.json"))
    assert vllm_kv._read_entry(str(tmp_path / "absent.json")) is None


@pytest.fixture
def two_namespaces():
    """Two network namespaces made here, joined by a veth pair (10.231.7.1 and .2): two hosts
    to the network, sharing this one's file systems. Removed after the test."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if IN_CI:
            pytest.fail("the network namespace test needs root and iproute2 in CI")
        pytest.skip("needs root and iproute2 (ip netns)")
    # Namespaces of a run that was killed before its teardown (its pid gone) go first.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for stale in re.findall(r"^(eakv(\d+)[ab])\b", listed, re.M):
        if not os.path.exists("/proc/%s" % stale[1]):
            subprocess.run(["ip", "netns", "del", stale[0]], capture_output=True)
    tag = "eakv%d" % os.getpid()  # "eakv" + at most 7 digits + "x": within IFNAMSIZ
    names = [tag + "a", tag + "b"]
    script = ["ip netns add %s" % n for n in names]
    script.append("ip link add %sx netns %s type veth peer name %sy netns %s"
                  % (tag, names[0], tag, names[1]))
    for i, (n, dev) in enumerate(zip(names, (tag + "x", tag + "y"))):
        script += ["ip -n %s addr add 10.231.7.%d/30 dev %s" % (n, i + 1, dev),
                   "ip -n %s link set %s up" % (n, dev), "ip -n %s link set lo up" % n]
    try:
        for command in script:
            subprocess.run(command.split(), check=True, capture_output=True, text=True)
        yield names, ["10.231.7.1", "10.231.7.2"]
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_a_decode_engine_in_another_network_namespace_loads_through_the_front_door(
        model, dirs, two_namespaces):
    """The prefill engine listens (listen, listen_token) in one network namespace; its
    outputs' kv_transfer_params carry the prompts' entries, as a proxy hands them on. A decode
    engine in the other namespace, whose stream directory does not hold the prefill engine's
    segments, fetches the blocks over UCX through the front door: with a wrong token it is
    refused (and computes the prompts: plain tokens), with the token it loads every full
    block; kv_transfer_params naming an address outside remote_producers are refused."""
    names, addresses = two_namespaces
    stream, spill = dirs
    elsewhere = tempfile.mkdtemp(prefix="ea-pytest-kv-other-", dir=stream_root())
    env = _env()
    env["UCX_TLS"] = "tcp"
    prompts = PROMPTS[1:4]
    common = dict(model=model, spill_directory=spill, max_tokens=8, prompts=prompts)

    # The decode engines, one after another in an engine host in the other namespace.
    host = engine_procs.EngineHost(ENGINE, env, prefix=["ip", "netns", "exec", names[1]])

    def decode(**request):
        return _run(host, **dict(common, role="kv_consumer", directory=elsewhere, **request))

    prefill = engine_procs.start(
        [ENGINE, json.dumps(dict(common, role="kv_producer", directory=stream, hold=True,
                                 listen=addresses[0] + ":0", listen_token="t0ken"))],
        env, prefix=["ip", "netns", "exec", names[0]])
    try:
        produced = _answer(prefill)
        params = produced["transfer_params"]
        assert all(p and len(p["expert_arena"]["entries"]) == 1 for p in params), params
        import expert_arena
        served_by = {expert_arena.decode_descriptor(bytes.fromhex(d))["remote"]
                     for p in params for d in p["expert_arena"]["entries"][0]["layers"].values()}
        assert len(served_by) == 1 and served_by.pop().startswith(addresses[0] + ":")
        producer = expert_arena.decode_descriptor(bytes.fromhex(next(iter(
            params[0]["expert_arena"]["entries"][0]["layers"].values()))))["remote"]
        loadable = [_loadable(p) for p in prompts]

        # Not among remote_producers: refused before anything is fetched.
        elsewhere_only, log = decode(remote_token="t0ken", remote_producers=["10.231.7.9:1"],
                                     transfer_params=params)
        assert elsewhere_only["tokens"] == produced["tokens"]
        assert elsewhere_only["counters"]["loaded_blocks"] == 0
        assert elsewhere_only["counters"]["refused"] >= len(prompts), elsewhere_only["counters"]
        assert "not one of remote_producers" in log, log[-6000:]

        # A wrong token: the producer refuses it before any byte; the blocks are computed.
        wrong, log = decode(remote_token="nope", remote_producers=[producer],
                            transfer_params=params)
        assert wrong["tokens"] == produced["tokens"]
        assert wrong["counters"]["loaded_blocks"] == 0
        assert wrong["counters"]["load_error_blocks"] == sum(-(-n // BLOCK) for n in loadable)
        assert "token" in log, log[-6000:]

        # The token: every token but the last from the other namespace.
        decoded, _ = decode(remote_token="t0ken", remote_producers=[producer],
                            transfer_params=params)
        assert decoded["tokens"] == produced["tokens"]
        assert decoded["cached"] == loadable, decoded
        assert decoded["counters"]["loaded_blocks"] == sum(-(-n // BLOCK) for n in loadable)
        assert decoded["counters"]["load_error_blocks"] == 0, decoded["counters"]
        assert os.listdir(elsewhere) == [], os.listdir(elsewhere)
    finally:
        code = _finish(prefill)
        host_code = host.close()
        shutil.rmtree(elsewhere, ignore_errors=True)
    assert code == 0, _log(prefill)[-6000:]
    assert host_code == 0, _log(host.p)[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def _hostile_cases(entry, identity, forged, other_digest, unlisted, listed):
    """(kv_transfer_params, what the refusal's log line says) for one prompt each: entry(**c)
    is a copy of the prompt's own entry (a local one: no remote address) with the fields c
    changed (None: removed), `identity` the entry's; forged(address, **fields) its layers'
    descriptors made anew, naming `address`, with `fields` changed (and no MAC: no producer
    made them)."""
    def params(*entries):
        return {"expert_arena": {"entries": list(entries)}}
    deep = "x"
    for _ in range(200):
        deep = [deep, {"k": deep if isinstance(deep, str) else None}]
    rank = "one entry per tensor-parallel rank"
    lacks = "entry 0 lacks tokens, layers or identity"
    fit = "do not fit this prompt's"
    return [
        # Refused by the scheduler (the request's kv_transfer_params).
        ({"expert_arena": "entries"}, rank),
        ({"expert_arena": [entry()]}, rank),
        ({"expert_arena": 12}, rank),
        ({"expert_arena": {"entries": "x"}}, rank),
        ({"expert_arena": {"entries": {"0": entry()}}}, rank),
        (params(), rank),
        (params(entry(), entry()), rank),
        (params("x"), "entry 0 is not a version 1 entry"),
        (params([entry()]), "entry 0 is not a version 1 entry"),
        (params({}), "entry 0 is not a version 1 entry"),
        (params(entry(version=2)), "entry 0 is not a version 1 entry"),
        (params(entry(layers=None)), lacks),
        (params(entry(identity=None)), lacks),
        (params(entry(tokens=None)), lacks),
        (params(entry(tokens=-BLOCK)), lacks),
        (params(entry(tokens="64")), lacks),
        (params(entry(layers={"model.layers.0": 7})), lacks),
        (params(entry(readers=-1)), "readers -1 is not from 1 to"),
        (params(entry(tail={"tokens": "7", "digest": "x"})), "its tail is not tokens and a"),
        (params(entry(tail=[7, "x"])), "its tail is not tokens and a digest"),
        (params(entry(tokens=(1 << 63) - BLOCK)), fit),  # vLLM takes up to 2**64 - 1
        (params(entry(tokens=BLOCK + BLOCK // 2)), fit),
        (params(entry(digest=other_digest)), "the KV of other tokens"),
        (params(entry(digest="\u30cf\u30c3\u30b7\u30e5")), "the KV of other tokens"),
        (params(entry(identity=dict(identity, model="/elsewhere/\u6a21\u578b"))),
         "entry 0: model: %r here, '/elsewhere/\u6a21\u578b' in the producer" % identity["model"]),
        (params(entry(identity=dict(identity, model=deep, junk={"x": [deep]}))),
         "'junk': None here, {'x': [[[...], {...}]]} in the producer"),  # cut short
        (params(entry(layers={"\u5c42": "\u00e9\u00e9"})),
         "entry 0: layer '\u5c42''s descriptor: non-hexadecimal"),
        (params(entry(layers={"l": "00" * 40})), "layer 'l''s descriptor: tensor descriptor "
         "refused: bad magic"),
        (params(entry(layers=forged(listed, offset=1 << 63, length=(1 << 64) - 1))),
         "offset + length overflows"),
        (params(entry()), "served by None, not one of remote_producers"),
        (params(entry(layers=forged(unlisted))),
         "served by %r, not one of remote_producers" % unlisted),
        # A shared KV cache's entry names a file of the decode engine's own host: never taken
        # from a request.
        (params(entry(cache={"file": "ea-kvcache-pytest-1-0123abcd", "blocks": [0, 1, 2]},
                      layers={"l": {"offset": 0}})), "names a prefill engine's KV cache file"),
        ({"do_remote_prefill": True, "expert": deep}, None),  # not ours: no remote entry
        # Accepted by the scheduler, refused by the worker before anything is opened.
        (params(entry(layers=forged(listed))), "MAC does not hold"),
        (params(entry(layers=forged(listed, blocks=1 << 40))), "MAC does not hold"),
        (params(entry(layers=forged(listed, blocks=1))), "saved 1 blocks, 3 are needed"),
        (params(entry(layers=dict(list(forged(listed).items())[:1]))), "layers (1)"),
    ]


def test_hostile_kv_transfer_params_are_refused_by_name_and_the_prompts_computed(model, dirs,
                                                                                 hosts):
    """kv_transfer_params a client sends with its requests (vLLM's server passes them on) in
    every wrong form: other types, missing or wrong fields, counts out of range, another
    prompt's digest, another model's identity, deep junk, non-ASCII, descriptors that are not
    descriptors, ones naming an address outside remote_producers or forged for one in it, and
    a shared KV cache's entry (a file of this host).
    One decode engine serves every prompt with plain vLLM's tokens (computed), loads nothing,
    logs each refusal naming the request and why, and connects nowhere."""
    from expert_arena import _core, vllm_kv
    stream, spill = dirs
    # Prompts of three loadable blocks each and no tail (the forged descriptors' block
    # dimension is the one of size 3), one per case.
    rng = random.Random(43)
    prompts = [[rng.randrange(3, 512) for _ in range(3 * BLOCK + 1)] for _ in range(37)]
    common = dict(model=model, directory=stream, spill_directory=spill, max_tokens=4,
                  prompts=prompts)
    # The prefill engine's tokens are plain vLLM's (saving reads the cache only); its entries
    # are the real ones the cases are made from.
    with _holding(hosts[0], role="kv_producer", **common) as produced:
        real = {}
        for name in _entries(stream):
            with open(os.path.join(stream, name)) as f:
                entry = json.load(f)
            real[entry["digest"]] = entry
    digests = [vllm_kv.prompt_digests(p[:3 * BLOCK])[-1] for p in prompts]
    assert set(digests) <= set(real), (len(real), len(prompts))

    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    try:
        listed, unlisted = ["127.0.0.1:%d" % s.getsockname()[1] for s in sockets]
        params = []
        for i, digest in enumerate(digests):
            def entry(**changes):
                e = copy.deepcopy(real[digest])
                for k, v in changes.items():
                    if v is None:
                        del e[k]
                    else:
                        e[k] = v
                return e

            def forged(address, blocks=None, **fields):
                out = {}
                for name, hexed in real[digest]["layers"].items():
                    d = dict(expert_arena.decode_descriptor(bytes.fromhex(hexed)), remote=address,
                             producer_instance=1, boot_id="0" * 32, **fields)
                    if blocks is not None:
                        d["shape"] = [blocks if n == 3 else n for n in d["shape"]]
                    out[name] = _core.encode_descriptor(d).hex()
                return out

            cases = _hostile_cases(entry, real[digest]["identity"], forged,
                                   digests[(i + 1) % len(digests)], unlisted, listed)
            params.append(cases[i])
        assert len(cases) == len(prompts)
        decoded, log = _run(hosts[1], role="kv_consumer", remote_producers=[listed],
                            remote_token="t0ken", transfer_params=[p for p, _ in params],
                            **common)
        # Nothing connected to either address (the forged descriptors lack the MAC a producer
        # with the token makes: refused before any connection).
        for s in sockets:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in sockets:
            s.close()
    assert decoded["tokens"] == produced["tokens"]
    counters = decoded["counters"]
    assert counters["loaded_blocks"] == 0, counters
    worker_refused = [i for i, (_, why) in enumerate(params)
                      if why in ("MAC does not hold", "saved 1 blocks, 3 are needed", "layers (1)")]
    assert counters["load_error_blocks"] == 3 * len(worker_refused), counters
    assert counters["refused"] >= len(params) - len(worker_refused) - 1, counters
    lines = log.splitlines()
    for i, (p, why) in enumerate(params):
        if why is None:
            continue
        named = [l for l in lines if re.search(r"request %d-\w+\b" % i, l)]
        assert any(why in l for l in named), (i, p if len(str(p)) < 2000 else "...", why, named)
    assert "Traceback" not in log, log[-6000:]
    assert os.listdir(stream) == [] and os.listdir(spill) == []


def test_the_connector_options_are_checked(tmp_path):
    from expert_arena import vllm_kv
    d = str(tmp_path)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key.*'listen_tokn'"):
        vllm_kv._Options({"directory": d, "listen_tokn": "x"})
    with pytest.raises(ValueError, match="listen needs listen_token or token_file"):
        vllm_kv._Options({"directory": d, "listen": "127.0.0.1:0"})
    with pytest.raises(ValueError, match="remote_producers needs remote_token"):
        vllm_kv._Options({"directory": d, "remote_producers": ["10.0.0.1:5000"]})
    with pytest.raises(ValueError, match="remote_producers must be a list"):
        vllm_kv._Options({"directory": d, "remote_producers": [5000], "remote_token": "t"})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="token_file .* is empty"):
        vllm_kv._Options({"directory": d, "token_file": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="token_file: .*absent"):
        vllm_kv._Options({"directory": d, "token_file": str(tmp_path / "absent")})
    # One token file serves both roles; the token never has to be in the logged config.
    (tmp_path / "token").write_text("s3cret\n")
    both = vllm_kv._Options({"directory": d, "token_file": str(tmp_path / "token"),
                             "listen": "127.0.0.1:0", "remote_producers": "10.0.0.1:5000"})
    assert (both.listen_token, both.remote_token) == ("s3cret", "s3cret")
    assert both.remote_producers == {"10.0.0.1:5000"}
    # How the decode engine loads: asynchronously unless told otherwise; nothing else.
    assert vllm_kv._Options({"directory": d}).load == "async"
    assert vllm_kv._Options({"directory": d, "load": "sync"}).load == "sync"
    for bad in ("later", 1, None):
        with pytest.raises(ValueError, match='load .* must be "async" or "sync"'):
            vllm_kv._Options({"directory": d, "load": bad})
    assert vllm_kv._Options({"directory": d}).huge_pages is True
    assert vllm_kv._Options({"directory": d, "huge_pages": False}).huge_pages is False
    for bad in ("false", 0, None):
        with pytest.raises(ValueError, match="huge_pages .* must be true or false"):
            vllm_kv._Options({"directory": d, "huge_pages": bad})


def test_a_decode_engines_own_cache_moves_onto_huge_pages_and_keeps_every_write():
    """_HostPages: the whole 2 MiB pages inside the cache tensors' bytes (one storage's views
    counted once, an unaligned start left out), collapsed on a thread while another thread
    writes to them, as the engine's loads and forwards do: every byte is what was written
    last, and the kernel's smaps counts what the connector says it made."""
    from expert_arena import vllm_kv
    import threading
    from vllm_kv_engine import anon_huge_bytes
    buf = torch.randint(0, 1 << 30, ((40 << 20) // 4 + 123,), dtype=torch.int32)
    views = {"a": (buf[123:].view(-1, 1024)[:5000], 0), "b": (buf[123:].view(-1, 1024), 0),
             "c": (torch.zeros(3), 0)}  # under 2 MiB: nothing to collapse
    first = buf[123:].data_ptr()
    last = first + ((buf.numel() - 123) * 4)
    want = buf.clone()
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            at = (i * 7919) % (buf.numel() - 4096)
            buf[at:at + 4096] = i
            want[at:at + 4096] = i
            i += 1
    t = threading.Thread(target=writer)
    t.start()
    try:
        pages = vllm_kv._HostPages(views).start()
        assert pages.wait(120)
    finally:
        stop.set()
        t.join()
    huge = 2 << 20
    assert pages.ranges == [(-(-first // huge) * huge, last // huge * huge)]
    assert pages.total == pages.ranges[0][1] - pages.ranges[0][0] >= 36 << 20
    assert torch.equal(buf, want)
    assert anon_huge_bytes(pages.ranges) == pages.huge_bytes
    if pages.error is None:
        assert pages.huge_bytes == pages.total
    else:
        assert pages.error in _NO_HUGE_PAGES
    pages.close()


def test_a_connector_cleans_only_the_files_of_its_own_name(tmp_path):
    """What a connector's cleanups (orphaned entries, readers' claims, abandoned temporaries)
    may touch are the files of its own name: never those of a connector whose name begins with
    its own and a dash (`kv` and `kv-b` in one directory, each with its own spill directory)."""
    from expert_arena import vllm_kv
    kv = vllm_kv._Options({"directory": str(tmp_path), "name": "kv"})
    mine = os.path.basename(kv.entry_path("ab" * 20, 0))
    theirs = os.path.basename(vllm_kv._Options({"directory": str(tmp_path), "name": "kv-b"})
                              .entry_path("ab" * 20, 0))
    for name in (mine, mine + ".read-3", mine + ".tmp-12-34"):
        assert kv.owns(name), name
    for name in (theirs, theirs + ".read-3", theirs + ".tmp-12-34", "ea-kv-kv-xyz.json",
                 "ea-stream-kv-1", mine.replace("-r0", "")):
        assert not kv.owns(name), name
    # The abandoned-temporary cleanup, on real files: only its own, unheld one goes.
    for name in (mine + ".tmp-12-34", theirs + ".tmp-12-34"):
        (tmp_path / name).write_text("{")
    vllm_kv._remove_abandoned_temporaries(str(tmp_path), kv.owns)
    assert sorted(os.listdir(tmp_path)) == [theirs + ".tmp-12-34"]


_AS_ANOTHER_USER = """
import os, sys, types
from expert_arena import vllm_kv
d = sys.argv[1]
options = vllm_kv._Options({"directory": d, "spill_directory": d, "name": "pytest"})
vllm_kv._sweep_cache_files(d, "pytest")
vllm_kv._remove_abandoned_temporaries(d, options.owns)
vllm_kv.ExpertArenaConnector._remove_orphan_entries(types.SimpleNamespace(_options=options))
entry = options.entry_path("ab" * 20, 0)
try:
    vllm_kv._read_entry(entry)
except ValueError as e:
    print(e)
vllm_kv._remove_entry(entry)
print("done")
"""


def test_the_files_of_another_user_in_a_shared_directory_are_left_alone(tmp_path):
    """A connector that runs as one user, in a sticky directory (/dev/shm) where another user
    left files of its name (an entry that is not JSON, a temporary, a cache file, a claim):
    its cleanups at start skip them and go on (removing one would fail: a prefill engine's
    start that raised there crashed the engine), and an entry of theirs is refused by name."""
    if os.geteuid() != 0:
        pytest.skip("runs a connector as another user (root)")
    from expert_arena import vllm_kv
    shared = tempfile.mkdtemp(prefix="ea-pytest-sticky-", dir="/dev/shm")
    try:
        os.chmod(shared, 0o1777)
        options = vllm_kv._Options({"directory": shared, "name": "pytest"})
        entry = options.entry_path("ab" * 20, 0)
        left = [entry, entry + ".read1", entry + ".tmp-1-2",
                os.path.join(shared, "ea-kvcache-pytest-1-0badf00d")]
        for path in left:
            with open(path, "w") as f:
                f.write("{")
        nobody = 65534
        done = subprocess.run(
            [sys.executable, "-c", _AS_ANOTHER_USER, shared], capture_output=True, text=True,
            timeout=300, env=dict(child_env(), HOME="/tmp"),
            preexec_fn=lambda: (os.setgid(nobody), os.setuid(nobody)))
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.splitlines() == [
            "index entry %s belongs to uid 0, not to this engine's uid %d: another user's "
            "file is not read" % (entry, nobody), "done"], (done.stdout, done.stderr[-4000:])
        assert sorted(os.listdir(shared)) == sorted(os.path.basename(p) for p in left)
    finally:
        shutil.rmtree(shared)


def _layouts(num_blocks):
    """KV cache tensors as vLLM lays them out: views of one zeroed backing buffer (vLLM
    0.32's allocate_kv_cache; big enough that malloc maps it by itself, and not a whole number
    of pages): the CPU backend's layout (blocks first) at its start, a GPU backend's keys and
    values first (FlashAttention's [2, blocks, ...]) inside it, MLA's latent cache at its very
    end; and a small storage two layers share (a hybrid model's), from the heap."""
    buf = torch.zeros((40 << 20) + 1008, dtype=torch.int8)

    def at(offset, shape, dtype):
        n = dtype.itemsize
        for d in shape:
            n *= d
        if offset < 0:
            offset = buf.numel() - n  # at the very end
        return buf[offset:offset + n].view(dtype).view(shape)
    shared = torch.zeros(2 * num_blocks * 4 * 64, dtype=torch.bfloat16)
    return {
        "cpu": (at(0, (num_blocks, 2, 16, 64), torch.bfloat16), 0),
        "flash": (at(20 << 20, (2, num_blocks, 16, 2, 32), torch.float16), 1),
        "mla": (at(-1, (num_blocks, 16, 72), torch.float32), 0),
        "hybrid.a": (shared[:num_blocks * 256].view(num_blocks, 4, 64), 0),
        "hybrid.b": (shared[num_blocks * 256:].view(num_blocks, 4, 64), 0),
    }


def test_a_shared_kv_cache_keeps_the_tensors_and_blocks_copy_out_of_it(tmp_path):
    """transfer "cache": the prefill engine's KV cache tensors move into one file (same
    shapes and strides, storages shared as vLLM shared them); what the engine writes is in the
    file, and a decode engine's copy_cache_blocks puts producer blocks into other blocks of its
    own cache, for every layout; a description that does not fit the file, blocks outside the
    cache and a file truncated under the copy are errors naming what is wrong, never a SIGBUS."""
    from expert_arena import vllm_kv
    options = vllm_kv._Options({"directory": str(tmp_path), "name": "unit"})
    caches = _layouts(12)
    before = {n: (t.data_ptr(), t.shape, t.stride()) for n, (t, _) in caches.items()}
    # A view of its own that a layer made before (MLA's squeeze, Mamba's state views): it is
    # not among the tensors vLLM registers.
    alias = caches["mla"][0].view(12, 16 * 72)
    cache = vllm_kv._SharedCache(options, caches)
    try:
        assert os.path.basename(cache.path).startswith("ea-kvcache-unit-%d-" % os.getpid())
        assert {n: (t.data_ptr(), t.shape, t.stride()) for n, (t, _) in caches.items()} == before
        for name, (t, _) in caches.items():
            assert not t.any(), name  # vLLM's zeros
            t.copy_(torch.randn(t.shape).to(t.dtype))
        # What the engine writes, through any view, is the file's (the bytes in a storage's
        # first and last pages once an entry is published: sync_edges).
        alias[5].fill_(3.5)
        cache.sync_edges()
        t = caches["cpu"][0]
        with open(cache.path, "rb") as f:
            f.seek(cache.layers["cpu"]["offset"] + 3 * t[0].numel() * 2)
            assert f.read(t[3].numel() * 2) == t[3].view(torch.uint8).numpy().tobytes()
            f.seek(cache.layers["mla"]["offset"] + 5 * 16 * 72 * 4)
            assert f.read(16 * 72 * 4) == torch.full((16 * 72,), 3.5).numpy().tobytes()
        # What is published is checked against the engine's memory: a file that lost a write
        # (a kernel's collapsed page) is found before an entry names it. (Shown here by a
        # write to block 0's bytes in the buffer's first page, which stays private, after
        # they were synced.)
        assert cache.mismatch(caches, [0, 5]) is None
        t[0, 0, 0, 0] += 1
        assert "block 0 of layer cpu reads back from %s unlike" % cache.path in \
            (cache.mismatch(caches, [0, 5]) or "")
        cache.sync_edges()

        src, dst = [3, 4, 5, 9, 0], [7, 8, 9, 1, 2]
        fd = os.open(cache.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            mapped = expert_arena._core.MappedFile(fd, "the cache")
            # (staged: through a host tensor, the way a device cache takes; source: out of the
            # file mapped, as the connector copies, or with pread)
            for (name, (t, dim)), staged, source in itertools.product(
                    caches.items(), (False, True), (None, mapped)):
                mine = torch.zeros_like(t)
                desc = cache.layers[name]
                vllm_kv._check_cache_layer(name, desc, size, t.element_size())
                n = vllm_kv.copy_cache_blocks(fd, desc, src, mine, dim, dst, staged=staged,
                                              source=source)
                assert n == len(src) * t.select(dim, 0).numel() * t.element_size()
                assert torch.equal(mine.index_select(dim, torch.tensor(dst)),
                                   t.index_select(dim, torch.tensor(src))), name
                untouched = [i for i in range(12) if i not in dst]
                assert not mine.index_select(dim, torch.tensor(untouched)).any()

            t, dim = caches["cpu"]
            desc = cache.layers["cpu"]
            for bad, why in [(dict(desc, offset=size), "ends past the %d bytes" % size),
                             (dict(desc, offset=-1), "offset, shape, stride or dim"),
                             (dict(desc, shape=[12, 2, 16]), "offset, shape, stride or dim"),
                             (dict(desc, stride=[1 << 62] + desc["stride"][1:]), "ends past"),
                             (dict(desc, dim=7), "offset, shape, stride or dim"),
                             (dict(desc, stride=[2048, 1024, 1, 16]), "not contiguous"),
                             ("x", "not described")]:
                with pytest.raises(ValueError, match=why):
                    vllm_kv._check_cache_layer("cpu", bad, size, 2)
            with pytest.raises(ValueError, match="block 12 is not one of the producer's 12"):
                vllm_kv.copy_cache_blocks(fd, desc, [12], torch.zeros_like(t), 0, [0])
        finally:
            os.close(fd)
        # Truncated after the checks (only its owner could: here a copy of it, as this
        # process's own cache is mapped onto the file): a short read, or out of the mapping
        # the pages it lost, never a SIGBUS.
        shutil.copyfile(cache.path, tmp_path / "copy")
        fd = os.open(tmp_path / "copy", os.O_RDONLY)
        try:
            mapped = expert_arena._core.MappedFile(fd, "the copy")
            os.truncate(tmp_path / "copy", desc["offset"] + 2 * t[0].numel() * 2)
            for source in (None, mapped):
                with pytest.raises(ValueError, match="shorter than the entry says"):
                    vllm_kv.copy_cache_blocks(fd, desc, [1, 2, 3], torch.zeros_like(t), 0,
                                              [4, 5, 6], source=source)
            del mapped
        finally:
            os.close(fd)
            os.unlink(tmp_path / "copy")
    finally:
        cache.close()
    assert os.listdir(tmp_path) == []


def test_a_kv_cache_that_does_not_fit_stays_private(tmp_path):
    """(And a tmpfs that makes 2 MiB pages itself is known for one: no collapse there.)"""
    from expert_arena import vllm_kv
    if os.geteuid() != 0:
        pytest.skip("mounts a small tmpfs (root)")
    mount = str(tmp_path / "small")
    os.mkdir(mount)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", mount], check=True)
    huge = str(tmp_path / "huge")
    os.mkdir(huge)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,huge=within_size", "none", huge],
                   check=True)
    try:
        assert vllm_kv._tmpfs_huge(huge) == "huge=within_size"
        if "[force]" not in open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read():
            assert vllm_kv._tmpfs_huge(mount) is None
    finally:
        subprocess.run(["umount", huge], check=True)
    try:
        options = vllm_kv._Options({"directory": mount, "name": "unit"})
        caches = _layouts(12)
        t = caches["cpu"][0]
        t.fill_(1)  # (written before the move: not the case in vLLM, checked as it is)
        with pytest.raises(OSError, match="has 1 MiB free, the KV cache takes"):
            vllm_kv._SharedCache(options, caches)
        assert bool((t == 1).all())
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", mount], check=True)


def test_a_killed_prefill_engines_cache_file_is_swept_and_a_live_ones_kept(tmp_path):
    from expert_arena import vllm_kv
    names = ["ea-kvcache-unit-%d-0123abcd" % i for i in (1, 2)]
    for n in names:
        (tmp_path / n).write_bytes(b"\0" * 4096)
    other = tmp_path / "ea-kvcache-unit-b-3-0123abcd"  # another connector name's
    other.write_bytes(b"")
    # A live engine holds its file (a shared flock), from another process.
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; "
                               "fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); "
                               "sys.stdin.read()", str(tmp_path / names[1])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        vllm_kv._sweep_cache_files(str(tmp_path), "unit")
        assert sorted(os.listdir(tmp_path)) == sorted([names[1], other.name])
    finally:
        holder.stdin.close()
        holder.wait()
