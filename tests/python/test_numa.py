"""NUMA placement through the Python package and the C ABI (docs/numa.md): the option is
checked before anything loads, and the report says where the pages are."""
import ctypes
import os

import pytest

import expert_arena
from test_capi_ctypes import OpenParams, open_library


def memory_nodes():
    try:
        with open("/sys/devices/system/node/has_memory") as f:
            text = f.read().strip()
    except OSError:
        return [0]
    nodes = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes


@pytest.mark.parametrize("bad", ["bogus", "node:", "node:-1", "Node:1", "node:1x", ""])
def test_a_placement_that_is_not_one_is_a_value_error(gen_model, shm_path, bad):
    model = gen_model("gguf", "f32")
    path = shm_path()
    with pytest.raises(ValueError, match="auto, local, interleave, node:N or replicate|node number"):
        expert_arena.open(model, shared_path=path, quiet=True, numa=bad)
    assert not os.path.exists(path), "nothing was created for a bad option"


def test_a_node_that_is_not_there_is_refused_naming_it(gen_model, shm_path):
    model = gen_model("gguf", "f32")
    path = shm_path()
    with pytest.raises(ValueError, match="no node 4000 with memory on this host"):
        expert_arena.open(model, shared_path=path, quiet=True, numa="node:4000")
    assert not os.path.exists(path)


@pytest.mark.parametrize("numa", ["auto", "local", "interleave", "node:%d" % memory_nodes()[0]])
def test_the_report_says_where_the_pages_are(gen_model, shm_path, numa):
    model = gen_model("gguf", "f32", layers=2, experts=4, hidden=128, ffn=256)
    path = shm_path()
    with expert_arena.open(model, shared_path=path, quiet=True, numa=numa) as arena:
        r = arena.report["numa"]
        assert r["placement"] == numa
        if len(memory_nodes()) == 1:
            # One node: every choice is first touch, and nothing is measured or printed.
            assert r["nodes"] == {}
            assert "numa:" not in arena.report["start_line"]
        else:
            assert sum(r["nodes"].values()) == arena.report["mapped_bytes"]
            assert "numa: " + numa in arena.report["start_line"]
        # An attacher finds the pages where the loader put them, whatever it asks for.
        with expert_arena.attach(path, quiet=True) as other:
            assert other.report["numa"]["placement"] == ""
            assert other.report["numa"]["nodes"] == r["nodes"]


@pytest.fixture(scope="module")
def lib():
    return open_library(NumaOpenParams)


class NumaOpenParams(ctypes.Structure):
    """ea_open_params up to its numa field (appended last)."""
    _fields_ = OpenParams._fields_ + [("from_peer", ctypes.c_char_p),
                                      ("peer_token", ctypes.c_char_p),
                                      ("pin_budget_bytes", ctypes.c_uint64),
                                      ("reader", ctypes.c_char_p), ("alignment", ctypes.c_uint64),
                                      ("peer_stall_seconds", ctypes.c_double),
                                      ("peer_transport", ctypes.c_char_p),
                                      ("numa", ctypes.c_char_p)]


def c_open(lib, model, path, numa):
    params = NumaOpenParams()
    lib.ea_open_params_init_sized(ctypes.byref(params), ctypes.sizeof(params))
    assert params.numa is None, "the default is NULL: auto"
    files = (ctypes.c_char_p * 1)(os.fsencode(model))
    params.model_files = files
    params.model_file_count = 1
    params.shared_path = os.fsencode(path)
    params.quiet = 1
    params.numa = numa
    handle = ctypes.c_void_p()
    rc = lib.ea_arena_open(ctypes.byref(params), ctypes.byref(handle))
    if rc == 0:
        lib.ea_arena_close(handle)
    return rc


def test_the_c_abi_takes_the_placement_and_refuses_a_bad_one(lib, gen_model, shm_path):
    model = gen_model("gguf", "f32")
    path = shm_path()
    assert c_open(lib, model, path, b"interleave") == 0, lib.ea_last_error()
    bad = shm_path()
    assert c_open(lib, model, bad, b"sideways") == -22
    assert b"expected auto, local, interleave, node:N or replicate" in lib.ea_last_error()
    assert not os.path.exists(bad)


# ---- stream producers: segments on the producer's node unless asked otherwise ----------------

