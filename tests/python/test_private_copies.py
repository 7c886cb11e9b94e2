"""Writes into arena views that copy a page into this process: they never travel to another
process as references, an operator can see them (Arena.private_bytes, private_tensors,
expert_arena.private_bytes), and a module bound to an arena refuses to run on them
(check_private_copies: shared_module and the vLLM loader's first forwards). A pickled Arena
is refused when its path now holds another arena."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import expert_arena
from conftest import child_env

torch = pytest.importorskip("torch") if os.environ.get("CI") != "true" else __import__("torch")
from torch import nn  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")

# A pickle file loaded in a fresh process: the sum of each tensor, and whether it is a view of
# an arena (zero-copy) or bytes of its own.
RECEIVER = textwrap.dedent("""
    import pickle, sys
    import torch
    import expert_arena._torch as et
    with open(sys.argv[1], "rb") as f:
        items = pickle.load(f)
    for t in items:
        inside = any(s <= t.data_ptr() < s + n
                     for s, n in (a.data_range() for a in et._ATTACHED.values()))
        print(repr(float(t.double().sum())), "view" if inside else "bytes", flush=True)
""")


def receive(items, tmp_path):
    """[(sum, "view" or "bytes")] of `items` pickled here and loaded in another process."""
    with open(tmp_path / "items.pickle", "wb") as f:
        pickle.dump(items, f)
    out = subprocess.run([sys.executable, "-c", RECEIVER, str(tmp_path / "items.pickle")],
                         env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [(float(s), kind) for s, kind in (line.split() for line in out.stdout.splitlines())]


def write(route, w):
    """Writes into arena view `w` by `route` (none of them raises: they bypass ArenaTensor's
    refusals) and returns the tensors whose values changed."""
    plain = w.as_subclass(torch.Tensor)
    if route == "add_":
        plain.add_(1)
        return [plain, w]
    if route == "mul_out":
        torch.mul(plain, 0, out=plain)
        return [plain, w]
    # An op on a slice: only the second row's page is written.
    plain[1].add_(5)
    return [plain[1], w[1], w]


@pytest.mark.parametrize("route", ["add_", "mul_out", "slice"])
def test_pickle_after_an_in_place_write_carries_the_written_values(gen_model, shm_path,
                                                                   tmp_path, route):
    """Found as: t = view.as_subclass(torch.Tensor); t.add_(1); pickle.loads(pickle.dumps(t))
    gave the arena's old values, in this process and in another, because the pickle was a
    reference to the arena."""
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        w = a[a.names()[0]]
        shared = w.clone()
        written = write(route, w)
        assert not torch.equal(w, shared)
        for t in written:
            back = pickle.loads(pickle.dumps(t))
            assert torch.equal(back, t), "%s: the pickle holds the arena's old values" % route
        got = receive(written, tmp_path)
        assert [s for s, _ in got] == [float(t.double().sum()) for t in written]
        assert [kind for _, kind in got] == ["bytes"] * len(written)
        # The arena itself never saw the write.
        with expert_arena.attach(path, quiet=True) as other:
            assert torch.equal(other.torch(a.names()[0]).as_subclass(torch.Tensor), shared)


def test_a_written_view_crosses_a_spawned_queue_by_value(gen_model, shm_path):
    """multiprocessing's pickler (a spawn Queue) sends it by value too."""
    path = shm_path()
    ctx = torch.multiprocessing.get_context("spawn")
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        w = a[a.names()[0]]
        plain = w.as_subclass(torch.Tensor)
        torch.mul(plain, 0, out=plain)
        queue, answers = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_sum_from_queue, args=(queue, answers))
        child.start()
        queue.put(w)
        assert answers.get(timeout=120) == 0.0
        child.join(timeout=120)
        assert child.exitcode == 0


def _sum_from_queue(queue, answers):
    answers.put(float(queue.get(timeout=120).double().sum()))


def test_untouched_views_still_pickle_by_reference(gen_model, shm_path, tmp_path):
    """Only the written tensor goes by value: another tensor of the same arena, and a view
    before any write, are a few hundred bytes that the receiver maps."""
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        first, second = a[a.names()[0]], a[a.names()[1]]
        assert len(pickle.dumps(first)) < 1024 < first.numel() * 4
        write("slice", first)
        assert len(pickle.dumps(first)) > first.numel() * 4
        assert len(pickle.dumps(second)) < 1024 < second.numel() * 4
        assert len(pickle.dumps(second.as_subclass(torch.Tensor)[2])) < 1024
        got = receive([second, first], tmp_path)
        assert got == [(float(second.double().sum()), "view"),
                       (float(first.double().sum()), "bytes")]


