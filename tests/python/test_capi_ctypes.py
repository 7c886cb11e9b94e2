"""The C ABI from Python through ctypes (what engines without the package use): attach with
libexpert_arena.so, read a tensor, and compare it with the model file and with the package;
stream tensors through the C ABI to and from the package in other processes; and the C
program's stream roles against the package's and the C++ peer's."""

import ctypes
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import expert_arena
from conftest import BUILD, ROLES, arena_table, child_env, consume, start_producer


class OpenParams(ctypes.Structure):
    """ea_open_params of include/expert_arena/expert_arena.h (same order, same types)."""
    _fields_ = [("size", ctypes.c_size_t), ("model_files", ctypes.POINTER(ctypes.c_char_p)),
                ("model_file_count", ctypes.c_size_t), ("select", ctypes.c_char_p),
                ("select_all", ctypes.c_int), ("shared_path", ctypes.c_char_p),
                ("attach_only", ctypes.c_int), ("wait_timeout_seconds", ctypes.c_double),
                ("huge_pages", ctypes.c_int), ("gpu", ctypes.c_char_p),
                ("gpu_required", ctypes.c_int), ("file_mode", ctypes.c_uint32),
                ("allow_foreign_owner", ctypes.c_int), ("quiet", ctypes.c_int),
                ("format", ctypes.c_int)]


class TensorView(ctypes.Structure):
    """ea_tensor_view."""
    _fields_ = [("size", ctypes.c_size_t), ("name", ctypes.c_char_p),
                ("dtype", ctypes.c_char_p), ("shape", ctypes.POINTER(ctypes.c_uint64)),
                ("ndim", ctypes.c_uint32), ("data", ctypes.c_void_p), ("bytes", ctypes.c_uint64),
                ("file_offset", ctypes.c_uint64), ("checksum", ctypes.c_uint64)]


def open_library(params_type):
    """libexpert_arena.so of the build through ctypes, ea_arena_open taking `params_type` (a
    Structure of ea_open_params up to the fields the test uses); fails in CI when not built."""
    path = os.path.join(BUILD, "lib", "libexpert_arena.so")
    if not os.path.exists(path):
        if os.environ.get("CI") == "true":
            pytest.fail("%s is not built" % path)
        pytest.skip("%s is not built" % path)
    lib = ctypes.CDLL(path)
    lib.ea_open_params_init_sized.argtypes = [ctypes.POINTER(params_type), ctypes.c_size_t]
    lib.ea_arena_open.argtypes = [ctypes.POINTER(params_type), ctypes.POINTER(ctypes.c_void_p)]
    lib.ea_arena_close.argtypes = [ctypes.c_void_p]
    lib.ea_last_error.restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def lib():
    lib = open_library(OpenParams)
    lib.ea_arena_find.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(TensorView)]
    return lib


def ctypes_attach(lib, path):
    params = OpenParams()
    lib.ea_open_params_init_sized(ctypes.byref(params), ctypes.sizeof(params))
    params.shared_path = os.fsencode(path)
    params.attach_only = 1
    params.quiet = 1
    handle = ctypes.c_void_p()
    rc = lib.ea_arena_open(ctypes.byref(params), ctypes.byref(handle))
    return rc, handle


def test_ctypes_reads_an_expert_of_a_gguf_model(lib, gen_model, shm_path):
    model = gen_model("gguf", "q8_0", layers=2, experts=4, hidden=128, ffn=256)
    path = shm_path()
    with expert_arena.open(model, shared_path=path, quiet=True) as arena:
        rc, handle = ctypes_attach(lib, path)
        assert rc == 0, lib.ea_last_error()
        try:
            view = TensorView()
            view.size = ctypes.sizeof(TensorView)
            name = "blk.1.ffn_down_exps.weight"
            assert lib.ea_arena_find(handle, name.encode(), ctypes.byref(view)) == 0
            assert view.dtype == b"q8_0"
            assert [view.shape[i] for i in range(view.ndim)] == [256, 128, 4]
            data = ctypes.string_at(view.data, view.bytes)
            row = [t for t in arena_table(path)["tensors"] if t["name"] == name][0]
            with open(arena_table(path)["sources"][row["source"]]["path"], "rb") as f:
                f.seek(row["source_offset"])
                assert data == f.read(row["bytes"])
            assert view.checksum == int(row["checksum"], 16)
            # The package reads the same bytes at the same file offset.
            assert arena.numpy(name).tobytes() == data
            assert arena.info(name)["file_offset"] == view.file_offset
        finally:
            lib.ea_arena_close(handle)


