"""A real in-process stage between two fake neighbours, for the stage's bad-input tests.

The stage is a real Stage server (rpc.Server + StageServicer + StageRuntime): the middle stage of
a 3-stage job, set up by coordinator.driver.JobDriver. Its two neighbours are fakes that accept
every call and record what they receive, and never send anything themselves, so the stage only
gets what the test sends.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch

from coordinator.driver import JobDriver
from coordinator.planner import make_plan
from hetpipe import outputs, rpc, wire
from hetpipe.config import JobConfig
from hetpipe.v1 import stage_pb2, stage_pb2_grpc, wire_pb2
from messages import messages
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer

State = stage_pb2.StageStatus.State
Code = grpc.StatusCode
STEPS, NM = 6, 2
# Counters and weights that a refused message must not touch.
STATE_FIELDS = ("state", "error", "received", "forwards_done", "backwards_done", "local_version", "in_flight",
                "weights_digest")


@dataclass
class FakeNeighbour(stage_pb2_grpc.StageServicer):
    """Accepts every call; records the tag and tensors of each Forward/Backward it gets."""

    got: list[tuple[str, Any, list[tuple[str, torch.Tensor]]]] = field(default_factory=list)  # a tag, or fp16 verdicts
    cv: threading.Condition = field(default_factory=threading.Condition)

    def Assign(self, request: Any, context: Any) -> wire_pb2.Ack:
        if request.checkpoint_dir:   # a stage on this host, as the driver checks it: it sees the folder
            outputs.shared_mark_path(request.checkpoint_dir, request.vw, request.stage,
                                    request.checkpoint_mark).write_text("fake\n")
        return wire_pb2.Ack()

    def Start(self, request: Any, context: Any) -> wire_pb2.Ack:
        return wire_pb2.Ack()

    def Status(self, request: Any, context: Any) -> stage_pb2.StageStatus:
        return stage_pb2.StageStatus(state=State.READY)

    def _record(self, method: str, frames: Iterator[wire_pb2.TensorFrame]) -> wire_pb2.Ack:
        bundle = wire.decode(frames)
        with self.cv:
            self.got.append((method, getattr(bundle.header, bundle.header.WhichOneof("header") or "minibatch"),
                             bundle.tensors))
            self.cv.notify_all()
        return wire_pb2.Ack()

    def Forward(self, request_iterator: Iterator[Any], context: Any) -> wire_pb2.Ack:
        return self._record("Forward", request_iterator)

    def Backward(self, request_iterator: Iterator[Any], context: Any) -> wire_pb2.Ack:
        return self._record("Backward", request_iterator)

    # One-frame bundles come over the link's stream; recorded under the stream method's name.
    def ForwardLink(self, frames: Iterator[bytes], context: Any) -> Iterator[wire_pb2.Ack]:
        for frame in frames:
            yield self._record("Forward", iter([frame]))

    def BackwardLink(self, frames: Iterator[bytes], context: Any) -> Iterator[wire_pb2.Ack]:
        for frame in frames:
            yield self._record("Backward", iter([frame]))

    def wait_for(self, n: int, timeout: float = 10.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.got) >= n, timeout), f"got {len(self.got)} messages, want {n}"


@dataclass
class Recorder(FakeNeighbour):
    """A fake stage that keeps the assignment the driver sends it."""

    assignment: stage_pb2.StageAssignment | None = None

    def Assign(self, request: Any, context: Any) -> wire_pb2.Ack:
        self.assignment = request
        return wire_pb2.Ack()


def serve(servicer: Any) -> rpc.Server:
    """An in-process server of the Stage service, registered as `python -m stage_worker` does."""
    server = rpc.Server("127.0.0.1", 0, workers=8)
    server.add("Stage", servicer)
    server.start()
    return server


class _Recording(StageServicer):
    """The real stage's servicer, keeping the assignment the driver sent."""

    assignment: stage_pb2.StageAssignment | None = None

    def Assign(self, request: stage_pb2.StageAssignment, context: Any) -> wire_pb2.Ack:
        self.assignment = request
        return super().Assign(request, context)


