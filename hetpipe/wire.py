"""Tensor wire codec: dtype + shape + raw little-endian bytes, chunked into ~1 MiB frames."""

from __future__ import annotations

import functools
import logging
import math
import mmap
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from hetpipe import buffers, cuda_ipc, shm
from hetpipe.buffers import raw_bytes
from hetpipe.memcpy import copy_bytes
from hetpipe.errors import Rejected
from hetpipe.rpc import CHUNK_BYTES
from hetpipe.v1 import wire_pb2

if sys.byteorder != "little":  # the wire format is little-endian and we copy raw memory
    raise ImportError("hetpipe's wire codec needs a little-endian host")

MAX_NDIM = 8
# Larger than any single activation or shard slice we move; a header claiming more is bogus.
MAX_BUNDLE_BYTES = 16 << 30

_TO_TORCH: dict[wire_pb2.DType, torch.dtype] = {
    wire_pb2.FLOAT32: torch.float32,
    wire_pb2.FLOAT64: torch.float64,
    wire_pb2.FLOAT16: torch.float16,
    wire_pb2.BFLOAT16: torch.bfloat16,
    wire_pb2.INT64: torch.int64,
    wire_pb2.INT32: torch.int32,
    wire_pb2.UINT8: torch.uint8,
    wire_pb2.BOOL: torch.bool,
}
_TO_WIRE: dict[torch.dtype, wire_pb2.DType] = {v: k for k, v in _TO_TORCH.items()}
CARRIED = tuple(_TO_WIRE)   # the dtypes a tensor may have to cross (and be written out: weight_files.DTYPES)


class WireError(Rejected):
    """A malformed tensor stream; carries the gRPC status the receiver should answer with."""


def wire_dtype(dtype: torch.dtype) -> wire_pb2.DType:
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def torch_dtype(code: int) -> torch.dtype:
    try:
        return _TO_TORCH[code]  # type: ignore[index]  # any int may arrive; unknown ones raise below
    except KeyError:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown dtype code {code}") from None


def _first_frame(
    tensors: Sequence[tuple[str, torch.Tensor]],
    minibatch: wire_pb2.MinibatchTag | None,
    push: wire_pb2.PushTag | None,
    init: wire_pb2.InitTag | None,
    pull: wire_pb2.PullTag | None,
    commit: wire_pb2.CommitTag | None = None,
    exchange: wire_pb2.ExchangeTag | None = None,
) -> wire_pb2.TensorFrame:
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
    if commit is not None:
        first.commit.CopyFrom(commit)
    if exchange is not None:
        first.exchange.CopyFrom(exchange)
    return first


