"""Arena views as engines use them: writes that stay private, the Mapping surface, zero-copy
parameters in nn.Modules, views sent to other processes by reference, FP8 decoding, and the
error a package without its compiled module raises."""

import ctypes
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import expert_arena
from conftest import ROOT, child_env

torch = pytest.importorskip("torch") if os.environ.get("CI") != "true" else __import__("torch")
import torch.multiprocessing as tmp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


def file_checksums(path):
    """{name: xxh3-64 of the bytes in the file} read with plain reads (no mapping)."""
    with expert_arena.attach(path) as a:
        entries = [(i["name"], i["file_offset"], i["bytes"]) for i in a.tensors()]
    out = {}
    with open(path, "rb") as f:
        for name, offset, size in entries:
            f.seek(offset)
            out[name] = expert_arena.xxh3_64(np.frombuffer(f.read(size), np.uint8))
    return out


WRITER = textwrap.dedent("""
    import sys, warnings
    import numpy as np, torch, torch.utils.dlpack as dl
    import expert_arena
    warnings.simplefilter("ignore")

    def write_everywhere(arena):
        name = arena.names()[0]
        t, x = arena.torch(name), arena.numpy(name)
        # The view's own in-place methods and NumPy routes raise, naming the tensor (NumPy:
        # its read-only array's own error).
        refused = [
            lambda: np.asarray(t).__setitem__((0, 0, 0), 7.0),
            lambda: t.__array__().reshape(-1).__setitem__(1, 7.0),
            lambda: t.numpy().__setitem__((0, 0, 0), 7.0),
            lambda: memoryview(np.asarray(t)).cast("B").__setitem__(16, 1),
            lambda: t.add_(1), lambda: t.zero_(), lambda: t.__setitem__(0, 1.0),
            lambda: t.copy_(torch.zeros_like(t)), lambda: t.set_(torch.zeros(3)),
            lambda: t.resize_(1), lambda: t.__iadd__(1), lambda: t.detach().fill_(0),
            lambda: torch.nn.Parameter(t, requires_grad=False).mul_(2),
        ]
        for route in refused:
            try:
                route()
            except ValueError as e:
                assert name in str(e) or "read-only" in str(e), e
            except TypeError as e:  # memoryview: "cannot modify read-only memory"
                assert "read-only" in str(e), e
            else:
                raise AssertionError("a write was not refused")
        # What torch cannot intercept without a per-op cost writes a private page.
        private = [
            lambda: torch.from_numpy(arena.numpy(name)).view(-1)[2].fill_(7.0),
            lambda: dl.from_dlpack(dl.to_dlpack(t)).view(-1)[3].fill_(7.0),
            lambda: t.as_strided((4,), (1,), 5).fill_(7.0),
            lambda: torch.empty(0).set_(t.storage()).view(-1)[9].fill_(7.0),
            lambda: torch.add(t, 1, out=t), lambda: t[1].mul_(3), lambda: torch.relu_(t),
            lambda: t.as_subclass(torch.Tensor).view(-1)[0].fill_(1.0),
        ]
        for route in private:
            route()
        # Every write stays in this process's pages, which every view of this process shares.
        assert float(x.reshape(-1)[0]) == 1.0, x.reshape(-1)[:4]
        for other in arena.names()[1:]:
            arena.torch(other).view(-1)[:8].fill_(-1)

    model, attached, loaded, loaded_gpu = sys.argv[1:]
    write_everywhere(expert_arena.attach(attached))
    write_everywhere(expert_arena.open(model, shared_path=loaded, quiet=True))
    # gpu="cuda" maps the shared arena writable (for the registration), with or without a
    # device; the views' mapping is the private one all the same.
    write_everywhere(expert_arena.open(model, shared_path=loaded_gpu, quiet=True, gpu="cuda"))
    print("ok", flush=True)
""")


