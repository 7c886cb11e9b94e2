"""The Python side of the streaming tests' processes, the same protocol as python_peer:

    stream_roles.py produce DIR   puts one tensor per dtype (NumPy and torch sources); prints
                                  "<key> <dtype> <shape,..> <xxh3> <descriptor hex>" per tensor,
                                  then "ready"; exits when stdin closes (or is killed)
    stream_roles.py consume DIR   reads descriptor hex lines; prints
                                  "<key> <dtype> <shape,..> <xxh3 of the view's bytes>"
"""

import sys

import numpy as np

import expert_arena

CASES = [("f64", (3, 5)), ("f32", (7, 3, 2)), ("f16", (9, 4)), ("bf16", (4, 11)),
         ("i64", (6,)), ("i32", (2, 2, 5)), ("i16", (13,)), ("i8", (3, 17)), ("u64", (5,)),
         ("u32", (4, 6)), ("u16", (10,)), ("u8", (257,)), ("bool", (12,)), ("c64", (3, 3)),
         ("f32", (1024, 1024))]
NUMPY = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64,
         "i32": np.int32, "i16": np.int16, "i8": np.int8, "u64": np.uint64, "u32": np.uint32,
         "u16": np.uint16, "u8": np.uint8, "bool": np.bool_, "c64": np.complex64}


def shape_text(shape):
    return ",".join(str(d) for d in shape) or "-"


def produce(directory):
    import torch
    rng = np.random.default_rng(99)
    producer = expert_arena.StreamProducer(directory, "pypeer", segment_bytes=8 << 20,
                                           max_segments=4, sweep_at_start=False, quiet=True)
    for i, (dtype, shape) in enumerate(CASES):
        if dtype == "bf16":
            source = torch.randn(shape, dtype=torch.float32).to(torch.bfloat16)
            raw = source.view(torch.int16).numpy().tobytes()
        else:
            nbytes = int(np.prod(shape)) * np.dtype(NUMPY[dtype]).itemsize
            raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
            if dtype == "bool":
                raw &= 1
            array = raw.view(NUMPY[dtype]).reshape(shape)
            raw = raw.tobytes()
            # Every other tensor goes in as a torch tensor, the rest as NumPy arrays.
            source = torch.from_numpy(array) if i % 2 and dtype not in ("u16", "u32", "u64") \
                else array
        key = "py-%s-%d" % (dtype, i)
        d = producer.put(key, source)
        print(key, dtype, shape_text(shape), "%016x" % expert_arena.xxh3_64(
            np.frombuffer(raw, np.uint8)), d.hex(), flush=True)
    print("ready", flush=True)
    sys.stdin.read()
    producer.close()


def consume(directory):
    consumer = expert_arena.StreamConsumer(directory, quiet=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            with consumer.open(bytes.fromhex(line)) as t:
                view = t.numpy()
                assert view.shape == tuple(t.shape) or view.dtype == np.uint8
                raw = np.ascontiguousarray(view).reshape(-1).view(np.uint8)
                if t.dtype == "bf16":
                    # The torch view holds the same bits.
                    import torch
                    assert t.torch().dtype == torch.bfloat16
                    tt = t.torch().contiguous().view(torch.int16).numpy()
                    assert tt.tobytes() == raw.tobytes()
                print(t.key, t.dtype, shape_text(t.shape),
                      "%016x" % expert_arena.xxh3_64(raw), flush=True)
        except (OSError, ValueError) as e:
            print("error %s: %s" % (type(e).__name__, e), flush=True)


if __name__ == "__main__":
    {"produce": produce, "consume": consume}[sys.argv[1]](sys.argv[2])
