"""The torch half of the package, imported only when a torch call is made.

Views of arena and stream bytes are `ReadOnlyTensor`s: torch (before 2.x and still today) has
no read-only tensors, and arena mappings are read-only (a write would be a segfault) or, when
registered with a GPU, shared with every engine (a write would corrupt them all). The subclass
refuses every in-place operation on itself and on the views derived from it with a ValueError;
everything else runs as on a plain tensor, and results that own new memory (`.to("cuda")`,
`.float()` of an f16 tensor, a matmul) are plain tensors.
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


def _writes_in_place(name):
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__")


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
        if kwargs is None:
            kwargs = {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if (isinstance(target, ReadOnlyTensor) and _writes_in_place(name)) or \
                isinstance(kwargs.get("out"), ReadOnlyTensor):
            raise ValueError(
                "expert_arena: %s would write into a read-only view of shared memory (an arena "
                "or a stream segment); make a copy first (tensor.clone())" % name)
        with torch._C.DisableTorchFunction():
            out = func(*args, **kwargs)
            if name == "numpy" and isinstance(out, np.ndarray):
                out.flags.writeable = False
                return out
            return _rewrap(out, args, cls)


def _ranges(args):
    ranges = []
    for a in args:
        if isinstance(a, ReadOnlyTensor):
            storage = a.storage()
            ranges.append((storage.data_ptr(), storage.nbytes()))
    return ranges


def _rewrap(out, args, cls):
    """Results that point into a read-only tensor's memory stay read-only."""
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            return out if type(out) is torch.Tensor else torch.Tensor.as_subclass(out, torch.Tensor)
        p = out.data_ptr()
        for start, size in _ranges(args):
            if start <= p < start + max(size, 1):
                return torch.Tensor.as_subclass(out, cls)
        return out if type(out) is torch.Tensor else torch.Tensor.as_subclass(out, torch.Tensor)
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
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
