"""Exhaustion (issue 14): calls that wait or stream cannot take every thread of a server. 130 Pulls
without a deadline used to starve a shard (its Status and Push hung), and 16 open Forward streams a
stage's Status. Each method has its lane; what is over is refused with RESOURCE_EXHAUSTED, and the
reserved threads keep Status, health checks and the other methods answering."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetpipe import rpc, wire
from hetpipe.v1 import ps_pb2, stage_pb2, wire_pb2
from service_process import Service, start

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start("ps_server", "ParameterServer", tmp_path_factory.mktemp("shard"))


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start("stage_worker", "Stage", tmp_path_factory.mktemp("stage"))


def _healthy(service: Service) -> bool:
    reply = health_pb2_grpc.HealthStub(service.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _answered(calls: list[Any], n: int) -> list[Any]:
    """The calls answered, once n of them are. Which calls get the lane is the server's order of
    arrival, not the order they were made in."""
    deadline = time.monotonic() + 30
    while sum(c.done() for c in calls) < n:
        assert time.monotonic() < deadline, f"{sum(c.done() for c in calls)} of {len(calls)} answered, not {n}"
        time.sleep(0.05)
    return [c for c in calls if c.done()]


def test_130_waiting_pulls_leave_status_and_push_answering(shard: Service) -> None:
    shard.call("Init", "stream_unary")(iter(wire.encode([("w", torch.zeros(4))],
                                                       init=wire_pb2.InitTag(virtual_workers=2))), timeout=10)
    # Clock 5 is far off: each pull waits (no deadline of its own) until cancelled.
    pull = ps_pb2.PullRequest(vw=0, keys=["w"], min_clock=5).SerializeToString()
    calls = [shard.call("Pull", "unary_stream")(pull) for _ in range(130)]
    try:
        lane = rpc.LANES["ParameterServer"]["Pull"]
        refused = _answered(calls, 130 - lane)
        assert {c.code() for c in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "Pull: 56 calls already in progress on this server" in refused[0].details()
        assert _healthy(shard)
        status = ps_pb2.ShardStatus.FromString(shard.call("Status")(b"", timeout=5))
        assert status.keys == 1
        reply = ps_pb2.PushReply.FromString(shard.call("Push", "stream_unary")(
            iter(wire.encode([("w", torch.ones(4))], push=wire_pb2.PushTag(vw=0, clock=0))), timeout=5))
        assert not reply.duplicate
        assert sum(not c.done() for c in calls) == lane, "the pulls in their lane still wait"
    finally:
        for call in calls:
            call.cancel()
    # Their lane is free again once they are cancelled.
    result = list(shard.call("Pull", "unary_stream")(
        ps_pb2.PullRequest(vw=0, keys=["w"], min_clock=0).SerializeToString(), timeout=10))
    assert wire.decode(result).tensors[0][1].tolist() == [1.0] * 4


def test_16_silent_forward_streams_leave_status_answering(stage: Service) -> None:
    never = threading.Event()

    def silent() -> Iterator[bytes]:
        never.wait(60)
        yield b""

    calls = [stage.call("Forward", "stream_unary").future(silent()) for _ in range(16)]
    try:
        lane = rpc.LANES["Stage"]["Forward"]
        codes = [c.exception().code() for c in _answered(calls, 16 - lane)]  # type: ignore[union-attr]
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (16 - lane)
        assert _healthy(stage)
        status = stage_pb2.StageStatus.FromString(stage.call("Status")(b"", timeout=5))
        assert status.state == stage_pb2.StageStatus.IDLE
        assert sum(not c.done() for c in calls) == lane, "the calls in their lane still wait"
    finally:
        never.set()
        for c in calls:
            c.cancel()


def test_64_open_health_watches_take_no_thread(stage: Service) -> None:
    """Health needs no token: its Watch streams, which grpc serves with a callback and no thread,
    must stay that way under the metrics' interceptor, or 22 of them silence the stage."""
    health = health_pb2_grpc.HealthStub(stage.channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=20) for _ in range(64)]
    try:
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        status = stage_pb2.StageStatus.FromString(stage.call("Status")(b"", timeout=5))
        assert status.state == stage_pb2.StageStatus.IDLE
    finally:
        for watch in watches:
            watch.cancel()


def test_a_stream_without_deadline_is_cut_at_the_cap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A client stream that opens and never sends holds its lane STREAM_CAP_S at most."""
    monkeypatch.setattr(rpc, "STREAM_CAP_S", 1.0)
    from stage_worker.runtime import StageRuntime
    from stage_worker.servicer import StageServicer

    server = rpc.Server("127.0.0.1", 0, workers=rpc.server_threads("Stage"))
    server.add("Stage", StageServicer(StageRuntime(), lambda: None))
    server.start()
    never = threading.Event()

    def silent() -> Iterator[bytes]:
        never.wait(60)
        yield b""

    try:
        with rpc.channel(server.address) as ch:
            forward = ch.stream_unary("/hetpipe.v1.Stage/Forward", request_serializer=None,
                                      response_deserializer=None)
            calls = [forward.future(silent()) for _ in range(rpc.LANES["Stage"]["Forward"])]
            for c in calls:  # cancelled by the server, not by the client's (absent) deadline
                assert c.exception(timeout=20).code() == grpc.StatusCode.CANCELLED  # type: ignore[union-attr]
            # The lane is free again: a well-formed stream is heard (and refused: no assignment).
            with pytest.raises(grpc.RpcError) as info:
                forward(iter([b""]), timeout=5)
            assert info.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    finally:
        never.set()
        server.stop()
