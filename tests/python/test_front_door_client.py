"""The client's side of the front door (docs/cross-host.md): a fake front door that admits with
the empty token and answers 200 random bytes as its UCX worker address leaves a consumer alive
with an error, `load --from-peer --model` reads the files instead, and an address other hosts
reach is not served without a token unless asked for by name. Real processes on loopback,
UCX_TLS=tcp."""

import hashlib
import hmac
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import IN_CI, child_env, tool

expert_arena = pytest.importorskip("expert_arena")

DOOR_MAGIC = 0x524F4F4441524145  # "EARADOOR" (front_door.h)


def _random_address():
    """200 random bytes whose first one carries a version UCX 1.13 asserts on (neither 0 nor
    1 in its low nibble: `address.c:1051 Assertion '*addr_version == UCP_OBJECT_VERSION_V2'`)."""
    address = bytearray(random.Random(39).randbytes(200))
    address[0] = (address[0] & 0xF0) | 0x0E
    return bytes(address)


def _recv_all(conn, n):
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


class FakeDoor:
    """A TCP server that speaks the front door protocol with the empty token (its proof is
    the one an unauthenticated server would send) and admits every client with `address` as
    its worker address. Counts the clients that connected."""

    def __init__(self, address):
        self.worker_address = address
        self.connections = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(10)
                try:
                    self._admit(conn)
                except (OSError, ConnectionError):
                    pass

    def _admit(self, conn):
        hello = _recv_all(conn, 48)
        _, _, service = struct.unpack_from("<QII", hello)
        client_nonce = hello[16:48]
        server_nonce = os.urandom(32)
        label = b"EA door server\0\0" + struct.pack("<I", service)
        proof = hmac.new(b"", label + client_nonce + server_nonce, hashlib.sha256).digest()
        conn.sendall(struct.pack("<QII", DOOR_MAGIC, 1, 0) + server_nonce + proof)
        _, n, _ = struct.unpack_from("<QII", _recv_all(conn, 48))
        _recv_all(conn, n)
        conn.sendall(struct.pack("<QII", DOOR_MAGIC, 0, len(self.worker_address)) +
                     os.urandom(16) + self.worker_address)
        try:
            conn.recv(1)  # until the client closes
        except OSError:
            pass

    def close(self):
        self._stop.set()
        self._thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def fake_door():
    door = FakeDoor(_random_address())
    yield door
    door.close()


def _with_remote(descriptor, remote):
    """`descriptor` (a listening producer's, unsigned) naming `remote` instead: the length
    and the xxh3 made to match, as anyone on the channel that carries descriptors can."""
    d = bytes(descriptor)
    at = d.index(b"127.0.0.1:")
    n = struct.unpack_from("<H", d, at - 2)[0]
    body = d[:at - 2] + struct.pack("<H", len(remote)) + remote.encode() + d[at + n:-8]
    body = body[:8] + struct.pack("<I", len(body) + 8) + body[12:]
    return body + struct.pack("<Q", expert_arena.xxh3_64(body))


def _listening_producer(stream_dir, **kw):
    try:
        return expert_arena.StreamProducer(stream_dir, "door", segment_bytes=8 << 20,
                                           max_segments=2, quiet=True, **kw)
    except OSError as e:
        if "without UCX" in str(e) and not IN_CI:
            pytest.skip(str(e))
        raise


_CONSUMER = r"""
import sys, expert_arena
kw = {"remote_allow_no_token": True} if sys.argv[3] == "opt-in" else {}
with expert_arena.StreamConsumer(sys.argv[1], quiet=True, remote_timeout_seconds=10, **kw) as c:
    try:
        c.open(bytes.fromhex(sys.argv[2]))
        print("OPENED")
    except Exception as e:
        print("REFUSED", type(e).__name__, e)
"""


