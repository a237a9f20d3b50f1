"""Fuzz: 400 malformed or hostile requests to each of the 26 RPCs of a real coordinator, shard
and stage process (`python -m ...`, as a launcher starts them). For every request: an answer
before the deadline with a status that names a refusal (never INTERNAL or UNKNOWN), the state
the service reports unchanged when the request was refused, and the service still answering
Status. Then 1500 more per RPC: the process alive and the floor of its RSS risen by less than
2.5 MiB over 1000 of them. Issue 14 item 7."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from fuzz_messages import job_json, malformed, serialized, tensor_stream
from hetpipe import rpc, wire
from service_process import Service, start
from hetpipe.v1 import coordinator_pb2, ps_pb2, stage_pb2, wire_pb2

pytestmark = pytest.mark.timeout(240)

REQUESTS = 400         # each checked for an unchanged state when refused
LEAK_REQUESTS = 1500   # then these, for RSS growth
CALL_S = 10.0
RSS_GROWTH_PER_1000 = 1 << 20   # the bound is 2.5 times this over the 1000 requests compared
# Codes that say "your request": anything else (INTERNAL, UNKNOWN, a client-side deadline) is a bug.
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED}
SHAPES = {"l0.weight": (2, 3), "l0.bias": (3,)}


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from _initialised_shard(tmp_path_factory)


@pytest.fixture(scope="module")
def evicting_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A shard of its own for Evict: a hostile but well-formed Evict rightly evicts a VW."""
    yield from _initialised_shard(tmp_path_factory)


def _initialised_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    for service in start("ps_server", "ParameterServer", tmp_path_factory.mktemp("shard")):
        # Initialised, with keys and two VWs: hostile pushes and pulls reach the WSP checks.
        w0 = [(k, torch.ones(s)) for k, s in SHAPES.items()]
        service.call("Init", "stream_unary")(iter(wire.encode(w0, init=wire_pb2.InitTag(virtual_workers=2))), timeout=CALL_S)
        yield service


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start("stage_worker", "Stage", tmp_path_factory.mktemp("stage"))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start("coordinator", "Coordinator", tmp_path_factory.mktemp("coordinator"))


def _shard_state(service: Service) -> Any:
    status = ps_pb2.ShardStatus.FromString(service.call("Status")(b"", timeout=CALL_S))
    status.ClearField("peak_rss_bytes")
    return status


def _stage_state(service: Service) -> Any:
    status = stage_pb2.StageStatus.FromString(service.call("Status")(b"", timeout=CALL_S))
    return (status.state, status.error, status.received, status.forwards_done, status.backwards_done,
            status.weights_digest)


def _coordinator_state(service: Service) -> Any:
    listed = coordinator_pb2.WorkerList.FromString(service.call("ListWorkers")(b"", timeout=CALL_S))
    workers = [(w.worker_id, w.info.SerializeToString(deterministic=True), w.assigned) for w in listed.workers]
    job = coordinator_pb2.JobStatus.FromString(service.call("GetJob")(b"", timeout=CALL_S))
    return workers, job.state, job.reason


Send = Callable[[Service, random.Random], None]


def _unary(method: str, descriptor: Any, *, parse_only: bool = False) -> Send:
    """Hostile or malformed requests; parse_only: malformed bytes only (an Empty that parses is a
    well-formed Stop, which would rightly stop the service)."""

    def send(service: Service, rnd: random.Random) -> None:
        data = malformed(rnd) if parse_only else serialized(descriptor, rnd)
        service.call(method)(data, timeout=CALL_S)

    return send


def _unary_stream(method: str, descriptor: Any, timeout: float = CALL_S) -> Send:
    def send(service: Service, rnd: random.Random) -> None:
        for _ in service.call(method, "unary_stream")(serialized(descriptor, rnd), timeout=timeout):
            pass

    return send