@dataclass
class Rig:
    job: JobConfig
    runtime: StageRuntime
    stub: stage_pb2_grpc.StageStub
    prev: FakeNeighbour
    next: FakeNeighbour
    address: str
    assignment: stage_pb2.StageAssignment

    @property
    def in_spec(self) -> Any:
        return self.runtime.setup.specs.activation

    @property
    def out_spec(self) -> Any:
        return self.runtime.setup.specs.output

    def status(self) -> stage_pb2.StageStatus:
        return self.stub.Status(stage_pb2.StatusRequest(weights_digest=True), timeout=5)

    def snapshot(self) -> dict[str, Any]:
        s = self.status()
        return {f: getattr(s, f) for f in STATE_FIELDS}

    def activation(self, p: int, **tag: Any) -> list[wire_pb2.TensorFrame]:
        x = torch.randn(self.in_spec.shape, dtype=self.in_spec.dtype)
        return frames([("activation", x)], p, **{"stage": 0, **tag})

    def gradient(self, p: int, **tag: Any) -> list[wire_pb2.TensorFrame]:
        g = torch.randn(self.out_spec.shape, dtype=self.out_spec.dtype)
        return frames([("gradient", g)], p, **{"stage": 2, **tag})

    def wait_until(self, what: str, value: int, timeout: float = 10.0) -> stage_pb2.StageStatus:
        deadline = time.monotonic() + timeout
        while (s := self.status()).state == State.RUNNING and getattr(s, what) < value:
            assert time.monotonic() < deadline, f"{what} stayed at {getattr(s, what)}, want {value}"
            time.sleep(0.01)
        assert getattr(s, what) == value, f"{what} = {getattr(s, what)} in state {State.Name(s.state)}: {s.error}"
        return s


def frames(tensors: list[tuple[str, torch.Tensor]], p: int, *, vw: int = 0, stage: int, version: int = 0,
           eval: int = 0, micro: int = 0) -> list[wire_pb2.TensorFrame]:
    tag = wire_pb2.MinibatchTag(vw=vw, minibatch=p, weight_version=version, stage=stage, eval=eval, micro=micro)
    return messages(wire.encode(tensors, minibatch=tag))


def unlimited_channel(address: str) -> grpc.Channel:
    """A client without gRPC's 4 MiB send limit, so that oversized messages reach the server."""
    return grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    )


@contextmanager
def middle_stage(make_job: Callable[..., JobConfig], parallel: dict[str, Any] | None = None,
                 **train: Any) -> Iterator[Rig]:
    """The middle stage of a 3-stage job, running, between two fake neighbours (make_job: the
    conftest fixture; parallel: more parallel keys, e.g. schedule; train: more train keys)."""
    job = make_job({"train": {"steps": STEPS, **train},
                    "parallel": {"stages_per_vw": 3, "nm": NM, **(parallel or {})}, "output": {"trace": False}})
    runtime = StageRuntime()
    prev, nxt = FakeNeighbour(), FakeNeighbour()
    middle = _Recording(runtime, on_stop=lambda: None)
    servers = [serve(prev), serve(middle), serve(nxt)]
    driver = JobDriver(job, make_plan(job), [s.address for s in servers])
    channel = unlimited_channel(servers[1].address)
    try:
        driver.setup()  # Assign, wait until loaded, Start, as `hetpipe run` does
        assert middle.assignment is not None
        yield Rig(job, runtime, stage_pb2_grpc.StageStub(channel), prev, nxt, servers[1].address, middle.assignment)
    finally:
        channel.close()
        driver.close()
        runtime.stop()
        for s in servers:
            s.stop(grace=0)


def refused(call: Any, request: Any, code: grpc.StatusCode, match: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    err: Any = info.value
    assert err.code() == code, f"got {err.code().name}: {err.details()}, want {code.name}"
    details: str = err.details()
    assert re.search(match, details), f"{details!r} does not match {match!r}"
    return details


def variant(good: stage_pb2.StageAssignment, job: dict[str, Any] | None = None,
            **fields: Any) -> stage_pb2.StageAssignment:
    """A copy of good with these fields replaced (lists whole), and job merged into its job file."""
    from conftest import deep_update  # pytest's module: imported where a test runs

    a = stage_pb2.StageAssignment()
    a.CopyFrom(good)
    if job is not None:
        a.job_json = json.dumps(deep_update(json.loads(good.job_json), job))
    for key, value in fields.items():
        if isinstance(value, list):
            del getattr(a, key)[:]
            getattr(a, key).extend(value)
        else:
            setattr(a, key, value)
    return a
