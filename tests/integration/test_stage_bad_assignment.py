"""A stage worker refuses a bad assignment with INVALID_ARGUMENT and a message naming the problem,
and stays IDLE; an assignment the model does not fit fails loading (or the first forward) naming
why; the driver's assignment still works after all the refused ones.

The stages come from stage_rig: a fresh real stage that the test assigns itself, or the running
middle stage of a 3-stage job. Bad data-plane messages are in test_stage_bad_input.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import deep_update, example_job
from coordinator.driver import JobDriver
from coordinator.planner import make_plan
from hetpipe import models, rpc
from hetpipe.config import load_job
from hetpipe.v1 import stage_pb2, stage_pb2_grpc, wire_pb2
from stage_rig import (
    NM,
    STATE_FIELDS,
    STEPS,
    Code,
    FakeNeighbour,
    Recorder,
    Rig,
    State,
    frames,
    middle_stage,
    refused,
    serve,
)
from stage_rig import variant as assignment_variant
from stage_worker import loaded
from stage_worker.assignment import validate
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer
from stage_worker.wsp_sync import WspSync

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def rig(make_job) -> Iterator[Rig]:
    with middle_stage(make_job) as running:
        yield running


# ---- Assign on a fresh worker ---------------------------------------------------------


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
        return assignment_variant(good, **changes)

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
        # A VW of several without its shards trained alone (the others' pulls waiting for its pushes).
        "shards for a lone VW": (variant(ps_addresses=["127.0.0.1:9"]),
                                 r"ps_addresses: 1 shard addresses, but the job has 0 ps shards"),
        "no shards for a VW of two": (assignment_variant(good, {"parallel": {"virtual_workers": 2, "ps_shards": 2}}),
                                      r"ps_addresses: 0 shard addresses, but the job has 2 ps shards"),
        "negative link time": (variant(prev_send_seconds=-1.0), r"prev_send_seconds: -1.0: expected a number of seconds"),
        "NaN push time": (variant(push_seconds=float("nan")), "push_seconds: nan: expected a number of seconds"),
        "infinite pull time": (variant(pull_seconds=float("inf")), "pull_seconds: inf: expected a number of seconds"),
        "absurd task time": (variant(forward_seconds=1e300), r"forward_seconds: 1e\+300: expected"),
        "device meta": (variant(device="meta"), "device 'meta': expected 'cpu', 'cuda:N'"),
        "device cpu:99": (variant(device="cpu:99"), "device 'cpu:99': expected"),
        "device with a final newline": (variant(device="cuda:0\n"), "device 'cuda:0\\\\n': expected"),
        "a huge input shape": (variant(input_shape=[4194304, batch[1]]), "one minibatch of data.batch_size"),
        "a zero dimension": (variant(input_shape=[batch[0], 0]), r"input_shape: \[\d+, 0\]: expected"),
        "a checkpoint mark that is no nonce": (variant(checkpoint_mark="../x\n"), "checkpoint_mark '../x\\\\n': expected"),
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
    # A real GPU type, not emulated, on a worker without CUDA (compose's cpu profile under a real
    # cluster): its numbers would pass for that GPU's.
    refused(stub.Assign, variant(gpu_type="h100-80gb", emulated=False, device="cpu"), Code.FAILED_PRECONDITION,
            "the plan puts a real h100-80gb at stage 1 of vw 0, but this worker has no CUDA device")
    assert stub.Status(stage_pb2.StatusRequest(), timeout=5).state == State.IDLE

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


# bench/gpu.py's 117.8M GPT on two emulated 16 GiB T4s: the largest minibatches of the jobs we ship.
GPT_118M = {"model": {"name": "gpt", "args": {"vocab": 8192, "context": 256, "dim": 1024, "heads": 16, "layers": 8}},
            "data": {"name": "synthetic", "args": {"rows": 64}},
            "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}], "emulate": {}},
            "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 2}}
LEGITIMATE = {
    **{name: (name, {}) for name in ("quickstart", "compose-cluster", "paper-cluster", "own-model", "streaming")},
    "gpt-118m batch 16": (None, deep_update(GPT_118M, {"data": {"batch_size": 16}})),
    "gpt-118m batch 32": (None, deep_update(GPT_118M, {"data": {"batch_size": 32}})),
}


@pytest.mark.parametrize("case", sorted(LEGITIMATE))
def test_the_planners_assignments_pass_the_minibatch_size_rule(tmp_path: Path, case: str) -> None:
    """The bound on one minibatch's bytes refuses no assignment of a job we ship: what JobDriver
    sends each stage of the examples and of the 118M GPT (up to 0.3 GiB a minibatch) validates."""
    example, raw = LEGITIMATE[case]
    if example is not None:
        job = load_job(example_job(tmp_path, example))
    else:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(deep_update(raw, {"output": {"dir": str(tmp_path / "out")}})))
        job = load_job(tmp_path / "job.yaml")
    plan = make_plan(job)
    fakes = [Recorder() for _ in plan.stages]
    servers = [serve(f) for f in fakes]
    shards = ["127.0.0.1:1"] * job.parallel.started_shards  # setup never calls them
    driver = JobDriver(job, plan, [s.address for s in servers], ps_addresses=shards)
    try:
        driver.setup()
        for fake in fakes:
            assert fake.assignment is not None
            validate(fake.assignment)  # Rejected if the rule refused it
    finally:
        driver.close()
        for server in servers:
            server.stop(grace=0)


@pytest.mark.parametrize(("change", "match"), [
    ({"layer_end": 99}, r"loading failed: LoadError: layers \[\d+, 99\) but the model has \d+"),
    ({"key_shards": [0], "ps_addresses": ["127.0.0.1:9"], "job_json": {"parallel": {"virtual_workers": 2}}},
     r"key_shards: 1 entries for \d+ parameters"),
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
        elif key == "job_json":
            a.job_json = json.dumps(deep_update(json.loads(a.job_json), value))
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


def test_a_load_that_fails_once_its_sync_exists_closes_the_sync(idle: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that fails after the stage has made its sync with the shards (here: the checkpoint
    it resumes from is missing) closes that sync: its pusher thread ends and its channels close."""
    good, _, _, _ = idle
    made: list[WspSync] = []

    class Recorded(WspSync):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loaded, "WspSync", Recorded)
    setup = validate(good)
    params = models.parameter_keys(models.structure(setup.job.model, setup.job.base_dir), setup.layer_begin,
                                   setup.layer_end)
    a = assignment_variant(good, {"parallel": {"virtual_workers": 2}}, ps_addresses=["127.0.0.1:9"],
                           key_shards=[0] * len(params), checkpoint_dir=str(tmp_path / "checkpoints"), resume_wave=1)
    with _stage_given(a) as (_, s):
        assert s.state == State.FAILED and re.search(r"loading failed: LoadError: .*vw0_stage1", s.error), s.error
        assert len(made) == 1, "the load failed before it made its sync: this test tests nothing"
        sync = made[0]
        sync._pusher.join(timeout=5)
        assert sync._closed.is_set() and not sync._pusher.is_alive(), "the failed load left its sync open"
        for ch in sync._channels:
            with pytest.raises(ValueError, match="closed channel"):  # open, it would try the shard
                ch.unary_unary("/hetpipe.v1.ParameterServer/Pull")(b"", timeout=1)