def _tensor_stream(method: str) -> Send:
    def send(service: Service, rnd: random.Random) -> None:
        service.call(method, "stream_unary")(iter(tensor_stream(rnd)), timeout=CALL_S)

    return send


def _tensor_frame(method: str) -> Send:
    """The unary twin of a TensorFrame stream method: the stream's first frame alone."""
    def send(service: Service, rnd: random.Random) -> None:
        service.call(method, "unary_unary")(tensor_stream(rnd)[0], timeout=CALL_S)

    return send


def _tensor_bidi(method: str) -> Send:
    def send(service: Service, rnd: random.Random) -> None:
        for _ in service.call(method, "stream_stream")(iter(tensor_stream(rnd)), timeout=CALL_S):
            pass

    return send


def _submit(service: Service, rnd: random.Random) -> None:
    data = (malformed(rnd) if rnd.random() < 0.2
            else coordinator_pb2.SubmitRequest(job_json=job_json(rnd)).SerializeToString())
    service.call("Submit")(data, timeout=CALL_S)


Empty = wire_pb2.Empty.DESCRIPTOR
JobRef = coordinator_pb2.JobRef.DESCRIPTOR
RPCS: dict[str, tuple[str, Callable[[Service], Any], Send]] = {
    "PS.Init": ("shard", _shard_state, _tensor_stream("Init")),
    "PS.Push": ("shard", _shard_state, _tensor_stream("Push")),
    "PS.PushFrame": ("shard", _shard_state, _tensor_frame("PushFrame")),
    # A pull of known keys for a clock not reached waits (G2) until just before its deadline.
    "PS.Pull": ("shard", _shard_state, _unary_stream("Pull", ps_pb2.PullRequest.DESCRIPTOR, timeout=0.5)),
    "PS.Status": ("shard", _shard_state, _unary("Status", Empty)),
    "PS.Evict": ("evicting_shard", _shard_state, _unary("Evict", ps_pb2.EvictRequest.DESCRIPTOR)),
    "PS.Exchange": ("shard", _shard_state, _tensor_bidi("Exchange")),
    "Stage.Assign": ("stage", _stage_state, _unary("Assign", stage_pb2.StageAssignment.DESCRIPTOR)),
    "Stage.Start": ("stage", _stage_state, _unary("Start", Empty)),
    "Stage.Forward": ("stage", _stage_state, _tensor_stream("Forward")),
    "Stage.Backward": ("stage", _stage_state, _tensor_stream("Backward")),
    "Stage.ForwardLink": ("stage", _stage_state, _tensor_bidi("ForwardLink")),
    "Stage.BackwardLink": ("stage", _stage_state, _tensor_bidi("BackwardLink")),
    "Stage.LinkSocket": ("stage", _stage_state, _unary("LinkSocket", Empty)),
    "Stage.Status": ("stage", _stage_state, _unary("Status", stage_pb2.StatusRequest.DESCRIPTOR)),
    "Stage.GetWeights": ("stage", _stage_state, _unary_stream("GetWeights", stage_pb2.WeightsRequest.DESCRIPTOR)),
    "Stage.Evaluate": ("stage", _stage_state, _unary("Evaluate", stage_pb2.EvalRequest.DESCRIPTOR)),
    "Stage.Stop": ("stage", _stage_state, _unary("Stop", Empty, parse_only=True)),
    "Stage.Continue": ("stage", _stage_state, _unary("Continue", Empty)),
    "Coordinator.Register": ("coordinator", _coordinator_state,
                             _unary("Register", coordinator_pb2.WorkerInfo.DESCRIPTOR)),
    "Coordinator.Heartbeat": ("coordinator", _coordinator_state,
                              _unary("Heartbeat", coordinator_pb2.HeartbeatRequest.DESCRIPTOR)),
    "Coordinator.ListWorkers": ("coordinator", _coordinator_state, _unary("ListWorkers", Empty)),
    "Coordinator.Submit": ("coordinator", _coordinator_state, _submit),
    "Coordinator.GetJob": ("coordinator", _coordinator_state, _unary("GetJob", JobRef)),
    # Malformed only: a JobRef that parses with an empty job_id is a well-formed stop of the job.
    "Coordinator.StopJob": ("coordinator", _coordinator_state, _unary("StopJob", JobRef, parse_only=True)),
    "Coordinator.Results": ("coordinator", _coordinator_state, _unary_stream("Results", coordinator_pb2.ResultsRequest.DESCRIPTOR)),
}


