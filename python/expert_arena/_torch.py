"""The torch half of the package, imported only when a torch call is made.

Arena and stream torch views are `ArenaTensor`s over this process's copy-on-write mapping
(`Arena::CopyOnWriteData`, `StreamTensor::private_bytes()`): torch has no read-only tensors,
and a guard written in Python (`__torch_function__`) costs 4-14x a small op. `ArenaTensor`'s
`__torch_function__` is torch's disabled implementation, so its ops run no Python; its own
in-place methods raise naming the tensor. The routes torch gives no Python hook without a
per-op cost (np.asarray of a derived tensor, torch.from_numpy, dlpack, as_strided, set_, out=)
are harmless over the MAP_PRIVATE mapping: a write copies the page it touches into this process
and never reaches the shared file, the GPU-registered mapping or another engine.
`ReadOnlyTensor` (`guard=True`) runs a Python `__torch_function__` per call and refuses those
routes too.

Tensors whose bytes lie in a shared arena, and stream views, cross processes by reference
through every pickler but torch.save's (ArenaTensor.__reduce_ex__, a copyreg reduction for
plain tensors, and multiprocessing's ForkingPickler): the pickle holds the arena's path,
identity, the byte range, dtype, size and strides (or the stream descriptor), and the receiving
process attaches to the arena (once) and rebuilds the view zero-copy. torch.save gets the
bytes. A tensor whose bytes lie on pages a write in this process copied (private copy-on-write
pages, found in the page tables) goes by value: a reference would give the receiver the arena's
bytes, not the ones written here.
"""

from __future__ import annotations

import collections
import copyreg
import pickle
import sys

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised by test_torch_missing
    raise ImportError(
        "expert_arena: this call needs PyTorch, which is not installed for this interpreter; "
        "install python3-torch (Debian/Ubuntu) or `pip install torch`") from e

_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__idiv__", "__set__",
})


# Methods whose names end in "_" but that write no element: they change flags or metadata
# (requires_grad_; share_memory_ moves the storage into new shared memory, a copy).
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_"})


def _writes_in_place(name):
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


_Tensor = torch.Tensor
_as_subclass = torch.Tensor.as_subclass
_detach = torch.Tensor.detach
# A new tensor of class `cls` over a plain tensor's storage, size and strides, that is not an
# autograd view of it (as_subclass makes one: indexing a view of a view costs 0.1 us more).
_make_subclass = torch.Tensor._make_subclass


def _label(tensor):
    """How a refusal names the tensor: its arena path and name, or its stream key."""
    ea = getattr(tensor, "_ea", None)
    if not ea:
        return "view"
    if ea[0] is None:  # open_many's views: the key is in the descriptor
        from . import _core
        return repr(_core.decode_descriptor(bytes(ea[1][0]))["key"])
    return ea[0]


def _refusal(name):
    def refuse(self, *args, **kwargs):
        raise ValueError(
            "expert_arena: %s would write into the read-only tensor %s (a zero-copy view of "
            "shared memory); make a copy first (tensor.clone())" % (name, _label(self)))
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = "Refused: %s would write into shared memory (ValueError)." % name
    return refuse


