"""Malformed and hostile requests for the fuzz suite: bytes that do not parse, and protobuf
messages that parse but carry extreme values (huge counts and shapes, NaN, negative numbers,
long or strange strings, unknown enum values, deep nesting), built from each message's
descriptor so that a field added to a .proto is fuzzed without touching this file."""

from __future__ import annotations

import json
import math
import random
from itertools import cycle, islice
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from hetpipe.v1 import wire_pb2

F = FieldDescriptor
INT_EXTREMES = {
    F.TYPE_INT32: (-(2**31), -1, 0, 1, 2**31 - 1),
    F.TYPE_INT64: (-(2**63), -1, 0, 1, 2**62, 2**63 - 1),
    F.TYPE_UINT32: (0, 1, 2, 7, 2**16, 2**31, 2**32 - 1),
    F.TYPE_UINT64: (0, 1, 2, 7, 2**32, 2**40, 2**63, 2**64 - 1),
}
FLOATS = (math.nan, math.inf, -math.inf, 1e300, -1e300, -1.0, 0.0, -0.0, 5e-324, 1e-3, 30.0)
STRINGS = ("", "a" * 70_000, "../../../../tmp/hetpipe-fuzz-owned", "\x00", "ü🦀" * 50, "x:0", "127.0.0.1:1",
           "cuda:999", "meta", "cpu", "{}", "[" * 50_000, "l0.weight", "a" * 300)


def malformed(rnd: random.Random) -> bytes:
    """Bytes that are not a protobuf message whatever follows the first few: wire
    types 6 and 7, or a length far past the end; then random bytes."""
    start = rnd.choice([b"\x0e", b"\x0f", b"\x0a\xff\xff\xff\x0f", b"\x12\xff\xff\xff\x7f"])
    return start + rnd.randbytes(rnd.randint(0, 300))


def _scalar(field: FieldDescriptor, rnd: random.Random) -> Any:
    kind = field.type
    if kind in INT_EXTREMES:
        return rnd.choice(INT_EXTREMES[kind]) if rnd.random() < 0.7 else rnd.randint(0, 1000)
    if kind in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        value = rnd.choice(FLOATS)
        return value if kind == F.TYPE_DOUBLE or not math.isfinite(value) or abs(value) < 3e38 else math.inf
    if kind == F.TYPE_BOOL:
        return rnd.random() < 0.5
    if kind == F.TYPE_STRING:
        return rnd.choice(STRINGS) if rnd.random() < 0.8 else rnd.randbytes(40).decode("latin-1")
    if kind == F.TYPE_BYTES:
        return rnd.randbytes(rnd.choice([0, 1, 7, 4096, 200_000]))
    if kind == F.TYPE_ENUM:
        return rnd.choice([v.number for v in field.enum_type.values] + [-1, 99, 2**31 - 1])
    raise AssertionError(f"no fuzz values for field {field.full_name} of type {kind}")


def hostile(descriptor: Descriptor, rnd: random.Random, depth: int = 0) -> Any:
    """A message of `descriptor`'s type with some fields set to extreme values."""
    message = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if rnd.random() < 0.35 or (field.containing_oneof is not None and rnd.random() < 0.5):
            continue
        repeated = field.is_repeated
        count = rnd.choice([1, 2, 3, 9, 5000]) if repeated else 1
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:   # a map: extreme keys to extreme values
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            target = getattr(message, field.name)
            for _ in range(min(count, 9)):
                target[_scalar(key, rnd)] = _scalar(value, rnd)
        elif field.type == F.TYPE_MESSAGE:
            if depth >= 3:
                continue
            count = min(count, 9)
            target = getattr(message, field.name)
            for _ in range(count):
                sub = target.add() if repeated else target
                sub.CopyFrom(hostile(field.message_type, rnd, depth + 1))
            if not repeated:
                target.SetInParent()
        elif repeated and count > 9 and field.type in (F.TYPE_STRING, F.TYPE_BYTES):  # many short names
            getattr(message, field.name).extend(f"key{i}" if field.type == F.TYPE_STRING else b"k" for i in range(count))
        elif repeated:  # a long list repeats 9 drawn values: drawing 5000 makes the client the bottleneck
            drawn = [_scalar(field, rnd) for _ in range(min(count, 9))]
            getattr(message, field.name).extend(islice(cycle(drawn), count))
        else:
            setattr(message, field.name, _scalar(field, rnd))
    return message


def serialized(descriptor: Descriptor, rnd: random.Random) -> bytes:
    """One malformed or hostile serialized request of descriptor's type."""
    return malformed(rnd) if rnd.random() < 0.4 else hostile(descriptor, rnd).SerializeToString()


def tensor_stream(rnd: random.Random) -> list[bytes]:
    """A hostile TensorFrame stream: a header frame with extreme metas (or garbage), then a few
    frames of data, garbage or repeated headers."""
    frames = []
    first = hostile(wire_pb2.TensorFrame.DESCRIPTOR, rnd)
    if rnd.random() < 0.5:  # plausible metas, so that validation gets past the header
        first.ClearField("tensors")
        for _ in range(rnd.randint(1, 3)):
            meta = first.tensors.add(name=rnd.choice(STRINGS[12:]), dtype=rnd.randint(0, 9))
            meta.shape.extend(rnd.choice([[2, 3], [3], [], [-1, 4], [2**40], [4194304, 64], [0, 5], [1] * 40]))
        first.data = rnd.randbytes(rnd.choice([0, 4, 24, 100]))
    frames.append(malformed(rnd) if rnd.random() < 0.2 else first.SerializeToString())
    for _ in range(rnd.randint(0, 3)):
        roll = rnd.random()
        if roll < 0.5:
            frames.append(wire_pb2.TensorFrame(data=rnd.randbytes(rnd.randint(0, 64))).SerializeToString())
        elif roll < 0.8:
            frames.append(malformed(rnd))
        else:
            frames.append(hostile(wire_pb2.TensorFrame.DESCRIPTOR, rnd).SerializeToString())
    return frames


def job_json(rnd: random.Random) -> str:
    """A hostile job text for Coordinator.Submit: deep nesting, huge numbers, wrong types."""
    roll = rnd.random()
    if roll < 0.25:
        depth = rnd.choice([100, 5000, 200_000])
        return "[" * depth + "]" * depth
    if roll < 0.5:
        return rnd.randbytes(rnd.randint(0, 200)).decode("latin-1")
    job: dict[str, Any] = {
        "model": {"name": rnd.choice(["mlp", "os:system", "", 7]), "args": rnd.choice([{}, [], {"hidden": [10**9]}])},
        "data": {"name": rnd.choice(["digits", "synthetic", "npz"]), "batch_size": rnd.choice([-1, 0, 10**18, 1.5])},
        "train": {"steps": rnd.choice([-5, 0, 10**18, "x"]), "optimizer": {"name": "sgd", "lr": rnd.choice(FLOATS)}},
        "parallel": {"virtual_workers": rnd.choice([0, -1, 10**18, 1e18, 2]), "stages_per_vw": rnd.choice([0, 10**6]),
                     "nm": rnd.choice([0, 10**9])},
    }
    return json.dumps(job, allow_nan=True)
