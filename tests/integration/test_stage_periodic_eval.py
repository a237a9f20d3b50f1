"""A periodic evaluation scores one weight version at every stage (stage_worker/evaluation.py).

Every stage runs an evaluation's minibatches one task each (stage 0 reads them, a later stage as
they arrive), and merges a pull that has arrived (G3, or an elastic exchange's delta) between
tasks. A pull that arrives while a stage is part way through an evaluation must wait until its
last minibatch there, or the evaluation would score two weight versions.

The stage is stage_rig's real middle stage of a 3-stage job; the pull reply is stood in for.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch

from conftest import deep_update
from stage_rig import FakeNeighbour, frames, middle_stage, serve, unlimited_channel
from stage_worker.sync import Sync, Weights

pytestmark = pytest.mark.timeout(120)


class PullArriving:
    """The stage's own sync, and a pull reply that arrives when the test says: the stage merges it
    (every weight + 1) at its next apply_pending once it has arrived."""

    def __init__(self, sync: Sync) -> None:
        self._sync = sync
        self.arrived = threading.Event()
        self.merged = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sync, name)

    def apply_pending(self, weights: Weights) -> None:
        if self.arrived.is_set() and not self.merged.is_set():
            compute: Any = weights
            weights.set_weights([p.detach() + 1.0 for p in compute.params])
            self.merged.set()


def test_a_pull_that_arrives_midway_through_an_evaluation_is_merged_after_it(make_job,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with_eval = {"data": {"eval_fraction": 0.2}, "eval": {"every": 2, "rows": 48}}
    with middle_stage(lambda overrides: make_job(deep_update(overrides, with_eval))) as rig:
        s = rig.runtime._s
        assert s is not None and s.evals is not None
        n = len(s.evals.batches)
        assert n == 3
        for p in (1, 2):   # evaluation 1 follows minibatch 2
            rig.stub.Forward(iter(rig.activation(p)), timeout=10)
            rig.wait_until("forwards_done", p)
            rig.stub.Backward(iter(rig.gradient(p)), timeout=10)
            rig.wait_until("backwards_done", p)
        pull = PullArriving(s.sync)
        monkeypatch.setattr(s, "sync", pull)
        before = copy.deepcopy(s.compute.module).eval()   # the weights evaluation 1 runs on here
        xs = [torch.randn(rig.in_spec.shape, dtype=rig.in_spec.dtype) for _ in range(n)]
        sent = len(rig.next.got)

        rig.stub.Forward(iter(frames([("activation", xs[0])], 1, stage=0, eval=1)), timeout=10)
        rig.next.wait_for(sent + 1)
        pull.arrived.set()   # the reply lands between the evaluation's first and second minibatch
        rig.runtime.wake()
        time.sleep(0.3)      # the compute thread goes round its loop, where pulls are merged
        for i in range(2, n + 1):
            rig.stub.Forward(iter(frames([("activation", xs[i - 1])], i, stage=0, eval=1)), timeout=10)
        rig.next.wait_for(sent + n)
        got = rig.next.got[sent:]
        assert [(t.eval, t.minibatch) for _, t, _ in got] == [(1, i) for i in range(1, n + 1)]
        with torch.no_grad():
            for i, ((_, _, tensors), x) in enumerate(zip(got, xs), 1):
                assert torch.allclose(tensors[0][1], before(x), atol=1e-6), \
                    f"evaluation 1's minibatch {i} ran on other weights than its minibatch 1 did"
        # Once the evaluation is over here, the pull is merged (before any training task).
        assert pull.merged.wait(5), "the pull was never merged"


def test_the_final_evaluations_rows_are_refused_while_the_stage_trains(make_job) -> None:
    """They follow the run: taken early, one would sit at the head of the evaluations' queue,
    holding back every periodic one behind it, and take the real row's place."""
    import grpc

    with_eval = {"data": {"eval_fraction": 0.2}, "eval": {"every": 2, "rows": 32}}
    with middle_stage(lambda overrides: make_job(deep_update(overrides, with_eval))) as rig:
        s = rig.runtime._s
        assert s is not None and s.evals is not None
        with pytest.raises(grpc.RpcError) as refused:
            rig.stub.Forward(iter(rig.activation(1, eval=s.evals.schedule.final_id)), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "follows the run" in refused.value.details()
        assert not rig.runtime._inbox.evals and not rig.runtime._inbox.eval_received
        for p in (1, 2):   # evaluation 1 follows minibatch 2, and runs as it comes
            rig.stub.Forward(iter(rig.activation(p)), timeout=10)
            rig.wait_until("forwards_done", p)
            rig.stub.Backward(iter(rig.gradient(p)), timeout=10)
            rig.wait_until("backwards_done", p)
        sent = len(rig.next.got)
        rig.stub.Forward(iter(rig.activation(1, eval=1)), timeout=10)
        deadline = time.monotonic() + 10
        while len(rig.next.got) == sent and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(t.eval, t.minibatch) for _, t, _ in rig.next.got[sent:]] == [(1, 1)]
        rig.wait_until("eval_minibatches", 1)   # progress, for the driver's stall check


def test_stage_0_sends_each_evaluation_minibatch_on_before_it_runs_the_next(make_job) -> None:
    """Run as one task, stage 0 held every activation of an evaluation (eval.rows / batch_size
    times a training minibatch's, on its device) until the last was computed."""
    from coordinator.driver import JobDriver
    from coordinator.planner import make_plan
    from hetpipe.v1 import stage_pb2_grpc
    from stage_worker.runtime import StageRuntime
    from stage_worker.servicer import StageServicer

    job = make_job({"data": {"eval_fraction": 0.2}, "eval": {"every": 2, "rows": 64},
                    "train": {"steps": 4}, "parallel": {"stages_per_vw": 2, "nm": 2}, "output": {"trace": False}})
    runtime, nxt = StageRuntime(), FakeNeighbour()
    servers = [serve(StageServicer(runtime, on_stop=lambda: None)), serve(nxt)]
    driver = JobDriver(job, make_plan(job), [s.address for s in servers])
    channel = unlimited_channel(servers[0].address)
    try:
        driver.setup()
        s = runtime._s
        assert s is not None and s.evals is not None and s.next is not None
        n = len(s.evals.batches)
        assert n > 1
        nxt.wait_for(2)   # minibatches 1 and 2 forwarded: it waits for their gradients
        events: list[str] = []
        evaluate, send = s.compute.evaluate, s.next.send
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr(s.compute, "evaluate", lambda x: (events.append("run"), evaluate(x))[1])
        monkeypatch.setattr(s.next, "send", lambda item: (events.append("sent" if item.tag.eval else "trained"),
                                                          send(item))[1])
        stub = stage_pb2_grpc.StageStub(channel)
        spec = runtime.setup.specs.output
        for p in (1, 2):   # evaluation 1 follows minibatch 2
            stub.Backward(iter(frames([("gradient", torch.randn(spec.shape, dtype=spec.dtype))], p, stage=1)),
                          timeout=10)
        nxt.wait_for(2 + n + 1)   # the evaluation's minibatches, then minibatch 3 (and 4)
        monkeypatch.undo()
        assert events[:2 * n + 1] == ["run", "sent"] * n + ["trained"]
        assert [(t.eval, t.minibatch) for _, t, _ in nxt.got[2:3 + n]] == [(1, i) for i in range(1, n + 1)] + [(0, 3)]
    finally:
        channel.close()
        driver.close()
        runtime.stop()
        for server in servers:
            server.stop(grace=0)