class ArenaTensor(torch.Tensor):
    """The torch view the package hands out for an arena tensor or a stream tensor: a
    torch.Tensor over this process's copy-on-write mapping whose in-place methods raise.

    `__torch_function__` is torch's disabled implementation, so torch's C++ argument parser
    never calls into Python for it, and its per-call lookup of that attribute is answered in
    C (_core.fast_torch_function_lookup): ops cost what they cost on a plain tensor (20-50 ns
    more per call) and their results are plain tensors. The in-place
    methods (every `*_` method but requires_grad_, share_memory_ and detach_, the in-place
    operators, `__setitem__`) raise ValueError naming the tensor; numpy() and np.asarray()
    give read-only arrays. What cannot be intercepted without a per-op cost (out=, torch.*
    in-place functions, writes through a tensor derived by an op, dlpack, torch.from_numpy of
    a view's array) writes a private copy of the page (docs/python.md).

    pickle (any pickler but torch.save's), copy.deepcopy and multiprocessing Queues send a
    reference (arena path, byte range, dtype, size, strides; or the stream descriptor), and
    the receiver re-attaches zero-copy; torch.save saves the bytes.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def detach(self):
        # nn.Parameter(view) needs detach() to keep the type (torch 1.13's Parameter.__new__
        # for subclasses); the result is the same bytes, read-only too.
        out = _make_subclass(type(self), _detach(self))
        ea = getattr(self, "_ea", None)
        if ea is not None:
            out._ea = ea
        return out

    def numpy(self):
        out = _Tensor.numpy(self)
        out.flags.writeable = False
        return out

    def __reduce_ex__(self, proto):
        if not _saving():
            ref = _reference(self)
            if ref is not None:
                return ref
        return _reduce_bytes(self, proto)

    def __deepcopy__(self, memo):
        # A deep copy of bytes nothing may write is a new view of the same bytes (as
        # copy.deepcopy returns a tuple or a str itself): no copy of the data.
        out = memo.get(id(self))
        if out is None:
            out = _make_subclass(type(self), _detach(self))
            out.__dict__.update(self.__dict__)
            if self.requires_grad:
                out.requires_grad_(True)
            memo[id(self)] = out
        return out


_NOT_WRITES_METHODS = frozenset({"requires_grad_", "share_memory_", "detach_"})
for _name in dir(torch.Tensor):
    if (_name.endswith("_") and not _name.endswith("__") and _name not in _NOT_WRITES_METHODS) \
            or _name in _INPLACE_DUNDERS:
        setattr(ArenaTensor, _name, _refusal(_name))

# torch asks each tensor argument for its __torch_function__ on every call: answered from
# ArenaTensor's class dict without a string built per call (python/src/torch_type.cc).
from . import _core  # noqa: E402
_core.fast_torch_function_lookup(ArenaTensor)


class ReadOnlyTensor(ArenaTensor):
    """guard=True: an ArenaTensor whose every torch call passes through Python, so that
    tensors derived from it (w[3], w.t()) are read-only too and out= raises, at a few
    microseconds per op."""

    def as_subclass(self, cls):
        # torch does not route as_subclass through __torch_function__: without this, a plain
        # tensor over the read-only mapping would escape the guard and a write through it
        # would end the process with SIGSEGV instead of raising.
        if isinstance(cls, type) and issubclass(cls, ReadOnlyTensor):
            return torch.Tensor.as_subclass(self, cls)
        raise ValueError(
            "expert_arena: as_subclass(%s) would drop the read-only guard of a view of shared "
            "memory (an arena or a stream segment); make a copy first (tensor.clone())"
            % getattr(cls, "__name__", cls))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Called for every torch call on a guarded tensor: kept short (a dict lookup per call
        # for the function's name and whether it writes).
        info = _FUNCTIONS.get(func)
        if info is None:
            name = getattr(func, "__name__", "")
            info = _FUNCTIONS[func] = (name, _writes_in_place(name),
                                       name in ("numpy", "__array__"))
        name, writes, to_numpy = info
        out_arg = kwargs.get("out") if kwargs else None
        if (writes and args and isinstance(args[0], ReadOnlyTensor)) or \
                isinstance(out_arg, ReadOnlyTensor):
            target = args[0] if writes and args and isinstance(args[0], ReadOnlyTensor) \
                else out_arg
            raise ValueError(
                "expert_arena: %s would write into the read-only tensor %s (a zero-copy view "
                "of shared memory); make a copy first (tensor.clone())"
                % (name, _label(target)))
        with _DisableTorchFunction():
            out = func(*args, **kwargs) if kwargs else func(*args)
            if to_numpy and isinstance(out, np.ndarray):
                out.flags.writeable = False
                return out
            return _rewrap(out, args, cls)


_FUNCTIONS = {}
_DisableTorchFunction = torch._C.DisableTorchFunction


def _storage_range(t):
    # Tensor._storage() (the untyped storage) where torch has it: storage() builds a
    # TypedStorage, several microseconds.
    get = getattr(t, "_storage", None) or getattr(t, "untyped_storage", None)
    storage = get() if get is not None else t.storage()
    return storage.data_ptr(), storage.nbytes()


def _rewrap(out, args, cls):
    """Results that point into a read-only tensor's memory stay read-only."""
    if type(out) is cls:  # the tensor itself (requires_grad_, detach_): the same object
        return out
    if isinstance(out, _Tensor):
        if not out.is_cpu:
            return out if type(out) is _Tensor else _as_subclass(out, _Tensor)
        p = out.data_ptr()
        for a in args:
            if isinstance(a, ReadOnlyTensor):
                start, size = _storage_range(a)
                if start <= p < start + max(size, 1):
                    out = _as_subclass(out, cls)
                    if getattr(a, "_ea", None) is not None:
                        # The name only: a part of a stream tensor pickles as bytes.
                        out._ea = (_label(a), None)
                    return out
        return out if type(out) is _Tensor else _as_subclass(out, _Tensor)
    if isinstance(out, (tuple, list)) and any(isinstance(o, _Tensor) for o in out):
        return type(out)(_rewrap(o, args, cls) for o in out)
    return out