def _pieces(tensors: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int) -> Iterator[memoryview]:
    """Zero-copy slices of the tensors' bytes, at most chunk_bytes each, never spanning two tensors."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for _, tensor in tensors:
        raw = raw_bytes(tensor)
        for start in range(0, len(raw), chunk_bytes):
            yield raw[start : start + chunk_bytes]


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger(__name__).warning(message)


def _groups(tensors: Sequence[tuple[str, torch.Tensor]], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """The pieces, gathered into frames of at most chunk_bytes: small tensors share a frame (a
    one-frame bundle then goes in one message, see rpc.send_bundle)."""
    group: list[memoryview] = []
    size = 0
    for piece in _pieces(tensors, chunk_bytes):
        if group and size + len(piece) > chunk_bytes:
            yield group
            group, size = [], 0
        group.append(piece)
        size += len(piece)
    if group:
        yield group


# A serialized TensorFrame holding only `data` is this tag byte (field 9, length-delimited), the
# payload length as a varint, then the payload: cheap to write and to recognise by hand.
_DATA_TAG = 0x4A
_DATA_TAG_BYTE = bytes((_DATA_TAG,))
_MAX_VARINT_BYTES = 10


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Frames:
    """encode()'s frames, serialized, made as they are asked for; `single`, once the first is out:
    whether no other follows. rpc.send_bundle reads it rather than ask for a second frame, which
    for a bundle in shared-memory chunks would be written before the call even starts.
    make(frames) yields them, and sets frames.single before the first."""

    def __init__(self, make: Callable[[Frames], Iterator[bytes]]) -> None:
        self.single: bool | None = None
        self._frames = make(self)
        self._peeked: bytes | None = None

    def __iter__(self) -> Frames:
        return self

    def __next__(self) -> bytes:
        if self._peeked is not None:
            frame, self._peeked = self._peeked, None
            return frame
        return next(self._frames)

    def peek(self) -> bytes:
        """The next frame, made now and returned again by next(): after the first, `single` is known."""
        if self._peeked is None:
            self._peeked = next(self._frames)
        return self._peeked


def encode(
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    minibatch: wire_pb2.MinibatchTag | None = None,
    push: wire_pb2.PushTag | None = None,
    init: wire_pb2.InitTag | None = None,
    pull: wire_pb2.PullTag | None = None,
    commit: wire_pb2.CommitTag | None = None,
    exchange: wire_pb2.ExchangeTag | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    ring: shm.Writer | None = None,
    cuda: tuple[wire_pb2.ShmRef, wire_pb2.CudaRef] | None = None,
) -> Frames:
    """The frames of one tensor bundle, serialized: the first carries the header and metas.

    Byte for byte what the TensorFrame messages serialize to, but each payload is copied once,
    straight from the tensor into the outgoing message, instead of through a protobuf object.
    Calls and replies that carry them skip gRPC's serializer (hetpipe.rpc registers and calls
    every TensorFrame stream that way). With a ring (a peer on this host), the bytes go into its
    next shared-memory slot instead and the frames carry only handles: one, or for a large bundle
    one a chunk, each frame made as its chunk is written (shm.Ring.refs). With cuda (the bytes
    already lie in a CUDA IPC slot, hetpipe/cuda_ipc.py), the one frame carries its handles.
    """
    first = _first_frame(tensors, minibatch, push, init, pull, commit, exchange)
    return Frames(lambda out: _frames(out, first, tensors, chunk_bytes, ring, cuda))


def _frames(out: Frames, first: wire_pb2.TensorFrame, tensors: Sequence[tuple[str, torch.Tensor]],
            chunk_bytes: int, ring: shm.Writer | None,
            cuda: tuple[wire_pb2.ShmRef, wire_pb2.CudaRef] | None) -> Iterator[bytes]:
    """encode()'s frames; sets out.single before the first one goes."""
    if cuda is not None:
        first.shm.CopyFrom(cuda[0])
        first.cuda.CopyFrom(cuda[1])
        out.single = True
        yield first.SerializeToString()
        return
    # Counted, not read: in frames, a tensor that is not a contiguous CPU one is copied to the
    # host only when its turn comes (_pieces), not all of them at once.
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    if ring is not None:
        refs = ring.refs([raw_bytes(t) for _, t in tensors])
        try:
            first.shm.CopyFrom(next(refs))
        except OSError as exc:  # /dev/shm is full: this bundle goes in frames
            _warn_once(f"shared memory unavailable ({exc.strerror}); sending in gRPC frames")
        else:
            out.single = first.shm.nbytes == total
            yield first.SerializeToString()
            for ref in refs:   # a large bundle's further chunks, each written as the last one goes
                yield wire_pb2.TensorFrame(shm=ref).SerializeToString()
            return
    # Field 9 is the highest-numbered field written here, so appending it keeps the canonical order.
    head: bytes | None = first.SerializeToString()
    out.single = total <= chunk_bytes   # one group: _groups fills a frame up to chunk_bytes
    for group in _groups(tensors, chunk_bytes):
        yield b"".join((head or b"", _DATA_TAG_BYTE, _varint(sum(len(p) for p in group)), *group))
        head = None
    if head is not None:  # bundle with no bytes at all (empty tensors, or none)
        yield head


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
    # Zero dimensions counted as 1: torch cannot lay out [0, 2**62, 2**62] either (its strides
    # overflow), and this bound is never below the bytes the tensor holds. Python's integers do
    # not overflow, and math.prod of a few of them costs a tenth of numpy's.
    layout = math.prod(max(d, 1) for d in shape) * dtype.itemsize
    if layout > MAX_BUNDLE_BYTES:
        raise WireError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what}: shape {shape} spans {layout} bytes, more than the {MAX_BUNDLE_BYTES} allowed",
        )
    nbytes = math.prod(shape) * dtype.itemsize
    return dtype, shape, nbytes


