"""Tensor streaming from Python, with real processes for everything that crosses them."""

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import expert_arena
from conftest import ROLES, child_env, consume, start_producer

torch = pytest.importorskip("torch") if os.environ.get("CI") != "true" else __import__("torch")


@pytest.mark.parametrize("producer,consumer", [("py", "py"), ("cxx", "py"), ("py", "cxx")])
def test_streaming_between_processes_is_bit_exact_for_every_dtype(stream_dir, producer,
                                                                 consumer):
    p, rows = start_producer(producer, stream_dir)
    try:
        got = consume(consumer, stream_dir, [r[4] for r in rows])
    finally:
        p.stdin.close()
        p.wait(30)
    assert len(got) == len(rows) >= 15
    dtypes = set()
    for sent, received in zip(rows, got):
        assert received[0] != "error", received
        # key, dtype, shape and xxh3 of the bytes as the consumer's view reads them
        assert received == sent[:4]
        dtypes.add(sent[1])
    assert {"f32", "f16", "bf16", "i8", "u8", "bool", "f64", "i64"} <= dtypes
    assert os.listdir(stream_dir) == []  # the producer unlinked its segments at exit


@pytest.mark.parametrize("consumer", ["py-tensor", "py-numpy", "py-torch", "cxx"])
def test_batches_and_in_place_tensors_cross_processes_bit_exact(stream_dir, consumer):
    cmd = [sys.executable, ROLES, "produce-batch", stream_dir]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=child_env())
    rows = []
    try:
        for line in p.stdout:
            if line.strip() == "ready":
                break
            rows.append(line.split())
        descriptors = [r[4] for r in rows]
        if consumer == "cxx":
            got = consume("cxx", stream_dir, descriptors)
        else:
            out = subprocess.run([sys.executable, ROLES, "consume-many", stream_dir,
                                  consumer[3:]], input="".join(d + "\n" for d in descriptors),
                                 text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env=child_env(), timeout=120)
            assert out.returncode == 0, out.stderr
            got = [line.split() for line in out.stdout.splitlines()]
    finally:
        p.stdin.close()
        p.wait(30)
    assert p.returncode == 0
    # one put_many of every case, then each case again written in place
    assert len(rows) == 30 and sum(r[0].startswith("in-place-") for r in rows) == 15
    assert [r[:4] for r in got] == [r[:4] for r in rows]
    assert os.listdir(stream_dir) == []


def test_put_many_is_all_or_none(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "many", segment_bytes=2 << 20, max_segments=1,
                                     strict=True, strict_wait_seconds=0.05, quiet=True) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        mib = np.ones(1 << 20, np.uint8)
        with pytest.raises(expert_arena.NoSpaceError, match=r"item 2 of 3.*'?c'?") as e:
            p.put_many([("a", mib), ("b", torch.ones(1 << 18)), ("c", mib)])
        assert "nothing of the batch was published" in str(e.value)
        assert p.stats()["live_blocks"] == 0 and p.abort("a") == 0
        # What cannot be put is refused before anything is reserved, naming the item.
        with pytest.raises(ValueError, match="not contiguous"):
            p.put_many({"a": mib, "t": torch.randn(8, 8).t()})
        with pytest.raises(TypeError, match="item 1 .*list"):
            p.put_many([("a", mib), ("l", [1, 2])])
        with pytest.raises(TypeError, match="item 0 is not a"):
            p.put_many([mib])
        with pytest.raises(ValueError, match="item 1 of 2.*key"):
            p.put_many([("a", mib), ("bad\n", mib)])
        with pytest.raises(ValueError, match="resolve_conj"):
            p.put_many({"z": torch.randn(4, dtype=torch.complex64).conj()})
        assert p.stats()["live_blocks"] == 0
        # A batch that fits: each tensor with its own dtype and shape, in order, for 2 readers.
        x, y = torch.randn(16, 8, dtype=torch.float16), np.arange(12, dtype=np.int64).reshape(3, 4)
        ds = p.put_many({"x": x, "y": y}, readers=2)
        for _ in range(2):
            tx, ty = c.open_many(ds)
            assert (tx.key, tx.dtype_name, tx.shape, ty.key, ty.dtype_name, ty.shape) == \
                ("x", "f16", (16, 8), "y", "i64", (3, 4))
            assert torch.equal(tx.torch(), x) and np.array_equal(ty.numpy(), y)
            tx.release()
            ty.release()
        p.reclaim()
        assert p.stats()["live_blocks"] == 0
        assert p.put_many([]) == []


