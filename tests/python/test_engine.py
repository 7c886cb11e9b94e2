"""tools/python/moe_engine.py against itself and against the C++ moe-engine, as real
processes sharing one arena file."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, child_env, tool

ENGINE = os.path.join(ROOT, "tools", "python", "moe_engine.py")
TOLERANCE = 1e-4  # max |py - cxx| <= TOLERANCE * max(1, max |cxx|), as moe_engine.py states
if os.environ.get("CI") != "true":
    pytest.importorskip("torch")


def py_engine(model, *extra):
    return subprocess.Popen([sys.executable, ENGINE, "--model", model, "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env())


def result(p):
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def cxx_engine(model, *extra):
    out = subprocess.run([tool("moe-engine"), "--model", model, "--json", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_four_python_engines_at_once_share_one_arena(gen_model, shm_path):
    model = gen_model("gguf", "q8_0", layers=3, experts=8, hidden=128, ffn=256)
    path = shm_path()
    engines = [py_engine(model, "--shared-expert-arena", path, "--tokens", "16")
               for _ in range(4)]
    results = [result(p) for p in engines]
    roles = sorted(r["role"] for r in results)
    assert roles == ["attached", "attached", "attached", "loaded"]
    assert len({r["checksum"] for r in results}) == 1
    loaded = [r for r in results if r["role"] == "loaded"][0]
    # Attachers read the model's header only, never its tensor data.
    assert all(r["bytes_read"] < loaded["tensor_bytes"] for r in results
               if r["role"] == "attached")
    private = result(py_engine(model, "--tokens", "16"))
    assert private["checksum"] == results[0]["checksum"]


@pytest.mark.parametrize("first", ["py", "cxx"])
def test_python_and_cxx_engines_share_one_arena_either_order(gen_model, shm_path, first, tmp_path):
    model = gen_model("gguf", "f16", layers=2, experts=8, hidden=64, ffn=128)
    path = shm_path()
    py_out, cxx_out = str(tmp_path / "py.bin"), str(tmp_path / "cxx.bin")
    if first == "py":
        py = result(py_engine(model, "--shared-expert-arena", path, "--outputs", py_out))
        cxx = cxx_engine(model, "--shared-expert-arena", path, "--outputs", cxx_out)
        assert (py["role"], cxx["role"]) == ("loaded", "attached")
    else:
        cxx = cxx_engine(model, "--shared-expert-arena", path, "--outputs", cxx_out)
        py = result(py_engine(model, "--shared-expert-arena", path, "--outputs", py_out))
        assert (cxx["role"], py["role"]) == ("loaded", "attached")
    attacher = cxx if first == "py" else py
    assert attacher["bytes_read"] < py["tensor_bytes"]
    a, b = np.fromfile(py_out, np.float32), np.fromfile(cxx_out, np.float32)
    assert a.shape == b.shape == (32 * 64,)
    assert np.abs(a - b).max() <= TOLERANCE * max(1.0, float(np.abs(b).max()))


@pytest.mark.parametrize("fmt,dtype", [("gguf", "f32"), ("gguf", "bf16"), ("gguf", "q8_0"),
                                       ("safetensors", "f16"), ("safetensors", "bf16"),
                                       ("safetensors", "f32")])
def test_python_engine_agrees_with_moe_engine(gen_model, shm_path, fmt, dtype, tmp_path):
    model = gen_model(fmt, dtype, layers=3, experts=8, hidden=64, ffn=96)
    py_out, cxx_out = str(tmp_path / "py.bin"), str(tmp_path / "cxx.bin")
    args = ["--tokens", "48", "--top-k", "3", "--seed", "777"]
    private = result(py_engine(model, *args, "--outputs", py_out))
    cxx_engine(model, *args, "--outputs", cxx_out)
    a, b = np.fromfile(py_out, np.float32), np.fromfile(cxx_out, np.float32)
    assert a.shape == b.shape == (48 * 64,)
    assert np.abs(a - b).max() <= TOLERANCE * max(1.0, float(np.abs(b).max()))
    assert np.abs(b).max() > 0.1  # a real output
    # With the flag the output is identical, bit for bit.
    shared = result(py_engine(model, *args, "--shared-expert-arena", shm_path()))
    assert shared["role"] == "loaded"
    assert shared["checksum"] == private["checksum"]


def test_python_engine_refuses_a_file_that_is_not_a_model(tmp_path):
    raw = tmp_path / "blob.bin"
    raw.write_bytes(b"\1" * 4096)
    p = py_engine(str(raw))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "blob.bin" in err
