"""The torch half of the package, imported only when a torch call is made.

Arena views are plain `torch.Tensor`s over the arena's copy-on-write mapping
(`Arena::CopyOnWriteData`): torch has no read-only tensors, and a guard written in Python
(`__torch_function__`) costs 5-50x a small op. Over a MAP_PRIVATE mapping every route to a
writable pointer (np.asarray, torch.from_numpy, dlpack, as_strided, set_, out=) is harmless: a
write copies the page it touches into this process and never reaches the shared file, the
GPU-registered mapping or another engine; the bytes the other views of this process read are
then the written ones, as for any tensor.

Stream tensor views are plain tensors too, over the consumer's copy-on-write mapping of the
segment (`StreamTensor::private_bytes()`): a write never reaches the producer's bytes.
`ReadOnlyTensor`, which refuses in-place operations with a ValueError (at the cost of a Python
call per op), is what `Arena.torch(name, guard=True)`, `StreamTensor.torch(guard=True)` and
`open_many(view="torch", guard=True)` give, for code that wants a write to raise.

Tensors whose bytes lie in a shared arena cross processes by reference through
multiprocessing's ForkingPickler (torch.multiprocessing Queues and Pools, multiprocessing's
own): the pickle holds the arena's path, identity, the byte range, dtype, size and strides,
and the receiving process attaches to the arena (once) and rebuilds the view zero-copy.
"""

from __future__ import annotations

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
    "__imatmul__", "__set__",
})


# Methods whose names end in "_" but that write no element: they change flags or metadata
# (requires_grad_; share_memory_ moves the storage into new shared memory, a copy).
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_"})


def _writes_in_place(name):
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES


class ReadOnlyTensor(torch.Tensor):
    """A tensor over shared memory that must not be written: in-place operations raise."""

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
            label = getattr(target, "_ea_name", None)
            raise ValueError(
                "expert_arena: %s would write into the read-only tensor %s (a view of shared "
                "memory: an arena or a stream segment); make a copy first (tensor.clone())"
                % (name, repr(label) if label else "view"))
        with _DisableTorchFunction():
            out = func(*args, **kwargs) if kwargs else func(*args)
            if to_numpy and isinstance(out, np.ndarray):
                out.flags.writeable = False
                return out
            return _rewrap(out, args, cls)


_FUNCTIONS = {}
_DisableTorchFunction = torch._C.DisableTorchFunction
_Tensor = torch.Tensor
_as_subclass = torch.Tensor.as_subclass


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
                    return _as_subclass(out, cls)
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


def view(buffer: np.ndarray, layout) -> torch.Tensor:
    """A ReadOnlyTensor over the writable uint8 `buffer` (never handed out) with `layout`.

    The tensor keeps `buffer` alive, and `buffer`'s base keeps the mapping alive.
    """
    t = torch.from_numpy(buffer)  # uint8; torch 1.13 takes no uint16 arrays
    dtype = torch_dtype(layout.torch_name, layout.numpy_dtype)
    if t.dtype != dtype:
        t = t.view(dtype)
    return torch.Tensor.as_subclass(t.reshape(layout.shape), ReadOnlyTensor)


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


def wrap(array: np.ndarray) -> torch.Tensor:
    """A ReadOnlyTensor over a writable typed array (never handed out) of a direct layout."""
    return torch.Tensor.as_subclass(torch.from_numpy(array), ReadOnlyTensor)


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
    storage = tensor.storage()
    nbytes = storage.nbytes()
    from . import _core
    found = _core.find_view(storage.data_ptr(), nbytes)
    if found is None:
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
                       storage_offset, requires_grad=False, parameter=False):
    """The receiving side of a view sent by reference: attaches to `path` and makes a
    zero-copy tensor over the same bytes, size and strides."""
    arena = _attached(path, identity_hash)
    buffer = arena._core.region(int(offset), int(nbytes), True)
    t = torch.from_numpy(buffer)
    if dtype != torch.uint8:
        t = t.view(dtype)
    t = t.as_strided(size, stride, storage_offset)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t


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
