"""Paths and tensor names that are not UTF-8 (any bytes but '/' and NUL name a file on Linux;
a GGUF tensor name is any bytes) through the Python API: they come back as str with lone
surrogates, as os.fsdecode makes them, and name the same bytes when passed back; messages show
them as \\xNN. Found as: attach(), names() and tensors() raised UnicodeDecodeError."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import expert_arena
from conftest import child_env
from model_files import write_gguf

GGML_F32 = 0
ODD_NAME = b"blk.0.ffn_up_exps.weight\xff"
PLAIN_NAME = b"blk.0.ffn_gate_exps.weight"
SHAPE = (2, 8, 16)  # experts, rows, columns


@pytest.fixture
def odd_model(tmp_path):
    """A GGUF whose file name and one tensor name end in the byte 0xFF: (path as bytes,
    {name as bytes: float32 array})."""
    path = os.fsencode(str(tmp_path)) + b"/model-\xff.gguf"
    arrays = {}
    tensors = {}
    for seed, name in enumerate((ODD_NAME, PLAIN_NAME)):
        arrays[name] = (np.arange(np.prod(SHAPE), dtype=np.float32) * (seed + 1)).reshape(SHAPE)
        tensors[name] = (GGML_F32, tuple(reversed(SHAPE)), arrays[name].tobytes())
    write_gguf(path, tensors)
    return path, arrays


def check_arena(a, arrays, path):
    names = a.names()
    assert [os.fsencode(n) for n in names] == list(arrays)
    assert [os.fsencode(t["name"]) for t in a.tensors()] == list(arrays)
    assert os.fsencode(a.report["path"]) == os.fsencode(path)
    for name in names:
        assert name in a
        assert os.fsencode(a.info(name)["name"]) == os.fsencode(name)
        assert np.array_equal(a.numpy(name), arrays[os.fsencode(name)])
    # bytes name the same tensor as the str handed out
    assert np.array_equal(a._core.buffer(ODD_NAME, False),
                          a._core.buffer(os.fsdecode(ODD_NAME), False))


def test_non_utf8_model_path_and_tensor_name_round_trip(odd_model, shm_path):
    model, arrays = odd_model
    path = shm_path("non-utf8-\udcff")
    with expert_arena.open(model, shared_path=path, select_all=True, quiet=True) as a:
        check_arena(a, arrays, path)
        assert "\\xff" in a.report["start_line"]  # printable, never an exception
        with pytest.raises(KeyError) as unknown:
            a.numpy("nope\udcfe")
        assert unknown.value.args[0].startswith("no tensor nope\\xfe in the arena")
        with expert_arena.attach(os.fsencode(path), quiet=True) as b:
            check_arena(b, arrays, path)
    with pytest.raises(FileNotFoundError, match=r"\\xff"):
        expert_arena.attach(path + ".absent")


ATTACHER = textwrap.dedent("""
    import os, pickle, sys
    import numpy as np
    import expert_arena
    with expert_arena.attach(sys.argv[1], quiet=True) as a:
        print(ascii([os.fsencode(n) for n in a.names()]))
        print(ascii([os.fsencode(t["name"]) for t in a.tensors()]))
        print(ascii(os.fsencode(a.report["path"])))
        name = [n for n in a.names() if os.fsencode(n).endswith(b"\\xff")][0]
        print(float(np.asarray(a.numpy(name), dtype=np.float64).sum()))
        if sys.argv[2] == "torch":
            view = a.torch(name)
            back = pickle.loads(pickle.dumps(view))  # a reference: the path round-trips
            print(bool((back == view).all()), float(view.double().sum()))
""")


@pytest.mark.parametrize("view", ["numpy", "torch"])
def test_another_process_attaches_a_non_utf8_path(odd_model, shm_path, view):
    if view == "torch":
        pytest.importorskip("torch")
    model, arrays = odd_model
    path = shm_path("non-utf8-\udcff")
    with expert_arena.open(model, shared_path=path, select_all=True, quiet=True):
        out = subprocess.run([sys.executable, "-c", ATTACHER, path, view], env=child_env(),
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == ascii(list(arrays)) and lines[1] == ascii(list(arrays))
    assert lines[2] == ascii(os.fsencode(path))
    total = float(arrays[ODD_NAME].astype(np.float64).sum())
    assert float(lines[3]) == total
    if view == "torch":
        assert lines[4].split() == ["True", repr(total)]
