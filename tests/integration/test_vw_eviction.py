"""Losing a VW (parallel.on_vw_failure: continue), the driver against in-process shards: a shard
that owns no key (more shards than layers with parameters, or `local` placement) must not fail the
eviction, and the evaluations count what a VW that left trained, not what it would have."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.driver import JobDriver
from coordinator.planner import make_plan
from hetpipe import rpc, wire
from hetpipe.v1 import ps_pb2_grpc, stage_pb2, wire_pb2
from messages import messages
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard

pytestmark = pytest.mark.timeout(60)
State = stage_pb2.StageStatus.State




class _Stage:
    """A stage as the driver's stub sees it; failed: it reports FAILED."""

    def __init__(self) -> None:
        self.failed = False

    def Status(self, request: Any, timeout: float) -> stage_pb2.StageStatus:
        if self.failed:
            return stage_pb2.StageStatus(state=State.FAILED, error="stage 0 of vw 1: boom", failed_at=1.0,
                                         backwards_done=3)
        return stage_pb2.StageStatus(state=State.RUNNING, recent_loss=1.0)

    def Stop(self, request: Any, timeout: float) -> wire_pb2.Ack:
        return wire_pb2.Ack()


def test_a_vw_leaves_although_a_shard_owns_no_key(make_job, tmp_path: Path) -> None:
    # mlp hidden [32]: two layers with parameters over three shards; shard 2 owns no key.
    job = make_job({"model": {"args": {"hidden": [32]}},
                    "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "ps_shards": 3,
                                 "on_vw_failure": "continue"},
                    "output": {"trace": False}})
    plan = make_plan(job)
    assert sorted(set(plan.key_shard.values())) == [0, 1]   # shard 2 owns nothing
    servers, channels, stubs = [], [], []
    for i in range(3):
        server = rpc.Server("127.0.0.1", 0, workers=4)
        server.add("ParameterServer", ShardServicer(Shard(), Durability(str(tmp_path / f"ps{i}"))))
        server.start()
        servers.append(server)
        ch = rpc.channel(server.address)
        channels.append(ch)
        stubs.append(ps_pb2_grpc.ParameterServerStub(ch))
    # What VW 0's stages give the shards that own keys (w0): the keyless one gets no Init.
    for i in range(2):
        keys = [k for k, s in plan.key_shard.items() if s == i]
        tensors = [(k, torch.zeros(3)) for k in keys]
        stubs[i].Init(iter(messages(wire.encode(tensors, init=wire_pb2.InitTag(virtual_workers=2, shard=i)))),
                      timeout=10)
    driver = JobDriver(job, plan, [f"127.0.0.1:{9 + i}" for i in range(len(plan.stages))])
    fakes = {}
    for h in driver.stages:
        h.stub = fakes[h.plan.vw] = _Stage()
    driver.shards = stubs   # type: ignore[assignment]
    try:
        fakes[1].failed = True
        driver.poll()   # VW 1 leaves; VW 0 trains on
        assert [e["vw"] for e in driver.evicted] == [1]
        assert [h.plan.vw for h in driver.stages] == [0]
    finally:
        driver.close()
        for ch in channels:
            ch.close()
        for server in servers:
            server.stop(grace=0)


class _Scorer(_Stage):
    """VW 0's last stage: one evaluation after its minibatch 20."""

    def Status(self, request: Any, timeout: float) -> stage_pb2.StageStatus:
        return stage_pb2.StageStatus(state=State.RUNNING, recent_loss=1.0, backwards_done=20,
                                     evals=[stage_pb2.EvalResult(id=1, minibatches=20, rows=16, loss=1.0,
                                                                 accuracy=0.5, time=0.0)])


class _Shard:
    def Evict(self, request: Any, timeout: float) -> wire_pb2.Ack:
        return wire_pb2.Ack()


def test_eval_samples_count_what_a_vw_that_left_trained(make_job, tmp_path: Path) -> None:
    import json
    job = make_job({"parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "ps_shards": 1,
                                 "on_vw_failure": "continue"},
                    "data": {"eval_fraction": 0.2}, "eval": {"every": 20, "rows": 16},
                    "output": {"trace": False, "dir": str(tmp_path / "out")}})
    plan = make_plan(job)
    driver = JobDriver(job, plan, [f"127.0.0.1:{9 + i}" for i in range(len(plan.stages))])
    (tmp_path / "out").mkdir()
    vw1 = _Stage()
    for h in driver.stages:
        h.stub = _Scorer() if h.plan.vw == 0 else vw1
        h.last = stage_pb2.StageStatus(state=State.RUNNING, backwards_done=3)   # VW 1 trained 3
    driver.shards = [_Shard()]   # type: ignore[list-item]
    try:
        vw1.failed = True
        driver.poll()   # VW 1 leaves after 3 minibatches; VW 0's evaluation after its 20th
        [left] = driver.evicted
        [row] = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
        batch = job.data.batch_size
        assert row["samples"] <= (20 + left["minibatches"]) * batch, (row, left)
    finally:
        driver.close()