def test_writes_through_every_route_never_reach_the_shared_bytes(gen_model, shm_path):
    """np.asarray, __array__, torch.from_numpy, dlpack, the buffer protocol, as_strided, set_,
    out= and in-place ops: none crashes, none reaches the file or another engine; in a process
    that attached, one that loaded, and one that loaded asking for a GPU."""
    model = gen_model("gguf", "f32")
    attached, loaded, loaded_gpu = shm_path(), shm_path(), shm_path()
    with expert_arena.open(model, shared_path=attached, quiet=True) as a:
        before = {n: a.info(n)["checksum"] for n in a.names()}
        held = {n: a.numpy(n) for n in a.names()}  # this engine's views, read after the writes
        out = subprocess.run([sys.executable, "-c", WRITER, model, attached, loaded, loaded_gpu],
                             env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["ok"]
        assert {n: expert_arena.xxh3_64(v) for n, v in held.items()} == before
    for path in (attached, loaded, loaded_gpu):
        assert file_checksums(path) == before


def test_private_arena_views_write_without_crashing(gen_model):
    with expert_arena.open(gen_model("gguf", "f32"), quiet=True) as a:
        name = a.names()[0]
        t = a.torch(name)
        with pytest.raises(ValueError, match="'%s' of a private arena" % name):
            t.fill_(5.0)
        t.as_subclass(torch.Tensor)[0, 0, 0] = 5.0
        assert float(a.numpy(name)[0, 0, 0]) == 5.0


def test_guarded_view_raises_naming_the_tensor(gen_model, shm_path):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        name = a.names()[1]
        g = a.torch(name, guard=True)
        for attempt in (lambda: g.add_(1), lambda: g[0].fill_(0), lambda: torch.add(g, 1, out=g),
                        lambda: g.__setitem__(0, 1.0)):
            with pytest.raises(ValueError, match="read-only"):
                attempt()
        with pytest.raises(ValueError, match=name):
            g.zero_()
        # Flags are not writes.
        assert g.requires_grad_(False) is g
        p = nn.Parameter(g, requires_grad=False)
        assert p.data_ptr() == g.data_ptr()
        assert torch.equal(g, a.torch(name))


def test_views_cost_what_plain_tensors_cost(gen_model):
    """The default view is an ArenaTensor whose __torch_function__ is torch's disabled one: no
    Python runs in its ops, whose results are plain tensors (the bench measures the time,
    bench/python_view_bench.py)."""
    with expert_arena.open(gen_model("gguf", "f32"), quiet=True) as a:
        t = a.torch(a.names()[0])
        assert type(t) is expert_arena.ArenaTensor
        assert type(t).__torch_function__ is torch._C._disabled_torch_function_impl
        assert type(t[3]) is torch.Tensor and type(t * 2) is torch.Tensor
        assert type(t.as_subclass(torch.Tensor)) is torch.Tensor
        # Not an autograd view of the tensor over the mapping: indexing a view of a view
        # costs more than indexing a plain tensor.
        assert t._base is None and not t._is_view()
        assert not a.torch(a.names()[1], guard=True)._is_view()
        # torch's per-call lookup goes through the char* API, which ArenaTensor answers
        # from its class (python/src/torch_type.cc); every other name as Python does.
        get = ctypes.pythonapi.PyObject_GetAttrString
        get.restype, get.argtypes = ctypes.py_object, (ctypes.py_object, ctypes.c_char_p)
        assert get(t, b"__torch_function__") is torch._C._disabled_torch_function_impl
        assert get(t, b"shape") == t.shape and get(t, b"_ea") == t._ea
        with pytest.raises(AttributeError):
            get(t, b"no_such_attribute")


def test_stream_torch_views_are_not_autograd_views(stream_dir):
    with expert_arena.StreamProducer(stream_dir, quiet=True) as producer, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as consumer:
        ds = [producer.put("a", torch.ones(4, 4)), producer.put("b", torch.ones(3).bfloat16())]
        views = consumer.open_many(ds, view="torch")
        for v in views:
            assert type(v) is expert_arena.ArenaTensor and not v._is_view()
        with consumer.open(producer.put("c", torch.ones(2))) as t:
            assert not t.torch()._is_view()
        del views


CLASS_CHANGES = textwrap.dedent("""
    import sys
    import torch
    import expert_arena
    calls = []

    def spy(cls, func, types, args=(), kwargs=None):
        calls.append(func.__name__)
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))

    a = expert_arena.open(sys.argv[1], quiet=True)
    t = a.torch(a.names()[0])
    assert type(t + 1) is torch.Tensor and not calls  # the lookup is cached from here
    expert_arena.ArenaTensor.__torch_function__ = classmethod(spy)
    t + 1
    assert len(calls) == 1, calls
    del expert_arena.ArenaTensor.__torch_function__
    calls.clear()
    # torch.Tensor's own __torch_function__ now: results keep the subclass.
    assert type(t + 1) is expert_arena.ArenaTensor and not calls

    class Spied(expert_arena.ArenaTensor):
        __torch_function__ = classmethod(spy)

    s = torch.Tensor._make_subclass(Spied, torch.zeros(2))
    s * 2
    assert len(calls) == 1, calls
    print("ok", flush=True)
""")


def test_torch_sees_changes_to_the_view_class(gen_model):
    """ArenaTensor's fast __torch_function__ answer follows the class: a new value, a deleted
    one, and a subclass's own are what torch calls."""
    out = subprocess.run([sys.executable, "-c", CLASS_CHANGES, gen_model("gguf", "f32")],
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def test_arena_is_a_mapping_like_safe_open(gen_model, shm_path):
    import collections.abc
    path = shm_path()
    with expert_arena.open(gen_model("safetensors", "bf16"), shared_path=path, quiet=True) as a:
        assert isinstance(a, collections.abc.Mapping)
        names = a.names()
        assert list(a.keys()) == names and len(a.keys()) == len(names)
        first = names[0]
        assert torch.equal(a[first], a.get_tensor(first))
        assert a[first].dtype == torch.bfloat16
        assert [k for k, _ in a.items()] == names
        assert all(isinstance(v, torch.Tensor) for v in a.values())
        assert a.get("nope") is None
        with pytest.raises(KeyError, match="nope"):
            a["nope"]
        other = expert_arena.attach(path)
        assert hash(a) == hash(a) and a != other
        other.close()
    with expert_arena.attach(path) as b:
        assert b.keys() == set(names)


class Experts(nn.Module):
    """A small MoE block: a router and E experts of gate/up/down projections."""

    def __init__(self, experts, hidden, ffn):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate = nn.Parameter(torch.zeros(experts, ffn, hidden))
        self.up = nn.Parameter(torch.zeros(experts, ffn, hidden))
        self.down = nn.Parameter(torch.zeros(experts, hidden, ffn))

    def forward(self, x):
        weights = F.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.gate.shape[0]):
            h = F.silu(F.linear(x, self.gate[e])) * F.linear(x, self.up[e])
            out = out + weights[:, e:e + 1] * F.linear(h, self.down[e])
        return out


class Model(nn.Module):
    def __init__(self, layers, experts, hidden, ffn):
        super().__init__()
        self.layers = nn.ModuleList(Experts(experts, hidden, ffn) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def gguf_names(layer):
    return {"blk.%d.ffn_gate_exps.weight" % layer: "layers.%d.gate" % layer,
            "blk.%d.ffn_up_exps.weight" % layer: "layers.%d.up" % layer,
            "blk.%d.ffn_down_exps.weight" % layer: "layers.%d.down" % layer}


def test_load_into_a_moe_module_zero_copy_equals_a_copying_load(gen_model, shm_path):
    layers, experts, hidden, ffn = 2, 4, 64, 96
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32", layers, experts, hidden, ffn),
                           shared_path=path, quiet=True) as a:
        names = {}
        for layer in range(layers):
            names.update(gguf_names(layer))
        names["blk.9.ffn_up_exps.weight"] = "layers.9.up"  # not in the arena: skipped
        torch.manual_seed(0)
        zero_copy = Model(layers, experts, hidden, ffn)
        copied = Model(layers, experts, hidden, ffn)
        copied.load_state_dict(zero_copy.state_dict())  # the same routers
        result = expert_arena.load_into(zero_copy, a, names)
        assert sorted(result.loaded) == sorted(v for k, v in names.items() if k in a)
        assert result.missing_keys == ["layers.0.router.weight", "layers.1.router.weight"]
        assert result.unexpected_keys == []
        for key, value in {v: a[k] for k, v in names.items() if k in a}.items():
            param = zero_copy.get_parameter(key)
            assert isinstance(param, nn.Parameter) and not param.requires_grad
            assert param.data_ptr() == value.data_ptr()  # zero-copy
        copied.load_state_dict({v: a[k].clone() for k, v in names.items() if k in a},
                               strict=False)
        x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(zero_copy(x), copied(x))
        # A name that maps to no key of the module is reported, strict refuses it.
        bad = dict(names)
        bad["blk.0.ffn_up_exps.weight"] = "layers.0.nope"
        result = expert_arena.load_into(Model(layers, experts, hidden, ffn), a, bad)
        assert result.unexpected_keys == ["blk.0.ffn_up_exps.weight"]
        with pytest.raises(KeyError, match="nope|blk.0.ffn_up"):
            expert_arena.load_into(Model(layers, experts, hidden, ffn), a, bad, strict=True)
        # Shape and dtype are checked, naming both sides.
        with pytest.raises(ValueError, match="layers.0.gate"):
            expert_arena.load_into(Model(layers, experts, hidden, ffn + 1), a, names)
        half = Model(layers, experts, hidden, ffn).half()
        with pytest.raises(ValueError, match="float16"):
            expert_arena.load_into(half, a, names)


def test_parameter_and_flags_are_zero_copy(gen_model):
    with expert_arena.open(gen_model("gguf", "f16"), quiet=True) as a:
        v = a.torch(a.names()[0])
        p = nn.Parameter(v, requires_grad=False)
        assert p.data_ptr() == v.data_ptr()
        assert v.requires_grad_(False) is v
        lin = nn.Linear(v.shape[-1], v.shape[-2], bias=False)
        del lin.weight
        lin.weight = nn.Parameter(v[0], requires_grad=False)
        assert lin.weight.data_ptr() == v[0].data_ptr()
        x = torch.randn(3, v.shape[-1])
        assert torch.equal(F.linear(x, lin.weight.float()), F.linear(x, v[0].float()))


# ---- across processes -------------------------------------------------------------------

def _sum_and_where(t):
    """In the receiving process: the tensor's sum, whether it is a view of an arena mapping of
    this process (zero-copy), and its type."""
    import expert_arena._torch as et
    ranges = [a.data_range() for a in et._ATTACHED.values()]
    p = t.data_ptr()
    inside = any(start <= p < start + size for start, size in ranges)
    return float(t.double().sum()), inside, type(t).__name__, tuple(t.shape), tuple(t.stride())


def _queue_child(q, out):
    t = q.get()
    out.put(_sum_and_where(t))


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_views_cross_queues_and_pools_by_reference(gen_model, shm_path, method):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        w = a.torch(a.names()[0])
        views = [w[3 % w.shape[0]], w[1].t(), nn.Parameter(w[0], requires_grad=False), w,
                 nn.Parameter(w, requires_grad=False)]
        # The pickle is a reference: a few hundred bytes, whatever the tensor's size.
        from multiprocessing.reduction import ForkingPickler
        data = bytes(ForkingPickler.dumps(w))
        assert len(data) < 1024 < w.numel() * 4
        ctx = tmp.get_context(method)
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_queue_child, args=(q, out))
        p.start()
        q.put(views[1])
        total, inside, kind, shape, stride = out.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0
        assert inside and kind == "Tensor"
        assert shape == tuple(views[1].shape) and stride == tuple(views[1].stride())
        assert total == pytest.approx(float(views[1].double().sum()))
        with ctx.Pool(1) as pool:
            results = pool.map(_sum_and_where, views)
            # A tensor that is not an arena view still goes torch's way (shared memory).
            assert pool.apply(_sum_and_where, (torch.arange(6.0),))[:2] == (15.0, False)
        for v, (total, inside, kind, shape, _) in zip(views, results):
            assert inside and shape == tuple(v.shape)
            assert total == pytest.approx(float(v.double().sum()))
        assert results[2][2] == "Parameter"
        assert results[3][2] == results[4][2] == "ArenaTensor"


