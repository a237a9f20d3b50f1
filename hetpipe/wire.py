"""Tensor wire codec: dtype + shape + raw little-endian bytes, chunked into ~1 MiB frames."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from hetpipe.rpc import CHUNK_BYTES, Rejected
from hetpipe.v1 import wire_pb2

if sys.byteorder != "little":  # the wire format is little-endian and we copy raw memory
    raise ImportError("hetpipe's wire codec needs a little-endian host")

MAX_NDIM = 8
# Larger than any single activation or shard slice we move; a header claiming more is bogus.
MAX_BUNDLE_BYTES = 16 << 30

_TO_TORCH: dict[int, torch.dtype] = {
    wire_pb2.FLOAT32: torch.float32,
    wire_pb2.FLOAT64: torch.float64,
    wire_pb2.FLOAT16: torch.float16,
    wire_pb2.BFLOAT16: torch.bfloat16,
    wire_pb2.INT64: torch.int64,
    wire_pb2.INT32: torch.int32,
    wire_pb2.UINT8: torch.uint8,
    wire_pb2.BOOL: torch.bool,
}
_TO_WIRE: dict[torch.dtype, int] = {v: k for k, v in _TO_TORCH.items()}


class WireError(Rejected):
    """A malformed tensor stream; carries the gRPC status the receiver should answer with."""


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def torch_dtype(code: int) -> torch.dtype:
    try:
        return _TO_TORCH[code]
    except KeyError:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown dtype code {code}") from None


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def encode(
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    minibatch: wire_pb2.MinibatchTag | None = None,
    push: wire_pb2.PushTag | None = None,
    init: wire_pb2.InitTag | None = None,
    pull: wire_pb2.PullTag | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[wire_pb2.TensorFrame]:
    """Yields the frames of one tensor bundle; the first frame carries header and metas."""
    metas = [
        wire_pb2.TensorMeta(name=name, dtype=wire_dtype(t.dtype), shape=list(t.shape))
        for name, t in tensors
    ]
    first = wire_pb2.TensorFrame(tensors=metas)
    if minibatch is not None:
        first.minibatch.CopyFrom(minibatch)
    if push is not None:
        first.push.CopyFrom(push)
    if init is not None:
        first.init.CopyFrom(init)
    if pull is not None:
        first.pull.CopyFrom(pull)
    pending: wire_pb2.TensorFrame | None = first
    for _, tensor in tensors:
        raw = _raw_bytes(tensor)
        for start in range(0, len(raw), chunk_bytes):
            piece = raw[start : start + chunk_bytes].tobytes()
            if pending is not None:
                pending.data = piece
                yield pending
                pending = None
            else:
                yield wire_pb2.TensorFrame(data=piece)
    if pending is not None:  # bundle with no bytes at all (empty tensors, or none)
        yield pending


@dataclass(frozen=True, slots=True)
class Bundle:
    """A decoded tensor stream: the first frame (header, metas; data cleared) and the tensors."""

    header: wire_pb2.TensorFrame
    tensors: list[tuple[str, torch.Tensor]]

    def named(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


def _checked_meta(index: int, meta: wire_pb2.TensorMeta) -> tuple[torch.dtype, list[int], int]:
    dtype = torch_dtype(meta.dtype)
    shape = list(meta.shape)
    what = f"tensor {index} ({meta.name or 'unnamed'})"
    if len(shape) > MAX_NDIM:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {len(shape)} dims, at most {MAX_NDIM}")
    if any(d < 0 for d in shape):
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: negative dimension in shape {shape}")
    nbytes = int(np.prod(shape, dtype=np.float64)) * torch.empty((), dtype=dtype).element_size()
    if nbytes > MAX_BUNDLE_BYTES:
        raise WireError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}: shape {shape} needs {nbytes} bytes, more than the {MAX_BUNDLE_BYTES} allowed",
        )
    return dtype, shape, nbytes


def decode(frames: Iterable[wire_pb2.TensorFrame], *, device: str = "cpu") -> Bundle:
    """Reassembles one bundle into preallocated tensors; raises WireError on any inconsistency."""
    it = iter(frames)
    first = next(it, None)
    if first is None:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "empty tensor stream: no header frame")
    specs = [_checked_meta(i, m) for i, m in enumerate(first.tensors)]
    total = sum(s[2] for s in specs)
    if total > MAX_BUNDLE_BYTES:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"bundle of {total} bytes exceeds {MAX_BUNDLE_BYTES}")
    tensors = [torch.empty(shape, dtype=dtype) for dtype, shape, _ in specs]
    sinks = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
    index, offset, received = 0, 0, 0

    def absorb(data: bytes) -> None:
        nonlocal index, offset, received
        src = np.frombuffer(data, dtype=np.uint8)
        received += len(src)
        if received > total:
            raise WireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"byte length {received}+ does not match the shapes in the header ({total} bytes)",
            )
        pos = 0
        while pos < len(src):
            while offset == len(sinks[index]):
                index, offset = index + 1, 0
            n = min(len(src) - pos, len(sinks[index]) - offset)
            sinks[index][offset : offset + n] = src[pos : pos + n]
            offset += n
            pos += n

    absorb(first.data)
    for frame in it:
        if frame.tensors or frame.WhichOneof("header") is not None:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "header fields repeated after the first frame")
        absorb(frame.data)
    if received != total:
        raise WireError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"byte length {received} does not match the shapes in the header ({total} bytes)",
        )
    header = wire_pb2.TensorFrame()
    header.CopyFrom(first)
    header.ClearField("data")
    if device != "cpu":
        tensors = [t.to(device, non_blocking=True) for t in tensors]
    return Bundle(header, [(m.name, t) for m, t in zip(first.tensors, tensors)])