def _burst(service: Service, state: Callable[[Service], Any] | None, send: Send, rnd: random.Random, n: int,
           codes: Counter[str]) -> None:
    """n requests, each answered in time with a refusal or OK; with state: each refused one left
    the state as it was."""
    before = state(service) if state else None
    for i in range(n):
        try:
            send(service, rnd)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            waited = code is grpc.StatusCode.DEADLINE_EXCEEDED and "not reached within" in (exc.details() or "")
            assert code in REFUSALS or waited, f"request {i}: {code.name}: {exc.details()} (exit code {service.proc.poll()})"
            assert len(exc.details() or "") <= rpc.MAX_DETAILS_CHARS + 100
        codes[code.name] += 1
        if state is None:
            continue
        after = state(service)  # also: the service still answers
        if code is not grpc.StatusCode.OK:
            assert after == before, f"request {i} was refused ({code.name}) but changed the state"
        before = after


def _floor_growth(service: Service, send: Send, rnd: random.Random, codes: Counter[str]) -> int:
    """Bytes the RSS floor rose over LEAK_REQUESTS requests: the lowest RSS over the last 500
    against the lowest over the first 500."""
    samples = []
    for _ in range(LEAK_REQUESTS // 50):
        _burst(service, None, send, rnd, 50, codes)
        samples.append(service.rss())
    window = 500 // 50
    return min(samples[-window:]) - min(samples[:window])


@pytest.mark.parametrize("rpc_name", sorted(RPCS))
def test_malformed_and_hostile_requests_are_refused_without_harm(rpc_name: str, shard: Service, evicting_shard: Service,
                                                                  stage: Service, coordinator: Service) -> None:
    fixture, state, send = RPCS[rpc_name]
    service = {"shard": shard, "evicting_shard": evicting_shard, "stage": stage, "coordinator": coordinator}[fixture]
    rnd = random.Random(rpc_name)
    codes: Counter[str] = Counter()
    _burst(service, state, send, rnd, REQUESTS, codes)
    # A leak raises the floor of RSS at a steady rate. The allocator settles 1-2 MiB above where
    # it started within the first 1000 requests and then swings by about 1 MiB either way, so
    # the floor is compared: the lowest RSS over the first and over the last 500 of LEAK_REQUESTS
    # requests, 1000 requests apart. (The parse-failure leak this suite caught: 19 MiB per 1000.)
    # Now and then the floor also jumps once, by 1.5 MiB or so (a thread of the server's pool
    # taking its own malloc arena): a leak rises again over the next LEAK_REQUESTS, a jump does not.
    bound = RSS_GROWTH_PER_1000 * 2.5
    growth = _floor_growth(service, send, rnd, codes)
    if growth >= bound:
        growth = min(growth, _floor_growth(service, send, rnd, codes))
    print(rpc_name, dict(codes), f"{growth / 2**20:+.2f} MiB")
    assert service.proc.poll() is None, service.log.read_text()[-3000:]
    assert growth < bound, (f"{rpc_name}: RSS floor rose {growth / 2**20:.2f} MiB over {LEAK_REQUESTS - 500} requests, "
                            f"twice ({codes})")
    # 40% of the requests do not parse (all of them for Stop and StopJob): those at least are refused.
    assert sum(v for k, v in codes.items() if k != "OK") >= 0.3 * (REQUESTS + LEAK_REQUESTS), codes