def _stream_child(q, out):
    t = q.get()
    out.put((t.key, float(t.numpy().sum()), t.released))
    t.release()


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_stream_tensor_crosses_a_queue_as_its_descriptor(stream_dir, method):
    import copy
    with expert_arena.StreamProducer(stream_dir, quiet=True) as producer, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as consumer:
        t = consumer.open(producer.put("k", np.arange(6, dtype=np.float32), readers=2))
        assert len(pickle.dumps(t)) < 1024
        with pytest.raises(TypeError, match="not data"):
            copy.deepcopy(t)
        ctx = tmp.get_context(method)
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_stream_child, args=(q, out))
        p.start()
        q.put(t)
        assert out.get(timeout=120) == ("k", 15.0, False)
        p.join(60)
        assert p.exitcode == 0
        assert producer.stats()["live_blocks"] == 1
        t.release()
        producer.reclaim()
        assert producer.stats()["live_blocks"] == 0
        with pytest.raises(TypeError, match="released"):
            pickle.dumps(t)


def test_arena_pickles_as_a_reference_to_its_path(gen_model, shm_path):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        data = pickle.dumps(a)
        assert len(data) < 512
        b = pickle.loads(data)
        assert b.report["role"] == "attached" and b.names() == a.names()
        assert torch.equal(b[a.names()[0]], a[a.names()[0]])
        b.close()
    with expert_arena.open(gen_model("gguf", "f32"), quiet=True) as private:
        with pytest.raises(TypeError, match="private"):
            pickle.dumps(private)


