"""Small requests that asked a service for a lot (issue 14, amplification): each is refused with
INVALID_ARGUMENT or RESOURCE_EXHAUSTED before the service allocates what it asks for, its RSS
grows by less than 10 MB, and the service goes on answering. (How fast each is refused is
measured by bench/amplification.py: timings do not belong in tests.)"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator.driver import JobDriver
from coordinator.planner import make_plan
from hetpipe import wire
from hetpipe.v1 import coordinator_pb2, ps_pb2, stage_pb2, wire_pb2
from service_process import Service, start
from stage_rig import Recorder, serve, variant

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode
RSS_LIMIT = 10 * 10**6
# NOT_FOUND: a key this shard does not own (what the push protocol has always answered).
REFUSED = {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.NOT_FOUND}


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start("ps_server", "ParameterServer", tmp_path_factory.mktemp("shard"))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start("coordinator", "Coordinator", tmp_path_factory.mktemp("coordinator"))


def _refused(call: object, *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)  # type: ignore[operator]
    assert info.value.code() in REFUSED, (info.value.code(), info.value.details())
    return info.value



def test_init_for_twenty_million_vws(shard: Service) -> None:
    rss = shard.rss()
    frames = wire.encode([("w", torch.ones(2))], init=wire_pb2.InitTag(virtual_workers=20_000_000))
    error = _refused(shard.call("Init", "stream_unary"), iter(frames), timeout=10)
    assert "virtual_workers must be in [1, 1024], got 20000000" in error.details()
    assert shard.rss() - rss < RSS_LIMIT
    status = ps_pb2.ShardStatus.FromString(shard.call("Status")(b"", timeout=10))
    assert status.virtual_workers == 0 and status.keys == 0, "nothing was initialised"


def test_256_mib_push_under_a_foreign_key_is_refused_at_its_header(shard: Service) -> None:
    shard.call("Init", "stream_unary")(iter(wire.encode([("w", torch.ones(2))], init=wire_pb2.InitTag(virtual_workers=2))),
                           timeout=10)
    sent = 0

    def frames() -> Iterator[bytes]:
        nonlocal sent
        for frame in wire.encode([("foreign", torch.zeros(64, 1 << 20))], push=wire_pb2.PushTag(vw=0, clock=0)):
            sent += len(frame)
            yield frame

    rss = shard.rss()
    error = _refused(shard.call("Push", "stream_unary"), frames(), timeout=30)
    assert "keys not owned by this shard: ['foreign']" in error.details()
    # What gRPC took in before the refusal reached the client: 10.2 MB once, under load. The
    # tensor, had it been allocated, is 256 MB.
    assert shard.rss() - rss < 4 * RSS_LIMIT
    assert sent < 64 << 20, f"the client got to send {sent >> 20} MiB of 256 before the refusal"


def test_sixty_registrations_with_1_mib_names(coordinator: Service) -> None:
    """Refused by size before they are parsed. The coordinator's threads share two malloc arenas:
    with one per thread, the buffers gRPC read these into left it 9-12 MB larger."""
    rss = coordinator.rss()
    for i in range(60):
        error = _refused(coordinator.call("Register"), _registration(i, "x" * (1 << 20)), timeout=10)
        assert error.details().startswith("Register: WorkerInfo request of 1048"), error.details()
        assert error.details().endswith("bytes, at most 16384"), error.details()
    assert coordinator.rss() - rss < RSS_LIMIT
    listed = coordinator_pb2.WorkerList.FromString(coordinator.call("ListWorkers")(b"", timeout=10))
    assert not listed.workers


def test_registration_fields_bounded(coordinator: Service) -> None:
    """Under the size bound, each field still has its own: a name is a name, not a payload."""
    error = _refused(coordinator.call("Register"), _registration(0, "x" * 10_000), timeout=10)
    assert "name: 10000 characters, at most 256" in error.details()
    listed = coordinator_pb2.WorkerList.FromString(coordinator.call("ListWorkers")(b"", timeout=10))
    assert not listed.workers


def test_control_requests_bounded_by_size(coordinator: Service, shard: Service) -> None:
    """Each request type has its own size bound, checked before the bytes are parsed."""
    error = _refused(coordinator.call("Register"), _registration(0, "x" * 100_000), timeout=10)
    assert error.code() == Code.INVALID_ARGUMENT
    assert error.details().startswith("Register: WorkerInfo request of 1000"), error.details()
    assert error.details().endswith("bytes, at most 16384"), error.details()
    # An Empty padded with an unknown field: it parses, but nothing legitimate is that large.
    padded = b"\x0a\x90\x20" + b"x" * 4112
    before = _shard_state(shard)
    error = _refused(shard.call("Status"), padded, timeout=10)
    assert error.details() == "Status: Empty request of 4115 bytes, at most 1024", error.details()
    assert _shard_state(shard) == before


def _shard_state(shard: Service) -> ps_pb2.ShardStatus:
    status = ps_pb2.ShardStatus.FromString(shard.call("Status")(b"", timeout=10))
    status.ClearField("peak_rss_bytes")  # the process's, not the shard's state
    return status


def _registration(i: int, name: str) -> bytes:
    return coordinator_pb2.WorkerInfo(role=coordinator_pb2.WorkerInfo.STAGE_WORKER, address=f"127.0.0.1:{1000 + i}",
                                      node="n0", device="cpu", name=name).SerializeToString()


@pytest.mark.parametrize("job_json", [
    json.dumps({"model": {"name": "mlp"}, "data": {"name": "digits"},
                "parallel": {"virtual_workers": 1e18, "stages_per_vw": 2}}),
    json.dumps({"model": {"name": "mlp"}, "data": {"name": "digits"},
                "parallel": {"virtual_workers": 10**18, "stages_per_vw": 2}}),
    "[" * 100_000 + "]" * 100_000,
], ids=["vws-1e18-float", "vws-1e18-int", "nested-100k"])
def test_submit_of_an_absurd_job(coordinator: Service, job_json: str) -> None:
    rss = coordinator.rss()
    error = _refused(coordinator.call("Submit"), coordinator_pb2.SubmitRequest(job_json=job_json).SerializeToString(),
                     timeout=10)
    assert error.details().startswith("job_json:"), error.details()
    assert coordinator.rss() - rss < RSS_LIMIT
    job = coordinator_pb2.JobStatus.FromString(coordinator.call("GetJob")(b"", timeout=10))
    assert job.state == coordinator_pb2.JobStatus.NONE


def test_shard_tensor_metas_bounded(shard: Service) -> None:
    """A shape that overflows torch's layout (no bytes: a dimension is 0), sent to a real shard by
    Push, PushFrame and Init: each is refused at its header, naming the shape, and changes nothing."""
    meta = wire_pb2.TensorMeta(name="t", dtype=wire_pb2.FLOAT32, shape=[0, 2**62, 2**62])
    push = wire_pb2.TensorFrame(tensors=[meta], push=wire_pb2.PushTag(vw=0, clock=0)).SerializeToString()
    init = wire_pb2.TensorFrame(tensors=[meta], init=wire_pb2.InitTag(virtual_workers=2)).SerializeToString()
    calls = {"Push": (shard.call("Push", "stream_unary"), iter([push])),
             "PushFrame": (shard.call("PushFrame"), push),
             "Init": (shard.call("Init", "stream_unary"), iter([init]))}
    before, rss = _shard_state(shard), shard.rss()
    for method, (call, request) in calls.items():
        error = _refused(call, request, timeout=10)
        # The wire's own check, not a later one (the key's owner, torch's allocation): the bundle
        # is refused before anything is looked up or allocated.
        assert error.code() == Code.INVALID_ARGUMENT, (method, error.code(), error.details())
        assert re.search(r"tensor 0 \(t\): shape \[0, 4611686018427387904, 4611686018427387904\] spans \d+ bytes, "
                         r"more than the \d+ allowed", error.details()), (method, error.details())
    assert shard.rss() - rss < RSS_LIMIT
    assert _shard_state(shard) == before, "Status answers, and nothing changed"


@pytest.fixture
def stage_and_assignment(tmp_path: Path, make_job: Any) -> Iterator[tuple[Service, stage_pb2.StageAssignment]]:
    """A fresh (IDLE) stage process, and what JobDriver.setup sends the middle stage of a 3-stage
    job, whose neighbours (recording fakes) stay up for the test."""
    job = make_job({"train": {"steps": 6}, "parallel": {"stages_per_vw": 3, "nm": 2}, "output": {"trace": False}})
    fakes = [Recorder() for _ in range(3)]
    servers = [serve(f) for f in fakes]
    driver = JobDriver(job, make_plan(job), [s.address for s in servers])
    try:
        driver.setup()
        assert fakes[1].assignment is not None
        for service in start("stage_worker", "Stage", tmp_path):
            yield service, fakes[1].assignment
    finally:
        driver.close()
        for server in servers:
            server.stop(grace=0)


def test_nonsense_assignments_leave_the_stage_idle_and_small(
        stage_and_assignment: tuple[Service, stage_pb2.StageAssignment]) -> None:
    """Issue 14's Assigns, to a real stage process: each refused naming its field before anything
    is allocated; the stage stays IDLE, within 10 MB, and takes the driver's assignment after."""
    stage, good = stage_and_assignment

    def state() -> stage_pb2.StageStatus:
        return stage_pb2.StageStatus.FromString(stage.call("Status")(b"", timeout=10))

    big = 1 << 20  # the largest data.batch_size a job may have
    bad = {
        "NaN task time": (variant(good, forward_seconds=float("nan")), Code.INVALID_ARGUMENT,
                          "forward_seconds: nan: expected a number of seconds"),
        "negative task time": (variant(good, backward_seconds=-1.0), Code.INVALID_ARGUMENT,
                               "backward_seconds: -1.0: expected a number of seconds"),
        "absurd send time": (variant(good, next_send_seconds=1e300), Code.INVALID_ARGUMENT,
                             r"next_send_seconds: 1e\+300: expected a number of seconds"),
        "device meta": (variant(good, device="meta"), Code.INVALID_ARGUMENT, "device 'meta': expected"),
        "device cpu:99": (variant(good, device="cpu:99"), Code.INVALID_ARGUMENT, "device 'cpu:99': expected"),
        # A device this machine lacks is a precondition of the machine, not a malformed field.
        "device cuda:99": (variant(good, device="cuda:99"), Code.FAILED_PRECONDITION,
                           "device 'cuda:99': this machine has"),
        "a middle stage without its previous stage": (variant(good, prev_address=""), Code.INVALID_ARGUMENT,
                                                      "stage 1 of 3: needs prev_address"),
        # The 873-byte Assign: 1 GiB of float32 input per minibatch.
        "a 1 GiB minibatch": (variant(good, {"data": {"batch_size": 4194304}}, input_shape=[4194304, 64],
                                       activation_shape=[4194304, 32], output_shape=[4194304, 32],
                                       target_shape=[4194304]),
                              Code.INVALID_ARGUMENT, "job_json: data.batch_size: expected an integer >= 1 and <= 1048576"),
        "a minibatch larger than the stage's GPU": (
            variant(good, {"data": {"batch_size": big}}, input_shape=[big, 64], activation_shape=[big, 32],
                     output_shape=[big, 32], target_shape=[big], capacity_bytes=64 << 20),
            Code.RESOURCE_EXHAUSTED, r"input_shape \[1048576, 64\]: one minibatch's tensors take 520\.0 MiB, "
                                     r"more than capacity_bytes 64\.0 MiB"),
        "a minibatch no bundle can carry": (
            variant(good, input_shape=[good.input_shape[0], 1 << 30], capacity_bytes=1 << 62),
            Code.RESOURCE_EXHAUSTED, r"input_shape \[16, 1073741824\]: one minibatch's tensors take 64\.00 GiB, "
                                     r"more than the 16\.00 GiB a tensor bundle may carry"),
    }
    rss = stage.rss()
    failures = []
    for name, (request, code, match) in bad.items():
        try:
            stage.call("Assign")(request.SerializeToString(), timeout=10)
            answer = ("OK", "accepted")
        except grpc.RpcError as exc:
            answer = (exc.code(), exc.details())
        time.sleep(0.2)  # what an accepted one would load, it loads now
        got = (*answer, stage_pb2.StageStatus.State.Name(state().state))
        if got[0] != code or not re.search(match, got[1]) or got[2] != "IDLE":
            failures.append(f"{name}: {got}")
        if stage.rss() - rss >= RSS_LIMIT:
            failures.append(f"{name}: RSS grew by {(stage.rss() - rss) / 1e6:.0f} MB")
    assert not failures, "\n".join(failures)

    stage.call("Assign")(good.SerializeToString(), timeout=10)
    deadline = time.monotonic() + 30
    while (s := state()).state == stage_pb2.StageStatus.LOADING:
        assert time.monotonic() < deadline, s.detail
        time.sleep(0.02)
    assert (stage_pb2.StageStatus.State.Name(s.state), s.vw, s.stage) == ("READY", 0, 1), s.error
