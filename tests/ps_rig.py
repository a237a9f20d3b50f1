"""An in-process ps shard (rpc.Server + ShardServicer, with durability, as `python -m ps_server`
wires it) and a client for it, for the shard's integration tests: its bad input, its pulls and
its durability."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hetpipe import rpc, wire
from hetpipe.v1 import ps_pb2, ps_pb2_grpc, wire_pb2
from messages import messages
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard

Code = grpc.StatusCode
SHAPES = {"l0.weight": (2, 3), "l0.bias": (3,)}
KEYS = list(SHAPES)
CALL_S = 10.0  # generous: the test host may be heavily loaded


def _frames(tensors: list[tuple[str, torch.Tensor]], **tags: Any) -> list[wire_pb2.TensorFrame]:
    return messages(wire.encode(tensors, **tags))


def w0() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(k, torch.randn(s, generator=g)) for k, s in SHAPES.items()]


def delta(vw: int, clock: int, keys: list[str] = KEYS) -> list[tuple[str, torch.Tensor]]:
    """VW vw's wave-`clock` update; the same tensor for a key whichever other keys come with it."""
    return [(k, torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(1000 * KEYS.index(k) + 100 * vw + clock)))
            for k in keys]


@dataclass
class Client:
    stub: ps_pb2_grpc.ParameterServerStub

    def init(self, tensors: list[tuple[str, torch.Tensor]], vws: int = 2, rule: dict[str, Any] | None = None,
             **kw: Any) -> wire_pb2.Ack:
        tag = wire_pb2.InitTag(virtual_workers=vws, **(rule or {}))
        return self.stub.Init(iter(_frames(tensors, init=tag)), timeout=CALL_S, **kw)

    def push(self, vw: int, clock: int, tensors: list[tuple[str, torch.Tensor]], **kw: Any) -> ps_pb2.PushReply:
        tag = wire_pb2.PushTag(vw=vw, clock=clock)
        return self.stub.Push(iter(_frames(tensors, push=tag)), timeout=CALL_S, **kw)

    def pull(self, vw: int, keys: list[str], min_clock: int = 0, timeout: float = CALL_S, **kw: Any) -> wire.Bundle:
        request = ps_pb2.PullRequest(vw=vw, keys=keys, min_clock=min_clock)
        return wire.decode(self.stub.Pull(request, timeout=timeout, **kw))

    def status(self, **kw: Any) -> ps_pb2.ShardStatus:
        return self.stub.Status(wire_pb2.Empty(), timeout=CALL_S, **kw)


def state(s: ps_pb2.ShardStatus) -> tuple[Any, ...]:
    """What a refused request must not change."""
    return (s.values_digest, [(c.vw, c.min_clock, c.max_clock) for c in s.clocks], s.c_global,
            s.pushes_applied, s.clock_distance, s.max_clock_distance)


def refused(call: Callable[[], Any], code: grpc.StatusCode, pattern: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    assert err.code() == code, f"{err.code()} {err.details()!r}, want {code}"
    assert re.search(pattern, err.details() or ""), f"message {err.details()!r} does not match {pattern!r}"
    return str(err.details())


@dataclass
class InProcess:
    client: Client
    servicer: ShardServicer
    expected: dict[str, torch.Tensor]   # w0 + every acknowledged push


@contextmanager
def in_process_shard(tmp_path: Path, rule: dict[str, Any] | None = None) -> Iterator[InProcess]:
    """A shard with 2 VWs and two float32 keys; vw 0 has pushed waves 0 and 1, vw 1 wave 0.
    rule: the InitTag's sync fields (default: wsp, not told D)."""
    servicer = ShardServicer(Shard(), Durability(str(tmp_path / "ckpt")), max_pull_wait_s=30.0)
    server = rpc.Server("127.0.0.1", 0, workers=16)
    server.add("ParameterServer", servicer)
    server.start()
    ch = rpc.channel(server.address)
    try:
        client = Client(ps_pb2_grpc.ParameterServerStub(ch))
        assert client.init(w0(), rule=rule).message == "initialised"
        expected = dict(w0())
        for vw, c in [(0, 0), (1, 0), (0, 1)]:
            reply = client.push(vw, c, delta(vw, c))
            assert not reply.duplicate
            for k, d in delta(vw, c):
                expected[k] = expected[k] + d
        s = client.status()
        assert s.c_global == 1 and [(c.min_clock, c.max_clock) for c in s.clocks] == [(2, 2), (1, 1)]
        # The checkpoint that c_global 1 captured is written on a thread of its own: done before a
        # test patches the disk's calls, which it would otherwise meet.
        servicer.checkpoints_written()
        yield InProcess(client, servicer, expected)
    finally:
        ch.close()
        server.stop()


def with_data(frames: list[wire_pb2.TensorFrame], data: bytes) -> list[wire_pb2.TensorFrame]:
    frames[0].data = data
    return frames