_TORCH_DTYPES = {}


def torch_dtype(torch_name: str, numpy_dtype) -> "torch.dtype":
    """The torch dtype for a layout; types this torch lacks (uint16 before torch 2.3, the FP8
    types before 2.1) fall back to the same-width type of the NumPy view."""
    key = (torch_name, numpy_dtype)
    dtype = _TORCH_DTYPES.get(key)
    if dtype is None:
        dtype = getattr(torch, torch_name, None)
        if not isinstance(dtype, torch.dtype):
            fallback = {np.dtype(np.uint16): torch.int16, np.dtype(np.uint32): torch.int32,
                        np.dtype(np.uint64): torch.int64}
            dtype = fallback.get(np.dtype(numpy_dtype)) or \
                torch.from_numpy(np.zeros(0, dtype=numpy_dtype)).dtype
        _TORCH_DTYPES[key] = dtype
    return dtype


def view(buffer: np.ndarray, layout, cls=None) -> torch.Tensor:
    """An ArenaTensor (or `cls`) over the writable uint8 `buffer` (never handed out) with
    `layout`. The tensor keeps `buffer` alive, and `buffer`'s base keeps the mapping alive.
    """
    t = torch.from_numpy(buffer)  # uint8; torch 1.13 takes no uint16 arrays
    dtype = torch_dtype(layout.torch_name, layout.numpy_dtype)
    if t.dtype != dtype:
        t = t.view(dtype)
    return _make_subclass(cls or ArenaTensor, t.reshape(layout.shape))


_DIRECT = {}


def direct(layout) -> bool:
    """True when torch.from_numpy of an array of the layout's NumPy dtype gives the layout's
    torch dtype (f32, f16, the integers torch has, ...), so a typed array can be wrapped as
    it is; bf16, FP8 and raw blocks go through view()."""
    key = (layout.numpy_dtype, layout.torch_name)
    ok = _DIRECT.get(key)
    if ok is None:
        try:
            ok = torch.from_numpy(np.zeros(1, layout.numpy_dtype)).dtype == \
                torch_dtype(layout.torch_name, layout.numpy_dtype)
        except TypeError:
            ok = False
        _DIRECT[key] = ok
    return ok


_DIRECT_DTYPES = None