def cpu_nodes():
    """The memory nodes holding a CPU of this process's affinity."""
    mine = os.sched_getaffinity(0)
    out = []
    for node in memory_nodes():
        try:
            with open("/sys/devices/system/node/node%d/cpulist" % node) as f:
                text = f.read().strip()
        except OSError:
            continue
        cpus = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus & mine:
            out.append(node)
    return out


@pytest.mark.parametrize("bad, message", [
    ("replicate", "no replica per node"),
    ("sideways", "auto, local, interleave, node:N or replicate"),
    ("node:4000", "no node 4000 with memory on this host"),
])
def test_a_stream_placement_it_cannot_take_is_a_value_error(stream_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        expert_arena.StreamProducer(directory=stream_dir, quiet=True, numa=bad)
    assert os.listdir(stream_dir) == []


def test_a_producers_segments_are_on_its_node_and_stats_say_which(stream_dir):
    import numpy as np
    mine = cpu_nodes()
    with expert_arena.StreamProducer(directory=stream_dir, segment_bytes=8 << 20,
                                     max_segments=2, quiet=True) as producer:
        producer.put("t", np.ones(1 << 20, dtype=np.float32))
        stats = producer.stats()
        where = producer.segment_nodes()
    if len(mine) == 1:
        assert stats["numa_node"] == mine[0], stats["numa"]
        assert stats["numa"].startswith("node:%d (the producer's node" % mine[0]), stats["numa"]
        if where:  # a kernel with numa_maps
            assert sum(where.values()) >= 10 << 20, where
            assert where[mine[0]] * 100 >= sum(where.values()) * 95, where
    else:
        assert stats["numa_node"] == -1 and "span nodes" in stats["numa"], stats["numa"]
    assert os.listdir(stream_dir) == []


def test_a_stream_producer_on_node_0_says_node_0(stream_dir):
    with expert_arena.StreamProducer(directory=stream_dir, quiet=True, numa="node:0") as p:
        assert p.stats()["numa_node"] == 0
        assert p.stats()["numa"] == "node:0"
    with expert_arena.StreamProducer(directory=stream_dir, quiet=True, numa="local") as p:
        assert p.stats()["numa"].startswith("local (first touch")


def test_the_c_stream_params_take_the_placement(stream_dir):
    from test_capi_ctypes import RemoteStreamParams, StreamParams, StreamStats

    class NumaStreamParams(ctypes.Structure):
        _fields_ = RemoteStreamParams._fields_ + [("numa", ctypes.c_char_p)]

    class NumaStreamStats(ctypes.Structure):
        _fields_ = StreamStats._fields_ + [("numa_node", ctypes.c_int64)]

    lib = open_library(NumaOpenParams)
    lib.ea_stream_params_init_sized.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ea_stream_producer_create.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.ea_stream_get_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ea_stream_producer_destroy.argtypes = [ctypes.c_void_p]
    lib.ea_last_error.restype = ctypes.c_char_p

    def create(numa):
        p = NumaStreamParams()
        lib.ea_stream_params_init_sized(ctypes.byref(p), ctypes.sizeof(p))
        assert p.numa is None  # NULL: auto
        p.directory = os.fsencode(stream_dir)
        p.quiet = 1
        p.numa = numa
        producer = ctypes.c_void_p()
        return lib.ea_stream_producer_create(ctypes.byref(p), ctypes.byref(producer)), producer

    rc, producer = create(b"node:0")
    assert rc == 0, lib.ea_last_error()
    try:
        stats = NumaStreamStats()
        stats.size = ctypes.sizeof(stats)
        assert lib.ea_stream_get_stats(producer, ctypes.byref(stats)) == 0, lib.ea_last_error()
        assert stats.numa_node == 0
    finally:
        lib.ea_stream_producer_destroy(producer)
    # An older caller's struct (without the field) is the default.
    assert ctypes.sizeof(StreamParams) < ctypes.sizeof(NumaStreamParams)
    for bad, message in ((b"replicate", b"no replica per node"),
                         (b"node:4000", b"no node 4000"), (b"x", b"expected auto")):
        rc, producer = create(bad)
        assert rc == -22 and not producer, bad
        assert message in lib.ea_last_error(), lib.ea_last_error()
