"""UCX is loaded by the transport plugin only (src/remote/ucx_plugin.h): importing
expert_arena, opening and attaching arenas and streaming tensors maps no UCX library; the
plugin next to the module brings it in at the first open(..., from_peer=...); a plugin that
cannot be loaded is a clear error and open() falls back to the model files."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD, IN_CI, child_env

expert_arena = pytest.importorskip("expert_arena")

UCX_LIBRARIES = ("libucp", "libucs", "libucm", "libuct")
PLUGIN = "libexpert_arena_ucx.so"


def ucx_built():
    """Whether this build has the plugin (UCX found at configure), from its CMake cache."""
    cache = os.path.join(BUILD, "CMakeCache.txt")
    if not os.path.exists(cache):
        return os.path.exists(os.path.join(os.path.dirname(expert_arena._core.__file__), PLUGIN))
    with open(cache) as f:
        return any(line.startswith("UCX_FOUND:INTERNAL=1") for line in f)


def need_ucx():
    if not ucx_built():
        if IN_CI:
            pytest.fail("built without UCX (libucx-dev)")
        pytest.skip("built without UCX (libucx-dev)")


# Run in a fresh interpreter: prints one JSON line of what was mapped at each step.
SCRIPT = r"""
import json, sys
import numpy as np
import expert_arena

def ucx():
    with open("/proc/self/maps") as f:
        return sorted({l.split()[-1] for l in f if any("/" + n in l for n in %r)})

model, shared, streams, peer = sys.argv[1:5]
seen = {"import": ucx()}
with expert_arena.open([model], shared_path=shared, quiet=True) as a, \
        expert_arena.attach(shared) as b:
    assert a.names() == b.names()
with expert_arena.StreamProducer(directory=streams, spill_directory=streams,
                                 segment_bytes=2 << 20, max_segments=2, quiet=True) as p, \
        expert_arena.StreamConsumer(directory=streams, spill_directory=streams,
                                    quiet=True) as c:
    d = p.put("k", np.arange(1000, dtype=np.float32))
    with c.open(d) as t:
        assert float(t.numpy()[999]) == 999.0
seen["arena_and_stream"] = ucx()
with expert_arena.open([model], shared_path=shared + "-peer", from_peer=peer,
                       quiet=True) as a:
    seen["peer_note"] = a.report["peer_note"]
    seen["role"] = a.report["role"]
seen["after_from_peer"] = ucx()
print(json.dumps(seen))
""" % (UCX_LIBRARIES,)


def run_script(gen_model, shm_path, stream_dir, env):
    model = gen_model("gguf", "f32")
    shared = shm_path("ucx")
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT, model, shared, stream_dir,
                              "127.0.0.1:9"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        if os.path.exists(shared + "-peer"):
            os.unlink(shared + "-peer")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_ucx_until_a_peer_fill(gen_model, shm_path, stream_dir):
    seen = run_script(gen_model, shm_path, stream_dir, child_env())
    assert seen["import"] == []
    assert seen["arena_and_stream"] == []
    # Nothing listens on port 9: the fill fails, the files are read; the plugin was loaded.
    assert seen["role"] == "loaded"
    assert "read the model files instead" in seen["peer_note"]
    if ucx_built():
        assert "UCX transport plugin" not in seen["peer_note"], seen["peer_note"]
        assert any("libucp" in p for p in seen["after_from_peer"]), seen
    else:
        assert "without UCX" in seen["peer_note"]


def test_missing_plugin_is_named_and_open_falls_back(gen_model, shm_path, stream_dir):
    need_ucx()
    missing = "/nonexistent-ea-dir/" + PLUGIN
    env = dict(child_env(), EXPERT_ARENA_UCX_PLUGIN=missing)
    seen = run_script(gen_model, shm_path, stream_dir, env)
    assert seen["role"] == "loaded"
    note = seen["peer_note"]
    assert "cannot load the UCX transport plugin" in note, note
    assert missing in note and "No such file" in note, note
    assert "read the model files instead" in note, note
    assert seen["after_from_peer"] == []


def test_module_needs_no_ucx_and_the_plugin_sits_next_to_it():
    core = expert_arena._core.__file__
    out = subprocess.run(["readelf", "-d", core], stdout=subprocess.PIPE, text=True, check=True)
    needed = [l.split("[")[1].rstrip("]") for l in out.stdout.splitlines() if "(NEEDED)" in l]
    assert needed and not [n for n in needed if n.startswith(UCX_LIBRARIES)], needed
    if ucx_built():
        assert os.path.exists(os.path.join(os.path.dirname(core), PLUGIN))