def direct_dtypes() -> dict:
    """{stream dtype name: NumPy dtype} of the names whose arrays torch.from_numpy takes as
    they are (open_many(view="torch") makes those typed; the rest come as bytes)."""
    global _DIRECT_DTYPES
    if _DIRECT_DTYPES is None:
        from . import _dtypes
        _DIRECT_DTYPES = {}
        for name, numpy_dtype in _dtypes.NUMPY_VIEW_DTYPES.items():
            layout = _dtypes.stream_layout(name, (1,), numpy_dtype.itemsize, name)
            if direct(layout):
                _DIRECT_DTYPES[name] = numpy_dtype
    return _DIRECT_DTYPES


def wrap(array: np.ndarray, cls=None) -> torch.Tensor:
    """An ArenaTensor (or `cls`) over a writable typed array (never handed out) of a direct
    layout."""
    t = torch.from_numpy(array)
    # The new tensor (no other reference, not an autograd view) becomes an instance of the
    # subclass in place: 0.1 us, where _make_subclass makes a second tensor (1-2 us).
    t.__class__ = cls or ArenaTensor
    return t


def writable_view(buffer: np.ndarray, layout) -> torch.Tensor:
    """A plain (writable) tensor over the writable uint8 `buffer` with `layout`."""
    t = torch.from_numpy(buffer)
    dtype = torch_dtype(layout.torch_name, layout.numpy_dtype)
    if t.dtype != dtype:
        t = t.view(dtype)
    return t.reshape(layout.shape)


def source(tensor):
    """(address, nbytes, stream dtype name, shape) of a CPU tensor put() may copy."""
    if tensor.layout != torch.strided:
        raise ValueError("put(): a %s tensor has no contiguous bytes; call .to_dense() first"
                         % tensor.layout)
    if not tensor.is_cpu:  # (tensor.device builds an object: 10x the cost)
        raise ValueError(
            "put(): the tensor is on %s; put() copies CPU memory (copy it to the host first, "
            "e.g. tensor.cpu(), or into a pinned buffer)" % tensor.device)
    if not tensor.is_contiguous():
        raise ValueError("put(): the tensor is not contiguous (shape %s, stride %s); call "
                         ".contiguous() first" % (list(tensor.shape), list(tensor.stride())))
    name = _STREAM_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError("put(): torch dtype %s has no stream name" % tensor.dtype)
    if tensor.is_complex() and (tensor.is_conj() or tensor.is_neg()):
        # The bytes are the unconjugated (or unnegated) values: putting them would be wrong.
        raise ValueError("put(): the tensor is a lazy conjugate or negative view; call "
                         ".resolve_conj() / .resolve_neg() first")
    return (tensor.data_ptr(), tensor.numel() * tensor.element_size(), name,
            list(tensor.shape))


_STREAM_NAMES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}
for _attr, _name in (("uint16", "u16"), ("uint32", "u32"), ("uint64", "u64"),
                     ("float8_e4m3fn", "f8_e4m3"), ("float8_e5m2", "f8_e5m2"),
                     ("float8_e8m0fnu", "f8_e8m0")):
    if isinstance(getattr(torch, _attr, None), torch.dtype):
        _STREAM_NAMES[getattr(torch, _attr)] = _name


# ---- Arena views across processes ---------------------------------------------------------

def _arena_reference(tensor):
    """The rebuild arguments of a CPU tensor whose storage lies in a shared arena's view
    mapping, or None."""
    if tensor.layout != torch.strided or not tensor.is_cpu or \
            (tensor.requires_grad and not tensor.is_leaf):
        return None
    try:
        start, nbytes = _storage_range(tensor)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
        return None
    from . import _core
    found = _core.find_view(start, nbytes)
    if found is None:
        return None
    if _core.view_private_bytes(start, nbytes, True):
        # A write in this process (out=, an in-place op on a plain tensor over the view, a
        # slice's) copied some of these pages and changed them: the receiver of a reference
        # would read the arena's bytes instead. Sent by value (decided by what the pages are
        # in the page tables, then by their bytes).
        return None
    path, identity_hash, offset = found
    return (path, identity_hash, offset, nbytes, tensor.dtype, tuple(tensor.size()),
            tuple(tensor.stride()), tensor.storage_offset())