@pytest.mark.parametrize("mode", ["no-token", "opt-in"])
def test_fake_front_door_leaves_the_consumer_alive(stream_dir, tmp_path, fake_door, mode):
    """A descriptor rewritten to name the fake door: the consumer (another process, on another
    directory, so the open is remote) gets an exception and exits normally. Without a token it
    is refused before it connects, naming remote_token; with the opt-in the random worker
    address is refused before UCX sees it."""
    with _listening_producer(stream_dir, listen="127.0.0.1:0") as p:
        desc = p.put("w", np.arange(1024, dtype=np.float32))
        forged = _with_remote(desc, fake_door.address)
        env = dict(child_env(), UCX_TLS="tcp")
        other = tmp_path / "elsewhere"
        other.mkdir()
        run = subprocess.run([sys.executable, "-c", _CONSUMER, str(other), forged.hex(), mode],
                             capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "REFUSED" in run.stdout, run.stdout + run.stderr
    if mode == "no-token":
        assert "remote_token" in run.stdout and "remote_allow_no_token" in run.stdout, run.stdout
        assert fake_door.connections == 0
    else:
        assert "worker address" in run.stdout and "version 14" in run.stdout, run.stdout
        assert fake_door.connections == 1


def _last_json(text):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("no JSON line in: " + text)


@pytest.mark.parametrize("extra", [[], ["--insecure-no-token"]])
def test_load_from_a_fake_peer_reads_the_model_files(gen_model, shm_path, fake_door, extra):
    """`load --from-peer FAKE --model FILE`: the arena is loaded from the files, and the report
    says why the peer was not used (no token; with the opt-in, the worker address)."""
    model = gen_model("gguf", "f16", layers=2, experts=4, hidden=64, ffn=96)
    arena = shm_path("fake-peer")
    env = dict(os.environ, UCX_TLS="tcp")
    env.pop("EXPERT_ARENA_TOKEN", None)
    run = subprocess.run([tool("expert-arena"), "load", "--from-peer", fake_door.address,
                          "--model", model, "--arena", arena, "--json", "--peer-stall-timeout",
                          "10"] + extra, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = _last_json(run.stdout)
    assert report["role"] == "loaded"
    assert report["bytes_read"] > 0
    assert report["from_peer"] == ""
    note = report["peer_note"]
    assert "read the model files instead" in note, note
    if extra:
        assert "worker address" in note, note
    else:
        assert "no token" in note and "--token" in note, note
    verify = subprocess.run([tool("expert-arena"), "verify", arena], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_serve_on_all_interfaces_needs_a_token_or_the_opt_in(gen_model, shm_path):
    """`serve --listen 0.0.0.0:0` without a token is refused with the reason; with
    --insecure-no-token it serves and warns what it exposes."""
    model = gen_model("gguf", "f16", layers=2, experts=4, hidden=64, ffn=96)
    served = shm_path("all-interfaces")
    subprocess.run([tool("expert-arena"), "load", "--model", model, "--arena", served],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, UCX_TLS="tcp")
    env.pop("EXPERT_ARENA_TOKEN", None)
    refused = subprocess.run([tool("expert-arena"), "serve", served, "--listen", "0.0.0.0:0"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "without a token" in refused.stderr and "--insecure-no-token" in refused.stderr, \
        refused.stderr
    proc = subprocess.Popen([tool("expert-arena"), "serve", served, "--listen", "0.0.0.0:0",
                             "--insecure-no-token", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        if not line:
            why = proc.stderr.read()
            if "without UCX" in why and not IN_CI:
                pytest.skip(why.strip())
            pytest.fail("serve did not start: " + why)
        assert json.loads(line)["token"] is False
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "without a token" in err and "any host that reaches" in err, err


def test_listening_producer_on_all_interfaces_needs_a_token_or_the_opt_in(stream_dir):
    with pytest.raises(PermissionError, match="listen_allow_no_token"):
        _listening_producer(stream_dir, listen="0.0.0.0:0")
    with _listening_producer(stream_dir, listen="0.0.0.0:0", listen_allow_no_token=True) as p:
        assert p.remote_address.startswith("0.0.0.0:")
    with _listening_producer(stream_dir, listen="0.0.0.0:0", listen_token="t0ken") as p:
        assert p.remote_address.startswith("0.0.0.0:")
