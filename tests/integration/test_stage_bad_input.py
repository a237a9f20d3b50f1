"""A stage worker refuses bad input with the right gRPC status and a message naming the problem,
keeps serving, and keeps its training state unchanged (DESIGN §2: explicit dtype + shape + bytes,
every message tagged (vw, minibatch, version)).

The stage under test is a real in-process Stage server (rpc.Server + StageServicer +
StageRuntime): the middle stage of a 3-stage job, set up by coordinator.driver.JobDriver. Its two
neighbours are fakes that accept every call and record what they receive, and never send anything
themselves, so the stage only gets what the test sends.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch

from coordinator.driver import JobDriver
from coordinator.planner import make_plan
from hetpipe import rpc, wire
from hetpipe.config import JobConfig
from hetpipe.v1 import stage_pb2, stage_pb2_grpc, wire_pb2
from messages import messages
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer

pytestmark = pytest.mark.timeout(120)

State = stage_pb2.StageStatus.State
Code = grpc.StatusCode
STEPS, NM = 6, 2
# Counters and weights that a refused message must not touch.
STATE_FIELDS = ("state", "error", "received", "forwards_done", "backwards_done", "local_version", "in_flight",
                "weights_digest")


# ---- fixtures: a real stage between two fake neighbours ------------------------------------------


@dataclass
class FakeNeighbour(stage_pb2_grpc.StageServicer):
    """Accepts every call; records the tag and tensors of each Forward/Backward it gets."""

    got: list[tuple[str, wire_pb2.MinibatchTag, list[tuple[str, torch.Tensor]]]] = field(default_factory=list)
    cv: threading.Condition = field(default_factory=threading.Condition)

    def Assign(self, request: Any, context: Any) -> wire_pb2.Ack:
        return wire_pb2.Ack()

    def Start(self, request: Any, context: Any) -> wire_pb2.Ack:
        return wire_pb2.Ack()

    def Status(self, request: Any, context: Any) -> stage_pb2.StageStatus:
        return stage_pb2.StageStatus(state=State.READY)

    def _record(self, method: str, frames: Iterator[wire_pb2.TensorFrame]) -> wire_pb2.Ack:
        bundle = wire.decode(frames)
        with self.cv:
            self.got.append((method, bundle.header.minibatch, bundle.tensors))
            self.cv.notify_all()
        return wire_pb2.Ack()

    def Forward(self, request_iterator: Iterator[Any], context: Any) -> wire_pb2.Ack:
        return self._record("Forward", request_iterator)

    def Backward(self, request_iterator: Iterator[Any], context: Any) -> wire_pb2.Ack:
        return self._record("Backward", request_iterator)

    def wait_for(self, n: int, timeout: float = 10.0) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.got) >= n, timeout), f"got {len(self.got)} messages, want {n}"


def serve(servicer: Any) -> rpc.Server:
    """An in-process server of the Stage service, registered as `python -m stage_worker` does."""
    server = rpc.Server("127.0.0.1", 0, workers=8)
    rpc.add_service(server.grpc, "Stage", servicer)
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
           eval: int = 0) -> list[wire_pb2.TensorFrame]:
    tag = wire_pb2.MinibatchTag(vw=vw, minibatch=p, weight_version=version, stage=stage, eval=eval)
    return messages(wire.encode(tensors, minibatch=tag))


@pytest.fixture
def unlimited_channel() -> Iterator[Any]:
    """A client without gRPC's 4 MiB send limit, so that oversized messages reach the server."""
    yield lambda address: grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    )


@pytest.fixture
def rig(make_job, unlimited_channel) -> Iterator[Rig]:
    job = make_job({"train": {"steps": STEPS}, "parallel": {"stages_per_vw": 3, "nm": NM},
                    "output": {"trace": False}})
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


# ---- malformed or wrong activations, on a freshly started stage ----------------------------------------


def _header_only(meta: list[wire_pb2.TensorMeta], p: int = 1, data: bytes = b"") -> list[wire_pb2.TensorFrame]:
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=p, stage=0)
    return [wire_pb2.TensorFrame(minibatch=tag, tensors=meta, data=data)]