# Received tensors of this size and more land in the receive pool's mappings (hetpipe/buffers.py):
# memory already faulted in, whichever thread receives and whatever sizes passed before.
POOLED_FROM_BYTES = 1 << 20


def empty(shape: Sequence[int], dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
    """An uninitialised contiguous tensor to receive data into; decode allocates with it.

    Large ones live in a mapping of the receive pool, which the tensor keeps (and the pool does
    not hand out again) while any view of it lives; their storage cannot be resized, which
    received tensors never need. pinned: page-locked (torch's caching host allocator), for a copy
    to a GPU that does not block.
    """
    if pinned:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < POOLED_FROM_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    mapping = buffers.RECEIVE.take(nbytes)
    return torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize).view(tuple(shape))


def _data_only(frame: bytes) -> memoryview | None:
    """The payload of a serialized frame that holds nothing but `data`, else None."""
    if len(frame) < 2 or frame[0] != _DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while True:
        if pos >= len(frame) or pos > _MAX_VARINT_BYTES:
            return None
        byte = frame[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
    # Anything else after the payload (another field, a repeated data field) is protobuf's to parse.
    if pos + length != len(frame):
        return None
    return memoryview(frame)[pos:]


def _parsed(frame: wire_pb2.TensorFrame | bytes) -> wire_pb2.TensorFrame:
    if not isinstance(frame, bytes):
        return frame
    try:
        return wire_pb2.TensorFrame.FromString(frame)
    except DecodeError as exc:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed TensorFrame: {exc}") from None


Spec = tuple[torch.dtype, list[int], int]   # dtype, shape, bytes


@dataclass(frozen=True, slots=True)
class Stream:
    """A tensor stream read frame by frame: the header (data cleared), each tensor's dtype,
    shape and size, and `pieces`, the payload in order as (tensor index, byte offset in that
    tensor, bytes). Nothing is allocated for the tensors: a writer can pass pieces straight on."""

    header: wire_pb2.TensorFrame
    specs: list[Spec]
    pieces: Iterator[tuple[int, int, memoryview]]
    gpu: cuda_ipc.Source | None = None   # the bytes are in a peer's GPU memory; `pieces` then has none
    shared_memory: bool = False          # the bytes are in the sender's shared memory: it shares this machine
    whole: bool = False                  # ... in one chunk: its version is checked once, after the last piece

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.header.tensors]


def sender(frame: wire_pb2.TensorFrame) -> str | None:
    """Who a bundle says it is from, as its shared-memory segments are bound to: "vw 0 stage 1"
    (an activation or gradient), "vw 0" (a push or an exchange); None for what no stage sends."""
    kind = frame.WhichOneof("header")
    if kind in ("minibatch", "commit"):
        tag = getattr(frame, kind)
        return f"vw {tag.vw} stage {tag.stage}"
    if kind in ("push", "exchange"):
        return f"vw {getattr(frame, kind).vw}"
    return None