def test_ctypes_reports_a_missing_arena(lib, shm_path):
    path = shm_path()
    rc, _ = ctypes_attach(lib, path)
    assert rc == -2
    assert path.encode() in lib.ea_last_error()


def test_ctypes_refuses_a_mode_with_special_bits_and_a_world_writable_file(lib, gen_model,
                                                                         shm_path):
    """file_mode with a setuid or execute bit, or write for every user, is -EINVAL naming the
    mode; attaching to a file every user may write is -EACCES."""
    model = gen_model("gguf", "f32")
    path = shm_path()
    files = (ctypes.c_char_p * 1)(os.fsencode(model))
    for mode, says in ((0o4777, b"file_mode 04777 has bits outside 0666"),
                       (0o666, b"file_mode 0666 lets every user write the arena")):
        params = OpenParams()
        lib.ea_open_params_init_sized(ctypes.byref(params), ctypes.sizeof(params))
        params.model_files = files
        params.model_file_count = 1
        params.shared_path = os.fsencode(path)
        params.file_mode = mode
        params.quiet = 1
        handle = ctypes.c_void_p()
        assert lib.ea_arena_open(ctypes.byref(params), ctypes.byref(handle)) == -22
        assert says in lib.ea_last_error()
        assert not os.path.exists(path)
    with expert_arena.open(model, shared_path=path, quiet=True):
        pass
    os.chmod(path, 0o666)
    rc, _ = ctypes_attach(lib, path)
    assert rc == -13
    assert b"any user may write it" in lib.ea_last_error()


# ---- tensor streaming through the C ABI (expert_arena_stream.h) ----------------------------

DESCRIPTOR_MAX = 4096  # EA_STREAM_DESCRIPTOR_MAX


class StreamParams(ctypes.Structure):
    """ea_stream_params."""
    _fields_ = [("size", ctypes.c_size_t), ("directory", ctypes.c_char_p),
                ("logical_name", ctypes.c_char_p), ("segment_bytes", ctypes.c_uint64),
                ("max_segments", ctypes.c_uint32), ("block_alignment", ctypes.c_uint64),
                ("spill_directory", ctypes.c_char_p), ("strict", ctypes.c_int),
                ("strict_wait_seconds", ctypes.c_double), ("huge_pages", ctypes.c_int),
                ("gpu", ctypes.c_char_p), ("pin_budget_bytes", ctypes.c_uint64),
                ("copy_threads", ctypes.c_uint32), ("non_temporal_copy_from", ctypes.c_uint64),
                ("grow_ahead", ctypes.c_int), ("warning_interval_seconds", ctypes.c_double),
                ("sweep_at_start", ctypes.c_int), ("allow_foreign_owner", ctypes.c_int),
                ("quiet", ctypes.c_int)]


class StreamStats(ctypes.Structure):
    """ea_stream_stats."""
    _fields_ = [("size", ctypes.c_size_t)] + [(name, ctypes.c_uint64) for name in (
        "total_bytes", "free_bytes", "largest_free_block", "segments", "dedicated_segments",
        "live_blocks", "pinned_bytes", "spills", "spill_files", "fragmentation_failures",
        "reclaimed_blocks", "dead_readers_cleared", "segments_grown_ahead")]


class StreamTensorInfo(ctypes.Structure):
    """ea_stream_tensor_info."""
    _fields_ = [("size", ctypes.c_size_t), ("data", ctypes.c_void_p),
                ("bytes", ctypes.c_uint64), ("key", ctypes.c_char_p), ("dtype", ctypes.c_char_p),
                ("shape", ctypes.POINTER(ctypes.c_uint64)), ("ndim", ctypes.c_uint32),
                ("spilled", ctypes.c_int)]


class StreamPutItem(ctypes.Structure):
    """ea_stream_put_item."""
    _fields_ = [("size", ctypes.c_size_t), ("key", ctypes.c_char_p), ("data", ctypes.c_void_p),
                ("bytes", ctypes.c_uint64), ("dtype", ctypes.c_char_p),
                ("shape", ctypes.POINTER(ctypes.c_uint64)), ("ndim", ctypes.c_uint32)]


