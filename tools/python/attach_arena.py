#!/usr/bin/env python3
"""Attach to a published expert arena from Python through libexpert_arena.so (ctypes).

A Python engine does the same: open the arena by path (no model read), look tensors up by
name, and wrap their bytes without a copy (memoryview / numpy.frombuffer over `data`).

    attach_arena.py --lib build/lib/libexpert_arena.so /dev/shm/model.arena
    attach_arena.py --lib ... ARENA --tensor blk.0.ffn_up_exps.weight --check build/bin/expert-arena

With --check, the tensor's bytes as read through the library are compared with the bytes
of the model file it came from (the source path and offset that `expert-arena info --json`
reports), and its dtype, shape, size and checksum with that table: exit 1 on a mismatch.
Standard library only.
"""

import argparse
import ctypes
import errno
import json
import os
import subprocess
import sys

EA_ROLE_NAMES = {0: "loaded", 1: "attached", 2: "private"}


class OpenParams(ctypes.Structure):
    """ea_open_params of include/expert_arena/expert_arena.h (same order, same types)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("model_files", ctypes.POINTER(ctypes.c_char_p)),
        ("model_file_count", ctypes.c_size_t),
        ("select", ctypes.c_char_p),
        ("select_all", ctypes.c_int),
        ("shared_path", ctypes.c_char_p),
        ("attach_only", ctypes.c_int),
        ("wait_timeout_seconds", ctypes.c_double),
        ("huge_pages", ctypes.c_int),
        ("gpu", ctypes.c_char_p),
        ("gpu_required", ctypes.c_int),
        ("file_mode", ctypes.c_uint32),
        ("allow_foreign_owner", ctypes.c_int),
        ("quiet", ctypes.c_int),
        ("format", ctypes.c_int),
    ]


class TensorView(ctypes.Structure):
    """ea_tensor_view."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_uint64)),
        ("ndim", ctypes.c_uint32),
        ("data", ctypes.c_void_p),
        ("bytes", ctypes.c_uint64),
        ("file_offset", ctypes.c_uint64),
        ("checksum", ctypes.c_uint64),
    ]


class ArenaInfo(ctypes.Structure):
    """ea_arena_info."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("role", ctypes.c_int),
        ("path", ctypes.c_char_p),
        ("backing", ctypes.c_char_p),
        ("start_line", ctypes.c_char_p),
        ("data", ctypes.c_void_p),
        ("data_bytes", ctypes.c_uint64),
        ("tensor_count", ctypes.c_uint64),
        ("tensor_bytes", ctypes.c_uint64),
        ("huge_bytes", ctypes.c_uint64),
        ("bytes_read", ctypes.c_uint64),
        ("seconds", ctypes.c_double),
        ("identity_hash", ctypes.c_uint64),
        ("gpu_registered_bytes", ctypes.c_uint64),
    ]


class ArenaError(Exception):
    pass


class Arena:
    """An attached arena; close() (or `with`) unmaps it. Views live as long as the Arena."""

    def __init__(self, lib_path, arena_path, quiet=True):
        self._lib = ctypes.CDLL(lib_path)
        lib = self._lib
        lib.ea_open_params_init.argtypes = [ctypes.POINTER(OpenParams)]
        lib.ea_open_params_init.restype = None
        lib.ea_arena_open.argtypes = [ctypes.POINTER(OpenParams), ctypes.POINTER(ctypes.c_void_p)]
        lib.ea_arena_open.restype = ctypes.c_int
        lib.ea_arena_close.argtypes = [ctypes.c_void_p]
        lib.ea_arena_close.restype = None
        lib.ea_arena_get_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(ArenaInfo)]
        lib.ea_arena_get_info.restype = ctypes.c_int
        lib.ea_arena_tensor_count.argtypes = [ctypes.c_void_p]
        lib.ea_arena_tensor_count.restype = ctypes.c_size_t
        lib.ea_arena_tensor.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(TensorView)]
        lib.ea_arena_tensor.restype = ctypes.c_int
        lib.ea_arena_find.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(TensorView)]
        lib.ea_arena_find.restype = ctypes.c_int
        lib.ea_last_error.argtypes = []
        lib.ea_last_error.restype = ctypes.c_char_p
        lib.ea_version.argtypes = []
        lib.ea_version.restype = ctypes.c_char_p

        params = OpenParams()
        lib.ea_open_params_init(ctypes.byref(params))
        params.shared_path = os.fsencode(arena_path)
        params.attach_only = 1
        params.quiet = 1 if quiet else 0
        handle = ctypes.c_void_p()
        self._check(lib.ea_arena_open(ctypes.byref(params), ctypes.byref(handle)))
        self._handle = handle

    def _check(self, rc):
        if rc != 0:
            message = self._lib.ea_last_error().decode(errors="replace")
            raise ArenaError("%s (%s)" % (message, errno.errorcode.get(-rc, str(rc))))

    def close(self):
        if self._handle:
            self._lib.ea_arena_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def version(self):
        return self._lib.ea_version().decode()

    def info(self):
        info = ArenaInfo()
        info.size = ctypes.sizeof(ArenaInfo)
        self._check(self._lib.ea_arena_get_info(self._handle, ctypes.byref(info)))
        return info

    def tensor_count(self):
        return self._lib.ea_arena_tensor_count(self._handle)

    def tensor(self, index):
        view = TensorView()
        view.size = ctypes.sizeof(TensorView)
        self._check(self._lib.ea_arena_tensor(self._handle, index, ctypes.byref(view)))
        return view

    def find(self, name):
        view = TensorView()
        view.size = ctypes.sizeof(TensorView)
        self._check(self._lib.ea_arena_find(self._handle, name.encode(), ctypes.byref(view)))
        return view

    @staticmethod
    def memory(view):
        """The tensor's bytes as a read-only memoryview over the arena (no copy)."""
        buf = (ctypes.c_char * view.bytes).from_address(view.data)
        return memoryview(buf).cast("B").toreadonly()


