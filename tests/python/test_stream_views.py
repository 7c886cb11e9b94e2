"""Stream views are ArenaTensors over a private copy-on-write mapping (issue 21, items 2, 5).

The view's in-place methods and NumPy routes raise naming the key; every other route from an
opened StreamTensor to writable memory (torch.from_numpy, dlpack, as_strided, set_, out=, a
tensor derived by an op) writes into this process's private copy of a page, never into the
producer's segment: a second consumer in another process reads the producer's bytes, and
nothing crashes. `guard=True` keeps the ReadOnlyTensor, which also refuses derived tensors.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import expert_arena

torch = pytest.importorskip("torch")

WRITER = textwrap.dedent(r"""
    import sys, warnings
    import numpy as np, torch, torch.utils.dlpack as dl
    import expert_arena
    warnings.simplefilter("ignore")
    directory, descriptors = sys.argv[1], [bytes.fromhex(h) for h in sys.argv[2:]]
    c = expert_arena.StreamConsumer(directory, quiet=True)
    for d in descriptors:
        t = c.open(d)
        v, n = t.torch(), t.numpy()
        assert isinstance(v, expert_arena.ArenaTensor) and v.data_ptr() == t.address
        # The view's in-place methods and NumPy routes raise, naming the key.
        refused = [lambda: v.add_(1), lambda: v.zero_(), lambda: v.__setitem__(0, 1),
                   lambda: v.copy_(v.clone()), lambda: v.__imul__(2)]
        if v.dtype != torch.bfloat16:  # (NumPy has no bfloat16: numpy() raises TypeError)
            refused += [lambda: np.asarray(v).reshape(-1).__setitem__(0, 7),
                        lambda: v.numpy().reshape(-1).__setitem__(0, 7)]
        for route in refused:
            try:
                route()
            except ValueError as e:
                assert t.key in str(e) or "read-only" in str(e), e
            else:
                raise AssertionError("a write was not refused")
        # The routes torch cannot intercept write this process's private copy of a page.
        # NumPy has no bfloat16: its routes go through the same bytes as int16.
        plain = v.as_subclass(torch.Tensor)
        w = plain.view(torch.int16) if v.dtype == torch.bfloat16 else plain
        routes = [
            lambda: np.asarray(w).reshape(-1).__setitem__(0, 7),
            lambda: w.__array__().reshape(-1).__setitem__(1, 7),
            lambda: torch.from_numpy(t.numpy().view(np.int16) if t.dtype == torch.bfloat16
                                     else t.numpy()).view(-1)[2].fill_(7),
            lambda: dl.from_dlpack(dl.to_dlpack(v)).view(-1)[3].fill_(7),
            lambda: memoryview(np.asarray(w)).cast("B").__setitem__(16, 1),
            lambda: v.view(-1).as_strided((4,), (1,), 5).fill_(7),
            lambda: torch.empty(0, dtype=v.dtype).set_(v.storage()).view(-1)[9].fill_(7),
            lambda: torch.add(v, 1, out=v),
            lambda: plain.add_(1), lambda: v.view(-1).zero_(),
            lambda: v.view(-1).__setitem__(0, 1),
            lambda: torch.from_numpy(np.asarray(w)).view(-1).fill_(5),
        ]
        for route in routes:
            route()
        # The writes are this process's: its views see them, the segment does not.
        assert float(n.reshape(-1)[0]) == 5.0
        for view in c.open_many([d], view="torch") + [t.torch(guard=False)]:
            view.view(-1).fill_(3)
        del v, w, n, view, plain
        t.release()
    print("wrote", len(descriptors), flush=True)
""")

READER = textwrap.dedent(r"""
    import sys
    import expert_arena
    directory, descriptors = sys.argv[1], [bytes.fromhex(h) for h in sys.argv[2:]]
    c = expert_arena.StreamConsumer(directory, quiet=True)
    for d in descriptors:
        with c.open(d) as t:
            print(expert_arena.xxh3_64(t.numpy()), flush=True)
""")


def _run(script, stream_dir, descriptors):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", script, stream_dir] +
                         [d.hex() for d in descriptors], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_every_write_route_leaves_the_producers_bytes_unchanged(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "cow", segment_bytes=4 << 20,
                                     max_segments=2, quiet=True) as p:
        tensors = {"f32": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
                   "bf16": torch.arange(1024, dtype=torch.bfloat16),
                   "i8": torch.arange(100, dtype=torch.int8),
                   "big": torch.full((3 << 20,), 2.5, dtype=torch.float16)}  # own segment
        descriptors = [p.put(k, x, readers=3) for k, x in tensors.items()]  # 2 + 1
        sums = [str(expert_arena.xxh3_64((x.view(torch.int16) if x.dtype == torch.bfloat16
                                          else x).numpy())) for x in tensors.values()]
        assert _run(WRITER, stream_dir, descriptors)[0] == "wrote 4"
        assert _run(READER, stream_dir, descriptors)[:4] == sums
        p.reclaim()
        assert p.stats()["live_blocks"] == 0


def test_a_write_is_dropped_with_the_share_so_a_reused_block_reads_the_producer(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "reuse", segment_bytes=2 << 20,
                                     max_segments=1, quiet=True) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        d1 = p.put("a", torch.ones(1000))
        (v,) = c.open_many([d1], view="torch")
        v.as_subclass(torch.Tensor)[:] = -1.0  # a private copy of its pages
        assert float(v[0]) == -1.0
        del v
        p.reclaim()
        d2 = p.put("b", torch.full((1000,), 4.0))
        # The same place in the segment: without the drop, this process would read -1.
        assert expert_arena.decode_descriptor(d2)["offset"] == \
            expert_arena.decode_descriptor(d1)["offset"]
        with c.open(d2) as t:
            assert float(t.torch().min()) == 4.0 and float(t.numpy().max()) == 4.0


def test_guard_keeps_the_raising_view(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "guard", segment_bytes=2 << 20,
                                     max_segments=1, quiet=True) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        d = p.put("g", torch.ones(8), readers=2)
        with c.open(d) as t:
            g = t.torch(guard=True)
            assert isinstance(g, expert_arena.ReadOnlyTensor)
            with pytest.raises(ValueError, match="'g'"):
                g.add_(1)
            del g
        (g,) = c.open_many([d], view="torch", guard=True)
        with pytest.raises(ValueError, match="read-only"):
            g.mul_(2)
        del g


def test_logical_names_take_dashes_and_lease_check_seconds_is_an_option(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "prefill-0.kv", segment_bytes=2 << 20,
                                     max_segments=1, quiet=True, lease_check_seconds=0) as p, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as c:
        d = p.put("k", np.arange(10, dtype=np.int32))
        assert p.instance_name.startswith("ea-stream-prefill-0.kv-")
        with c.open(d) as t:
            assert t.numpy().tolist() == list(range(10))
    for bad in ("a..b", "a/b", "", "x" * 49):
        with pytest.raises(ValueError, match="logical name"):
            expert_arena.StreamProducer(stream_dir, bad, quiet=True)
    with pytest.raises(ValueError, match="lease_check_seconds"):
        expert_arena.StreamProducer(stream_dir, segment_bytes=2 << 20, max_segments=1,
                                    quiet=True, lease_check_seconds=-1)