@pytest.fixture(scope="module")
def slib(lib):
    """The stream calls' signatures on the same library."""
    P, vp, u64, u32, sz = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, \
        ctypes.c_size_t
    pvp, psz = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.ea_stream_params_init_sized.argtypes = [ctypes.POINTER(StreamParams), sz]
    lib.ea_stream_params_init_sized.restype = None
    for name in ("ea_stream_producer_create", "ea_stream_consumer_create"):
        getattr(lib, name).argtypes = [ctypes.POINTER(StreamParams), pvp]
    for name in ("ea_stream_producer_destroy", "ea_stream_consumer_destroy",
                 "ea_stream_release", "ea_stream_reservation_destroy"):
        getattr(lib, name).argtypes = [P]
        getattr(lib, name).restype = None
    lib.ea_stream_put.argtypes = [P, ctypes.c_char_p, vp, u64, ctypes.c_char_p, u64p, u32, u32,
                                  vp, sz, psz]
    lib.ea_stream_put_many.argtypes = [P, ctypes.POINTER(StreamPutItem), sz, u32, vp, sz, psz,
                                       psz]
    lib.ea_stream_reserve.argtypes = [P, ctypes.c_char_p, u64, pvp, pvp]
    lib.ea_stream_publish.argtypes = [P, ctypes.c_char_p, u64p, u32, u32, vp, sz, psz]
    lib.ea_stream_reclaim.argtypes = [P]
    lib.ea_stream_get_stats.argtypes = [P, ctypes.POINTER(StreamStats)]
    lib.ea_stream_open.argtypes = [P, vp, sz, pvp]
    lib.ea_stream_tensor_get_info.argtypes = [P, ctypes.POINTER(StreamTensorInfo)]
    return lib