def test_layers_that_do_not_produce_the_planned_output_fail_at_the_first_forward(rig: Rig) -> None:
    batch, features = rig.out_spec.shape
    a = stage_pb2.StageAssignment()
    a.CopyFrom(rig.assignment)
    del a.output_shape[:]
    a.output_shape.extend([batch, features + 1])  # a plan that got this stage's output wrong
    with _stage_given(a) as (stub, loaded_status):
        assert loaded_status.state == State.READY
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


@contextlib.contextmanager
def _stage_given(a: stage_pb2.StageAssignment) -> Iterator[tuple[Any, Any]]:
    """A fresh stage on port 0, given assignment a: (its stub, its status once it has loaded)."""
    runtime = StageRuntime()
    server = serve(StageServicer(runtime, on_stop=lambda: None))
    try:
        with rpc.channel(server.address) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            stub.Assign(a, timeout=10)
            yield stub, _loaded(stub)
    finally:
        runtime.stop()
        server.stop(grace=0)


def test_cuda_ipc_is_kept_only_where_the_link_shares_memory(idle: Any) -> None:
    """The driver asks CUDA IPC of two GPU neighbours only (none here: the stages are on the CPU);
    a stage keeps it only for a link through shared memory, to a neighbour it has."""
    good = idle[0]
    assert good.prev_address and not good.next_address   # the last of two stages
    assert not good.prev_cuda_ipc and not good.next_cuda_ipc
    assert validate(assignment_variant(good, prev_cuda_ipc=True, prev_shm=True)).prev_cuda_ipc
    assert not validate(assignment_variant(good, prev_cuda_ipc=True, prev_shm=False)).prev_cuda_ipc
    assert not validate(assignment_variant(good, next_cuda_ipc=True, next_shm=True)).next_cuda_ipc


def test_a_stage_that_is_stopping_does_not_start(idle: Any) -> None:
    """Stop closes the links and the sync it finds; a Start after it would make links that outlive
    the stage. Refused, naming why."""
    good, stub, runtime, _ = idle
    stub.Assign(good, timeout=10)
    assert _loaded(stub).state == State.READY
    runtime.stop()
    refused(stub.Start, wire_pb2.Empty(), Code.FAILED_PRECONDITION, "cannot start: the stage is stopping")
    assert runtime._s is not None and runtime._s.prev is None and runtime._thread is None