def _shared(first: wire_pb2.TensorFrame, it: Iterator[wire_pb2.TensorFrame | bytes], reader: shm.Reader | None,
            total: int, source: str | None) -> Iterator[memoryview]:
    """The payload of a bundle whose bytes are in the sender's shared memory, a chunk a frame: the
    first frame's handle is checked now, each chunk again once it is read. read()'s pieces check
    that the chunks add up to the bundle."""
    if first.data:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "a frame carries both data and a shared-memory handle")
    if reader is None:
        raise WireError(grpc.StatusCode.FAILED_PRECONDITION, "this call takes no shared-memory handles")
    opened = _chunk(reader, first.shm, total, total, source, first=True)

    def payloads() -> Iterator[memoryview]:
        ref, (view, mapping), left = first.shm, opened, total
        while True:
            yield view
            left -= len(view)
            try:
                reader.verify(ref, mapping)   # the copy is done: was it overwritten meanwhile?
            except shm.HandleError as exc:
                raise WireError(exc.code, str(exc)) from None
            frame = next(it, None)
            if frame is None:
                return
            parsed = _parsed(frame)
            if not parsed.HasField("shm") or len(parsed.ListFields()) != 1:
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                "a frame after a shared-memory handle carries more than the next chunk's handle")
            ref = parsed.shm
            view, mapping = _chunk(reader, ref, left, total, source, first=False)

    return payloads()


def _chunk(reader: shm.Reader, ref: wire_pb2.ShmRef, left: int, total: int, source: str | None, *,
           first: bool) -> tuple[memoryview, mmap.mmap]:
    """One chunk's bytes and their mapping; the chunk must fit in what is left of the bundle's
    total bytes, and hold some, unless it is the one chunk of a bundle that holds none."""
    if ref.nbytes > left or (ref.nbytes == 0 and not (first and total == 0)):
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"shared-memory handle of {ref.name[:80]} holds {ref.nbytes} bytes, where the shapes in "
                        f"the header ({total} bytes) leave {left}")
    try:
        return reader.open(ref, ref.nbytes, source)
    except shm.HandleError as exc:
        raise WireError(exc.code, str(exc)) from None


def _gpu(first: wire_pb2.TensorFrame, it: Iterator[wire_pb2.TensorFrame | bytes], ipc: cuda_ipc.Opener | None,
         total: int, source: str | None) -> tuple[cuda_ipc.Source, Iterator[tuple[int, int, memoryview]]]:
    """A bundle whose bytes are in a peer's GPU memory, opened; and its pieces, none, which check
    that nothing follows the one frame."""
    if first.data:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "a frame carries both data and a CUDA IPC handle")
    if not first.HasField("shm"):
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "a CUDA IPC handle without its slot's header")
    if ipc is None:
        raise WireError(grpc.StatusCode.FAILED_PRECONDITION, "this call takes no CUDA IPC handles (not a GPU stage)")
    try:
        opened = ipc.open(first.cuda, first.shm, total, source)
    except shm.HandleError as exc:
        raise WireError(exc.code, str(exc)) from None

    def nothing_follows() -> Iterator[tuple[int, int, memoryview]]:
        if next(it, None) is not None:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "frames after a CUDA IPC handle")
        yield from ()

    return opened, nothing_follows()