def test_open_many_is_all_or_none_and_views_hold_their_share(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "open", segment_bytes=2 << 20,
                                     max_segments=2, quiet=True) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        good = p.put("good", np.arange(100, dtype=np.float32))
        gone = p.put("gone", np.zeros(100, np.float32))
        assert p.abort("gone") == 1
        with pytest.raises((ValueError, OSError), match="item 1 of 2.*gone") as e:
            c.open_many([good, gone])
        assert "given back unread" in str(e.value)
        p.reclaim()
        assert p.stats()["live_blocks"] == 1  # good's share was not spent: it opens again
        [again] = c.open_many([good], view="numpy")
        assert again.tolist() == list(range(100))
        del again
        p.reclaim()
        assert p.stats()["live_blocks"] == 0  # good's one reader released it, gone aborted
        with pytest.raises(TypeError):
            c.open_many(["not bytes"])
        with pytest.raises(ValueError, match="view"):
            c.open_many([], view="pandas")
        # Views from open_many hold the reader's share until they are dropped.
        ds = p.put_many({"n": np.arange(6, dtype=np.int16).reshape(2, 3),
                         "t": torch.arange(4, dtype=torch.bfloat16)})
        n, t = c.open_many(ds[:1], view="numpy") + c.open_many(ds[1:], view="torch", guard=True)
        assert n.dtype == np.int16 and n.shape == (2, 3) and not n.flags.writeable
        assert t.dtype == torch.bfloat16 and torch.equal(t, torch.arange(4, dtype=torch.bfloat16))
        with pytest.raises(ValueError):
            n[0, 0] = 1
        with pytest.raises(ValueError):
            t.add_(1)
        p.reclaim()
        assert p.stats()["live_blocks"] == 2
        del n
        p.reclaim()
        assert p.stats()["live_blocks"] == 1
        del t
        p.reclaim()
        assert p.stats()["live_blocks"] == 0
        # A dtype torch takes as it is (no byte view): still read-only, still zero-copy.
        (w,) = c.open_many([p.put("w", np.arange(8, dtype=np.float32))], view="torch",
                           guard=True)
        assert w.dtype == torch.float32 and w.shape == (8,) and w[7] == 7
        with pytest.raises(ValueError):
            w.mul_(2)
        del w
        p.reclaim()
        assert p.stats()["live_blocks"] == 0


def test_reserve_of_a_shape_seen_before_gives_the_same_layout(stream_dir):
    """reserve() remembers the layout of a (dtype, shape) it was given; the same shape in
    another spelling (a list, a NumPy type, a name) and a bad one asked twice are all
    worked out as the first time."""
    with expert_arena.StreamProducer(stream_dir, "shapes", segment_bytes=2 << 20,
                                     max_segments=1, quiet=True) as p:
        for _ in range(3):
            for dtype, shape, name, dims, nbytes in (
                    (torch.bfloat16, (4, 8), "bf16", (4, 8), 64),
                    (torch.bfloat16, [4, 8], "bf16", (4, 8), 64),
                    (np.float32, (4, 8), "f32", (4, 8), 128),
                    ("f16", torch.Size([4, 8]), "f16", (4, 8), 64),
                    (torch.float32, (4.0, 8), "f32", (4, 8), 128),
                    (np.dtype("i8"), (3,), "i64", (3,), 24)):
                with p.reserve("k", shape, dtype) as r:
                    assert (r.dtype, r.shape, r.nbytes) == (name, dims, nbytes)
                    assert r.torch().shape == r.shape
            for bad in ((-1, 4), (2, -3)):
                with pytest.raises(ValueError, match="negative"):
                    p.reserve("n", bad, np.float32)
            with pytest.raises(TypeError, match="no element size"):
                p.reserve("q", (32,), "q8_0")