RECEIVER = textwrap.dedent("""
    import pickle, sys
    import torch
    import expert_arena, expert_arena._torch as et
    with open(sys.argv[1], "rb") as f:
        items = pickle.load(f)
    for t in items:
        # Zero-copy: the tensor points into this process's mapping of the arena it attached.
        inside = any(s <= t.data_ptr() < s + n
                     for s, n in (a.data_range() for a in et._ATTACHED.values()))
        total = float(t.double().sum())
        try:
            t.add_(1)
            refused = ""
        except ValueError as e:
            refused = str(e)
        print(type(t).__name__, inside, repr(total), refused, flush=True)
""")


def test_plain_pickle_sends_a_reference_that_another_process_attaches(gen_model, shm_path,
                                                                      tmp_path):
    """pickle.dump of a view, of a slice of it and of a Parameter made from it is a few hundred
    bytes; a process started afresh loads them as zero-copy views of the arena, still read-only
    where the sender's was."""
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        name = a.names()[0]
        w = a[name]
        # (the plain slice last: the receiver's write to it is seen by its other views)
        items = [w, nn.Parameter(w, requires_grad=False), w[1].t()]
        for item in items:
            assert len(pickle.dumps(item)) < 1024 < w.numel() * 4
        with open(tmp_path / "views.pickle", "wb") as f:
            pickle.dump(items, f)
        out = subprocess.run([sys.executable, "-c", RECEIVER, str(tmp_path / "views.pickle")],
                             env=child_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = [line.split(" ", 3) for line in out.stdout.splitlines()]
        assert [line[:2] for line in lines] == [["ArenaTensor", "True"], ["ArenaTensor", "True"],
                                                ["Tensor", "True"]]
        for item, line in zip(items, lines):
            assert float(line[2]) == float(item.double().sum())
        assert name in lines[0][3] and path in lines[0][3] and "read-only" in lines[1][3]
        assert lines[2][3] == ""  # a plain tensor: the write went to a private page


def test_deepcopy_is_a_new_view_of_the_same_bytes(gen_model, shm_path):
    import copy
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32", 1, 4, 64, 96), shared_path=path,
                           quiet=True) as a:
        w = a[a.names()[0]]
        c = copy.deepcopy(w)
        assert type(c) is type(w) and c is not w and c.data_ptr() == w.data_ptr()
        assert torch.equal(c, w)
        with pytest.raises(ValueError, match=a.names()[0]):
            c.zero_()
        # A module holding views deep-copies without copying them (a memo keeps one copy
        # per tensor), and its parameters stay parameters.
        model = Model(1, 4, 64, 96)
        expert_arena.load_into(model, a, gguf_names(0))
        twin = copy.deepcopy(model)
        assert twin.layers[0].up.data_ptr() == model.layers[0].up.data_ptr()
        assert isinstance(twin.layers[0].up, nn.Parameter) and not twin.layers[0].up.requires_grad
        assert twin.layers[0].router.weight.data_ptr() != model.layers[0].router.weight.data_ptr()
        x = torch.randn(3, 64)
        with torch.no_grad():
            assert torch.equal(twin(x), model(x))
    # A private arena has no file to refer to: deepcopy still shares the bytes, pickle copies.
    with expert_arena.open(gen_model("gguf", "f32"), quiet=True) as a:
        w = a[a.names()[0]]
        assert copy.deepcopy(w).data_ptr() == w.data_ptr()
        back = pickle.loads(pickle.dumps(w))
        assert torch.equal(back, w) and back.data_ptr() != w.data_ptr()
        assert type(back) is torch.Tensor