def check_against_table(view, data, arena_path, expert_arena_bin):
    """Compares the view and its bytes with `expert-arena info --json` and the source file."""
    name = view.name.decode()
    out = subprocess.run([expert_arena_bin, "info", "--json", arena_path], check=True,
                         stdout=subprocess.PIPE).stdout
    table = json.loads(out)
    rows = [t for t in table["tensors"] if t["name"] == name]
    if not rows:
        return ["tensor %s is not in `expert-arena info --json`" % name]
    row = rows[0]
    problems = []
    shape = [view.shape[i] for i in range(view.ndim)]
    if row["dtype"] != view.dtype.decode():
        problems.append("dtype %s, table says %s" % (view.dtype.decode(), row["dtype"]))
    if row["shape"] != shape:
        problems.append("shape %s, table says %s" % (shape, row["shape"]))
    if row["bytes"] != view.bytes:
        problems.append("%d bytes, table says %d" % (view.bytes, row["bytes"]))
    if int(row["checksum"], 16) != view.checksum:
        problems.append("checksum %016x, table says %s" % (view.checksum, row["checksum"]))
    if row["file_offset"] != view.file_offset:
        problems.append("file_offset %d, table says %d" % (view.file_offset, row["file_offset"]))
    source = table["sources"][row["source"]]["path"]
    with open(source, "rb") as f:
        f.seek(row["source_offset"])
        expected = f.read(row["bytes"])
    if bytes(data) != expected:
        first = next((i for i in range(min(len(data), len(expected)))
                      if data[i] != expected[i]), min(len(data), len(expected)))
        problems.append("bytes differ from %s at offset %d (+%d into the tensor)"
                        % (source, row["source_offset"] + first, first))
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arena", help="published arena file, e.g. /dev/shm/model.arena")
    parser.add_argument("--lib", required=True, help="path of libexpert_arena.so")
    parser.add_argument("--tensor", help="tensor name (default: the first tensor)")
    parser.add_argument("--check", metavar="EXPERT_ARENA",
                        help="the expert-arena binary: compare with `info --json` and the "
                             "model file")
    args = parser.parse_args()

    try:
        with Arena(args.lib, args.arena) as arena:
            info = arena.info()
            print("libexpert_arena %s: %s %s (%s): %d tensors, %.1f MiB, %d model bytes read"
                  % (arena.version(), EA_ROLE_NAMES.get(info.role, "?"), info.path.decode(),
                     info.backing.decode(), info.tensor_count, info.tensor_bytes / 2**20,
                     info.bytes_read))
            view = arena.find(args.tensor) if args.tensor else arena.tensor(0)
            data = Arena.memory(view)
            shape = [view.shape[i] for i in range(view.ndim)]
            print("tensor %s: %s %s, %d bytes at file offset %d, checksum %016x, first bytes %s"
                  % (view.name.decode(), view.dtype.decode(), shape, view.bytes,
                     view.file_offset, view.checksum, bytes(data[:8]).hex()))
            if args.check:
                problems = check_against_table(view, data, args.arena, args.check)
                if problems:
                    for p in problems:
                        print("attach_arena.py: MISMATCH: tensor %s: %s"
                              % (view.name.decode(), p), file=sys.stderr)
                    return 1
                print("tensor %s: %d bytes equal the model file's; table entry matches"
                      % (view.name.decode(), view.bytes))
    except (ArenaError, OSError, subprocess.CalledProcessError) as e:
        print("attach_arena.py: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
