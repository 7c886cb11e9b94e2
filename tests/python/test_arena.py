"""Arenas from Python: open/attach, views (zero-copy, read-only, dtypes), lifetimes, errors."""

import gc
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import expert_arena
from conftest import arena_table, child_env, tool
from model_files import pattern, write_gguf, write_safetensors

torch = pytest.importorskip("torch") if os.environ.get("CI") != "true" else __import__("torch")


def mapped(path):
    """Whether this process maps `path` (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


def test_open_loads_then_attach_and_report(gen_model, shm_path):
    model = gen_model("gguf", "f16")
    path = shm_path()
    with expert_arena.open(model, shared_path=path, quiet=True) as a:
        r = a.report
        assert r["role"] == "loaded"
        assert r["path"] == path
        assert r["bytes_read"] > 0
        assert r["tensors"] == len(a) == 6
        for k in ("seconds", "huge_bytes", "data_bytes", "backing", "gpu", "start_line"):
            assert k in r
        assert "loaded" in r["start_line"] and path in r["start_line"]
        names = a.names()
        assert names[0] in a and "nope" not in a and 3 not in a
        assert list(a) == names
    with expert_arena.attach(path) as b:
        assert b.report["role"] == "attached"
        assert b.report["bytes_read"] == 0
        assert b.names() == names
    # A second open with the model attaches too, reading no tensor data.
    with expert_arena.open([model], shared_path=path, quiet=True) as c:
        assert c.report["role"] == "attached"


# What each emulated kernel (tests/kernel/kernel_profiles.sh) must make the report name.
_PROFILE_LACKS = {
    "linux-4.18": ["MADV_POPULATE_READ/WRITE", "PAGEMAP_SCAN"],
    "linux-5.10": ["MADV_POPULATE_READ/WRITE", "PAGEMAP_SCAN"],
    "linux-5.15": ["PAGEMAP_SCAN"],
    "linux-6.1": ["PAGEMAP_SCAN"],
    "docker": [],
    "podman": [],
}


def test_report_says_what_the_kernel_lacked(gen_model, shm_path):
    model = gen_model("gguf", "f16")
    path = shm_path()
    with expert_arena.open(model, shared_path=path, quiet=True) as a:
        k = a.report["kernel"]
        assert k["release"] == os.uname().release
        assert k["note"] == a.report["kernel_note"]
        for m in k["missing"]:
            assert set(m) == {"feature", "since", "answer", "fallback", "used", "seconds", "bytes"}
            if m["used"]:
                assert m["feature"] in k["note"] and m["answer"].split(":")[0] in k["note"]
        if k["note"]:
            assert k["note"] in a.report["start_line"]
    with expert_arena.attach(path) as b:
        used = {m["feature"] for m in b.report["kernel"]["missing"] if m["used"]}
        profile = os.environ.get("EXPERT_ARENA_KERNEL_PROFILE")
        if profile is None:
            return
        # The attach populated the mapping and read its 2 MiB share: what it used and the
        # kernel lacked is named, and nothing else.
        assert used == set(_PROFILE_LACKS[profile]), (profile, b.report["kernel"])


@pytest.mark.parametrize("fmt,dtype,np_dtype,torch_dtype", [
    ("gguf", "f32", np.float32, "float32"), ("gguf", "f16", np.float16, "float16"),
    ("gguf", "bf16", np.uint16, "bfloat16"), ("gguf", "q8_0", np.uint8, "uint8"),
    ("safetensors", "f32", np.float32, "float32"), ("safetensors", "f16", np.float16, "float16"),
    ("safetensors", "bf16", np.uint16, "bfloat16"),
])
def test_views_are_zero_copy_with_dtype_and_shape(gen_model, fmt, dtype, np_dtype, torch_dtype):
    model = gen_model(fmt, dtype, hidden=64, ffn=96, experts=4)
    with expert_arena.open(model, quiet=True) as a:
        start, size = a.data_range()
        for name in a.names():
            info = a.info(name)
            x = a.numpy(name)
            t = a.torch(name)
            assert x.dtype == np_dtype
            assert t.dtype == getattr(torch, torch_dtype)
            assert x.shape == tuple(t.shape) == info["array_shape"]
            # Zero copy: both views point into the arena's mapping, at the same address.
            ptr = x.__array_interface__["data"][0]
            assert start <= ptr and ptr + info["bytes"] <= start + size
            assert t.data_ptr() == ptr
            assert not x.flags.writeable and not x.flags.owndata
            assert expert_arena.xxh3_64(x) == info["checksum"]
            if fmt == "gguf":
                # ggml order: ne=[hidden, ffn, experts] (or [ffn, hidden, experts] for down).
                assert info["shape"] == tuple(reversed(info["array_shape"])) or dtype == "q8_0"
                if dtype == "q8_0":
                    rows, cols = info["shape"][2] * info["shape"][1], info["shape"][0]
                    assert x.shape == (info["shape"][2], info["shape"][1], cols // 32 * 34)
                    assert x.size == rows * cols // 32 * 34
            else:
                assert info["shape"] == info["array_shape"]
            if dtype == "bf16":
                # The NumPy uint16 view and the torch bf16 view are the same numbers.
                as_f32 = torch.from_numpy((x.astype(np.int32) << 16)).view(torch.float32)
                assert torch.equal(as_f32, t.float())


def test_views_equal_the_model_files_bytes(gen_model, shm_path):
    """The bytes of a view are the model file's bytes at the offset the table names."""
    model = gen_model("gguf", "q8_0", layers=2, experts=4, hidden=128, ffn=256)
    path = shm_path()
    with expert_arena.open(model, shared_path=path, quiet=True):
        table = arena_table(path)
        with expert_arena.attach(path) as a:
            for row in table["tensors"]:
                x = a.numpy(row["name"])
                with open(table["sources"][row["source"]]["path"], "rb") as f:
                    f.seek(row["source_offset"])
                    assert x.tobytes() == f.read(row["bytes"])
                info = a.info(row["name"])
                assert info["file_offset"] == row["file_offset"]
                assert "%016x" % info["checksum"] == row["checksum"]
                assert list(info["shape"]) == row["shape"]


