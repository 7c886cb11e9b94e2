"""torch.compile of a module whose parameters are arena views (torch 2.x, the .venv run): the
compiled module computes what the eager one does, on the arena's bytes (no copy of a
parameter), and a compiled in-place update of a parameter never reaches the shared file.

torch.compile is torch 2.x: under Debian's torch 1.13 these tests skip with that reason; the
suite's .venv run (scripts/test.sh) runs them, and in CI a torch 2.x without a working
torch.compile fails them."""

import os
import subprocess
import sys
import textwrap

import pytest

import expert_arena
from conftest import child_env
from test_views import Model, file_checksums, gguf_names

torch = pytest.importorskip("torch") if os.environ.get("CI") != "true" else __import__("torch")

TORCH2 = int(torch.__version__.split(".")[0]) >= 2
pytestmark = pytest.mark.skipif(not TORCH2, reason="torch.compile needs torch 2.x (this is %s)"
                                % torch.__version__)


def _bind(module, arena, layers):
    names = {}
    for layer in range(layers):
        names.update(gguf_names(layer))
    result = expert_arena.load_into(module, arena, names)
    assert result.unexpected_keys == []
    return names


def test_compiled_module_on_arena_views_equals_eager_and_copies_nothing(gen_model, shm_path):
    layers, experts, hidden, ffn = 2, 4, 64, 96
    path = shm_path()
    model_file = gen_model("gguf", "f32", layers, experts, hidden, ffn)
    with expert_arena.open(model_file, shared_path=path, quiet=True) as a:
        torch.manual_seed(0)
        module = Model(layers, experts, hidden, ffn).eval()
        names = _bind(module, a, layers)
        start, size = a.data_range()
        ptrs = {k: module.get_parameter(v).data_ptr() for k, v in names.items()}
        assert all(start <= p < start + size for p in ptrs.values())
        x = torch.randn(7, hidden, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            eager = module(x)
            compiled = torch.compile(module, backend="inductor", fullgraph=False)
            got = compiled(x)
            again = compiled(x * 2)
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(again, module(x * 2), rtol=1e-5, atol=1e-5)
        # The parameters are still the arena's bytes: compile neither copied nor rebound them.
        assert {k: module.get_parameter(v).data_ptr() for k, v in names.items()} == ptrs
        assert all(type(module.get_parameter(v)).__name__ in ("Parameter", "ArenaTensor")
                   for v in names.values())


COMPILED_WRITER = textwrap.dedent("""
    import sys, warnings
    import torch
    import expert_arena
    from torch import nn
    warnings.simplefilter("ignore")
    path, name = sys.argv[1:]
    arena = expert_arena.attach(path)
    view = arena.torch(name)

    class Scale(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = nn.Parameter(w, requires_grad=False)

        def forward(self, x):
            self.w.mul_(2)  # an in-place update inside the compiled graph
            return x @ self.w[0].t()

    m = Scale(view)
    x = torch.ones(2, view.shape[-1])
    try:
        torch.compile(m)(x)
        print("ran", flush=True)   # it wrote this process's private copy-on-write pages
    except Exception as e:
        print("refused", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
""")


def test_a_compiled_write_never_reaches_the_shared_bytes(gen_model, shm_path):
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        name = a.names()[0]
    before = file_checksums(path)
    out = subprocess.run([sys.executable, "-c", COMPILED_WRITER, path, name], env=child_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] in ("ran", "refused"), out.stdout
    assert file_checksums(path) == before
