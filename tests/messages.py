"""Tensor frames as protobuf messages: what a client generated from the .proto sends and receives."""

from __future__ import annotations

from collections.abc import Iterable

from hetpipe.v1 import wire_pb2


def messages(frames: Iterable[bytes]) -> list[wire_pb2.TensorFrame]:
    """wire.encode's frames, parsed: the same bytes on the wire as any protobuf client's."""
    return [wire_pb2.TensorFrame.FromString(f) for f in frames]
