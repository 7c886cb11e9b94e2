"""expert_arena: one RAM copy of a MoE model's experts shared by engines, and zero-copy
tensor streaming between processes, for NumPy and PyTorch engines.

Shared arenas (the first engine loads, the others attach without reading the model)::

    import expert_arena
    with expert_arena.open(["model.gguf"], shared_path="/dev/shm/model.arena") as arena:
        w = arena.torch("blk.0.ffn_up_exps.weight")   # zero-copy; in-place ops raise
        print(arena.report["start_line"])

Tensor streaming (descriptors are bytes an engine sends over its own channel)::

    producer = expert_arena.StreamProducer(logical_name="prefill")
    descriptor = producer.put("req-17", hidden_states)      # one copy into shared memory
    # ... in another process:
    consumer = expert_arena.StreamConsumer()
    with consumer.open(descriptor) as t:
        x = t.torch()                                        # zero-copy view

Lifetimes: a view (NumPy array or tensor) keeps the memory it points into mapped: closing an
arena or releasing a stream tensor while views exist never lets a view read unmapped memory;
the mapping (or the reader's share of a stream block) goes when the last view is gone. NumPy is
required; torch is imported only by the torch calls (ImportError naming python3-torch when it
is missing). See docs/python.md for the whole API, the dtype table and the exceptions.
"""

from __future__ import annotations

import atexit as _atexit
import collections.abc as _abc
import logging as _logging
import os
import sys
import threading
import time

import numpy as _np

try:
    from . import _core
except ImportError as _e:  # the pure-Python files without the built module next to them
    _here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        "expert_arena: the compiled module expert_arena._core is missing from %s. Build it with "
        "`cmake --preset default && cmake --build --preset default --target expert_arena_python` "
        "(scripts/demo.sh does), then use PYTHONPATH=build/python; or install the package with "
        "`pip install .` (docs/python.md). The import failed with: %s" % (_here, _e),
        name="expert_arena._core") from _e
from . import _binder, _dtypes
from ._core import BusyError, NoSpaceError

__version__ = _core.__version__

# `open` is left out of __all__: `from expert_arena import *` must not shadow the built-in.
# So are LoadResult, ArenaTensor and ReadOnlyTensor, which import torch (module attributes on
# first use).
__all__ = [
    "Arena", "BusyError", "NoSpaceError", "Reservation", "StreamConsumer",
    "StreamProducer", "StreamTensor",
    "attach", "decode_descriptor", "decode_fp8", "inspect_segment", "load_into", "metrics",
    "open_engine", "PrivateCopyError", "check_private_copies", "private_bytes",
    "shared_module", "sweep",
    "xxh3_64", "__version__",
]


_torch_part = None

# The library's messages (start lines, notes, warnings) go to this logger, as records of
# Python's logging: INFO for start lines, WARNING for what an operator should act on. Python's
# defaults show WARNING and above on stderr; logging.basicConfig(level=logging.INFO) shows the
# start lines too. `quiet=True` drops them in the library.
_log = _logging.getLogger("expert_arena")


def _emit_logs():
    """Hands the messages the library collected since the last call to the logger."""
    records, dropped = _core.take_logs()
    for level, text in records:
        _log.log(level, "%s", text)
    if dropped:
        _log.warning("expert-arena: %d log messages were dropped (more than 4096 between "
                     "two calls)", dropped)


_atexit.register(_emit_logs)


def _load_torch():
    global _torch_part
    if _torch_part is None:
        from . import _torch as t  # raises an ImportError naming python3-torch without torch
        _torch_part = t
    return _torch_part


def _paths(model_files):
    if isinstance(model_files, (str, bytes, os.PathLike)):
        model_files = [model_files]
    return [os.fsdecode(os.fspath(f)) for f in model_files]