LOADER = textwrap.dedent("""
    import sys
    import torch
    saved = torch.load(sys.argv[1])
    expected = torch.load(sys.argv[2])
    for key, value in expected.items():
        got = saved[key]
        assert torch.equal(got, value), key
        assert type(got) is type(value), (key, type(got), type(value))
    print("ok", sorted(saved), flush=True)
""")


def test_torch_save_holds_the_bytes_after_the_arena_is_gone(gen_model, shm_path, tmp_path):
    """torch.save of views, of a Parameter made from one, and of a module's state_dict loaded
    with load_into writes the data: another process loads it after the arena file is removed,
    and gets plain tensors and Parameters."""
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32", 1, 4, 64, 96), shared_path=path,
                           quiet=True) as a:
        model = Model(1, 4, 64, 96)
        expert_arena.load_into(model, a, gguf_names(0))
        w = a[a.names()[0]]
        saved = dict(model.state_dict(), view=w, slice=w[2],
                     param=nn.Parameter(w[1], requires_grad=False),  # a plain one's
                     view_param=nn.Parameter(w, requires_grad=False))  # an ArenaTensor's
        torch.save(saved, tmp_path / "checkpoint.pt")
        torch.save(saved, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
        expected = {k: (nn.Parameter(v.clone(), requires_grad=False) if k.endswith("param")
                        else v.clone()) for k, v in saved.items()}
        torch.save(expected, tmp_path / "expected.pt")
        del model, w, saved
    os.unlink(path)
    for checkpoint in ("checkpoint.pt", "legacy.pt"):
        out = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / checkpoint),
                              str(tmp_path / "expected.pt")], env=child_env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("ok")