def test_safetensors_integer_bool_and_fp8_dtypes(tmp_path):
    values = {
        "I8": (np.int8, (3, 5)), "I16": (np.int16, (4, 3)), "I32": (np.int32, (2, 7)),
        "I64": (np.int64, (5,)), "U8": (np.uint8, (9, 2)), "U16": (np.uint16, (6,)),
        "U32": (np.uint32, (3,)), "U64": (np.uint64, (2, 2)), "F64": (np.float64, (3, 3)),
        "BOOL": (np.bool_, (10,)), "F8_E4M3": (np.uint8, (4, 4)), "F8_E5M2": (np.uint8, (8,)),
    }
    arrays, tensors = {}, {}
    for i, (dtype, (np_dtype, shape)) in enumerate(values.items()):
        raw = pattern(int(np.prod(shape)) * np.dtype(np_dtype).itemsize, i)
        if dtype == "BOOL":
            raw = bytes(b & 1 for b in raw)
        arrays[dtype] = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
        tensors["t.%s" % dtype] = (dtype, shape, raw)
    model = str(tmp_path / "ints.safetensors")
    write_safetensors(model, tensors)
    with expert_arena.open(model, select_all=True, quiet=True) as a:
        assert len(a) == len(values)
        for dtype, expected in arrays.items():
            x = a.numpy("t.%s" % dtype)
            assert x.dtype == expected.dtype and x.shape == expected.shape
            assert np.array_equal(x, expected)
            t = a.torch("t.%s" % dtype)
            assert tuple(t.shape) == expected.shape
            assert t.element_size() == expected.dtype.itemsize
            # Same bits whatever torch type carries them (uint16 is int16 before torch 2.3,
            # FP8 is uint8 before torch 2.1).
            assert bytes(t.contiguous().view(torch.uint8).numpy()) == expected.tobytes()
        assert a.torch("t.I32").dtype == torch.int32
        assert a.torch("t.BOOL").dtype == torch.bool
        f8 = a.torch("t.F8_E4M3").dtype
        assert f8 == getattr(torch, "float8_e4m3fn", torch.uint8)