def test_reservations_are_written_in_place_and_given_back_when_unused(stream_dir):
    with expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        p = expert_arena.StreamProducer(stream_dir, "inplace", segment_bytes=2 << 20,
                                        max_segments=1, strict=True, strict_wait_seconds=0.05,
                                        quiet=True)
        r = p.reserve("h", (4, 8), torch.float32)
        assert (r.key, r.dtype, r.shape, r.nbytes) == ("h", "f32", (4, 8), 128)
        w = r.torch()
        assert type(w) is torch.Tensor and w.data_ptr() == r.address  # in the segment
        torch.randn(4, 8, out=w)
        expected = w.clone()
        d = r.publish()
        assert r.published
        with pytest.raises(ValueError, match="published"):
            r.numpy()
        with c.open(d) as t:
            assert t.shape == (4, 8) and torch.equal(t.torch(), expected)
        del w  # (a writable view after publish is the engine's to drop: see docs/python.md)
        # Cancelled (here: a `with` block left without publish), the space goes back once
        # the last view of it is gone, never while a view could still write into it.
        with p.reserve("c", (1000,), "i32") as r2:
            v = r2.numpy()
            v[:] = 7
        p.reclaim()
        assert p.stats()["live_blocks"] == 2 - 1  # h was released; c is held by v
        del v
        p.reclaim()
        assert p.stats()["live_blocks"] == 0
        with pytest.raises(TypeError, match="no element size"):
            p.reserve("q", (32,), "q8_0")
        with pytest.raises(ValueError, match="negative"):
            p.reserve("n", (-1, 4), np.float32)
        with pytest.raises(ValueError, match="key"):
            p.reserve("", (4,), "u8")
        big = p.reserve("big", (2 << 20,), np.uint8)
        with pytest.raises(expert_arena.NoSpaceError):
            p.reserve("more", (1,), np.uint8)
        big.cancel()
        # An abort while the tensor is written refuses its publish and gives the space back.
        r3 = p.reserve("abc", (16,), torch.int64)
        assert p.abort("abc") == 1
        with pytest.raises(expert_arena.BusyError, match="abc"):
            r3.publish()
        assert p.stats()["live_blocks"] == 0
        # A view that outlives close() writes into memory that is still mapped; the files go
        # when it is gone.
        r4 = p.reserve("late", (1 << 16,), np.uint8)
        late = r4.numpy()
        p.close()
        del r4
        late[:] = 1
        assert late.sum() == 1 << 16
        assert os.listdir(stream_dir) != []
        del late
        assert os.listdir(stream_dir) == []


def test_views_are_zero_copy_read_only_and_outlive_release(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "views", segment_bytes=2 << 20,
                                     max_segments=2, quiet=True) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        x = torch.randn(64, 32)
        t = c.open(p.put("k1", x))
        assert (t.key, t.dtype_name, t.shape, t.nbytes) == ("k1", "f32", (64, 32), x.numel() * 4)
        v, n = t.torch(guard=True), t.numpy()
        assert v.data_ptr() == t.address == n.__array_interface__["data"][0]
        assert torch.equal(v, x) and np.array_equal(n, x.numpy())
        with pytest.raises(ValueError):
            v.add_(1)
        with pytest.raises(ValueError):
            n[0, 0] = 1
        t.release()
        with pytest.raises(ValueError, match="released"):
            t.numpy()
        assert p.stats()["live_blocks"] == 1
        # The views still read the bytes: the reader's share is held until they are gone.
        p.reclaim()
        assert p.stats()["live_blocks"] == 1
        assert torch.equal(v, x)
        del v, n
        p.reclaim()
        assert p.stats()["live_blocks"] == 0
        # The same without release(): dropping the tensor and its views gives the block back.
        t2 = c.open(p.put("k2", np.arange(1000, dtype=np.int32)))
        view = t2.numpy()
        del t2
        p.reclaim()
        assert p.stats()["live_blocks"] == 1 and view[999] == 999
        del view
        p.reclaim()
        assert p.stats()["live_blocks"] == 0