def test_write_attempts_name_the_tensor(gen_model, shm_path, stream_dir):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        name = a.names()[1]
        w = a.torch(name)
        for attempt in (lambda: w.add_(1), lambda: w.__setitem__(0, 1.0), lambda: w.copy_(w),
                        lambda: w.__imul__(2), lambda: w.index_fill_(0, torch.tensor([0]), 1.0),
                        lambda: nn.Parameter(w, requires_grad=False).zero_()):
            with pytest.raises(ValueError) as e:
                attempt()
            assert "'%s' of the arena %s" % (name, path) in str(e.value)
        # Flags and moves are not writes.
        assert w.requires_grad_(False) is w
        assert type(w.detach()) is type(w)
        moved = a.torch(name)
        assert moved.share_memory_() is moved and moved.is_shared()
        assert torch.equal(moved, w)
    with expert_arena.StreamProducer(stream_dir, quiet=True) as producer, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as consumer:
        d = producer.put("kv-7", torch.ones(4, 4), readers=2)
        (v,) = consumer.open_many([d], view="torch")
        with consumer.open(d) as t:
            for view in (v, t.torch()):
                with pytest.raises(ValueError, match="'kv-7'"):
                    view.fill_(0)
        del v


STREAM_RECEIVER = textwrap.dedent("""
    import gc, pickle, sys
    import expert_arena
    with open(sys.argv[1], "rb") as f:
        views = pickle.load(f)
    print(" ".join("%s:%s" % (type(v).__name__, float(v.sum())) for v in views), flush=True)
    del views
    gc.collect()
    print("released", flush=True)
    sys.stdin.read()
""")