def needs_torch():
    """stream_roles.py reads bf16 through torch: skipped without it, except in CI."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("torch")


def stream_params(lib, directory, **fields):
    p = StreamParams()
    lib.ea_stream_params_init_sized(ctypes.byref(p), ctypes.sizeof(p))
    p.directory = os.fsencode(directory)
    p.logical_name = b"ctypes"
    p.segment_bytes = 8 << 20
    p.max_segments = 4
    p.sweep_at_start = 0
    p.quiet = 1
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def ctypes_producer(lib, directory):
    handle = ctypes.c_void_p()
    rc = lib.ea_stream_producer_create(ctypes.byref(stream_params(lib, directory)),
                                       ctypes.byref(handle))
    assert rc == 0, lib.ea_last_error()
    return handle


def ctypes_put(lib, producer, key, array, dtype):
    raw = np.ascontiguousarray(array)
    shape = (ctypes.c_uint64 * max(raw.ndim, 1))(*raw.shape)
    buf = ctypes.create_string_buffer(DESCRIPTOR_MAX)
    n = ctypes.c_size_t()
    rc = lib.ea_stream_put(producer, key.encode(), raw.ctypes.data, raw.nbytes, dtype.encode(),
                           shape, raw.ndim, 1, buf, len(buf), ctypes.byref(n))
    assert rc == 0, lib.ea_last_error()
    return buf.raw[:n.value]


def live_blocks(lib, producer):
    assert lib.ea_stream_reclaim(producer) == 0
    stats = StreamStats()
    stats.size = ctypes.sizeof(stats)
    assert lib.ea_stream_get_stats(producer, ctypes.byref(stats)) == 0, lib.ea_last_error()
    return stats.live_blocks


def checksum(raw):
    return "%016x" % expert_arena.xxh3_64(np.frombuffer(raw, np.uint8))


def shape_text(shape):
    return ",".join(str(d) for d in shape) or "-"


def test_ctypes_streams_to_the_package_consumer_in_another_process(slib, stream_dir):
    """A producer made through the C ABI from Python; a Python process with the package opens
    its descriptors bit-exact, and its releases give the space back."""
    needs_torch()
    lib = slib
    rng = np.random.default_rng(7)
    cases = [("ct-f32", rng.standard_normal((7, 3, 2)).astype(np.float32), "f32"),
             ("ct-f16", rng.standard_normal((9, 4)).astype(np.float16), "f16"),
             ("ct-i8", rng.integers(-128, 128, (3, 17), dtype=np.int8), "i8"),
             ("ct-u8", rng.integers(0, 256, 257, dtype=np.uint8), "u8"),
             ("ct-bf16", rng.integers(0, 1 << 16, (4, 11), dtype=np.uint16), "bf16"),
             ("ct-big", rng.standard_normal((512, 1024)).astype(np.float32), "f32")]
    producer = ctypes_producer(lib, stream_dir)
    try:
        sent = []
        for key, array, dtype in cases:
            d = ctypes_put(lib, producer, key, array, dtype)
            sent.append((key, dtype, shape_text(array.shape), checksum(array.tobytes()), d))
        # One written in place: reserve, fill the C pointer, publish.
        reservation, at = ctypes.c_void_p(), ctypes.c_void_p()
        payload = rng.integers(0, 256, 4096, dtype=np.uint8)
        assert lib.ea_stream_reserve(producer, b"ct-in-place", payload.nbytes,
                                     ctypes.byref(reservation), ctypes.byref(at)) == 0
        ctypes.memmove(at, payload.ctypes.data, payload.nbytes)
        buf, n = ctypes.create_string_buffer(DESCRIPTOR_MAX), ctypes.c_size_t()
        shape = (ctypes.c_uint64 * 2)(64, 64)
        assert lib.ea_stream_publish(reservation, b"u8", shape, 2, 1, buf, len(buf),
                                     ctypes.byref(n)) == 0, lib.ea_last_error()
        lib.ea_stream_reservation_destroy(reservation)
        sent.append(("ct-in-place", "u8", "64,64", checksum(payload.tobytes()), buf.raw[:n.value]))
        assert live_blocks(lib, producer) == len(sent)

        out = subprocess.run([sys.executable, ROLES, "consume", stream_dir],
                             input="".join(s[4].hex() + "\n" for s in sent), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(),
                             timeout=120)
        assert out.returncode == 0, out.stderr
        got = [line.split() for line in out.stdout.splitlines()]
        assert got == [list(s[:4]) for s in sent]
        # Every block was released by the other process.
        assert live_blocks(lib, producer) == 0
    finally:
        lib.ea_stream_producer_destroy(producer)
    assert os.listdir(stream_dir) == []


def test_ctypes_consumer_opens_what_the_package_produced(slib, stream_dir):
    """The reverse: a package producer in another process, a C ABI consumer here."""
    needs_torch()
    lib = slib
    p = subprocess.Popen([sys.executable, ROLES, "produce", stream_dir], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=child_env())
    consumer = ctypes.c_void_p()
    try:
        rows = []
        for line in p.stdout:
            if line.strip() == "ready":
                break
            rows.append(line.split())
        assert len(rows) >= 15
        assert lib.ea_stream_consumer_create(ctypes.byref(stream_params(lib, stream_dir)),
                                             ctypes.byref(consumer)) == 0, lib.ea_last_error()
        for key, dtype, shape, xxh, hex_descriptor in rows:
            d = bytes.fromhex(hex_descriptor)
            tensor = ctypes.c_void_p()
            assert lib.ea_stream_open(consumer, d, len(d), ctypes.byref(tensor)) == 0, \
                lib.ea_last_error()
            info = StreamTensorInfo()
            info.size = ctypes.sizeof(info)
            assert lib.ea_stream_tensor_get_info(tensor, ctypes.byref(info)) == 0
            got = [info.key.decode(), info.dtype.decode(),
                   shape_text([info.shape[i] for i in range(info.ndim)]),
                   checksum(ctypes.string_at(info.data, info.bytes))]
            lib.ea_stream_release(tensor)
            assert got == [key, dtype, shape, xxh]
        # A descriptor the producer never made: refused with the reason, nothing mapped.
        garbage = bytes(range(64))
        tensor = ctypes.c_void_p()
        assert lib.ea_stream_open(consumer, garbage, len(garbage), ctypes.byref(tensor)) == -22
        assert b"tensor descriptor refused" in lib.ea_last_error()
    finally:
        lib.ea_stream_consumer_destroy(consumer)
        p.stdin.close()
        p.wait(30)
    assert os.listdir(stream_dir) == []


def test_ctypes_stream_errors_carry_the_library_message(slib, stream_dir):
    lib = slib
    producer = ctypes_producer(lib, stream_dir)
    try:
        data = np.zeros(16, np.uint8)
        buf, n = ctypes.create_string_buffer(DESCRIPTOR_MAX), ctypes.c_size_t()
        rc = lib.ea_stream_put(producer, b"bad\x01key", data.ctypes.data, 16, b"u8", None, 0, 1,
                               buf, len(buf), ctypes.byref(n))
        assert rc == -22 and b"control" in lib.ea_last_error()
        # A buffer too small: -ERANGE with the size needed, nothing reserved; that size works.
        small = ctypes.create_string_buffer(8)
        rc = lib.ea_stream_put(producer, b"k", data.ctypes.data, 16, b"u8", None, 0, 1, small,
                               len(small), ctypes.byref(n))
        assert rc == -34 and n.value > 8 and live_blocks(lib, producer) == 0
        exact = ctypes.create_string_buffer(n.value)
        assert lib.ea_stream_put(producer, b"k", data.ctypes.data, 16, b"u8", None, 0, 1, exact,
                                 len(exact), ctypes.byref(n)) == 0
        assert n.value <= len(exact)
        decoded = expert_arena.decode_descriptor(exact.raw[:n.value])
        assert decoded["key"] == "k" and decoded["dtype"] == "u8"
    finally:
        lib.ea_stream_producer_destroy(producer)
    assert os.listdir(stream_dir) == []


# The C program's produce and consume roles against the package's (stream_roles.py) and the
# C++ peer's (python_peer): one protocol, every pairing with a C side (conftest's peers).


@pytest.mark.parametrize("producer,consumer",
                         [("c", "c"), ("c", "py"), ("py", "c"), ("c", "cxx"), ("cxx", "c")])
def test_c_program_streams_with_python_and_cxx_processes(stream_dir, producer, consumer):
    if "py" in (producer, consumer):
        needs_torch()
    p, rows = start_producer(producer, stream_dir)
    try:
        got = consume(consumer, stream_dir, [r[4] for r in rows])
    finally:
        p.stdin.close()
        p.wait(30)
    assert p.returncode == 0
    assert len(got) == len(rows) >= 9
    for sent, received in zip(rows, got):
        assert received[0] != "error", received
        assert received == sent[:4]  # key, dtype, shape, xxh3 of the bytes
    assert os.listdir(stream_dir) == []


def test_ctypes_put_many_opens_in_the_package_consumer(slib, stream_dir):
    """A batch through ea_stream_put_many, all or none, opened by the package's consumer."""
    lib = slib
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int64)]
    items = (StreamPutItem * 2)()
    shapes = []
    for i, (item, a) in enumerate(zip(items, arrays)):
        shapes.append((ctypes.c_uint64 * a.ndim)(*a.shape))
        item.size = ctypes.sizeof(StreamPutItem)
        item.key = b"batch-%d" % i
        item.data = a.ctypes.data
        item.bytes = a.nbytes
        item.dtype = b"f32" if i == 0 else b"i64"
        item.shape = shapes[-1]
        item.ndim = a.ndim
    buf = ctypes.create_string_buffer(2 * DESCRIPTOR_MAX)
    lens, total = (ctypes.c_size_t * 2)(), ctypes.c_size_t()
    producer = ctypes_producer(lib, stream_dir)
    consumer = expert_arena.StreamConsumer(stream_dir, quiet=True)
    try:
        items[1].key = b"bad\x01"  # refuses the whole batch, naming the item
        assert lib.ea_stream_put_many(producer, items, 2, 1, buf, len(buf), lens,
                                      ctypes.byref(total)) == -22
        assert b"item 1" in lib.ea_last_error() and live_blocks(lib, producer) == 0
        items[1].key = b"batch-1"
        assert lib.ea_stream_put_many(producer, items, 2, 1, buf, len(buf), lens,
                                      ctypes.byref(total)) == 0, lib.ea_last_error()
        assert lens[0] + lens[1] == total.value
        at = 0
        for i, a in enumerate(arrays):
            with consumer.open(buf.raw[at:at + lens[i]]) as t:
                assert t.key == "batch-%d" % i and tuple(t.shape) == a.shape
                assert np.array_equal(t.numpy(), a)
            at += lens[i]
        assert live_blocks(lib, producer) == 0
    finally:
        consumer.close()
        lib.ea_stream_producer_destroy(producer)
    assert os.listdir(stream_dir) == []