def test_gguf_block_quantized_and_integer_types(tmp_path):
    q4k = pattern(3 * 2 * 144, 7)         # q4_K: 256 values in 144 bytes; ne=[512, 3]
    i8 = pattern(20, 8)
    f32 = np.arange(12, dtype=np.float32)
    model = str(tmp_path / "quant.gguf")
    write_gguf(model, {"w.q4k": (12, [512, 3], q4k), "w.i8": (24, [5, 4], i8),
                       "w.f32": (0, [6, 2], f32.tobytes())})
    with expert_arena.open(model, select_all=True, quiet=True) as a:
        info = a.info("w.q4k")
        assert info["dtype"] == "q4_k" and info["shape"] == (512, 3) and info["raw"]
        x = a.numpy("w.q4k")
        assert x.dtype == np.uint8 and x.shape == (3, 288) and x.tobytes() == q4k
        assert a.torch("w.q4k").shape == (3, 288)
        assert np.array_equal(a.numpy("w.i8"), np.frombuffer(i8, np.int8).reshape(4, 5))
        assert np.array_equal(a.numpy("w.f32"), f32.reshape(2, 6))
        assert torch.equal(a.torch("w.f32"), torch.from_numpy(f32.reshape(2, 6)))


def test_writing_through_a_guarded_view_raises_and_the_file_is_unchanged(gen_model, shm_path):
    """NumPy views are flagged read-only; torch views made with guard=True refuse in-place
    ops (test_views.py: what a write through the default, plain view does)."""
    model = gen_model("gguf", "f32")
    path = shm_path()
    with expert_arena.open(model, shared_path=path, quiet=True) as a:
        name = a.names()[0]
        before = a.info(name)["checksum"]
        x, t = a.numpy(name), a.torch(name, guard=True)
        with pytest.raises(ValueError):
            x[0, 0, 0] = 1.0
        with pytest.raises(ValueError):
            x.flags.writeable = True
        attempts = [lambda: t.add_(1), lambda: t.zero_(), lambda: t.__setitem__(0, 1.0),
                    lambda: t[1].fill_(3), lambda: t.view(-1).copy_(torch.zeros(t.numel())),
                    lambda: torch.add(t, 1, out=t), lambda: t[0].t().mul_(2),
                    lambda: t.numpy().__setitem__((0, 0, 0), 1.0),
                    lambda: t.as_subclass(torch.Tensor).add_(1),
                    lambda: t[0].as_subclass(torch.Tensor).fill_(0)]
        for attempt in attempts:
            with pytest.raises(ValueError):
                attempt()
        # Reading, and operations that make new tensors, work and give plain tensors.
        y = t * 2 + 1
        assert type(y) is torch.Tensor and y.data_ptr() != t.data_ptr()
        y.add_(1)
        assert float(t.sum()) == pytest.approx(float(x.sum(dtype=np.float64)), rel=1e-5)
        assert expert_arena.xxh3_64(x) == before
    with open(path, "rb") as f:
        f.seek(a_info_offset(path, name))
        raw = f.read(x.nbytes)
    assert expert_arena.xxh3_64(np.frombuffer(raw, np.uint8)) == before


def a_info_offset(path, name):
    with expert_arena.attach(path) as a:
        return a.info(name)["file_offset"]