def test_a_pickled_stream_view_is_opened_as_one_more_reader(stream_dir, tmp_path):
    """pickle of a stream view sends its descriptor; the receiving process opens it as one more
    reader and gives that share back when its view is gone, never the sender's."""
    with expert_arena.StreamProducer(stream_dir, quiet=True) as producer, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as consumer:
        d1 = producer.put("a", torch.full((64,), 2.0), readers=2)
        d2 = producer.put("b", torch.full((8,), 3.0), readers=2)
        (v1,) = consumer.open_many([d1], view="torch")
        t2 = consumer.open(d2)
        v2 = t2.torch()
        t2.release()  # the view still holds the share, and still pickles
        with open(tmp_path / "views.pickle", "wb") as f:
            pickle.dump([v1, v2], f)
        assert len(pickle.dumps(v1)) < 1024
        child = subprocess.Popen([sys.executable, "-c", STREAM_RECEIVER,
                                  str(tmp_path / "views.pickle")], env=child_env(),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().split() == ["ArenaTensor:128.0", "ArenaTensor:24.0"]
            assert child.stdout.readline().strip() == "released"
            # The child gave its shares back (it is still alive: no lease ended); the
            # sender's are held by its views.
            pending = {p["key"]: p["readers_left"] for p in producer.pending()}
            assert pending == {"a": 1, "b": 1}
            del v1, v2
            producer.reclaim()
            assert producer.pending() == [] and producer.stats()["live_blocks"] == 0
        finally:
            child.stdin.close()
            assert child.wait(60) == 0


# ---- FP8 --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,codes,values", [
    ("e4m3", [0x00, 0x38, 0x40, 0xC0, 0x7E, 0x01, 0x08, 0x3C, 0xFE],
     [0.0, 1.0, 2.0, -2.0, 448.0, 2.0 ** -9, 2.0 ** -6, 1.5, -448.0]),
    ("e5m2", [0x00, 0x3C, 0x40, 0xC0, 0x7B, 0x01, 0x04, 0x3E, 0x7C, 0xFC],
     [0.0, 1.0, 2.0, -2.0, 57344.0, 2.0 ** -16, 2.0 ** -14, 1.5, float("inf"), float("-inf")]),
])
def test_decode_fp8_known_values(fmt, codes, values):
    t = torch.tensor(codes, dtype=torch.uint8)
    got = expert_arena.decode_fp8(t, fmt)
    assert got.dtype == torch.float32
    assert got.tolist() == values
    assert expert_arena.decode_fp8(t, fmt, torch.bfloat16).dtype == torch.bfloat16
    assert expert_arena.decode_fp8(np.array(codes, np.uint8), fmt, scale=2.0).tolist() == \
        [v * 2 for v in values]