def _bad_activations(rig: Rig) -> dict[str, tuple[Any, grpc.StatusCode, str]]:
    """name -> (frames, code, regex the message must match)."""
    xs = list(rig.in_spec.shape)
    good = rig.activation(1)
    nbytes = torch.randn(xs).numel() * 4

    def edited(i: int, **kw: Any) -> list[wire_pb2.TensorFrame]:
        """The good frames with tensor i's meta changed."""
        out = [wire_pb2.TensorFrame() for _ in good]
        for o, g in zip(out, good):
            o.CopyFrom(g)
        meta = out[0].tensors[i]
        for k, v in kw.items():
            if k == "shape":
                del meta.shape[:]
                meta.shape.extend(v)
            else:
                setattr(meta, k, v)
        return out

    ok_x = torch.randn(xs)
    wider = torch.randn([xs[0], xs[1] + 1])
    return {
        "unknown dtype code": (edited(0, dtype=99), Code.INVALID_ARGUMENT, "unknown dtype code 99"),
        "wrong dtype": (frames([("activation", ok_x.double())], 1, stage=0),
                        Code.INVALID_ARGUMENT, r"activation: dtype torch\.float64, expected torch\.float32"),
        "too few bytes": (_header_only(good[0].tensors, data=bytes(nbytes - 4)), Code.INVALID_ARGUMENT,
                          rf"byte length {nbytes - 4} does not match the shapes in the header \({nbytes} bytes\)"),
        "too many bytes": (_header_only(good[0].tensors, data=bytes(nbytes + 8)), Code.INVALID_ARGUMENT,
                           rf"byte length .* does not match the shapes in the header \({nbytes} bytes\)"),
        "shape claims more than sent": (edited(0, shape=[xs[0], xs[1] * 1000]), Code.INVALID_ARGUMENT,
                                        "byte length .* does not match the shapes in the header"),
        "huge claimed shape": (edited(0, shape=[1 << 20, 1 << 20]), Code.INVALID_ARGUMENT,
                               r"shape \[1048576, 1048576\] needs \d+ bytes, more than the \d+ allowed"),
        "negative dimension": (edited(0, shape=[-1, xs[1]]), Code.INVALID_ARGUMENT,
                               "negative dimension"),
        "too many dims": (edited(0, shape=[1] * 9 + [xs[1]]), Code.INVALID_ARGUMENT,
                          "10 dims, at most 8"),
        "minibatch 0": (rig.activation(0), Code.INVALID_ARGUMENT,
                        rf"minibatch 0: the job has minibatches 1\.\.{STEPS}"),
        "minibatch steps+1": (rig.activation(STEPS + 1), Code.INVALID_ARGUMENT,
                              rf"minibatch {STEPS + 1}: the job has minibatches 1\.\.{STEPS}"),
        "another vw": (rig.activation(1, vw=1), Code.INVALID_ARGUMENT,
                       "tagged for vw 1, but this is stage 1 of vw 0"),
        "wrong sender stage": (rig.activation(1, stage=2), Code.INVALID_ARGUMENT, "sent by stage 2, expected stage 0"),
        "no minibatch tag": ([wire_pb2.TensorFrame(tensors=good[0].tensors, data=good[0].data)] + good[1:],
                             Code.INVALID_ARGUMENT, "lacks the minibatch tag"),
        "wrong activation shape": (frames([("activation", wider)], 1, stage=0),
                                   Code.INVALID_ARGUMENT,
                                   rf"activation: shape \[{xs[0]}, {xs[1] + 1}\], expected \[{xs[0]}, {xs[1]}\]"),
        "a target alongside (they no longer travel)": (
            frames([("activation", ok_x), ("target", torch.zeros(xs[0], dtype=torch.int64))], 1, stage=0),
            Code.INVALID_ARGUMENT, r"activation: expected 1 tensor, got 2"),
        "an evaluation this stage does not run": (rig.activation(1, eval=3), Code.INVALID_ARGUMENT,
                                                  r"activation: evaluation 3 minibatch 1 is not one this stage runs"),
        "empty stream": ([], Code.INVALID_ARGUMENT, "empty tensor stream"),
        "header repeated": (good + [wire_pb2.TensorFrame(minibatch=good[0].minibatch)], Code.INVALID_ARGUMENT,
                            "header fields repeated after the first frame"),
        "oversized frame": (_header_only(good[0].tensors, data=bytes(5 << 20)), Code.RESOURCE_EXHAUSTED,
                            r"(?i)larger than max"),
        "beyond the nm window": (rig.activation(NM + 1), Code.FAILED_PRECONDITION,
                                 rf"activation for minibatch {NM + 1} .*at most nm={NM}"),
    }