_ATTACHED = {}


def _attached(path, identity_hash):
    """This process's attachment to the arena at `path` (made once and kept: views received
    later reuse it), checked to be the same arena the sender had."""
    from . import attach
    arena = _ATTACHED.get(path)
    if arena is None or arena.closed or arena.report["identity_hash"] != identity_hash:
        arena = attach(path)
        if arena.report["identity_hash"] != identity_hash:
            arena.close()
            raise ValueError(
                "expert_arena: a tensor sent from the arena %s cannot be rebuilt: the file now "
                "holds another model (identity %016x, the sender's was %016x)"
                % (path, arena.report["identity_hash"], identity_hash))
        _ATTACHED[path] = arena
    return arena


def rebuild_arena_view(path, identity_hash, offset, nbytes, dtype, size, stride,
                       storage_offset, requires_grad=False, parameter=False, label=None,
                       arena_tensor=False):
    """The receiving side of a view sent by reference: attaches to `path` and makes a
    zero-copy tensor over the same bytes, size and strides (an ArenaTensor when the sender's
    was one, an nn.Parameter when it was one)."""
    arena = _attached(path, identity_hash)
    buffer = arena._core.region(int(offset), int(nbytes), True)
    t = torch.from_numpy(buffer)
    if dtype != torch.uint8:
        t = t.view(dtype)
    t = t.as_strided(size, stride, storage_offset)
    if arena_tensor:
        t = _make_subclass(ArenaTensor, t)
        if label is not None:
            t._ea = (label, None)
        if parameter:
            return torch.nn.Parameter(t, requires_grad=requires_grad)
        if requires_grad:
            t.requires_grad_(True)
        return t
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t


def rebuild_stream_view(descriptor, directory, spill_directory, requires_grad=False,
                        parameter=False):
    """The receiving side of a stream view sent by reference: this process's consumer of the
    sender's directories opens the descriptor as one more reader, and the view holds that
    share (given back when the view and every tensor made from it are gone)."""
    from . import _receive_stream_tensor
    st = _receive_stream_tensor(descriptor, directory, spill_directory)
    t = st.torch()
    del st  # the view holds the share
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _save_codes():
    import torch.serialization as ser
    return frozenset(getattr(ser, f).__code__ for f in ("_save", "_legacy_save")
                     if hasattr(ser, f))


_SAVE_CODES = _save_codes()