def test_a_view_outlives_close(gen_model, shm_path):
    model = gen_model("gguf", "f16")
    path = shm_path()
    a = expert_arena.open(model, shared_path=path, quiet=True)
    name = a.names()[-1]
    x, t = a.numpy(name), a.torch(name)
    expected = x.astype(np.float64).sum()
    a.close()
    a.close()  # idempotent
    assert a.closed
    with pytest.raises(ValueError, match="closed"):
        a.numpy(name)
    with pytest.raises(ValueError, match="closed"):
        len(a)
    # The views still read the mapping, which stays until they are gone.
    assert mapped(path)
    assert x.astype(np.float64).sum() == expected
    assert float(t.double().sum()) == pytest.approx(expected)
    derived = t[0]
    del x, t
    gc.collect()
    assert mapped(path)  # a view derived from a view keeps it too
    assert torch.isfinite(derived.double().sum())
    del derived
    gc.collect()
    assert not mapped(path)


def test_with_block_and_views_in_another_thread(gen_model):
    model = gen_model("gguf", "f32")
    with expert_arena.open(model, quiet=True) as a:
        views = [a.numpy(n) for n in a.names()]
    sums = []
    th = threading.Thread(target=lambda: sums.extend(float(v.sum()) for v in views))
    th.start()
    th.join()
    assert len(sums) == len(views)


def test_missing_tensor_is_a_key_error(gen_model):
    with expert_arena.open(gen_model("gguf", "f32"), quiet=True) as a:
        with pytest.raises(KeyError, match="no tensor nope"):
            a.numpy("nope")
        with pytest.raises(KeyError):
            a.info("nope")


def test_errors_are_python_exceptions_with_the_library_message(gen_model, shm_path, tmp_path):
    missing = shm_path()
    with pytest.raises(FileNotFoundError, match=missing) as e:
        expert_arena.attach(missing)
    assert e.value.errno == 2
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        expert_arena.open(str(tmp_path / "nope.gguf"), quiet=True)
    html = tmp_path / "page.gguf"
    html.write_bytes(b"<!DOCTYPE html><html><body>not a model</body></html>" * 10)
    with pytest.raises(ValueError, match="page.gguf"):
        expert_arena.open(str(html), quiet=True)
    with pytest.raises(ValueError, match="format"):
        expert_arena.open(str(html), format="pickle", quiet=True)
    # Raw bytes only when asked for: one u8 tensor named after the file.
    with expert_arena.open(str(html), format="raw", quiet=True) as raw:
        assert len(raw) == 1
        assert raw.numpy(raw.names()[0]).tobytes() == html.read_bytes()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0) + b"\0" * 64)
    with pytest.raises(ValueError, match="damaged.gguf"):
        expert_arena.open(str(damaged), quiet=True)
    not_arena = tmp_path / "x.arena"
    not_arena.write_bytes(b"\0" * 8192)
    with pytest.raises(ValueError, match="x.arena"):
        expert_arena.attach(str(not_arena))
    with pytest.raises(ValueError, match="huge"):
        expert_arena.open(gen_model("gguf", "f32"), huge="sometimes", quiet=True)
    assert issubclass(expert_arena.BusyError, OSError)
    assert issubclass(expert_arena.NoSpaceError, OSError)