class Arena(_abc.Mapping):
    """The expert tensors of a model in one mapping: loaded, attached, or private.

    Made by `open()` or `attach()`. A read-only Mapping of tensor names to torch tensors, as
    safetensors' `safe_open`: `arena[name]`, `get_tensor(name)`, `keys()`, `items()`,
    `values()`, `len(arena)`, `name in arena`; NumPy views with `numpy(name)`; `info()` for a
    tensor's table entry; `report` for what happened at open. `close()` (or leaving a `with`
    block) drops this handle; the mapping lives until the last view made from it is gone.
    Thread-safe for reading; `close()` must not race with calls on the same Arena.

    Views point into this process's copy-on-write mapping of the arena: the torch view's
    in-place methods raise, and a write by any other route (out=, torch.from_numpy, dlpack)
    copies the page it touches into this process and never reaches the shared file or another
    engine (docs/python.md). A shared arena pickles as a reference to its path (the receiver
    attaches); so do its views (torch.save saves their bytes).
    """

    __slots__ = ("_core", "_report", "_layouts", "__weakref__")
    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def __init__(self, core):
        self._core = core
        self._report = None
        self._layouts = {}

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._core

    def __iter__(self):
        return iter(self._core.names())

    def __getitem__(self, name: str):
        """The torch view of tensor `name` (KeyError when the arena has none)."""
        if not isinstance(name, str):
            raise KeyError(name)
        return self.torch(name)

    def get_tensor(self, name: str):
        """The torch view of tensor `name`, as safetensors' safe_open(...).get_tensor()."""
        return self.torch(name)

    def keys(self):
        """The tensor names (a KeysView, in arena order)."""
        return _abc.KeysView(self)

    def __reduce__(self):
        path = self.report["path"] if not self._core.closed else ""
        if not path:
            raise TypeError("a private (or closed) expert_arena.Arena cannot be pickled: only "
                            "a shared arena is sent, as a reference to its path")
        return _attach_same, (path, self.report["identity_hash"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self._core.closed:
            return "<expert_arena.Arena closed>"
        r = self.report
        return "<expert_arena.Arena %s %s: %d tensors, %d bytes>" % (
            r["role"], r["path"] or "(private)", r["tensors"], r["tensor_bytes"])

    @property
    def closed(self) -> bool:
        return self._core.closed

    def close(self) -> None:
        """Drops this handle (idempotent). Views made before stay valid; the arena is
        unmapped, and this engine's USER lock dropped, when the last of them is gone."""
        self._core.close()
        _emit_logs()

    def memory(self) -> dict:
        """What the arena costs this process now, from /proc/self/smaps of its mappings:
        rss_bytes (resident pages, counted once per mapping and per process, so N engines
        show N times the arena), pss_bytes (this process's proportional share: the engines'
        Pss sums to the arena once), shared_bytes (of it, the arena's own pages),
        private_bytes (pages only this process holds: copies a write made) and mappings (1, or
        2 once views exist: the arena's own mapping, whose pages leave the page tables then,
        and the views' copy-on-write one). docs/deployment.md, "Memory per engine"."""
        return self._core.memory()

    @property
    def awaiting_confirm(self) -> bool:
        """True while this engine built the arena with confirm_after_run and neither
        confirm() nor abandon() was called: the other engines wait for it."""
        return self._core.awaiting_confirm

    def confirm(self) -> None:
        """Publishes an arena this engine built with confirm_after_run, once the engine ran
        on its views (publish only what runs, docs/engine-arenas.md); a no-op otherwise."""
        try:
            self._core.confirm()
        finally:
            _emit_logs()

    def abandon(self, reason: str) -> None:
        """Records that this engine failed on an arena it built with confirm_after_run:
        `reason` (escaped, cut to 240 bytes) is what the next engines report. The next engine
        of the identity rebuilds it once; after a second failure every engine is refused with
        the first reason. Close the arena afterwards (while it is mapped, nobody can rebuild
        it). A no-op for any other arena."""
        try:
            self._core.abandon(str(reason))
        finally:
            _emit_logs()

    def names(self):
        """Tensor names, in arena order."""
        return self._core.names()

    @property
    def report(self) -> dict:
        """The start line's facts: role ("loaded", "attached", "private"), path, backing,
        seconds, bytes_read, huge_bytes, data_bytes, tensors, tensor_bytes, gpu (the
        registration note), start_line, and the rest of ArenaReport."""
        if self._report is None:
            self._report = self._core.report()
        return dict(self._report)

    def info(self, name: str) -> dict:
        """The table entry of `name`: dtype, shape (as the source gives it: ggml order for
        GGUF), bytes, checksum (xxh3-64), file_offset, plus array_shape and array_dtype of the
        views. KeyError when the arena has no such tensor."""
        info = self._core.info(name)
        layout = self._layout(name, info)
        info["array_shape"] = layout.shape
        info["array_dtype"] = str(layout.numpy_dtype) if layout.torch_name != "bfloat16" \
            else "uint16 (bf16)"
        info["raw"] = layout.raw
        return info

    def tensors(self):
        """The table entry of every tensor (name, dtype, shape, bytes, checksum, file_offset)."""
        return self._core.tensors()

    def _layout(self, name, info=None):
        layout = self._layouts.get(name)
        if layout is None:
            if info is None:
                info = self._core.info(name)
            layout = _dtypes.arena_layout(info["dtype"], info["shape"], info["bytes"], name)
            self._layouts[name] = layout
        return layout

    def numpy(self, name: str):
        """A read-only NumPy view of tensor `name` (no copy). bf16 comes as uint16, FP8 as
        uint8, block-quantized ggml types as uint8 rows of their raw blocks."""
        layout = self._layout(name)
        return _dtypes.as_numpy(self._core.buffer(name, False), layout)

    def torch(self, name: str, guard: bool = False):
        """A torch tensor over tensor `name` (no copy): an expert_arena.ArenaTensor, a
        torch.Tensor subclass over this process's copy-on-write mapping whose ops cost what
        they cost on a plain tensor (their results are plain tensors) and whose in-place
        methods raise ValueError naming the tensor. pickle and copy.deepcopy of it send a
        reference (the receiver attaches), torch.save saves its bytes. `guard=True` gives a
        ReadOnlyTensor instead, which also makes tensors derived from it read-only and
        refuses out=, at the cost of a Python call per op. Needs torch (ImportError naming
        python3-torch otherwise)."""
        t = _load_torch()
        layout = self._layout(name)
        view = t.view(self._core.buffer(name, True), layout,
                      t.ReadOnlyTensor if guard else None)
        view._ea = (self._label(name), None)
        return view

    def _label(self, name):
        path = self.report["path"]
        return "%r of the arena %s" % (name, path) if path else "%r of a private arena" % name

    def private_bytes(self, changed: bool = False) -> int:
        """Bytes of this process's views that are private copies: pages of the views'
        copy-on-write mapping that a write in this process copied (out=, an in-place op on a
        plain tensor over a view), found by what the pages are in the page tables, not by
        pointers (a write keeps every address). This process reads those bytes, every other
        engine the arena's. `changed=True` counts only the pages whose bytes now differ from
        the arena's (a write of the values already there copies a page too). 0 for an
        untouched arena and for a private one (no shared bytes to differ from)."""
        return sum(n for _, n in self._core.private_copies(bool(changed)))

    def private_tensors(self, changed: bool = True) -> dict:
        """{tensor name: bytes} of the tensors whose bytes in this process lie on such pages
        (by default only the pages whose bytes differ from the arena's), in arena order."""
        return dict(self._core.private_tensors(bool(changed)))

    def data_range(self):
        """(address, bytes) of the data region of the views' copy-on-write mapping: every
        view points inside it."""
        return self._core.data_range()

    def shared_range(self):
        """(address, bytes) of the data region of the arena's own mapping, the one a GPU
        registration covers (no Python view points there)."""
        return self._core.shared_range()


def _attach_same(path, identity_hash):
    """The receiving side of a pickled Arena: attaches to `path`, and refuses when the file
    there is no longer the arena the sender had (replaced by another model's since)."""
    arena = attach(path)
    if arena.report["identity_hash"] != identity_hash:
        found = arena.report["identity_hash"]
        arena.close()
        raise ValueError(
            "expert_arena: an Arena sent as a reference to %s cannot be rebuilt: the file now "
            "holds another arena (identity %016x, the sender's was %016x)"
            % (path, found, identity_hash))
    return arena


def open(model_files, shared_path=None, select=None, select_all=False, gpu="none",
         huge="auto", wait_timeout=600.0, file_mode=0o600, allow_foreign_owner=False, *,
         gpu_required=False, pin_budget_bytes=0, reader="auto", alignment=4096, quiet=False,
         progress=None, format="auto", from_peer=None, peer_token=None, peer_stall_seconds=30.0,
         peer_transport="auto", numa="auto", allow_world_writable=False,
         peer_allow_no_token=False) -> Arena:
    """Loads a model's expert tensors, or attaches to the shared arena another engine loaded.

    Same semantics as `Arena::Open`: with `shared_path` (a file on tmpfs or hugetlbfs) the
    first engine loads and publishes, every other one (now or after a restart) attaches
    without reading tensor data; without it the arena is private. `select` is a regex of
    tensor names (default: the routed experts), `select_all` takes every tensor. `format`
    is "auto" (GGUF, safetensors or a safetensors index, by their first bytes; anything else
    is refused naming what it looks like), "gguf", "safetensors", or "raw" (never guessed:
    each file's bytes as one u8 tensor named after the file). `gpu` is
    "none", "cuda[:N]" or "hip[:N]" (registration failure is reported in report["gpu"] unless
    `gpu_required`). The start line goes to Python's logging, logger "expert_arena", level
    INFO (warnings at WARNING), unless `quiet`. The GIL is released while loading or waiting.

    `from_peer="HOST:PORT"` fills the shared arena from `expert-arena serve` on another host
    over UCX, checking every tensor's checksum (docs/cross-host.md); `model_files` may then be
    empty (the peer's table is used), and when given, their layout must be the peer's and they
    are read if the fill fails (report["peer_note"] says why; report["peer_transport"] says how
    the bytes crossed: "am" or "get"). `peer_token` is the peer's shared token; without one
    the fill is refused unless `peer_allow_no_token` (nothing would prove who answers);
    `peer_stall_seconds` the longest wait for the peer before the fill is abandoned;
    `peer_transport` "auto", "am" (only ranges the peer checks and sends) or "get".
    docs/options.md lists every option as C++, C, the CLI and Python name it.

    `numa` is where a loader puts the pages on a host with several NUMA nodes (docs/numa.md):
    "auto" (interleave over the nodes this process may use where the kernel allows it, else
    first touch), "local" (first touch), "interleave", "node:N", or "replicate" (one arena per
    node, the node in its file name, each engine on its GPU's or CPUs' node's). report["numa"] says where the pages are: placement,
    policy (as numa_maps names it), note, and nodes ({node: bytes}, empty on a one-node host).

    `file_mode` takes read and write bits only (0o666 at most; a setuid, setgid, sticky or
    execute bit is a ValueError); a mode any user may write (0o002), and attaching to such a
    file, need `allow_world_writable=True`. `wait_timeout=float("inf")` waits without a limit.

    Raises FileNotFoundError, PermissionError (a foreign owner, a mode), TimeoutError (another
    engine's load took longer than `wait_timeout`), BusyError (a file of another model in
    use), NoSpaceError (the filesystem is too small), ValueError (a damaged model, a bad
    option), each with the library's message naming the file and the cause.
    """
    if progress is None:
        progress = sys.stderr is not None and sys.stderr.isatty()
    try:
        core = _core.open(_paths(model_files),
                          None if shared_path is None else os.fsdecode(os.fspath(shared_path)),
                          select, bool(select_all), gpu, bool(gpu_required), huge,
                          float(wait_timeout), int(file_mode), bool(allow_foreign_owner),
                          int(pin_budget_bytes), reader, bool(quiet), bool(progress),
                          int(alignment), format, from_peer or "", peer_token or "",
                          float(peer_stall_seconds), peer_transport, numa,
                          bool(allow_world_writable), bool(peer_allow_no_token))
    finally:
        _emit_logs()
    return Arena(core)


def attach(path, gpu="none", *, gpu_required=False, allow_foreign_owner=False,
           pin_budget_bytes=0, quiet=False, allow_world_writable=False) -> Arena:
    """Attaches to a published shared arena without knowing the model (never loads).

    The start line goes to the "expert_arena" logger at INFO, as open()'s, unless `quiet`.
    FileNotFoundError when `path` does not exist, BusyError while it is being loaded (not yet
    published), ValueError when it is not an arena or is damaged, PermissionError for a file
    of another user. The GIL is released while attaching.
    """
    try:
        core = _core.attach(os.fsdecode(os.fspath(path)), gpu, bool(gpu_required),
                            bool(allow_foreign_owner), int(pin_budget_bytes), bool(quiet),
                            bool(allow_world_writable))
    finally:
        _emit_logs()
    return Arena(core)


def open_engine(path, identity, declare, fill, files=(), *, alignment=4096, gpu="none",
                gpu_required=False, huge="auto", wait_timeout=600.0, file_mode=0o600,
                allow_foreign_owner=False, pin_budget_bytes=0, quiet=False,
                allow_world_writable=False, confirm_after_run=False,
                pages_as_written=True, freed_as_written=0, huge_after_build=True) -> Arena:
    """An arena of tensors this engine makes itself (fused, repacked, quantized): attaches when
    one of `identity` over the checkpoint `files` is published at `path` (waiting for an engine
    that is building it), else this engine builds it and publishes it (docs/engine-arenas.md).

    Only the engine that builds calls `declare()`, which returns the table as a list of
    (name, dtype, shape, bytes, alignment) tuples (dtype a safetensors name: "F32", "BF16",
    ...; alignment 0 for the default), then `fill(writer)`, which writes every tensor with
    `writer.write(index, buffer)` (a C-contiguous buffer of exactly its bytes; the writer is
    void once fill returns). An exception from either propagates and publishes nothing. The
    arena's pages are made as the tensors are written (on tmpfs on 4 KiB pages, where 2 MiB
    pages are made in pieces): an engine that lets go of its own copy of each tensor once
    written gives that memory to the next tensors' pages and holds the model about once, not
    twice (`pages_as_written=False`: all made before fill, as a C++ spec's default).
    `writer.buffer(index)` is a tensor's bytes in the arena (a memoryview, writable
    until fill returns, then read-only, valid while the arena is open): the engine's copy of a
    tensor can be moved onto them once written (what shared_module and the vLLM loader do).
    `freed_as_written`: the bytes of this engine's own memory that fill frees for certain as it
    writes (a number, or a callable asked once declare returned): a memory cgroup's limit is
    then checked against the build's peak rather than the whole arena on top of that memory.
    `huge_after_build` (the default): on tmpfs on 4 KiB pages the tensors are written into
    4 KiB pages and the arena's 2 MiB pages made after the build, on a thread at nice 19,
    instead of before each write: a shorter build where making a 2 MiB page is slow (a VM
    whose host takes free memory back), reads slowed until the thread is done
    (docs/engine-arenas.md); an engine that attaches with it makes the 2 MiB pages the file
    still lacks. False: the build waits for each piece's 2 MiB pages before writing it.
    `identity` names what makes the tensors what they are beyond the checkpoint (the engine
    and its version, the transform's settings, dtype, rank and world size); `files` are the
    checkpoint files or directories, fingerprinted by the library.

    With `confirm_after_run`, an arena this engine builds is published only when it calls
    `arena.confirm()` after its first forwards ran on the views (the others wait until then),
    or marked failed by `arena.abandon(reason)`; see Arena.confirm.
    """
    try:
        core = _core.open_engine(os.fsdecode(os.fspath(path)), str(identity), _paths(files),
                                 int(alignment), declare, fill, gpu, bool(gpu_required), huge,
                                 float(wait_timeout), int(file_mode), bool(allow_foreign_owner),
                                 int(pin_budget_bytes), bool(quiet), bool(allow_world_writable),
                                 bool(confirm_after_run), bool(pages_as_written),
                                 freed_as_written, bool(huge_after_build))
    finally:
        _emit_logs()
    return Arena(core)


def _declare_module(torch, module, built):
    """The engine table of everything `module` holds (_binder), kept in `built` for
    _fill_module."""
    return _binder.declare(module, built)


def _fill_module(torch, built, writer):
    _binder.fill(built, writer, release=True)


def _bind_module(torch, module, arena):
    """Binds every parameter, buffer and tensor attribute of `module` to the arena's read-only
    view of the same name (_binder: names, dtypes, shapes and strides checked); BindingError, a
    ValueError, naming both sides of every mismatch."""
    _binder.bind_module(module, arena, "shared_module(): the module")
    return module


def _confirm_at_first_forward(module, arena, check=None):
    """Publish only what runs: the arena this engine built is confirmed when the module's
    first forward on its views returned (and `check()`, when given, accepted what the forward
    left). A forward that raises, or a check that does, abandons the build with that error
    (where torch calls hooks on exceptions, 2.1 and later; on older torch a raising forward
    confirms nothing and the engine's exit leaves the build unconfirmed), so the next engine
    rebuilds it once and the one after a second failure is refused with the first."""
    import sys
    handles = []

    def done(mod, args, output):
        if not handles:
            return
        raised = sys.exc_info()[1] if output is None else None
        if raised is not None:
            # Called by torch from the forward's exception handler (always_call), which
            # iterates the hooks' dict itself: the hook is not removed there, only spent.
            handles.clear()
            arena.abandon("%s at the first forward: %s" % (type(raised).__name__, raised))
            return
        for h in handles:
            h.remove()
        handles.clear()
        if check is not None:
            try:
                check()
            except Exception as e:
                arena.abandon("%s after the first forward: %s" % (type(e).__name__, e))
                raise
        arena.confirm()

    try:
        handles.append(module.register_forward_hook(done, always_call=True))
    except TypeError:  # torch before 2.1
        handles.append(module.register_forward_hook(done))


def shared_module(path, make, load, *, identity, files=(), gpu="none", huge="auto",
                  wait_timeout=600.0, file_mode=0o600, allow_foreign_owner=False, quiet=False,
                  alignment=4096, confirm="forward", huge_after_build=True):
    """A torch module whose parameters, buffers and tensor attributes are read-only views of
    one shared arena.

    Where the arena of `identity` over `files` is published at `path`, the module is built
    with `make()` on the meta device (torch 2.x; on 1.13 on the CPU, then freed) and bound to
    the arena (expert_arena._binder): every parameter, buffer and tensor attribute of every
    submodule becomes the arena's view of the same name, its name, dtype, shape and strides
    checked (a mismatch is a BindingError, a ValueError, naming both sides), and the tensor
    attributes the building engine's `load` made that `make()` does not are set. Otherwise this
    engine builds: `module = make()`, then `load(module)` (the engine's own loading and
    transforms; it may return another module to use instead), publishes everything the module
    holds, binds the module to the views and lets the private copies go. Concurrent engines
    build once; a build that raises or is killed publishes nothing. Returns the module;
    `module.expert_arena` is the Arena (its report says "loaded" or "attached"). Needs torch.

    Publish only what runs: an arena this engine builds is published when `confirm` says.
    "forward" (the default): after the module's first forward returned, on the arena's views;
    the other engines wait until then, and a build whose engine fails first (it calls
    `module.expert_arena.abandon(reason)`) or dies is rebuilt once, then refused with the first
    failure. "explicit": when the engine calls `module.expert_arena.confirm()`. "filled": as
    soon as it is filled (a build-only step that runs no forward). `huge_after_build`: see
    open_engine.
    """
    if confirm not in ("forward", "explicit", "filled"):
        raise ValueError("shared_module(): confirm must be \"forward\", \"explicit\" or "
                         "\"filled\", got %r" % (confirm,))
    torch = __import__("torch")
    built = {}

    def declare():
        module = make()
        replaced = load(module)
        if replaced is not None:
            module = replaced
        built["module"] = module
        return _declare_module(torch, module, built)

    def fill(writer):
        _fill_module(torch, built, writer)

    try:
        arena = open_engine(path, identity, declare, fill, files, alignment=alignment, gpu=gpu,
                            huge=huge, wait_timeout=wait_timeout, file_mode=file_mode,
                            allow_foreign_owner=allow_foreign_owner, quiet=quiet,
                            confirm_after_run=confirm != "filled",
                            freed_as_written=lambda: built.get("freed", 0),
                            huge_after_build=huge_after_build)
    except BaseException:
        _binder.forget_released(built)
        raise
    module = built.pop("module", None)
    kept = built.get("kept", 1)
    built.clear()
    # Private tensors to free: those of the builder's own that did not move onto the arena's
    # bytes as they were written, or make()'s where it cannot build on meta. (A full garbage
    # collection of a large process's heap takes a good part of a second.)
    held_private = (module is not None and kept > 0) or int(torch.__version__.split(".")[0]) < 2
    if module is None:
        if int(torch.__version__.split(".")[0]) >= 2:
            with torch.device("meta"):
                module = make()
        else:
            module = make()
    try:
        _bind_module(torch, module, arena)
        module.expert_arena = arena
        check_private_copies(module, "shared_module(): after binding")
    except Exception as e:
        # A build this engine cannot bind itself to is a failed build, not a published one.
        arena.abandon("%s: %s" % (type(e).__name__, e))
        arena.close()
        raise
    if confirm == "forward" and arena.awaiting_confirm:
        _confirm_at_first_forward(module, arena)
    _release_freed_memory(collect=held_private)
    return module


class PrivateCopyError(RuntimeError):
    """A module bound to a shared arena reads bytes of its own: a write in this process
    copied pages of the arena's views and changed them."""


def check_private_copies(module, when="on demand"):
    """Raises PrivateCopyError naming every parameter and buffer of `module` (bound to the
    arena `module.expert_arena` by shared_module() or the vLLM loader) whose bytes in this
    process differ from the arena's: a write into a bound tensor (out=, an in-place op on a
    plain tensor over it, vLLM or a kernel writing a weight) keeps its address but copies the
    page it touched into this process, so the module computes on other values than every
    engine that shares the arena. Found by what the pages are (private copy-on-write pages in
    the page tables), then compared with the arena's bytes: a write of the values already
    there is not reported. Returns the arena's private bytes (0 when none). Cheap when nothing
    was written (one page-table scan of the arena); callable at any time."""
    arena = getattr(module, "expert_arena", None)
    if arena is None or arena.closed:
        raise ValueError("check_private_copies(): the module has no open arena "
                         "(module.expert_arena, set by shared_module() and the vLLM loader)")
    ranges = arena._core.private_copies(True)
    if not ranges:
        return arena.private_bytes()
    base = arena.data_range()[0]
    ranges = [(base + offset, base + offset + n) for offset, n in ranges]
    written = []
    for name, t, _, _ in _binder.module_tensors(module):
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        first = t.data_ptr()
        last = first + t.numel() * t.element_size()
        hit = sum(min(last, end) - max(first, start) for start, end in ranges
                  if start < last and first < end)
        if hit > 0:
            written.append("%s (%d bytes)" % (name, hit))
    by_arena = ["%r (%d bytes)" % kv for kv in arena._core.private_tensors(True)]
    raise PrivateCopyError(
        "expert_arena: %s: %s written in this process: %s of the arena %s now lie on private "
        "copy-on-write pages whose bytes differ from the arena's, so this engine computes on "
        "other weights than every engine sharing it. Find the in-place write (out=, a *_ op on "
        "a plain tensor over the parameter) and write into a copy (tensor.clone()) instead."
        % (when, ", ".join(written[:8]) or "no bound tensor (bytes between them)",
           ", ".join(by_arena[:8]) or "bytes", arena.report["path"]))


def private_bytes(tensor, changed=False) -> int:
    """Bytes of `tensor` (a CPU view of a shared arena, or a tensor over one: a slice, a
    parameter bound to it) that lie on pages a write in this process copied: this process
    reads them, every other engine reads the arena's (Arena.private_bytes() for the whole
    arena). `changed=True`: only those whose bytes differ from the arena's. ValueError for a
    tensor that is not over a shared arena's views. Needs torch."""
    return _load_torch().private_bytes(tensor, changed)


def _release_freed_memory(collect=True):
    """Gives the private copies' memory, freed by the rebinding, back to the kernel: glibc's
    allocator keeps freed heap memory (measured: a building transformers engine held 137 MiB
    more than an attaching one until malloc_trim). `collect`: the private tensors are freed by
    a garbage collection first (they sit in reference cycles); only for an engine that held
    them: a full collection of vLLM's heap took 0.41 s of an attaching engine's 0.69 s."""
    import gc
    if collect:
        gc.collect()
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def _numpy_source(array):
    if array.dtype.hasobject:
        raise TypeError("put(): a NumPy array of dtype %s holds Python objects, not bytes"
                        % array.dtype)
    name = _dtypes.STREAM_NAMES.get(array.dtype)
    if name is None:
        raise TypeError("put(): NumPy dtype %s has no stream name (native-endian numbers "
                        "and bool only)" % array.dtype)
    if not array.flags.c_contiguous:
        raise ValueError("put(): the array is not C-contiguous (shape %s, strides %s); call "
                         "numpy.ascontiguousarray() first" % (list(array.shape),
                                                              list(array.strides)))
    return _core.array_address(array), array.nbytes, name, list(array.shape)


class StreamProducer:
    """Puts tensors into shared segments and hands out descriptors (bytes).

    One per engine process; methods may be called from any thread. `close()` (or `with`)
    unlinks this producer's segments; consumers that mapped them keep their views until they
    release them. Options as in `StreamOptions` of stream.h.
    """

    def __init__(self, directory="/dev/shm", logical_name="stream", segment_bytes=256 << 20,
                 max_segments=32, strict=False, gpu="none", *, strict_wait_seconds=1.0,
                 pin_budget_bytes=4 << 30, block_alignment=4096, spill_directory="/var/tmp",
                 huge="auto", copy_threads=0, grow_ahead=True, sweep_at_start=True,
                 quiet=False, lease_check_seconds=1.0, listen=None, listen_token=None,
                 remote_lease_seconds=60.0, non_temporal_copy_from=0,
                 warning_interval_seconds=10.0, numa="auto", listen_allow_no_token=False):
        if not lease_check_seconds >= 0:
            raise ValueError("StreamProducer(): lease_check_seconds must be >= 0 (0 checks "
                             "readers' leases at every reserve), got %r" % (lease_check_seconds,))
        self._core = _core.StreamProducer(
            os.fsdecode(os.fspath(directory)), logical_name, int(segment_bytes),
            int(max_segments), bool(strict), float(strict_wait_seconds), gpu,
            int(pin_budget_bytes), int(block_alignment),
            os.fsdecode(os.fspath(spill_directory)), huge, int(copy_threads), bool(grow_ahead),
            bool(sweep_at_start), bool(quiet), float(lease_check_seconds), listen or "",
            listen_token or "", float(remote_lease_seconds), int(non_temporal_copy_from),
            float(warning_interval_seconds), "auto" if numa is None else numa,
            bool(listen_allow_no_token))
        _emit_logs()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def put(self, key: str, tensor, readers: int = 1) -> bytes:
        """Copies a contiguous CPU torch tensor or NumPy array once into a segment (the GIL
        released during the copy), publishes it for `readers` releases and returns its
        descriptor. ValueError for a non-contiguous, CUDA or sparse tensor; TypeError for an
        object array or anything else. NoSpaceError in strict mode at the cap."""
        if isinstance(tensor, _np.ndarray):
            address, nbytes, dtype, shape = _numpy_source(tensor)
        elif _is_torch(tensor):
            address, nbytes, dtype, shape = _load_torch().source(tensor)
        else:
            raise TypeError("put(): expected a torch.Tensor or a numpy.ndarray, got %s"
                            % type(tensor).__name__)
        # `tensor` stays referenced by this frame while the copy runs without the GIL.
        return self._core.put(key, address, nbytes, dtype, shape,
                              readers if type(readers) is int else int(readers))

    def put_many(self, items, readers: int = 1) -> list:
        """put() of a batch in one call, all or none: `items` is a dict {key: tensor} or an
        iterable of (key, tensor) pairs; returns the descriptors in order. Every tensor is
        checked first; then each is copied into its own block and all are published together
        (the GIL released meanwhile). When any fails nothing is published, the space taken so
        far is given back, and the exception names the item's index and key."""
        if isinstance(items, dict):
            pairs = list(items.items())
        else:
            pairs = [p if type(p) is tuple else _pair(i, p) for i, p in enumerate(items)]
        torch_type, strided, torch_names = _torch_fast_path()
        # `pairs` keeps every tensor referenced while the copies run without the GIL.
        return self._core.put_many_pairs(pairs, readers if type(readers) is int else int(readers),
                                         _dtypes.STREAM_NAMES, torch_type, strided, torch_names,
                                         _slow_source)

    def reserve(self, key: str, shape, dtype="u8") -> "Reservation":
        """Space for one tensor of `shape` and `dtype` (a torch or NumPy dtype, or a stream
        name such as "bf16"), to be written in place and then published: no copy at all.

            r = producer.reserve("req-17", (4, 4096), torch.bfloat16)
            torch.matmul(x, w, out=r.torch())      # the result lands in shared memory
            descriptor = r.publish()

        The space goes back when the reservation is cancelled (or its `with` block ends
        unpublished) and no view of it is left. NoSpaceError in strict mode at the cap."""
        try:
            name, nbytes, layout = _RESERVED_SHAPES[dtype, shape]
        except (KeyError, TypeError):  # a new shape, or an unhashable one (a list)
            name, nbytes, layout = _reserved_shape(dtype, shape, key)
        return Reservation(self._core.reserve(key, nbytes), key, name, layout)

    def abort(self, key: str) -> int:
        """Frees exactly the blocks `key` owns (no prefix matching), each once its current
        readers release it; returns how many were marked."""
        return self._core.abort(key)

    def reclaim(self) -> None:
        """Reclaims released blocks now (put() does it on its own when it needs space)."""
        self._core.reclaim()

    def stats(self) -> dict:
        """total_bytes, free_bytes, largest_free_block, segments, live_blocks, spills, ...,
        numa (where segments are placed, e.g. "node:1 (the producer's node)") and numa_node
        (the node every segment is on; -1 when interleaved or first touch over several)."""
        _emit_logs()
        return self._core.stats()

    def segment_paths(self):
        return self._core.segment_paths()

    def segment_nodes(self) -> dict:
        """{node: bytes} of this producer's segments on each memory node, read from
        /proc/self/numa_maps; {} where the kernel has no NUMA."""
        return self._core.segment_nodes()

    def pending(self) -> list:
        """The blocks not yet given back, oldest first: one dict per block with key, state
        ("writing", "published", "aborted"), age_seconds (since it was reserved), readers_left
        (releases still expected), holders (consumer processes holding a view now), bytes,
        segment and spilled. It first ends the leases of consumer processes that died or exited
        without releasing, as reclaim() does."""
        return self._core.pending()

    @property
    def instance_name(self) -> str:
        return self._core.instance_name()

    @property
    def remote_address(self) -> str:
        """"ADDR:PORT" this producer serves other hosts on (`listen=`), "" when it does not."""
        return self._core.remote_address()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def close(self) -> None:
        self._core.close()


def _pair(index, item):
    try:
        key, tensor = item
    except (TypeError, ValueError):
        raise TypeError("put_many(): item %d is not a (key, tensor) pair: %s"
                        % (index, type(item).__name__)) from None
    return key, tensor


def _slow_source(index, key, tensor):
    """(address, nbytes, dtype, shape) of an item put_many's fast path did not take, or the
    error that says why it cannot be put."""
    if isinstance(tensor, _np.ndarray):
        return _numpy_source(tensor)
    if _is_torch(tensor):
        return _load_torch().source(tensor)
    raise TypeError("put_many(): item %d (key %r): expected a torch.Tensor or a numpy.ndarray, "
                    "got %s" % (index, key, type(tensor).__name__))


_TORCH_FAST = None


def _torch_fast_path():
    """(torch.Tensor, torch.strided, {torch dtype: stream name}) once torch is imported, for
    put_many's fast path; (None, None, {}) before (no tensor can be a torch tensor then)."""
    global _TORCH_FAST
    if _TORCH_FAST is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None, None, {}
        # Complex tensors take the slow path, which refuses lazy conjugate views.
        names = {k: v for k, v in _load_torch()._STREAM_NAMES.items() if not k.is_complex}
        _TORCH_FAST = (torch.Tensor, torch.strided, names)
    return _TORCH_FAST


def _is_torch(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _stream_name(dtype) -> str:
    """The stream dtype name of a torch dtype, a NumPy dtype (or type) or a name."""
    if isinstance(dtype, str):
        name = dtype.lower()
        if not _dtypes.is_plain(name):
            raise TypeError("reserve(): dtype %r has no element size; reserve \"u8\" bytes "
                            "instead" % dtype)
        return name
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        name = _load_torch()._STREAM_NAMES.get(dtype)
        if name is None:
            raise TypeError("reserve(): torch dtype %s has no stream name" % dtype)
        return name
    try:
        np_dtype = _np.dtype(dtype)
    except TypeError:
        raise TypeError("reserve(): expected a torch dtype, a NumPy dtype or a dtype name, got "
                        "%r" % (dtype,)) from None
    name = _dtypes.STREAM_NAMES.get(np_dtype)
    if name is None:
        raise TypeError("reserve(): NumPy dtype %s has no stream name" % np_dtype)
    return name


# (dtype, shape) as reserve() was given them -> (stream name, bytes, layout): an engine
# reserves the same few shapes again and again, and working them out costs more than the
# reservation itself (4 us against 2 us).
_RESERVED_SHAPES = {}


def _reserved_shape(dtype, shape, key):
    name = _stream_name(dtype)
    dims = tuple(int(d) for d in shape)
    nbytes = _dtypes.element_bytes(name, dims, key)
    found = (name, nbytes, _dtypes.stream_layout(name, dims, nbytes, key))
    try:
        if len(_RESERVED_SHAPES) >= 4096:
            _RESERVED_SHAPES.clear()
        _RESERVED_SHAPES[dtype, shape] = found
    except TypeError:
        pass
    return found


class Reservation:
    """Space for one tensor in a producer's segment, written in place, then published.

    `.numpy()` and `.torch()` give writable views of the space (bf16 as uint16 in NumPy);
    `publish(readers=1)` makes it readable and returns the descriptor; `cancel()` (or the end
    of a `with` block without publish) gives the space back once no view of it is left. Write
    only before publish(): afterwards the bytes belong to the readers, and the views made
    before stay valid memory but must not be written (as with C++'s Reservation).
    """

    __slots__ = ("_core", "key", "dtype", "shape", "nbytes", "_layout")

    def __init__(self, core, key, dtype, layout):
        self._core = core
        self.key = key
        self.dtype = dtype
        self.shape = layout.shape
        self.nbytes = core.nbytes
        self._layout = layout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._core.published:
            self._core.cancel()

    def __repr__(self):
        state = "published" if self.published else ("open" if self._core.open else "cancelled")
        return "<expert_arena.Reservation %r %s %s %s>" % (self.key, self.dtype,
                                                          list(self.shape), state)

    def numpy(self):
        """A writable NumPy view of the space (ValueError after publish() or cancel())."""
        return self._core.view(self._layout.numpy_dtype, self._layout.shape)

    def torch(self):
        """A writable torch tensor over the space (ValueError after publish() or cancel())."""
        return _load_torch().writable_view(self._core.view(_np.dtype(_np.uint8), [self.nbytes]),
                                           self._layout)

    def publish(self, readers: int = 1) -> bytes:
        """Makes the tensor readable by `readers` releases and returns its descriptor.
        BusyError when its key was aborted meanwhile (the space is given back)."""
        return self._core.publish(self.dtype, list(self.shape), int(readers))

    def cancel(self) -> None:
        """Gives the space back once no view of it is left (idempotent; not after publish)."""
        self._core.cancel()

    @property
    def published(self) -> bool:
        return self._core.published

    @property
    def spilled(self) -> bool:
        """True when the space is in a spill file (the producer was at its cap)."""
        return self._core.spilled

    @property
    def address(self) -> int:
        return self._core.address()


class StreamTensor:
    """A consumer's zero-copy view of one streamed tensor.

    `.key`, `.shape`, `.nbytes`; `.dtype` the torch dtype of `.torch()` (the NumPy dtype of
    `.numpy()` when torch is not installed), `.numpy_dtype`, and `.dtype_name` the stream's
    name ("f32", "bf16", ...); `.numpy()` and `.torch()` give read-only views.
    The reader's share goes back to the producer when this object and every view made from it
    are gone, or at `release()` (or the end of a `with` block) once the views are gone:
    after `release()` no new view can be made (ValueError), and views made before stay valid
    until they are dropped, so none ever reads memory given back to the producer.
    """

    __slots__ = ("_core", "_layout", "_release_later", "_where", "key", "dtype_name", "shape",
                 "nbytes")

    def __init__(self, core, summary=None):
        self._core = core
        self.key, self.dtype_name, self.shape, self.nbytes = summary or core.summary()
        self._layout = None
        self._release_later = False
        self._where = None

    @classmethod
    def _opened(cls, opened):
        # (handle, key, dtype, shape, nbytes) from _core's open_summary, without __init__'s
        # second call into the module.
        self = object.__new__(cls)
        self._core, self.key, self.dtype_name, self.shape, self.nbytes = opened
        self._layout = None
        self._release_later = False
        self._where = None
        return self

    @property
    def descriptor(self) -> dict:
        """The descriptor's fields: segment, spilled, slot, generation, offset, length, dtype,
        shape, key."""
        return self._core.descriptor()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._release_later:
            self.release()

    def __reduce__(self):
        """Pickles as a reference: the descriptor and the consumer's directories. The receiving
        process opens it (zero-copy) as one more reader, so the producer must have published
        it for as many readers as processes will open it; this one keeps its own share until
        it releases it."""
        if self._where is None or self._core.released:
            raise TypeError("stream tensor %s cannot be pickled: %s" % (
                self.key, "it was released" if self._core.released else
                "it was not opened by a StreamConsumer of this package"))
        return _receive_stream_tensor, (_core.encode_descriptor(self._core.descriptor()),
                                        self._where[0], self._where[1])

    def __deepcopy__(self, memo):
        raise TypeError("a StreamTensor is a reader's share of a producer's block, not data: "
                        "copy its view (t.torch().clone(), t.numpy().copy()), or open its "
                        "descriptor again")

    def __repr__(self):
        return "<expert_arena.StreamTensor %r %s %s%s>" % (
            self.key, self.dtype_name, list(self.shape), " released" if self.released else "")

    def _get_layout(self):
        if self._layout is None:
            self._layout = _dtypes.cached_stream_layout(self.dtype_name, self.shape,
                                                        self.nbytes, self.key)
        return self._layout

    @property
    def numpy_dtype(self):
        """The NumPy dtype of numpy() (bf16 as uint16, FP8 and unknown names as uint8)."""
        return (self._layout or self._get_layout()).numpy_dtype

    @property
    def dtype(self):
        """The torch dtype of torch() (torch.bfloat16 for "bf16"; uint8 for FP8 on a torch
        without FP8 types); the NumPy dtype of numpy() when torch is not installed."""
        layout = self._layout or self._get_layout()
        try:
            t = _load_torch()
        except ImportError:
            return layout.numpy_dtype
        return t.torch_dtype(layout.torch_name, layout.numpy_dtype)

    def numpy(self):
        """A read-only NumPy view (bf16 as uint16, unknown dtypes as raw uint8 bytes)."""
        layout = self._layout or self._get_layout()
        return self._core.view(False, layout.numpy_dtype, layout.shape)

    def torch(self, guard: bool = False):
        """A torch tensor over the bytes (no copy): an expert_arena.ArenaTensor over this
        process's copy-on-write mapping of the segment, whose ops cost what they cost on a
        plain tensor and whose in-place methods raise ValueError naming the key; a write by a
        route torch cannot intercept (out=, dlpack) stays in this process and is dropped when
        the share is released. pickle sends its descriptor (the receiver opens it as one more
        reader). `guard=True` gives a ReadOnlyTensor instead (tensors derived from it are
        read-only too, out= raises), at the cost of a Python call per op."""
        t = _load_torch()
        layout = self._layout or self._get_layout()
        cls = t.ReadOnlyTensor if guard else None
        if t.direct(layout):
            view = t.wrap(self._core.view(True, layout.numpy_dtype, layout.shape), cls)
        else:
            view = t.view(self._core.buffer(True), layout, cls)
        view._ea = (repr(self.key), (self._core, self._where or _NOWHERE))
        return view

    @property
    def address(self) -> int:
        """Address of the bytes the views point into: this process's copy-on-write mapping of
        the segment (for a zero-copy check or a device copy; it is not GPU-registered)."""
        return self._core.address()

    @property
    def released(self) -> bool:
        return self._core.released

    def release(self) -> None:
        """Gives this reader's share back once the views made from it are gone (idempotent)."""
        self._core.release()

    def release_after(self, event) -> None:
        """Gives this reader's share back once `event` has completed, as C++'s ReleaseWhen:
        `event` is anything with query() -> bool, such as a torch.cuda.Event recorded after an
        asynchronous copy from this tensor's views (the copy may outlive the views, which
        torch does not know to keep). Checked by every consumer's open(), open_many() and
        poll_releases(); a consumer's close() waits for it. The end of a `with` block no
        longer releases this tensor; release() still does, at once."""
        if not callable(getattr(event, "query", None)):
            raise TypeError("release_after(): expected an event with query(), such as a "
                            "torch.cuda.Event recorded after the copy, got %s"
                            % type(event).__name__)
        if self._core.released:
            raise ValueError("stream tensor %s was released" % self.key)
        self._release_later = True
        with _deferred_lock:
            _deferred.append((event, self))


_opened_tensor = StreamTensor._opened

# Stream tensors waiting for an event (release_after), settled by every consumer's calls and
# waited for by close(). Kept module-wide: a consumer dropped without close() must not drop
# them while a copy may still read their bytes.
_deferred = []
_deferred_lock = threading.Lock()


def _wait_for(event):
    synchronize = getattr(event, "synchronize", None)
    if callable(synchronize):
        synchronize()
        return
    while not event.query():
        time.sleep(0.0002)


def _settle_deferred(wait=False) -> int:
    """Releases the deferred tensors whose events completed (all of them, waiting, with
    `wait`); returns how many."""
    with _deferred_lock:
        done, keep = [], []
        for entry in _deferred:
            if wait:
                _wait_for(entry[0])
            if wait or entry[0].query():
                done.append(entry[1])
            else:
                keep.append(entry)
        _deferred[:] = keep
    for t in done:
        t.release()
    return len(done)


class StreamConsumer:
    """Opens descriptors from producers of this host (any process) as zero-copy tensors.

    Segments are mapped once and cached. Options as in `ConsumerOptions` of stream.h;
    `directory` and `spill_directory` must be the producers'.
    """

    def __init__(self, directory="/dev/shm", *, spill_directory="/var/tmp", gpu="none",
                 pin_budget_bytes=4 << 30, allow_foreign_owner=False, quiet=False,
                 remote_token=None, remote_timeout_seconds=30.0, remote_allow_no_token=False):
        self._where = (os.fsdecode(os.fspath(directory)), os.fsdecode(os.fspath(spill_directory)))
        self._core = _core.StreamConsumer(
            os.fsdecode(os.fspath(directory)), os.fsdecode(os.fspath(spill_directory)), gpu,
            int(pin_budget_bytes), bool(allow_foreign_owner), bool(quiet), remote_token or "",
            float(remote_timeout_seconds), bool(remote_allow_no_token))
        _emit_logs()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def open(self, descriptor: bytes) -> StreamTensor:
        """Validates `descriptor` and maps its tensor (GIL released). ValueError for a
        damaged or forged descriptor, FileNotFoundError when its segment is gone, BusyError
        or ValueError for an aborted or fully released block, each naming the key."""
        if type(descriptor) is not bytes:
            if not isinstance(descriptor, (bytes, bytearray, memoryview)):
                raise TypeError("open(): a descriptor is bytes, got %s"
                                % type(descriptor).__name__)
            descriptor = bytes(descriptor)
        if _deferred:
            _settle_deferred()
        t = _opened_tensor(self._core.open_summary(descriptor))
        t._where = self._where
        return t

    def open_many(self, descriptors, view=None, guard: bool = False) -> list:
        """open() of a batch in one call (the GIL released once), all or none: when one
        fails, those opened before it are released and the exception names its index.

        view=None gives StreamTensors; view="numpy" gives read-only NumPy arrays and
        view="torch" ArenaTensors in this process's copy-on-write mapping (as
        StreamTensor.torch(); `guard=True`: ReadOnlyTensors), each holding its reader's share
        until it (and every view made from it) is gone, which is the fastest way to read a
        batch."""
        if type(descriptors) is not list:
            descriptors = list(descriptors)
        if _deferred:
            _settle_deferred()
        if view is None:
            opened = [_opened_tensor(o) for o in self._core.open_many_summary(descriptors)]
            for t in opened:
                t._where = self._where
            return opened
        if view == "numpy":
            return self._core.open_many_arrays(descriptors, _dtypes.NUMPY_VIEW_DTYPES)
        if view == "torch":
            t = _load_torch()
            arrays = self._core.open_many_arrays(descriptors, t.direct_dtypes(), True)
            cls = t.ReadOnlyTensor if guard else t.ArenaTensor
            from_numpy, as_view, layout, where = t.torch.from_numpy, t.view, \
                _dtypes.cached_stream_layout, self._where
            out = []
            for a, d in zip(arrays, descriptors):
                if type(a) is not tuple:
                    v = from_numpy(a)
                    v.__class__ = cls  # t.wrap inlined: a call less per tensor
                else:
                    v = as_view(a[0], layout(a[1], a[2], a[0].nbytes, a[3]), cls)
                # The descriptor, for pickling, and for the key a refusal names (decoded then).
                v._ea = (None, (d, where))
                out.append(v)
            return out
        raise ValueError("open_many(): view is None, \"numpy\" or \"torch\", got %r" % (view,))

    def poll_releases(self) -> int:
        """Gives back the shares whose release_after() events completed; returns how many."""
        return _settle_deferred() + self._core.poll_releases()

    def stats(self) -> dict:
        return self._core.stats()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def close(self) -> None:
        """Waits for the events of tensors given to release_after() and releases them, then
        drops this handle; tensors opened from it keep the consumer's state alive."""
        if _deferred:
            _settle_deferred(wait=True)
        self._core.close()


_NOWHERE = ("/dev/shm", "/var/tmp")


_RECEIVING_CONSUMERS = {}
_RECEIVING_LOCK = threading.Lock()


def _receive_stream_tensor(descriptor, directory, spill_directory):
    """The receiving side of a pickled StreamTensor: opens its descriptor with this process's
    consumer of those directories (made once)."""
    where = (os.getpid(), directory, spill_directory)  # a forked child makes its own
    with _RECEIVING_LOCK:
        consumer = _RECEIVING_CONSUMERS.get(where)
        if consumer is None or consumer.closed:
            consumer = StreamConsumer(directory, spill_directory=spill_directory, quiet=True)
            _RECEIVING_CONSUMERS[where] = consumer
    return consumer.open(descriptor)


def decode_descriptor(descriptor: bytes) -> dict:
    """The fields of a descriptor (segment, offset, length, dtype, shape, key), validated."""
    return _core.decode_descriptor(bytes(descriptor))


def xxh3_64(data) -> int:
    """xxh3-64 of the bytes of a contiguous buffer (bytes, a NumPy array, a memoryview): the
    checksum `Arena.info()` reports, computed without the GIL."""
    if isinstance(data, _np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError("xxh3_64(): the array is not C-contiguous")
        data = data.reshape(-1).view(_np.uint8)
    return _core.xxh3_64(memoryview(data).cast("B"))


def sweep(directory="/dev/shm") -> dict:
    """Removes the stream segments in `directory` whose owner process is gone (robust to pid
    reuse; never another user's files). Returns {"removed": [...], "live": [...],
    "notes": [...]}."""
    return _core.sweep(os.fsdecode(os.fspath(directory)))


def metrics(directories=("/dev/shm",)) -> str:
    """The arenas and stream segments in `directories` in Prometheus' text exposition format:
    the text `expert-arena metrics` prints (docs/deployment.md#metrics), for an engine to add to its
    own /metrics. A directory that cannot be listed is expert_arena_directory_up 0, with a
    warning on the "expert_arena" logger naming why."""
    if isinstance(directories, (str, bytes, os.PathLike)):
        directories = [directories]
    text, problems = _core.metrics([os.fsdecode(os.fspath(d)) for d in directories])
    for problem in problems:
        _log.warning("expert_arena.metrics(): %s (reported as expert_arena_directory_up 0)",
                     problem)
    return text


def inspect_segment(path) -> dict:
    """A segment's header and block table (owner, liveness, live blocks), taking nothing."""
    return _core.inspect_segment(os.fsdecode(os.fspath(path)))


def load_into(module, arena, names=None, strict=False, requires_grad=False):
    """Puts arena tensors into an nn.Module's parameters and buffers without copying (torch
    1.13's load_state_dict copies). `names` maps arena names to module keys: a dict (HF
    names to module attributes), a callable returning the key or None, or None for the same
    names. Shapes and dtypes must match (ValueError naming both). Returns LoadResult(loaded,
    missing_keys, unexpected_keys); `strict` raises KeyError when a list is not empty, before
    anything is changed. Parameters become nn.Parameter(view, requires_grad=False)."""
    return _load_torch().load_into(module, arena, names, strict, requires_grad)


def decode_fp8(tensor, format="e4m3", dtype=None, scale=None):
    """FP8 codes (the uint8 views of f8_e4m3 / f8_e5m2 tensors, or a torch float8 tensor)
    decoded to torch.float32, or `dtype` (torch.bfloat16, torch.float16), times `scale` when
    given; works on torch 1.13, which has no FP8 types. `format` is "e4m3" (OCP e4m3fn:
    finite, max 448) or "e5m2" (IEEE-like, with inf and NaN)."""
    return _load_torch().decode_fp8(tensor, format, dtype, scale)


def __getattr__(name):
    if name == "LoadResult":
        return _load_torch().LoadResult
    if name == "ReadOnlyTensor":
        return _load_torch().ReadOnlyTensor
    if name == "ArenaTensor":
        return _load_torch().ArenaTensor
    raise AttributeError("module 'expert_arena' has no attribute %r" % name)
