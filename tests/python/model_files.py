"""Small model files written byte by byte, for dtypes `expert-arena gen-model` does not make:
safetensors integer, bool and FP8 tensors, and GGUF block-quantized (q4_K) and integer ones."""

import json
import struct

import numpy as np


def write_safetensors(path, tensors):
    """tensors: {name: (dtype name, shape, raw bytes)}."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def _gguf_string(s):
    b = s if isinstance(s, bytes) else s.encode()  # bytes: names that are not UTF-8
    return struct.pack("<Q", len(b)) + b


def write_gguf(path, tensors, alignment=32):
    """tensors: {name (str or bytes): (ggml type id, ne (ggml order), raw bytes)}; GGUF v3."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1))
    out += _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("llama")
    offset = 0
    offsets = []
    for name, (type_id, ne, raw) in tensors.items():
        out += _gguf_string(name) + struct.pack("<I", len(ne))
        out += b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", type_id, offset)
        offsets.append(offset)
        offset += len(raw) + (-len(raw) % alignment)
    out += b"\0" * (-len(out) % alignment)
    for (name, (_, _, raw)) in tensors.items():
        out += raw + b"\0" * (-len(raw) % alignment)
    with open(path, "wb") as f:
        f.write(out)


def pattern(nbytes, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()