def test_busy_when_another_models_arena_is_in_use(gen_model, shm_path):
    path = shm_path()
    holder = subprocess.Popen([tool("expert-arena"), "load", "--model", gen_model("gguf", "f32"),
                               "--arena", path, "--hold", "--json"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        holder.stdout.readline()  # loaded and mapped
        with pytest.raises(expert_arena.BusyError, match=path) as e:
            expert_arena.open(gen_model("gguf", "f16"), shared_path=path, quiet=True)
        assert e.value.errno == 16
    finally:
        holder.stdin.close()
        holder.wait(30)


def test_foreign_owner_is_a_permission_error(gen_model, shm_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the arena file to another user")
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True):
        pass
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match=path):
        expert_arena.attach(path)
    with expert_arena.attach(path, allow_foreign_owner=True) as a:
        assert a.report["role"] == "attached"


def test_wait_timeout_is_a_timeout_error_and_open_releases_the_gil(gen_model, shm_path):
    """A C++ loader holds FILL (sleeping before it publishes): open() waits without the GIL
    (another Python thread keeps running) and gives up with TimeoutError."""
    path = shm_path()
    model = gen_model("gguf", "f32")
    loader = subprocess.Popen([tool("python_peer"), "slow-load", "30", path, model],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert loader.stdout.readline().strip() == "publishing"
        ticks = [0]
        done = threading.Event()

        def spin():
            while not done.is_set():
                ticks[0] += 1
                time.sleep(0.001)

        spinner = threading.Thread(target=spin)
        spinner.start()
        try:
            with pytest.raises(TimeoutError, match=path) as e:
                expert_arena.open(model, shared_path=path, wait_timeout=1.0, quiet=True)
        finally:
            done.set()
            spinner.join()
        assert e.value.errno == 110
        assert ticks[0] > 10, "the waiting open() held the GIL"
    finally:
        loader.kill()
        loader.wait(30)


@pytest.mark.parametrize("timeout", [float("inf"), 1e10])
def test_an_unlimited_wait_timeout_waits_for_the_loader(gen_model, shm_path, timeout):
    """wait_timeout=inf (or one too large for the clock) waits without a limit: it once made a
    deadline in the past (an out-of-range conversion) and timed out within seconds. A loader
    holds FILL for 4 s; the open waits for it and attaches to what it published."""
    path = shm_path()
    model = gen_model("gguf", "f32")
    loader = subprocess.Popen([tool("python_peer"), "slow-load", "4", path, model],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert loader.stdout.readline().strip() == "publishing"
        with expert_arena.open(model, shared_path=path, wait_timeout=timeout, quiet=True) as a:
            assert a.report["role"] == "attached"
        assert loader.wait(60) == 0, loader.stderr.read()
    finally:
        loader.kill()
        loader.wait(30)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="wait_timeout"):
            expert_arena.open(model, shared_path=path, wait_timeout=bad, quiet=True)


@pytest.mark.parametrize("mode", [0o4777, 0o2660, 0o1600, 0o700, 0o744])
def test_a_mode_with_bits_outside_0o666_is_refused(gen_model, shm_path, mode):
    """setuid, setgid, sticky and execute bits on a file any engine writes through a mapping:
    a root engine once made -rwsrwxrwx in /dev/shm. Refused before any file is made."""
    path = shm_path()
    with pytest.raises(ValueError, match="file_mode 0%o has bits outside 0666" % mode):
        expert_arena.open(gen_model("gguf", "f32"), shared_path=path, file_mode=mode, quiet=True)
    assert not os.path.exists(path)


def test_a_world_writable_arena_only_when_asked_for_by_name(gen_model, shm_path):
    """A mode that lets every user write the arena (0o666), and attaching to a file that every
    user may write (chmod after it was made), are refused with the reason and the fix unless
    allow_world_writable=True."""
    model = gen_model("gguf", "f32")
    path = shm_path()
    with pytest.raises(ValueError, match="lets every user write the arena.*allow_world_writable"):
        expert_arena.open(model, shared_path=path, file_mode=0o666, quiet=True)
    assert not os.path.exists(path)
    with expert_arena.open(model, shared_path=path, file_mode=0o666, allow_world_writable=True,
                           quiet=True) as a:
        assert a.report["role"] == "loaded"
        assert os.stat(path).st_mode & 0o7777 == 0o666
    os.chmod(path, 0o600)
    with expert_arena.open(model, shared_path=path, quiet=True) as a:
        assert a.report["role"] == "attached"
    os.chmod(path, 0o646)  # made by hand: any user may now change every engine's bytes
    with pytest.raises(PermissionError, match=r"mode 0646: any user may write it.*chmod o-w"):
        expert_arena.open(model, shared_path=path, quiet=True)
    with pytest.raises(PermissionError, match="any user may write it"):
        expert_arena.attach(path)
    with expert_arena.attach(path, allow_world_writable=True) as a:
        assert a.report["role"] == "attached"
    os.chmod(path, 0o4600)  # a setuid bit is refused whatever is allowed
    with pytest.raises(PermissionError, match="setuid, setgid, sticky or execute"):
        expert_arena.attach(path, allow_world_writable=True)


def test_nospace_error_in_strict_streaming(stream_dir):
    with expert_arena.StreamProducer(stream_dir, "strict", segment_bytes=2 << 20, max_segments=1,
                                     strict=True, strict_wait_seconds=0.2, grow_ahead=False,
                                     quiet=True) as p:
        held = p.put("a", np.zeros(1536 << 10, np.uint8))
        assert held
        with pytest.raises(expert_arena.NoSpaceError) as e:
            p.put("b", np.zeros(1536 << 10, np.uint8))
        assert e.value.errno == 28


def test_torch_missing_raises_an_import_error_naming_the_package(gen_model, tmp_path):
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "import expert_arena, numpy\n"
        "a = expert_arena.open(sys.argv[1], quiet=True)\n"
        "n = a.names()[0]\n"
        "assert a.numpy(n).size > 0\n"
        "exec('from expert_arena import *', {})\n"  # star import needs no torch
        "assert list(a.keys()) == a.names()\n"
        "try:\n"
        "    a.torch(n)\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", script, gen_model("gguf", "f32")],
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout
    assert "ImportError:" in out.stdout and "python3-torch" in out.stdout


def test_version_and_module_info(gen_model, shm_path):
    assert expert_arena.__version__.count(".") == 2
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "q8_0"), shared_path=path, quiet=True):
        pass
    out = subprocess.run([sys.executable, "-m", "expert_arena", "info", path],
                         env=child_env(), stdout=subprocess.PIPE, text=True, timeout=60)
    assert out.returncode == 0
    assert "attached" in out.stdout and "blk.0.ffn_up_exps.weight" in out.stdout
    out = subprocess.run([sys.executable, "-m", "expert_arena", "info", "--json", path],
                         env=child_env(), stdout=subprocess.PIPE, text=True, timeout=60)
    import json
    j = json.loads(out.stdout)
    assert j["report"]["role"] == "attached" and len(j["tensors"]) == 6
    out = subprocess.run([sys.executable, "-m", "expert_arena", "info", path + ".absent"],
                         env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, timeout=60)
    assert out.returncode == 1 and "No such file" in out.stderr