def test_bad_activations_are_refused_and_change_nothing(rig: Rig) -> None:
    before = rig.snapshot()
    assert before["state"] == State.RUNNING and before["received"] == 0 and before["weights_digest"]
    for name, (request, code, match) in _bad_activations(rig).items():
        try:
            refused(rig.stub.Forward, iter(request), code, match)
            assert rig.snapshot() == before, "a refused message changed the stage's state"
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert not rig.next.got and not rig.prev.got, "a refused activation was passed on"

    # The stage still takes a valid activation, runs it, and passes it on with its version.
    rig.stub.Forward(iter(rig.activation(1)), timeout=10)
    rig.wait_until("forwards_done", 1)
    rig.next.wait_for(1)
    method, tag, tensors = rig.next.got[0]
    assert (method, tag.vw, tag.minibatch, tag.stage, tag.weight_version) == ("Forward", 0, 1, 1, 0)
    assert [(n, list(t.shape)) for n, t in tensors] == [("activation", list(rig.out_spec.shape))]
    after = rig.snapshot()
    assert (after["received"], after["forwards_done"], after["in_flight"]) == (1, 1, 1)
    assert after["weights_digest"] == before["weights_digest"]  # a forward does not update weights


def test_duplicates_and_unexpected_gradients_are_refused(rig: Rig) -> None:
    # A gradient for a minibatch this stage never forwarded.
    before = rig.snapshot()
    refused(rig.stub.Backward, iter(rig.gradient(1)), Code.FAILED_PRECONDITION,
            "gradient for minibatch 1, which this stage has not forwarded")
    assert rig.snapshot() == before

    rig.stub.Forward(iter(rig.activation(1)), timeout=10)
    rig.wait_until("forwards_done", 1)
    before = rig.snapshot()
    bad_gradients = {
        "duplicate activation": (rig.stub.Forward, rig.activation(1), Code.ALREADY_EXISTS,
                                 "activation for minibatch 1 was already received"),
        "gradient never forwarded": (rig.stub.Backward, rig.gradient(2), Code.FAILED_PRECONDITION,
                                     "gradient for minibatch 2, which this stage has not forwarded"),
        "gradient minibatch 0": (rig.stub.Backward, rig.gradient(0), Code.INVALID_ARGUMENT,
                                 rf"gradient for minibatch 0: the job has minibatches 1\.\.{STEPS}"),
        "gradient another vw": (rig.stub.Backward, rig.gradient(1, vw=3), Code.INVALID_ARGUMENT,
                                "gradient: tagged for vw 3, but this is stage 1 of vw 0"),
        "gradient wrong sender": (rig.stub.Backward, rig.gradient(1, stage=0), Code.INVALID_ARGUMENT,
                                  "gradient: sent by stage 0, expected stage 2"),
        "gradient wrong shape": (rig.stub.Backward,
                                 frames([("gradient", torch.randn(rig.out_spec.shape[0], 3))], 1, stage=2),
                                 Code.INVALID_ARGUMENT, r"gradient: shape \[\d+, 3\], expected"),
        "gradient wrong dtype": (rig.stub.Backward,
                                 frames([("gradient", torch.randn(rig.out_spec.shape).double())], 1, stage=2),
                                 Code.INVALID_ARGUMENT, r"gradient: dtype torch\.float64, expected torch\.float32"),
        "gradient two tensors": (rig.stub.Backward,
                                 frames([("gradient", torch.randn(rig.out_spec.shape))] * 2, 1, stage=2),
                                 Code.INVALID_ARGUMENT, r"gradient: expected 1 tensor, got 2"),
    }
    for name, (call, request, code, match) in bad_gradients.items():
        try:
            refused(call, iter(request), code, match)
            assert rig.snapshot() == before, "a refused message changed the stage's state"
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None

    # The valid gradient is still accepted: one backward, one local update (L3), the gradient
    # goes on to the previous stage tagged with the stashed version.
    rig.stub.Backward(iter(rig.gradient(1)), timeout=10)
    after = rig.wait_until("backwards_done", 1)
    assert (after.local_version, after.in_flight, after.received) == (1, 0, 2)
    assert after.weights_digest != before["weights_digest"]
    rig.prev.wait_for(1)
    method, tag, tensors = rig.prev.got[0]
    assert (method, tag.minibatch, tag.stage, tag.weight_version) == ("Backward", 1, 1, 0)
    assert [(n, list(t.shape)) for n, t in tensors] == [("gradient", list(rig.in_spec.shape))]

    done = rig.snapshot()
    refused(rig.stub.Backward, iter(rig.gradient(1)), Code.ALREADY_EXISTS, "gradient for minibatch 1 was already received")
    refused(rig.stub.Forward, iter(rig.activation(1)), Code.ALREADY_EXISTS, "activation for minibatch 1 was already received")
    assert rig.snapshot() == done