def _saving():
    """True when the caller is torch.save (its pickler is on this thread's stack): a
    checkpoint must hold the bytes, not a reference to /dev/shm."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in _SAVE_CODES:
            return True
        f = f.f_back
    return False


def _reference(tensor):
    """The reduction that sends an ArenaTensor by reference, or None (a private arena)."""
    parameter = bool(getattr(tensor, "_is_param", False))
    ea = getattr(tensor, "_ea", None)
    if ea is not None and ea[1] is not None:  # a stream view: (handle, where) or descriptor
        source, where = ea[1]
        if not isinstance(source, bytes):
            from . import _core
            source = _core.encode_descriptor(source.descriptor())
        return rebuild_stream_view, (source, where[0], where[1], tensor.requires_grad,
                                     parameter)
    ref = _arena_reference(tensor)
    if ref is None:
        return None
    return rebuild_arena_view, ref + (tensor.requires_grad, parameter,
                                      ea[0] if ea else None, True)


def _reduce_bytes(tensor, proto):
    """torch's own reduction of the same tensor as a plain tensor (or nn.Parameter): the
    bytes, which torch.load rebuilds as an ordinary tensor."""
    plain = _detach(_as_subclass(tensor, _Tensor))
    if getattr(tensor, "_is_param", False):
        return torch._utils._rebuild_parameter, (plain, tensor.requires_grad,
                                                 collections.OrderedDict())
    if tensor.requires_grad:
        plain.requires_grad_(True)
    return plain.__reduce_ex__(proto)


def _reduce_plain(tensor):
    """copyreg's reduction of a plain torch.Tensor: one whose storage lies in a shared arena
    (w[3], w.t() of a view) goes by reference outside torch.save; every other one as torch
    reduces it."""
    if type(tensor) is _Tensor and not _saving():
        ref = _arena_reference(tensor)
        if ref is not None:
            return rebuild_arena_view, ref + (tensor.requires_grad, False)
    return tensor.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


def _reducer(previous, parameter):
    def reduce(tensor):
        ref = _arena_reference(tensor)
        if ref is None:
            return previous(tensor)
        return rebuild_arena_view, ref + (tensor.requires_grad, parameter)
    reduce.__name__ = "reduce_arena_tensor"
    return reduce


def _default_reduce(tensor):
    return tensor.__reduce_ex__(4)


def register_reductions():
    """Registers with multiprocessing's ForkingPickler (torch.multiprocessing Queues and
    Pools, multiprocessing's own) a reduction that sends views of shared arenas by reference
    and hands every other tensor to the reduction registered before (torch's, which moves it
    to shared memory)."""
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing  # noqa: F401  (torch's reductions first; ours wrap them)
    for cls, parameter in ((torch.Tensor, False), (torch.nn.Parameter, True)):
        previous = ForkingPickler._extra_reducers.get(cls, _default_reduce)
        if getattr(previous, "__name__", "") == "reduce_arena_tensor":
            continue
        ForkingPickler.register(cls, _reducer(previous, parameter))


register_reductions()
copyreg.pickle(torch.Tensor, _reduce_plain)


def private_bytes(tensor, changed=False):
    """Bytes of `tensor` (a CPU view of a shared arena, or a tensor made over one) that lie on
    pages a write in this process copied: this process reads them, every other engine reads
    the arena's; `changed`: only those whose bytes differ from the arena's. ValueError for a
    tensor that is not over a shared arena's views."""
    if not isinstance(tensor, _Tensor) or tensor.layout != torch.strided or not tensor.is_cpu:
        raise ValueError("private_bytes(): expected a CPU tensor over a shared arena's views")
    # The bytes from the first element to the last (torch strides are never negative).
    span = 0 if tensor.numel() == 0 else tensor.element_size() * (
        1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride())))
    from . import _core
    found = _core.view_private_bytes(tensor.data_ptr(), span, bool(changed))
    if found is None:
        raise ValueError("private_bytes(): the tensor is not a view of a shared arena (or the "
                         "arena is private: no shared bytes to differ from)")
    return found


# ---- Loading into modules -----------------------------------------------------------------

class LoadResult(tuple):
    """(loaded, missing_keys, unexpected_keys) of load_into()."""

    __slots__ = ()

    def __new__(cls, loaded, missing_keys, unexpected_keys):
        return tuple.__new__(cls, (loaded, missing_keys, unexpected_keys))

    loaded = property(lambda self: self[0])
    missing_keys = property(lambda self: self[1])
    unexpected_keys = property(lambda self: self[2])

    def __repr__(self):
        return "LoadResult(loaded=%d, missing_keys=%r, unexpected_keys=%r)" % (
            len(self[0]), self[1], self[2])