def test_an_arena_used_in_a_forked_child_reads_and_its_close_leaves_the_parents(gen_model,
                                                                                shm_path):
    # The child inherits the mappings and the fd (the same open file description, so the same
    # OFD USER lock): it reads, and its close unmaps its copies without releasing the lock the
    # parent's engine holds.
    path = shm_path()
    with expert_arena.open(gen_model("gguf", "f32"), shared_path=path, quiet=True) as a:
        sums = {n: expert_arena.xxh3_64(a.numpy(n)) for n in a.names()}
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                ok = all(expert_arena.xxh3_64(a.numpy(n)) == s for n, s in sums.items())
                ok = ok and all(expert_arena.xxh3_64(a.torch(n).numpy()) == s
                                for n, s in sums.items())
                a.close()
                with expert_arena.attach(path) as own:  # the child's own attach, closed
                    ok = ok and all(expert_arena.xxh3_64(own.numpy(n)) == s
                                    for n, s in sums.items())
                code = 0 if ok else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert {n: expert_arena.xxh3_64(a.numpy(n)) for n in a.names()} == sums
        held = subprocess.run([tool("expert-arena"), "rm", path], capture_output=True,
                              text=True, env=child_env())
        assert held.returncode != 0 and os.path.exists(path), held.stdout + held.stderr
    gone = subprocess.run([tool("expert-arena"), "rm", path], capture_output=True, text=True,
                          env=child_env())
    assert gone.returncode == 0 and not os.path.exists(path), gone.stdout + gone.stderr
