"""StreamProducer(listen=...) across loopback (UCX_TLS=tcp): a consumer whose directory does not
hold the producer's segments fetches the tensor over UCX, as one on another host does (the
two-host cases are tests/remote/stream_remote_test.cc)."""

import os
import signal
import tempfile
import shutil
import threading
import time

import numpy as np
import pytest

from conftest import IN_CI, test_dir as _test_dir

expert_arena = pytest.importorskip("expert_arena")
torch = pytest.importorskip("torch")


@pytest.fixture
def other_dir():
    """Another stream directory: the consumer's, where the producer's segments are not."""
    d = tempfile.mkdtemp(prefix="ea-pytest-xs-", dir=_test_dir())
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _producer(stream_dir, **kw):
    try:
        return expert_arena.StreamProducer(stream_dir, "xs", segment_bytes=8 << 20,
                                           max_segments=2, quiet=True, listen="127.0.0.1:0",
                                           **kw)
    except OSError as e:
        if "without UCX" in str(e) and not IN_CI:
            pytest.skip(str(e))
        raise


def test_listen_serves_a_consumer_that_cannot_see_the_segment(stream_dir, other_dir,
                                                               monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    with _producer(stream_dir, listen_token="t0ken") as p, \
            expert_arena.StreamConsumer(other_dir, quiet=True, remote_token="t0ken") as c:
        assert p.remote_address.startswith("127.0.0.1:")
        x = torch.arange(300000, dtype=torch.float32).reshape(600, 500) * 0.5
        x[0, 0] = float("nan")
        d = p.put("hidden", x)
        assert expert_arena.decode_descriptor(d)["remote"] == p.remote_address
        with c.open(d) as t:
            y = t.torch()
            assert y.shape == x.shape and y.dtype == x.dtype
            assert y.view(torch.int32).equal(x.view(torch.int32))  # bit-exact, the NaN too
            assert sum(b["remote_holders"] for b in p.pending()) == 1
            del y  # the view goes first: the release waits for it
        # The release crossed the wire: the block is gone at the producer.
        for _ in range(500):
            if not p.pending():
                break
            time.sleep(0.01)
        assert p.pending() == []
        # A wrong token is refused before any byte.
        with expert_arena.StreamConsumer(other_dir, quiet=True, remote_token="nope") as bad:
            d2 = p.put("other", np.arange(10, dtype=np.int64))
            with pytest.raises(OSError, match="token"):
                bad.open(d2)


def test_same_directory_keeps_the_local_path(stream_dir, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    with _producer(stream_dir) as p, expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        d = p.put("k", np.arange(1000, dtype=np.int16))
        with c.open(d) as t:
            assert t.numpy().tolist() == list(range(1000))
            assert all(b["remote_holders"] == 0 for b in p.pending())


def test_nothing_listens_by_default(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "xs", segment_bytes=2 << 20, max_segments=1,
                                     quiet=True) as p:
        assert p.remote_address == ""
        assert "remote" not in expert_arena.decode_descriptor(p.put("k", np.zeros(4)))


def _net_process_of_this_process():
    """The pid of the expert-arena-net child of this process (the newest, should an earlier
    test's still be exiting)."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == me and name.startswith("expert-arena-ne"):
            found.append(int(entry))
    assert found, "no network process under pid %d" % me
    return max(found)


def _state(pid):
    with open("/proc/%d/stat" % pid) as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()[0]


def test_stopped_network_process_does_not_hold_up_stats_or_put(stream_dir):
    """With the network process stopped (SIGSTOP), stats() and a put() in another thread both
    return, with their values, while that process is still stopped: neither waited for a
    request to it to time out (5 s, after which it is killed and restarted)."""
    with _producer(stream_dir, listen_token="t0ken") as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        net = _net_process_of_this_process()
        before = p.stats()
        os.kill(net, signal.SIGSTOP)
        try:
            put = {}

            def other_thread():
                put["desc"] = p.put("while-stopped", np.full(4096, 7, dtype=np.int32))

            t = threading.Thread(target=other_thread)
            t.start()
            stats = p.stats()
            t.join(timeout=60)
            assert not t.is_alive()
            assert _state(net) == "T", "the stopped network process was killed or restarted"
        finally:
            os.kill(net, signal.SIGCONT)
        assert stats["remote_restarts"] == 0
        assert stats["live_blocks"] >= before["live_blocks"]
        with c.open(put["desc"]) as tensor:
            assert np.array_equal(tensor.numpy(), np.full(4096, 7, dtype=np.int32))