def load_into(module, arena, names=None, strict=False, requires_grad=False):
    """Puts arena tensors into `module`'s parameters and buffers without copying.

    `names` maps an arena tensor name to the module key (as in module.state_dict()): a dict
    (arena names it lists that the arena lacks are skipped: their keys stay missing), a
    callable returning the key or None (skip), or None (the same names). Each target must
    exist with the same shape and dtype (ValueError naming both otherwise); a parameter
    becomes nn.Parameter(view, requires_grad=False), a buffer the view itself. Returns
    LoadResult(loaded, missing_keys, unexpected_keys): the keys filled, the module's keys left
    as they were, and the arena names (dict: the mapped ones) that name no key of the module.
    `strict` raises KeyError when either list is not empty, before anything is changed."""
    if names is None:
        def key_of(name):
            return name
    elif callable(names):
        key_of = names
    else:
        mapping = dict(names)

        def key_of(name):
            return mapping.get(name)
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    plan, unexpected = [], []
    for name in (arena.keys() if names is None or callable(names) else
                 [n for n in mapping if n in arena]):
        key = key_of(name)
        if key is None:
            continue
        target = params.get(key)
        if target is None:
            target = buffers.get(key)
        if target is None:
            unexpected.append(name)
            continue
        view = arena.torch(name)
        if tuple(view.shape) != tuple(target.shape) or view.dtype != target.dtype:
            raise ValueError(
                "load_into(): arena tensor %r is %s %s but %s is %s %s"
                % (name, view.dtype, list(view.shape), key, target.dtype, list(target.shape)))
        plan.append((key, view, key in params))
    loaded = [key for key, _, _ in plan]
    missing = [k for k in list(params) + list(buffers) if k not in set(loaded)]
    if strict and (missing or unexpected):
        raise KeyError("load_into(): missing keys %s, unexpected names %s" % (missing, unexpected))
    for key, view, is_param in plan:
        owner_name, _, attr = key.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if is_param:
            setattr(owner, attr, torch.nn.Parameter(view, requires_grad=requires_grad))
        else:
            owner._buffers[attr] = view
    return LoadResult(loaded, missing, unexpected)


# ---- FP8 ----------------------------------------------------------------------------------

_FP8 = {}


def _fp8_table(kind):
    """The 256 values of an FP8 format as float32 (OCP FP8: e4m3fn has no infinities and one
    NaN per sign; e5m2 follows IEEE 754 with infinities and NaNs)."""
    table = _FP8.get(kind)
    if table is None:
        if kind == "e4m3":
            exp_bits, man_bits, bias = 4, 3, 7
        elif kind == "e5m2":
            exp_bits, man_bits, bias = 5, 2, 15
        else:
            raise ValueError("decode_fp8(): format is \"e4m3\" or \"e5m2\", got %r" % (kind,))
        codes = np.arange(256, dtype=np.uint32)
        sign = np.where(codes & 0x80, -1.0, 1.0)
        exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
        man = codes & ((1 << man_bits) - 1)
        normal = (1.0 + man / float(1 << man_bits)) * np.power(2.0, exp.astype(np.float64) - bias)
        subnormal = (man / float(1 << man_bits)) * 2.0 ** (1 - bias)
        values = sign * np.where(exp == 0, subnormal, normal)
        if kind == "e4m3":
            values[(exp == 15) & (man == 7)] = np.nan
        else:
            top = exp == 31
            values[top & (man == 0)] = sign[top & (man == 0)] * np.inf
            values[top & (man != 0)] = np.nan
        table = torch.from_numpy(values.astype(np.float32))
        _FP8[kind] = table
    return table


def decode_fp8(tensor, format="e4m3", dtype=None, scale=None):
    """FP8 bytes (uint8, or a torch float8 tensor) decoded to `dtype` (torch.float32 by
    default, or torch.bfloat16 / float16), optionally multiplied by `scale` (a number or a
    tensor that broadcasts, such as a per-block scale already expanded). Works on torch 1.13,
    which has no FP8 dtypes: a table lookup of the 256 codes."""
    if not isinstance(tensor, torch.Tensor):
        tensor = torch.from_numpy(np.asarray(tensor))
    if tensor.dtype != torch.uint8:
        if tensor.element_size() != 1:
            raise TypeError("decode_fp8(): expected 1-byte codes (uint8 or a float8 dtype), got "
                            "%s" % tensor.dtype)
        tensor = tensor.view(torch.uint8)
    table = _fp8_table(format).to(tensor.device)
    out = table[tensor.long()]
    if scale is not None:
        out = out * scale
    return out.to(dtype) if dtype is not None and dtype != torch.float32 else out