def test_abort_is_exact_key(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "abort", segment_bytes=2 << 20,
                                     max_segments=2, quiet=True) as p:
        d_abc = p.put("abc", np.ones(100, np.float32))
        d_long = p.put("abc_1_2", np.full(100, 2, np.float32))
        d_other = p.put("ab", np.full(100, 3, np.float32))
        assert p.abort("abc") == 1
        got = consume("py", stream_dir, [d_abc.hex(), d_long.hex(), d_other.hex()])
        assert got[0][0] == "error"
        assert got[1][:3] == ["abc_1_2", "f32", "100"]
        assert got[2][:3] == ["ab", "f32", "100"]
        with expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
            with pytest.raises((ValueError, OSError), match="abc"):
                c.open(d_abc)
        p.reclaim()
        assert p.stats()["live_blocks"] == 0  # abc aborted, the others released once each


def test_a_killed_python_producers_segments_are_swept(stream_dir):
    p, rows = start_producer("py", stream_dir)
    seen = sorted(os.path.join(stream_dir, f) for f in os.listdir(stream_dir))
    assert seen and rows
    info = expert_arena.inspect_segment(seen[0])
    assert info["ours"] and info["owner_pid"] == p.pid and info["owner_alive"]
    assert info["live_blocks"] > 0
    # The owner is alive: the segments it holds stay. (One its grow-ahead thread is creating
    # at that moment, not locked yet, may be removed: the producer makes it again under
    # another name, src/stream/sweep.cc.)
    live = expert_arena.sweep(stream_dir)
    assert seen[0] in live["live"] and seen[0] not in live["removed"], live
    seen = [s for s in seen if s not in live["removed"]]
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    p.stdin.close()
    # What the killed producer left: the segments seen, and one its grow-ahead thread may have
    # made after they were listed.
    segments = sorted(os.path.join(stream_dir, f) for f in os.listdir(stream_dir))
    assert set(seen) <= set(segments), (seen, segments)
    assert not expert_arena.inspect_segment(segments[0])["owner_alive"]
    report = expert_arena.sweep(stream_dir)
    assert sorted(report["removed"]) == segments
    assert os.listdir(stream_dir) == []


def test_bad_inputs_get_their_exceptions(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "bad", segment_bytes=2 << 20, max_segments=2,
                                     quiet=True) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        with pytest.raises(ValueError, match="not contiguous"):
            p.put("k", torch.randn(8, 8).t())
        with pytest.raises(ValueError, match="not C-contiguous"):
            p.put("k", np.arange(20)[::2])
        with pytest.raises(ValueError, match="meta"):
            p.put("k", torch.empty(4, device="meta"))  # a device tensor (no GPU here)
        with pytest.raises(TypeError, match="object"):
            p.put("k", np.array([object(), 1]))
        with pytest.raises(TypeError, match="list"):
            p.put("k", [1, 2, 3])
        with pytest.raises(ValueError, match="key"):
            p.put("", np.zeros(4))
        with pytest.raises(ValueError, match="key"):
            p.put("a\nb", np.zeros(4))
        with pytest.raises(ValueError):
            c.open(b"garbage")
        d = p.put("good", np.zeros(4))
        with pytest.raises(ValueError):
            c.open(d[:-3])
        forged = bytearray(d)
        forged[10] ^= 0xFF
        with pytest.raises(ValueError):
            c.open(bytes(forged))
        with pytest.raises(TypeError):
            c.open("not bytes")
        assert expert_arena.decode_descriptor(d)["key"] == "good"
        p.close()
        with pytest.raises(ValueError, match="closed"):
            p.put("k", np.zeros(4))
    with pytest.raises(FileNotFoundError):
        expert_arena.StreamProducer(os.path.join(stream_dir, "absent"), quiet=True)


class FakeEvent:
    """What release_after() needs of a torch.cuda.Event: query(), and synchronize() for close()."""

    def __init__(self, can_synchronize=True):
        self.done = False
        if can_synchronize:
            self.synchronize = self._synchronize

    def query(self):
        return self.done

    def _synchronize(self):
        self.done = True


