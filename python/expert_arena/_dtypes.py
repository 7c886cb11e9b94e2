"""Dtype names of arenas and stream descriptors, and how their bytes become arrays.

Arena tensors keep the dtype and shape of their source: safetensors names are upper case
("BF16", "F8_E4M3") with the shape outermost first; GGUF names are ggml's lower case ("f32",
"q8_0") with the shape in ggml order (ne[0], the fastest-varying dimension, first), so the
array shape is that shape reversed, as gguf-py does. Stream descriptors carry the dtype name
and the row-major shape the producer gave (this package writes the lower-case names of
STREAM_NAMES); names are compared without regard to case.
"""

from __future__ import annotations

import numpy as np

from . import _core

# name (lower case) -> (NumPy dtype of the array, torch dtype attribute or None, itemsize).
# A torch attribute that the installed torch lacks falls back to the NumPy dtype's torch
# counterpart (see _torch.py); bf16 has no NumPy type and comes as uint16 in NumPy.
_PLAIN = {
    "f64": (np.float64, "float64"),
    "f32": (np.float32, "float32"),
    "f16": (np.float16, "float16"),
    "bf16": (np.uint16, "bfloat16"),
    "i64": (np.int64, "int64"),
    "i32": (np.int32, "int32"),
    "i16": (np.int16, "int16"),
    "i8": (np.int8, "int8"),
    "u64": (np.uint64, "uint64"),
    "u32": (np.uint32, "uint32"),
    "u16": (np.uint16, "uint16"),
    "u8": (np.uint8, "uint8"),
    "bool": (np.bool_, "bool"),
    "c64": (np.complex64, "complex64"),
    "c128": (np.complex128, "complex128"),
    # FP8: NumPy has no 8-bit floats; torch >= 2.1 has these types, older torch gets uint8.
    "f8_e4m3": (np.uint8, "float8_e4m3fn"),
    "f8_e5m2": (np.uint8, "float8_e5m2"),
    "f8_e8m0": (np.uint8, "float8_e8m0fnu"),
}

# lower-case stream name -> the NumPy dtype of its view (open_many(view="numpy")).
NUMPY_VIEW_DTYPES = {name: np.dtype(v[0]) for name, v in _PLAIN.items()}

# NumPy dtype -> the stream name put() writes.
STREAM_NAMES = {
    np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
    np.dtype(np.int64): "i64", np.dtype(np.int32): "i32", np.dtype(np.int16): "i16",
    np.dtype(np.int8): "i8", np.dtype(np.uint64): "u64", np.dtype(np.uint32): "u32",
    np.dtype(np.uint16): "u16", np.dtype(np.uint8): "u8", np.dtype(np.bool_): "bool",
    np.dtype(np.complex64): "c64", np.dtype(np.complex128): "c128",
}


class Layout:
    """How a tensor's bytes are viewed: NumPy dtype, torch dtype name, array shape."""

    __slots__ = ("numpy_dtype", "torch_name", "shape", "raw")

    def __init__(self, numpy_dtype, torch_name, shape, raw):
        self.numpy_dtype = np.dtype(numpy_dtype)
        self.torch_name = torch_name
        self.shape = tuple(shape)
        self.raw = raw  # True: uint8 bytes of a type without an element type (blocks, F4, ...)


def _count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _plain(name):
    return _PLAIN.get(name.lower())


def is_plain(name: str) -> bool:
    """True for a name with an element type (f32, bf16, u8, ...), not blocks or raw bytes."""
    return name.lower() in _PLAIN


def element_bytes(name: str, shape, key: str) -> int:
    """Bytes of a tensor of a plain dtype and shape (ValueError for a negative dimension)."""
    for d in shape:
        if d < 0:
            raise ValueError("reserve() of key %r: shape %s has a negative dimension"
                             % (key, list(shape)))
    return _count(shape) * np.dtype(_PLAIN[name.lower()][0]).itemsize


def arena_layout(dtype: str, shape, nbytes: int, tensor: str) -> Layout:
    """The layout of an arena tensor (see the module docstring for the shape order)."""
    # ggml names are lower case; safetensors names (F32, BF16, F8_E4M3) upper case.
    ggml_order = dtype != dtype.upper()
    lower = dtype.lower()
    plain = _plain(lower)
    array_shape = tuple(reversed(shape)) if ggml_order else tuple(shape)
    if plain is not None:
        layout = Layout(plain[0], plain[1], array_shape, False)
    else:
        block = _core.ggml_block(lower) if ggml_order else None
        if block is not None and array_shape and array_shape[-1] % block[0] == 0:
            row = array_shape[-1] // block[0] * block[1]
            layout = Layout(np.uint8, "uint8", array_shape[:-1] + (row,), True)
        else:
            # A type without an element type (F4, F6_*, an unknown name): the raw bytes.
            return Layout(np.uint8, "uint8", (nbytes,), True)
    expected = _count(layout.shape) * layout.numpy_dtype.itemsize
    if expected != nbytes:
        raise ValueError("tensor %s: %d bytes, but %s %s takes %d"
                         % (tensor, nbytes, dtype, list(shape), expected))
    return layout


def stream_layout(dtype: str, shape, nbytes: int, key: str) -> Layout:
    """The layout of a streamed tensor: row-major shape; an unknown dtype gives raw bytes."""
    plain = _plain(dtype)
    if plain is None:
        return Layout(np.uint8, "uint8", (nbytes,), True)
    layout = Layout(plain[0], plain[1], shape, False)
    expected = _count(layout.shape) * layout.numpy_dtype.itemsize
    if expected != nbytes:
        raise ValueError("stream tensor %s: %d bytes, but %s %s takes %d"
                         % (key, nbytes, dtype, list(shape), expected))
    return layout


def as_numpy(buffer, layout: Layout):
    """A view of the uint8 `buffer` with the layout's dtype and shape (no copy)."""
    array = buffer if layout.numpy_dtype == np.uint8 else buffer.view(layout.numpy_dtype)
    return array.reshape(layout.shape)


_STREAM_LAYOUTS = {}


def cached_stream_layout(dtype: str, shape, nbytes: int, key: str) -> Layout:
    """stream_layout, remembered for the shapes an engine sends again and again."""
    k = (dtype, shape, nbytes)
    layout = _STREAM_LAYOUTS.get(k)
    if layout is None:
        layout = stream_layout(dtype, shape, nbytes, key)
        if len(_STREAM_LAYOUTS) >= 4096:
            _STREAM_LAYOUTS.clear()
        _STREAM_LAYOUTS[k] = layout
    return layout