class RemoteStreamParams(ctypes.Structure):
    """ea_stream_params with the fields added for streams across hosts."""
    _fields_ = StreamParams._fields_ + [
        ("lease_check_seconds", ctypes.c_double), ("listen", ctypes.c_char_p),
        ("listen_token", ctypes.c_char_p), ("remote_lease_seconds", ctypes.c_double),
        ("remote_timeout_seconds", ctypes.c_double)]


class RemotePendingBlock(ctypes.Structure):
    """ea_stream_pending_block."""
    _fields_ = [("size", ctypes.c_size_t), ("key", ctypes.c_char_p), ("state", ctypes.c_char_p),
                ("segment", ctypes.c_char_p), ("age_seconds", ctypes.c_double),
                ("readers_left", ctypes.c_uint32), ("holders", ctypes.c_uint32),
                ("bytes", ctypes.c_uint64), ("spilled", ctypes.c_int),
                ("remote_holders", ctypes.c_uint32)]


def test_ctypes_listen_serves_a_consumer_of_another_directory(slib, stream_dir, tmp_path,
                                                              monkeypatch):
    """The C params listen, listen_token, remote_lease_seconds and remote_timeout_seconds over
    loopback (UCX_TLS=tcp): the consumer's directory does not hold the segment, so it fetches
    the tensor (tests/remote/stream_remote_test.cc has the two-host cases)."""
    lib = slib
    monkeypatch.setenv("UCX_TLS", "tcp")
    as_params = ctypes.POINTER(StreamParams)

    def params(directory, **fields):
        p = RemoteStreamParams()
        lib.ea_stream_params_init_sized(ctypes.cast(ctypes.pointer(p), as_params),
                                        ctypes.sizeof(p))
        assert p.remote_lease_seconds == 60 and p.remote_timeout_seconds == 30
        p.directory = os.fsencode(directory)
        p.logical_name = b"xs"
        p.segment_bytes = 8 << 20
        p.max_segments = 2
        p.quiet = 1
        for k, v in fields.items():
            setattr(p, k, v)
        return ctypes.cast(ctypes.pointer(p), as_params), p

    producer = ctypes.c_void_p()
    pp, keep_p = params(stream_dir, listen=b"127.0.0.1:0", listen_token=b"t0ken")
    rc = lib.ea_stream_producer_create(pp, ctypes.byref(producer))
    if rc != 0 and b"without UCX" in lib.ea_last_error() and os.environ.get("CI") != "true":
        pytest.skip(lib.ea_last_error().decode())
    assert rc == 0, lib.ea_last_error()
    lib.ea_stream_producer_remote_address.argtypes = [ctypes.c_void_p]
    lib.ea_stream_producer_remote_address.restype = ctypes.c_char_p
    lib.ea_stream_pending.argtypes = [ctypes.c_void_p, ctypes.POINTER(RemotePendingBlock),
                                      ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    consumer = ctypes.c_void_p()
    try:
        assert lib.ea_stream_producer_remote_address(producer).startswith(b"127.0.0.1:")
        data = np.arange(100000, dtype=np.float32)
        desc = ctypes_put(lib, producer, "remote", data, "f32")
        other = tmp_path / "consumer"
        other.mkdir()
        cp, keep_c = params(other, listen_token=b"t0ken", remote_timeout_seconds=10.0)
        assert lib.ea_stream_consumer_create(cp, ctypes.byref(consumer)) == 0, \
            lib.ea_last_error()
        tensor = ctypes.c_void_p()
        assert lib.ea_stream_open(consumer, desc, len(desc), ctypes.byref(tensor)) == 0, \
            lib.ea_last_error()
        info = StreamTensorInfo()
        info.size = ctypes.sizeof(info)
        assert lib.ea_stream_tensor_get_info(tensor, ctypes.byref(info)) == 0
        assert ctypes.string_at(info.data, info.bytes) == data.tobytes()
        blocks = (RemotePendingBlock * 4)()
        blocks[0].size = ctypes.sizeof(RemotePendingBlock)
        count = ctypes.c_size_t()
        assert lib.ea_stream_pending(producer, blocks, 4, ctypes.byref(count)) == 0
        assert count.value == 1 and blocks[0].remote_holders == 1
        lib.ea_stream_release(tensor)
        for _ in range(500):  # the release crosses the wire
            if live_blocks(lib, producer) == 0:
                break
            time.sleep(0.01)
        assert live_blocks(lib, producer) == 0
        # A zero or negative timeout is refused with the field's name.
        bad, keep_b = params(other, remote_timeout_seconds=0.0)
        refused = ctypes.c_void_p()
        assert lib.ea_stream_consumer_create(bad, ctypes.byref(refused)) != 0
        assert b"remote_timeout_seconds" in lib.ea_last_error()
    finally:
        if consumer:
            lib.ea_stream_consumer_destroy(consumer)
        lib.ea_stream_producer_destroy(producer)