def read(frames: Iterable[wire_pb2.TensorFrame | bytes], reader: shm.Reader | None = None,
         ipc: cuda_ipc.Opener | None = None) -> Stream:
    """Opens one bundle; WireError on any inconsistency, from here or while the pieces are read.

    Frames are TensorFrame messages, or their serialized bytes (from a call registered with
    request_deserializer=None), whose data-only frames are then read without a protobuf parse.
    A bundle in shared memory is read through reader, one in a peer's GPU memory through ipc
    (None: refused with FAILED_PRECONDITION); `gpu` then holds it and `pieces` checks the rest.
    """
    it = iter(frames)
    raw_first = next(it, None)
    if raw_first is None:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "empty tensor stream: no header frame")
    first = _parsed(raw_first)
    specs = [_checked_meta(i, m) for i, m in enumerate(first.tensors)]
    total = sum(s[2] for s in specs)
    if total > MAX_BUNDLE_BYTES:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"bundle of {total} bytes exceeds {MAX_BUNDLE_BYTES}")
    header = wire_pb2.TensorFrame()
    header.CopyFrom(first)
    header.ClearField("data")
    header.ClearField("shm")
    header.ClearField("cuda")
    sizes = [s[2] for s in specs]

    def payloads() -> Iterator[memoryview]:
        if shared is not None:
            yield from shared
            return
        yield memoryview(first.data)
        for frame in it:
            payload = _data_only(frame) if isinstance(frame, bytes) else None
            if payload is None:
                parsed = _parsed(frame)
                if (parsed.tensors or parsed.WhichOneof("header") is not None or parsed.HasField("shm")
                        or parsed.HasField("cuda")):
                    raise WireError(grpc.StatusCode.INVALID_ARGUMENT, "header fields repeated after the first frame")
                payload = memoryview(parsed.data)
            yield payload

    def pieces() -> Iterator[tuple[int, int, memoryview]]:
        index, offset, received = 0, 0, 0
        for data in payloads():
            received += len(data)
            if received > total:
                raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"byte length {received}+ does not match the shapes in the header ({total} bytes)")
            pos = 0
            while pos < len(data):
                while sizes[index] == 0:  # empty tensors take no bytes
                    index += 1
                n = min(len(data) - pos, sizes[index] - offset)
                yield index, offset, data[pos:pos + n]
                offset += n
                pos += n
                if offset == sizes[index]:
                    index, offset = index + 1, 0
        if received != total:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"byte length {received} does not match the shapes in the header ({total} bytes)")

    # A handle is checked now, before a receiver's check() and allocation: a bad one changes nothing.
    if first.HasField("cuda"):
        gpu, nothing = _gpu(first, it, ipc, total, sender(first))
        return Stream(header, specs, nothing, gpu)
    shared = _shared(first, it, reader, total, sender(first)) if first.HasField("shm") else None
    return Stream(header, specs, pieces(), shared_memory=shared is not None,
                  whole=shared is not None and first.shm.nbytes == total)


def decode(frames: Iterable[wire_pb2.TensorFrame | bytes], *, device: str = "cpu",
           check: Callable[[Stream], None] | None = None, reader: shm.Reader | None = None,
           pinned: bool = False, ipc: cuda_ipc.Opener | None = None) -> Bundle:
    """Reassembles one bundle into preallocated tensors; raises WireError on any inconsistency.
    pinned: into page-locked memory (the receiver moves them to a GPU). A bundle in a peer's GPU
    memory (CUDA IPC, through ipc) lands on ipc's device.

    check(stream) runs once the header is read, before anything is allocated or received: a
    receiver refuses there what it would refuse anyway (an unknown key, a wrong shape), so a
    256 MiB push under a foreign key costs one frame."""
    stream = read(frames, reader, ipc)
    if check is not None:
        check(stream)
    return receive(stream, device=device, pinned=pinned)


def fill(stream: Stream, sinks: Sequence[memoryview]) -> None:
    """Copies a stream's bytes into sinks, one writable byte view per tensor (its whole length);
    WireError as the pieces are read."""
    for index, offset, piece in stream.pieces:
        copy_bytes(sinks[index][offset:offset + len(piece)], piece)


def receive(stream: Stream, *, device: str = "cpu", pinned: bool = False) -> Bundle:
    """The rest of decode(): a stream whose header was checked, received into new tensors."""
    if stream.gpu is not None:
        for _ in stream.pieces:   # none: this checks that no frame follows the handle
            pass
        try:
            gpu_tensors = stream.gpu.copy_out(stream.specs)
        except shm.HandleError as exc:
            raise WireError(exc.code, str(exc)) from None
        return Bundle(stream.header, [(m.name, t) for m, t in zip(stream.header.tensors, gpu_tensors)])
    tensors = [empty(shape, dtype, pinned=pinned) for dtype, shape, _ in stream.specs]
    try:
        fill(stream, [t.reshape(-1).view(torch.uint8).numpy().data for t in tensors])
    except BaseException:
        buffers.RECEIVE.forget(tensors)   # a refused bundle changes nothing, the pool included
        raise
    if device != "cpu":
        tensors = [t.to(device, non_blocking=True) for t in tensors]
    return Bundle(stream.header, [(m.name, t) for m, t in zip(stream.header.tensors, tensors)])