def test_control_calls_out_of_turn_are_refused(rig: Rig) -> None:
    before = rig.snapshot()
    refused(rig.stub.Start, wire_pb2.Empty(), Code.FAILED_PRECONDITION, "cannot start in state RUNNING")
    refused(rig.stub.Assign, stage_pb2.StageAssignment(job_json=rig.job.to_json()), Code.FAILED_PRECONDITION,
            "stage already assigned")
    refused(rig.stub.Evaluate, stage_pb2.EvalRequest(), Code.FAILED_PRECONDITION,
            "evaluate: this stage has no evaluation to run in state RUNNING")
    assert rig.snapshot() == before


# ---- Assign on a fresh worker ---------------------------------------------------------


@dataclass
class Recorder(FakeNeighbour):
    """A fake stage that keeps the assignment the driver sends it."""

    assignment: stage_pb2.StageAssignment | None = None

    def Assign(self, request: Any, context: Any) -> wire_pb2.Ack:
        self.assignment = request
        return wire_pb2.Ack()


@pytest.fixture
def idle(make_job) -> Iterator[tuple[Any, ...]]:
    """What JobDriver.setup sends stage 1 of a 2-stage job; a fresh (IDLE) real stage's stub and
    runtime; and the fake stage 0 that the assignment names as the previous stage."""
    job = make_job({"train": {"steps": STEPS}, "parallel": {"stages_per_vw": 2, "nm": NM},
                    "output": {"trace": False}})
    fakes = [FakeNeighbour(), Recorder()]
    servers = [serve(f) for f in fakes]
    runtime = StageRuntime()
    servers.append(serve(StageServicer(runtime, on_stop=lambda: None)))
    driver = JobDriver(job, make_plan(job), [s.address for s in servers[:2]])
    channel = rpc.channel(servers[2].address)
    try:
        driver.setup()
        recorder = fakes[1]
        assert recorder.assignment is not None
        yield recorder.assignment, stage_pb2_grpc.StageStub(channel), runtime, fakes[0]
    finally:
        channel.close()
        driver.close()
        runtime.stop()
        for server in servers:
            server.stop(grace=0)


def _loaded(stub: Any, timeout: float = 10.0) -> stage_pb2.StageStatus:
    """The stage's status once it has left LOADING."""
    deadline = time.monotonic() + timeout
    while (s := stub.Status(stage_pb2.StatusRequest(weights_digest=True), timeout=5)).state == State.LOADING:
        assert time.monotonic() < deadline, f"still loading: {s.detail}"
        time.sleep(0.01)
    return s


