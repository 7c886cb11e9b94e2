"""The Python side of the streaming tests' processes, the same protocol as python_peer:

    stream_roles.py produce DIR   puts one tensor per dtype (NumPy and torch sources); prints
                                  "<key> <dtype> <shape,..> <xxh3> <descriptor hex>" per tensor,
                                  then "ready"; exits when stdin closes (or is killed)
    stream_roles.py consume DIR   reads descriptor hex lines; prints
                                  "<key> <dtype> <shape,..> <xxh3 of the view's bytes>"
    stream_roles.py produce-batch DIR
                                  as produce, with every tensor in one put_many and a second
                                  copy of each written in place (reserve, write, publish)
    stream_roles.py consume-many DIR VIEW
                                  as consume, opening all lines with one open_many(view=VIEW)
                                  (tensor, numpy or torch)
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


def sources():
    """(key, dtype, shape, source, raw bytes) per case: NumPy and torch sources alternate."""
    import torch
    rng = np.random.default_rng(99)
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
        yield "py-%s-%d" % (dtype, i), dtype, shape, source, raw


def checksum(raw):
    return "%016x" % expert_arena.xxh3_64(np.frombuffer(raw, np.uint8))


def new_producer(directory):
    return expert_arena.StreamProducer(directory, "pypeer", segment_bytes=8 << 20,
                                       max_segments=4, sweep_at_start=False, quiet=True)


def produce(directory):
    producer = new_producer(directory)
    for key, dtype, shape, source, raw in sources():
        d = producer.put(key, source)
        print(key, dtype, shape_text(shape), checksum(raw), d.hex(), flush=True)
    print("ready", flush=True)
    sys.stdin.read()
    producer.close()


def produce_batch(directory):
    import torch
    producer = new_producer(directory)
    cases = list(sources())
    descriptors = producer.put_many([(key, source) for key, _, _, source, _ in cases])
    for (key, dtype, shape, _, raw), d in zip(cases, descriptors):
        print(key, dtype, shape_text(shape), checksum(raw), d.hex(), flush=True)
    for i, (key, dtype, shape, source, raw) in enumerate(cases):
        key = "in-place-" + key
        # by stream name, torch dtype or NumPy dtype, in turn
        spec = dtype if i % 3 == 0 else (source.dtype if isinstance(source, torch.Tensor)
                                         else source.dtype.type)
        with producer.reserve(key, shape, spec) as r:
            if i % 2:
                t = r.torch()
                assert type(t) is torch.Tensor and tuple(t.shape) == shape
                t.copy_(torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape(t.shape))
            else:
                r.numpy().reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, np.uint8)
            d = r.publish()
        print(key, dtype, shape_text(shape), checksum(raw), d.hex(), flush=True)
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
                if t.dtype_name == "bf16":
                    # The torch view holds the same bits.
                    import torch
                    assert t.torch().dtype == torch.bfloat16
                    tt = t.torch().contiguous().view(torch.int16).numpy()
                    assert tt.tobytes() == raw.tobytes()
                print(t.key, t.dtype_name, shape_text(t.shape),
                      "%016x" % expert_arena.xxh3_64(raw), flush=True)
        except (OSError, ValueError) as e:
            print("error %s: %s" % (type(e).__name__, e), flush=True)


def consume_many(directory, view):
    import torch
    consumer = expert_arena.StreamConsumer(directory, quiet=True)
    lines = [bytes.fromhex(line.strip()) for line in sys.stdin if line.strip()]
    opened = consumer.open_many(lines, view=None if view == "tensor" else view)
    for d, o in zip(lines, opened):
        fields = expert_arena.decode_descriptor(d)
        if view == "tensor":
            o = o.numpy()
        if view == "torch":
            assert isinstance(o, torch.Tensor)
            with_bits = o.contiguous()
            if with_bits.dtype == torch.bfloat16:
                with_bits = with_bits.view(torch.int16)
            raw = with_bits.numpy().reshape(-1).view(np.uint8)
        else:
            assert not o.flags.writeable
            raw = np.ascontiguousarray(o).reshape(-1).view(np.uint8)
        print(fields["key"], fields["dtype"], shape_text(fields["shape"]),
              "%016x" % expert_arena.xxh3_64(raw), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "consume-many":
        consume_many(sys.argv[2], sys.argv[3])
    else:
        {"produce": produce, "consume": consume,
         "produce-batch": produce_batch}[sys.argv[1]](sys.argv[2])