def test_a_pickled_arena_is_refused_when_its_path_holds_another_arena(gen_model, shm_path):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        data = pickle.dumps(a)
        again = pickle.loads(data)  # the same arena: attaches
        assert again.names() == a.names()
        again.close()
    # Nobody maps it any more: another model's engine replaces the file at the same path.
    with expert_arena.open(gen_model("gguf", "f32", experts=8), shared_path=path,
                           quiet=True) as b:
        with pytest.raises(ValueError, match="now holds another arena") as refused:
            pickle.loads(data)
        assert path in str(refused.value)
        assert b.report["role"] == "loaded"


def test_private_bytes_on_demand_name_the_written_page(gen_model, shm_path):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        names = a.names()
        views = [a[n] for n in names]
        for v in views:
            float(v.sum())  # every page read: still the arena's
        assert a.private_bytes() == 0 and a.private_bytes(changed=True) == 0
        assert a.private_tensors() == {}
        assert [expert_arena.private_bytes(v) for v in views] == [0] * len(views)

        # One element written: its page is this process's (on hugetlbfs a whole huge page,
        # which may hold the next tensors too: compared byte for byte, only one page differs).
        hugetlbfs = a.report["backing"] == "hugetlbfs"
        flat = views[0].as_subclass(torch.Tensor).view(-1)
        torch.add(flat[5], 1, out=flat[5])
        assert a.private_bytes(changed=True) == PAGE
        assert a.private_bytes() >= PAGE
        assert a.private_tensors() == {names[0]: PAGE}
        assert expert_arena.private_bytes(views[0]) >= PAGE
        assert expert_arena.private_bytes(views[0], changed=True) == PAGE
        assert expert_arena.private_bytes(views[0].view(-1)[5]) == 4  # the element itself
        assert expert_arena.private_bytes(views[1], changed=True) == 0
        if not hugetlbfs:
            assert expert_arena.private_bytes(views[1]) == 0

        # The value already there written back: a private page, but no byte differs.
        second = views[1].as_subclass(torch.Tensor)
        torch.mul(second, 1, out=second)
        assert expert_arena.private_bytes(views[1]) >= PAGE
        assert expert_arena.private_bytes(views[1], changed=True) == 0
        assert a.private_bytes(changed=True) == PAGE
        assert a.private_tensors() == {names[0]: PAGE}
        assert names[1] in a.private_tensors(changed=False)

        with pytest.raises(ValueError, match="not a view of a shared arena"):
            expert_arena.private_bytes(torch.zeros(3))
    with expert_arena.open(gen_model("gguf", "f32"), quiet=True) as private:
        w = private[private.names()[0]].as_subclass(torch.Tensor)
        w.add_(1)
        assert private.private_bytes() == 0  # no shared bytes to differ from


def make_module():
    return nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 8))


def load_module(module):
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p)


def test_a_write_into_a_bound_parameter_is_reported_naming_it(shm_path):
    path = shm_path()
    module = expert_arena.shared_module(path, make_module, load_module, identity="privcopy-1",
                                        quiet=True)
    assert expert_arena.check_private_copies(module) == 0
    x = torch.ones(2, 64)
    expected = module(x)
    weight = module[2].weight.as_subclass(torch.Tensor)
    weight[3].add_(1)  # what a kernel writing a weight in place does
    with pytest.raises(expert_arena.PrivateCopyError) as refused:
        expert_arena.check_private_copies(module)
    message = str(refused.value)
    assert "2.weight" in message and path in message and "0.weight" not in message
    assert not torch.equal(module(x), expected)
    # Another engine attaching to the arena still reads the published weights.
    other = expert_arena.shared_module(path, make_module, load_module, identity="privcopy-1",
                                       quiet=True)
    assert other.expert_arena.report["role"] == "attached"
    assert torch.equal(other(x), expected)
    del module, other


def test_the_vllm_loaders_first_forwards_refuse_a_written_parameter(shm_path):
    """The vLLM loader's hook (expert_arena.vllm.check_at_first_forwards) on a module bound to
    an arena: the first forward passes, a write between forwards is refused at the next one,
    naming the parameter. (Importing expert_arena.vllm needs no vLLM.)"""
    from expert_arena import _binder
    from expert_arena import vllm as loader
    path = shm_path()
    module = expert_arena.shared_module(path, make_module, load_module, identity="privcopy-2",
                                        quiet=True)
    views = {e.arena_name: e.tensor for e in _binder.module_tensors(module)}
    loader.check_at_first_forwards(module, views)
    x = torch.ones(2, 64)
    module(x)
    torch.mul(module[0].bias.as_subclass(torch.Tensor), 2, out=module[0].bias)
    with pytest.raises(expert_arena.PrivateCopyError, match=r"at forward 2: .*0\.bias"):
        module(x)
    del module