def test_release_after_an_event_holds_the_share_until_it_completes(stream_dir):
    p = expert_arena.StreamProducer(stream_dir, "later", segment_bytes=2 << 20, max_segments=2,
                                    quiet=True)
    c = expert_arena.StreamConsumer(stream_dir, quiet=True)
    try:
        def live():
            p.reclaim()
            return p.stats()["live_blocks"]

        # An asynchronous copy reads the bytes after the views are gone: the share waits for
        # its event, also past the end of the `with` block.
        copying = FakeEvent()
        with c.open(p.put("a", np.arange(64, dtype=np.float32))) as t:
            view = t.numpy()
            t.release_after(copying)
            del view
        assert live() == 1
        assert c.poll_releases() == 0 and live() == 1
        copying.done = True
        assert c.poll_releases() >= 1
        assert live() == 0
        # Settled by the next open() as well, and by open_many().
        e1, e2 = FakeEvent(), FakeEvent()
        t1 = c.open(p.put("b", np.zeros(16, np.int32)))
        t1.release_after(e1)
        del t1
        e1.done = True
        t2 = c.open(p.put("c", np.zeros(16, np.int32)))
        assert live() == 1  # b released by that open; c is held by t2
        t2.release_after(e2)
        del t2
        e2.done = True
        assert c.open_many([]) == [] and live() == 0
        # close() waits for the events (synchronize(), or query() until it says done).
        for event in (FakeEvent(can_synchronize=True), FakeEvent(can_synchronize=False)):
            t3 = c.open(p.put("d", np.zeros(16, np.int8)))
            t3.release_after(event)
            del t3
            if not hasattr(event, "synchronize"):
                threading.Timer(0.05, setattr, (event, "done", True)).start()
            c.close()
            assert event.done and live() == 0
            c = expert_arena.StreamConsumer(stream_dir, quiet=True)
        # Bad uses say what is wrong.
        t4 = c.open(p.put("e", np.zeros(4, np.int8)))
        with pytest.raises(TypeError, match="query"):
            t4.release_after(object())
        t4.release()
        with pytest.raises(ValueError, match="released"):
            t4.release_after(FakeEvent())
        assert live() == 0
    finally:
        c.close()
        p.close()


def test_a_loads_runs_are_read_and_copied_in_one_call_and_a_short_file_is_refused(tmp_path):
    """The KV connector's copies (expert_arena.vllm_kv): runs (file offset or source address,
    destination address, bytes) land bit-exact; a file that ends before a run is a ValueError
    naming where, after the runs before it were read; a runs array of another form is
    refused by name."""
    core = expert_arena._core
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "cache"
    path.write_bytes(data.tobytes())
    out = np.zeros(1 << 20, dtype=np.uint8)
    base = core.array_address(out)
    runs = np.array([[4096, base, 8192], [0, base + 8192, 100], [(1 << 20) - 7, base + 9000, 7]],
                    dtype=np.uint64)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert core.read_runs(fd, runs) == 8192 + 100 + 7
        assert (out[:8192] == data[4096:4096 + 8192]).all()
        assert (out[8192:8292] == data[:100]).all() and (out[9000:9007] == data[-7:]).all()
        assert not out[8292:9000].any() and not out[9007:].any()
        past = np.array([[0, base, 16], [(1 << 20) - 8, base + 64, 16]], dtype=np.uint64)
        with pytest.raises(ValueError, match=r"ends at offset 1048576, before the 16 bytes at "
                                             r"offset 1048568 that run 1 reads"):
            core.read_runs(fd, past)
        with pytest.raises(ValueError, match="n x 3 uint64"):
            core.read_runs(fd, np.zeros((2, 2), dtype=np.uint64))
    finally:
        os.close(fd)
    copied = np.zeros(1 << 20, dtype=np.uint8)
    to = core.array_address(copied)
    assert core.copy_runs(np.array([[base, to + 5, 8192], [base + 9000, to, 5]],
                                   dtype=np.uint64)) == 8197
    assert (copied[5:8197] == out[:8192]).all() and (copied[:5] == data[-7:-2]).all()
    with pytest.raises(ValueError, match="n x 3 uint64"):
        core.copy_runs(np.zeros(3, dtype=np.uint64))


