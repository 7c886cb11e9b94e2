"""expert_arena.open(from_peer=...): an arena filled from `expert-arena serve` over UCX
(loopback, UCX_TLS=tcp; the two-host cases are tests/remote/peer_fill_test.cc)."""

import json
import os
import subprocess

import pytest

import numpy as np

from conftest import IN_CI, tool

expert_arena = pytest.importorskip("expert_arena")


@pytest.fixture
def server(gen_model, shm_path):
    """A published arena served on loopback: (address, path of the served arena, model)."""
    model = gen_model("gguf", "f16", layers=2, experts=4, hidden=128, ffn=256)
    served = shm_path("served")
    subprocess.run([tool("expert-arena"), "load", "--model", model, "--arena", served],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, UCX_TLS="tcp")
    proc = subprocess.Popen([tool("expert-arena"), "serve", served, "--listen", "127.0.0.1:0",
                             "--token", "t0ken", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            why = proc.stderr.read()
            if "without UCX" in why and not IN_CI:
                pytest.skip(why.strip())
            pytest.fail("serve did not start: " + why)
        yield json.loads(line)["address"], served, model
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_open_from_peer_without_the_model(server, shm_path, monkeypatch):
    address, served, _ = server
    monkeypatch.setenv("UCX_TLS", "tcp")
    filled = shm_path("filled")
    with expert_arena.open([], shared_path=filled, from_peer=address, peer_token="t0ken",
                           quiet=True) as arena, expert_arena.attach(served) as source:
        report = arena.report
        assert report["role"] == "loaded"
        assert report["from_peer"] == address
        assert report["peer_bytes"] >= report["tensor_bytes"]
        assert report["peer_transport"] == "am"  # serve's default
        assert report["bytes_read"] == 0
        assert arena.names() == source.names()
        for name in source.names():
            assert np.array_equal(arena.numpy(name), source.numpy(name))


def test_open_from_peer_falls_back_to_the_model_files(server, shm_path, monkeypatch):
    address, _, model = server
    monkeypatch.setenv("UCX_TLS", "tcp")
    filled = shm_path("fallback")
    # A wrong token: refused before any byte; the model files are read instead.
    with expert_arena.open([model], shared_path=filled, from_peer=address, peer_token="wrong",
                           quiet=True) as arena:
        assert arena.report["from_peer"] == ""
        assert "refused" in arena.report["peer_note"]
        assert arena.report["bytes_read"] >= arena.report["tensor_bytes"]
    # Without the files, the same refusal is an error and nothing is published.
    with pytest.raises(OSError, match="refused"):
        expert_arena.open([], shared_path=shm_path("none"), from_peer=address, quiet=True)