def test_bad_assignments_are_refused_and_a_good_one_still_works(idle: Any) -> None:
    good, stub, runtime, stage0 = idle

    def variant(**changes: Any) -> stage_pb2.StageAssignment:
        a = stage_pb2.StageAssignment()
        a.CopyFrom(good)
        for key, value in changes.items():
            if isinstance(value, list):
                del getattr(a, key)[:]
                getattr(a, key).extend(value)
            else:
                setattr(a, key, value)
        return a

    raw = json.loads(good.job_json)
    raw["parallel"]["nm"] = "auto"
    auto_nm = json.dumps(raw)
    batch = list(good.input_shape)
    bad = {
        "garbage job_json": (variant(job_json="{not json"), "job_json: not valid JSON"),
        "job_json not an object": (variant(job_json="[1, 2]"), "job_json: .*expected a JSON object"),
        "job_json missing the model": (variant(job_json="{}"), "job_json: model: give exactly one of model.name"),
        "unresolved nm": (variant(job_json=auto_nm), "parallel.nm: expected an integer"),
        "stage beyond num_stages": (variant(stage=2), r"stage 2 of 2: the job has 2 stages"),
        "num_stages not the job's": (variant(num_stages=3), r"stage 1 of 3: the job has 2 stages"),
        "a later stage without its previous stage": (variant(prev_address=""), "needs prev_address"),
        "the last stage with a next stage": (variant(next_address="127.0.0.1:1"), "next_address exactly when"),
        "empty layer range": (variant(layer_begin=3, layer_end=3), r"layers \[3, 3\)"),
        "layers in the wrong order": (variant(layer_begin=5, layer_end=3), r"layers \[5, 3\): an empty range"),
        "vw beyond the job": (variant(vw=5), "vw 5 but the job has 1"),
        "unknown input dtype": (variant(input_dtype=99), "unknown dtype code 99"),
        "an output shape of another batch": (variant(output_shape=[batch[0] + 1, 10]), "one minibatch of data"),
        "unknown output dtype": (variant(output_dtype=77), "output_dtype: unknown dtype code 77"),
        "key_shards without shards": (variant(key_shards=[0]), "key_shards: shards \\[0\\] for 0 shard addresses"),
        "negative link time": (variant(prev_send_seconds=-1.0), r"prev_send_seconds: -1.0: expected a number of seconds"),
        "NaN push time": (variant(push_seconds=float("nan")), "push_seconds: nan: expected a number of seconds"),
        "infinite pull time": (variant(pull_seconds=float("inf")), "pull_seconds: inf: expected a number of seconds"),
        "absurd task time": (variant(forward_seconds=1e300), r"forward_seconds: 1e\+300: expected"),
        "device meta": (variant(device="meta"), "device 'meta': expected 'cpu', 'cuda:N'"),
        "device cpu:99": (variant(device="cpu:99"), "device 'cpu:99': expected"),
        "a huge input shape": (variant(input_shape=[4194304, batch[1]]), "one minibatch of data.batch_size"),
        "a zero dimension": (variant(input_shape=[batch[0], 0]), r"input_shape: \[\d+, 0\]: expected"),
    }
    failures = []
    for name, (request, match) in bad.items():
        try:
            refused(stub.Assign, request, Code.INVALID_ARGUMENT, match)
            s = stub.Status(stage_pb2.StatusRequest(weights_digest=True), timeout=5)
            assert s.state == State.IDLE, f"state {State.Name(s.state)} after a refused Assign"
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)

    # After all that, the driver's assignment is accepted, and the stage loads it...
    stub.Assign(good, timeout=10)
    s = _loaded(stub)
    assert (s.state, s.vw, s.stage) == (State.READY, 0, 1)

    # The last stage computes the loss and takes no gradient, even a well-formed one.
    before = {f: getattr(s, f) for f in STATE_FIELDS}
    logits = torch.randn(runtime.setup.specs.output.shape)
    refused(stub.Backward, iter(frames([("gradient", logits)], 1, stage=2)), Code.FAILED_PRECONDITION,
            "the last stage computes the loss and takes no gradients")
    s = stub.Status(stage_pb2.StatusRequest(weights_digest=True), timeout=5)
    assert {f: getattr(s, f) for f in STATE_FIELDS} == before

    # An activation may arrive before Start: it waits, and runs (F+B) once the stage starts.
    x = torch.randn(runtime.setup.specs.activation.shape)
    stub.Forward(iter(frames([("activation", x)], 1, stage=0)), timeout=10)
    stub.Start(wire_pb2.Empty(), timeout=10)
    stage0.wait_for(1)
    method, tag, tensors = stage0.got[0]
    assert (method, tag.minibatch, tag.stage, tag.weight_version) == ("Backward", 1, 1, 0)
    assert [(n, list(t.shape)) for n, t in tensors] == [("gradient", list(runtime.setup.specs.activation.shape))]
    deadline = time.monotonic() + 10
    while (s := stub.Status(stage_pb2.StatusRequest(weights_digest=True), timeout=5)).backwards_done < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (s.state, s.received, s.forwards_done, s.backwards_done, s.local_version) == (State.RUNNING, 1, 1, 1, 1)
    assert s.last_loss > 0