def test_a_mapped_file_copies_its_runs_and_a_truncation_under_it_is_an_error(tmp_path):
    """The KV connector's copies out of a prefill engine's cache file mapped in the decode
    engine (_core.MappedFile): runs land bit-exact; a run past the file is refused by name; a
    file its owner truncates under the mapping (before or during a copy) is a ValueError naming
    the run, never a SIGBUS, and the process copies on; a removed file's mapping is let go."""
    core = expert_arena._core
    size = 4 << 20
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "cache"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        source = core.MappedFile(fd, "the test's cache", watch_seconds=0.05)
        assert source.size == size and source.mapped and source.wait_populated(30)
        out = np.zeros(size, dtype=np.uint8)
        base = core.array_address(out)
        runs = np.array([[4096, base, 8192], [0, base + 8192, 100], [size - 7, base + 9000, 7]],
                        dtype=np.uint64)
        assert source.copy_runs(runs) == 8192 + 100 + 7
        assert (out[:8192] == data[4096:4096 + 8192]).all()
        assert (out[8192:8292] == data[:100]).all() and (out[9000:9007] == data[-7:]).all()
        with pytest.raises(ValueError, match="run 1 reads 16 bytes at offset %d of the test's "
                                             "cache, which has %d" % (size - 8, size)):
            source.copy_runs(np.array([[0, base, 16], [size - 8, base, 16]], dtype=np.uint64))
        with pytest.raises(ValueError, match="n x 3 uint64"):
            source.copy_runs(np.zeros((2, 2), dtype=np.uint64))

        os.ftruncate(fd, 1 << 20)
        with pytest.raises(ValueError, match=r"the test's cache lost pages under the copy "
                                             r"\(truncated by its owner\): run 1 \(2097152 "
                                             r"bytes at offset 1048576\) reads past its end"):
            source.copy_runs(np.array([[0, base, 4096], [1 << 20, base, 2 << 20]],
                                      dtype=np.uint64))
        out[:] = 0
        assert source.copy_runs(np.array([[0, base, 1 << 20]], dtype=np.uint64)) == 1 << 20
        assert (out[:1 << 20] == data[:1 << 20]).all()

        # Truncated and grown again while copies run: each copy ends whole or as an error,
        # and once the owner stopped the file copies whole again.
        stop = threading.Event()

        def owner():
            for _ in range(100):
                if stop.is_set():
                    break
                os.ftruncate(fd, 1 << 20)
                stop.wait(0.0005)
                os.ftruncate(fd, size)
                stop.wait(0.0005)
        t = threading.Thread(target=owner)
        t.start()
        try:
            for _ in range(2000):
                if not t.is_alive():
                    break
                try:
                    assert source.copy_runs(np.array([[0, base, size]], dtype=np.uint64)) == size
                except ValueError as e:
                    assert "run 0 (%d bytes at offset 0) reads past its end" % size in str(e)
        finally:
            stop.set()
            t.join()
        assert source.copy_runs(np.array([[0, base, size]], dtype=np.uint64)) == size
    finally:
        os.close(fd)
    os.unlink(path)
    for _ in range(200):
        if not source.mapped:
            break
        threading.Event().wait(0.05)
    assert not source.mapped
    with pytest.raises(FileNotFoundError, match="the test's cache was removed"):
        source.copy_runs(np.array([[0, base, 1]], dtype=np.uint64))


def test_a_sigbus_outside_a_guarded_copy_still_ends_the_process(tmp_path):
    """The guarded copies' SIGBUS handler passes on what is not theirs: a touch of a truncated
    mapping elsewhere in the process ends it by SIGBUS, as it would have."""
    script = (
        "import mmap, os, numpy as np, expert_arena\n"
        "p = %r\n"
        "open(p, 'wb').write(b'x' * 8192)\n"
        "fd = os.open(p, os.O_RDWR)\n"
        "source = expert_arena._core.MappedFile(fd, 'f')\n"
        "out = np.zeros(16, dtype=np.uint8)\n"
        "to = expert_arena._core.array_address(out)\n"
        "assert source.copy_runs(np.array([[0, to, 16]], dtype=np.uint64)) == 16\n"
        "m = mmap.mmap(fd, 8192)\n"
        "os.ftruncate(fd, 0)\n"
        "print('touching', flush=True)\n"
        "m[5000]\n"
        "print('survived', flush=True)\n" % str(tmp_path / "f"))
    done = subprocess.run([sys.executable, "-c", script], env=child_env(), timeout=120,
                          capture_output=True, text=True)
    assert done.stdout == "touching\n", (done.stdout, done.stderr)
    # (An interpreter under AddressSanitizer: its handler, the one before, reports and exits.)
    assert done.returncode == -signal.SIGBUS or (
        done.returncode != 0 and "AddressSanitizer: BUS" in done.stderr), done.stderr