def test_decode_fp8_nan_and_bad_format():
    assert torch.isnan(expert_arena.decode_fp8(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))).all()
    assert torch.isnan(expert_arena.decode_fp8(torch.tensor([0x7D], dtype=torch.uint8), "e5m2"))
    with pytest.raises(ValueError, match="e4m3"):
        expert_arena.decode_fp8(torch.zeros(1, dtype=torch.uint8), "e3m4")


# ---- the package surface ----------------------------------------------------------------

def test_logs_go_to_python_logging_for_open_and_attach(gen_model, shm_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="expert_arena")
    model = gen_model("gguf", "f32")
    path = shm_path()

    def lines():
        out = [r.getMessage() for r in caplog.records if r.name == "expert_arena"]
        caplog.clear()
        return out

    with expert_arena.open(model, shared_path=path):
        assert any("loaded" in m and path in m for m in lines())
    with expert_arena.attach(path):
        assert any("attached" in m and path in m for m in lines())
    with expert_arena.attach(path, quiet=True), expert_arena.open(model, quiet=True):
        assert lines() == []


def test_errors_name_python_arguments(gen_model, tmp_path):
    model = gen_model("gguf", "f32")
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n" * 100)
    with pytest.raises(ValueError) as e:
        expert_arena.open(str(text))
    assert 'format="raw"' in str(e.value) and "--format" not in str(e.value)
    with pytest.raises(ValueError) as e:
        expert_arena.open(model, select="(")
    assert "select=(" in str(e.value) and "--select" not in str(e.value)
    with pytest.raises(ValueError) as e:
        expert_arena.open(model, select="^nothing$")
    assert "select_all=True" in str(e.value) and "--all" not in str(e.value)


def test_stream_tensor_dtypes_are_torch_and_numpy_dtypes(stream_dir):
    with expert_arena.StreamProducer(stream_dir, quiet=True) as producer, \
            expert_arena.StreamConsumer(stream_dir, quiet=True) as consumer:
        d32 = producer.put("a", torch.ones(2, 3))
        d16 = producer.put("b", torch.ones(4, dtype=torch.bfloat16))
        with consumer.open(d32) as a, consumer.open(d16) as b:
            assert (a.dtype, a.numpy_dtype, a.dtype_name) == (torch.float32, np.float32, "f32")
            assert (b.dtype, b.numpy_dtype, b.dtype_name) == (torch.bfloat16, np.uint16, "bf16")
            assert a.torch().dtype == a.dtype and b.numpy().dtype == b.numpy_dtype
            # A guarded stream view: np.asarray of it is read-only too.
            assert not np.asarray(a.torch(guard=True)).flags.writeable
            with pytest.raises(ValueError):
                np.asarray(a.torch(guard=True))[0, 0] = 2.0
            # So is the default view's; a plain tensor made from it writes a private copy of
            # the page (test_stream_views.py).
            with pytest.raises(ValueError, match="read-only"):
                np.asarray(a.torch())[0, 0] = 2.0
            a.torch().as_subclass(torch.Tensor)[0, 0] = 2.0
            assert float(a.numpy()[0, 0]) == 2.0


def test_star_import_leaves_the_builtin_open():
    assert "open" not in expert_arena.__all__
    scope = {}
    exec("from expert_arena import *", scope)
    assert "open" not in scope and "attach" in scope


def test_package_without_its_module_says_how_to_build_it(tmp_path):
    """From the source tree (python/expert_arena has no _core), and from a copy of the
    package's files without the module, the ImportError names the build target."""
    for where in (os.path.join(ROOT, "python"), str(tmp_path)):
        if where == str(tmp_path):
            pkg = tmp_path / "expert_arena"
            pkg.mkdir()
            src = os.path.join(ROOT, "python", "expert_arena", "__init__.py")
            (pkg / "__init__.py").write_text(open(src).read())
        out = subprocess.run([sys.executable, "-c", "import expert_arena"],
                             env=dict(os.environ, PYTHONPATH=where), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
        assert out.returncode != 0
        assert "ImportError" in out.stderr and "expert_arena_python" in out.stderr, out.stderr


if __name__ == "__main__":
    multiprocessing.freeze_support()