def test_bytes_that_are_not_a_frame_are_refused(rig: Rig, unlimited_channel: Any) -> None:
    before = rig.snapshot()
    channel = unlimited_channel(rig.address)
    try:
        refused(rpc.Stub(channel, "Stage").Forward, iter([b"\xff\xff\xff\xff"]), Code.INVALID_ARGUMENT,
                "malformed TensorFrame")
    finally:
        channel.close()
    assert rig.snapshot() == before


@pytest.mark.parametrize(("change", "match"), [
    ({"layer_end": 99}, r"loading failed: LoadError: layers \[\d+, 99\) but the model has \d+"),
    ({"key_shards": [0], "ps_addresses": ["127.0.0.1:9"]}, r"key_shards: 1 entries for \d+ parameters"),
])
def test_an_assignment_the_model_does_not_fit_fails_loading_naming_why(idle: Any, change: dict[str, Any],
                                                                       match: str) -> None:
    good, _, _, _ = idle
    runtime = StageRuntime()
    server = serve(StageServicer(runtime, on_stop=lambda: None))
    a = stage_pb2.StageAssignment()
    a.CopyFrom(good)
    for key, value in change.items():
        if isinstance(value, list):
            getattr(a, key).extend(value)
        else:
            setattr(a, key, value)
    try:
        with rpc.channel(server.address) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            stub.Assign(a, timeout=10)  # answered at once: the model is built in the background
            s = _loaded(stub)
            assert s.state == State.FAILED and re.search(match, s.error), s.error
            assert s.error.startswith("stage 1 of vw 0: ")
    finally:
        runtime.stop()
        server.stop(grace=0)


def test_layers_that_do_not_produce_the_planned_output_fail_at_the_first_forward(rig: Rig) -> None:
    batch, features = rig.out_spec.shape
    a = stage_pb2.StageAssignment()
    a.CopyFrom(rig.assignment)
    del a.output_shape[:]
    a.output_shape.extend([batch, features + 1])  # a plan that got this stage's output wrong
    runtime = StageRuntime()
    server = serve(StageServicer(runtime, on_stop=lambda: None))
    try:
        with rpc.channel(server.address) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            stub.Assign(a, timeout=10)
            assert _loaded(stub).state == State.READY
            stub.Start(wire_pb2.Empty(), timeout=10)
            stub.Forward(iter(rig.activation(1)), timeout=10)
            deadline = time.monotonic() + 10
            while (s := stub.Status(stage_pb2.StatusRequest(), timeout=5)).state == State.RUNNING:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert s.state == State.FAILED
        assert (f"layers produce torch.float32 [{batch}, {features}], the plan expected torch.float32 "
                f"[{batch}, {features + 1}]") in s.error, s.error
        assert "at minibatch 1" in s.error
    finally:
        runtime.stop()
        server.stop(grace=0)
