"""The C ABI from Python through ctypes (what engines without the package use): attach with
libexpert_arena.so, read a tensor, and compare it with the model file and with the package."""

import ctypes
import os

import numpy as np
import pytest

import expert_arena
from conftest import BUILD, arena_table


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


@pytest.fixture(scope="module")
def lib():
    path = os.path.join(BUILD, "lib", "libexpert_arena.so")
    if not os.path.exists(path):
        if os.environ.get("CI") == "true":
            pytest.fail("%s is not built" % path)
        pytest.skip("%s is not built" % path)
    lib = ctypes.CDLL(path)
    lib.ea_open_params_init_sized.argtypes = [ctypes.POINTER(OpenParams), ctypes.c_size_t]
    lib.ea_arena_open.argtypes = [ctypes.POINTER(OpenParams), ctypes.POINTER(ctypes.c_void_p)]
    lib.ea_arena_close.argtypes = [ctypes.c_void_p]
    lib.ea_arena_find.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(TensorView)]
    lib.ea_last_error.restype = ctypes.c_char_p
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
