"""Forged, stale and malformed shared-memory handles for one bundle (hetpipe/shm.py), to send a
stage or a shard: each must be refused with its status and change nothing."""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from hetpipe import shm, wire
from hetpipe.v1 import wire_pb2
from messages import messages

Code = grpc.StatusCode
Case = tuple[list[wire_pb2.TensorFrame], grpc.StatusCode, str]   # frames, status, regex of the message


@dataclass
class Handles:
    bad: dict[str, Case]
    good: list[wire_pb2.TensorFrame]   # the same bundle, through a handle that is current


def _edited(frames: list[wire_pb2.TensorFrame], **ref: Any) -> list[wire_pb2.TensorFrame]:
    first = wire_pb2.TensorFrame()
    first.CopyFrom(frames[0])
    for key, value in ref.items():
        setattr(first.shm, key, value)
    return [first]


def _with_cuda(frames: list[wire_pb2.TensorFrame], header: bool = True) -> list[wire_pb2.TensorFrame]:
    """The first frame with a well-formed CUDA IPC handle beside (or instead of) its shm handle."""
    first = wire_pb2.TensorFrame()
    first.CopyFrom(frames[0])
    first.cuda.CopyFrom(wire_pb2.CudaRef(handle=b"\x02c" + b"\x01" * 64, storage_bytes=1 << 20,
                                         ref_counter_handle=b"/torch_1_2_3"))
    if not header:
        first.ClearField("shm")
    return [first]


@contextmanager
def forged_handles(tensors: list[tuple[str, torch.Tensor]], **tag: Any) -> Iterator[Handles]:
    """The bad handles of a bundle of these tensors under this tag, and a good one; every segment
    made here is removed on exit."""
    ring = shm.Ring(slots=1)
    chunked_ring = shm.Ring(slots=1, chunk_bytes=16, whole_up_to=16)   # this bundle in chunks of 16 bytes
    junk = shm.SHM_DIR / f"{shm.PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    held: int | None = None
    try:
        stale = messages(wire.encode(tensors, ring=ring, **tag))
        good = messages(wire.encode(tensors, ring=ring, **tag))   # the one slot moves on: `stale` is
        nbytes = good[0].shm.nbytes
        chunked = messages(wire.encode(tensors, ring=chunked_ring, **tag))
        assert len(chunked) > 2, "the forged chunks below need a bundle of three chunks or more"
        beside = wire_pb2.TensorFrame()
        beside.CopyFrom(chunked[1])
        beside.data = b"\x00" * 4
        empty = wire_pb2.TensorFrame()
        empty.CopyFrom(chunked[1])
        empty.shm.nbytes = 0
        junk.write_bytes(b"\x00not a segment" * 100)
        # Held as a live owner holds its segments: a launcher's shm.sweep in another test of this
        # host takes an unlocked file under a segment's name for a dead owner's, and removed it.
        held = os.open(junk, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_SH)
        grpc_frames = messages(wire.encode(tensors, **tag))
        both = _edited(good)
        both[0].data = grpc_frames[0].data
        bad = {
            "a path, not a segment name": (_edited(good, name="../../etc/passwd"), Code.INVALID_ARGUMENT,
                                           "names no hetpipe segment"),
            "another file in /dev/shm": (_edited(good, name="libpod_lock"), Code.INVALID_ARGUMENT,
                                         "names no hetpipe segment"),
            "a segment that does not exist": (_edited(good, name=f"{shm.PREFIX}1-{'0' * 16}"),
                                              Code.FAILED_PRECONDITION, "does not exist"),
            "a file that is no segment": (_edited(good, name=junk.name), Code.INVALID_ARGUMENT,
                                          "is not a hetpipe segment"),
            "a stale version": (stale, Code.FAILED_PRECONDITION, "stale shared-memory handle"),
            "a version never written": (_edited(good, version=good[0].shm.version + 1), Code.INVALID_ARGUMENT,
                                        "is not a written one"),
            "a future version": (_edited(good, version=good[0].shm.version + 2), Code.FAILED_PRECONDITION,
                                 "stale shared-memory handle"),
            "fewer bytes than the shapes": (_edited(good, nbytes=nbytes - 4), Code.INVALID_ARGUMENT,
                                            rf"byte length {nbytes - 4} does not match the shapes in the header \({nbytes} bytes\)"),
            "more bytes than the shapes": (_edited(good, nbytes=nbytes + 4), Code.INVALID_ARGUMENT,
                                           rf"holds {nbytes + 4} bytes, where the shapes in the header \({nbytes} bytes\) leave {nbytes}$"),
            "data beside the handle": (both, Code.INVALID_ARGUMENT, "both data and a shared-memory handle"),
            "frames after the handle": (good + [wire_pb2.TensorFrame(data=b"\x00" * 8)], Code.INVALID_ARGUMENT,
                                        "a frame after a shared-memory handle carries more than the next chunk's handle"),
            # A large bundle goes in chunks, a handle a frame (shm.Ring.refs).
            "a chunk past the bundle's end": (chunked + chunked[-1:], Code.INVALID_ARGUMENT,
                                              rf"holds {chunked[-1].shm.nbytes} bytes, where the shapes in the header "
                                              rf"\({nbytes} bytes\) leave 0"),
            "data beside a chunk's handle": (chunked[:1] + [beside] + chunked[2:], Code.INVALID_ARGUMENT,
                                             "carries more than the next chunk's handle"),
            "an empty chunk": (chunked[:1] + [empty] + chunked[2:], Code.INVALID_ARGUMENT, "holds 0 bytes"),
            "a chunk missing": (chunked[:1] + chunked[2:], Code.INVALID_ARGUMENT,
                                rf"byte length {nbytes - chunked[1].shm.nbytes} does not match the shapes in the header "
                                rf"\({nbytes} bytes\)"),
            # A CUDA IPC handle (hetpipe/cuda_ipc.py) goes only from a GPU stage to a GPU stage.
            "a CUDA IPC handle to a process off the GPU": (_with_cuda(good), Code.FAILED_PRECONDITION,
                                                           "takes no CUDA IPC handles"),
            "a CUDA IPC handle without its slot's header": (_with_cuda(good, header=False), Code.INVALID_ARGUMENT,
                                                            "without its slot's header"),
            "a CUDA IPC handle beside data": (_with_cuda(grpc_frames[:1]), Code.INVALID_ARGUMENT,
                                              "both data and a CUDA IPC handle"),
        }
        yield Handles(bad, good)
    finally:
        ring.close()
        chunked_ring.close()
        junk.unlink(missing_ok=True)
        if held is not None:
            os.close(held)
