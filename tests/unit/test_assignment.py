"""coordinator/assignment.py: what each stage is told at setup, built from the planned job alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.assignment import Assigner
from coordinator.driver import StageHandle
from coordinator.planner import make_plan
from coordinator.planner.shapes import boundaries
from hetpipe import data, models
from hetpipe.errors import JobFailed


def _assigner(make_job: Any, transport: str, ps_hosts: list[str]) -> tuple[Assigner, list[StageHandle]]:
    """2 VWs x 2 stages and two shards; stage i of VW v at port 9000 + 10 v + i."""
    job = make_job({"parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "ps_shards": 2,
                                 "transport": transport}})
    plan = make_plan(job)
    model = models.structure(job.model, job.base_dir, dtype=job.train.dtype)
    batch = data.batch_shapes(job)
    flows = boundaries(model, batch[0], torch.float32)
    stages = [StageHandle(sp, f"127.0.0.1:{9000 + 10 * sp.vw + sp.stage}", None, None,  # type: ignore[arg-type]
                          host_id=f"host-{sp.vw}") for sp in plan.stages]
    assigner = Assigner(job, plan, model, batch, flows, ["127.0.0.1:8000", "127.0.0.1:8001"], ps_hosts,
                        Path("trace"), None, "", 0)
    return assigner, stages


def test_each_stage_is_told_its_own_layers_its_vws_neighbours_and_the_shards_of_its_keys(make_job: Any) -> None:
    assigner, stages = _assigner(make_job, "auto", ["host-0", "host-1"])
    plan = assigner.plan
    for h in stages:
        a = assigner.assignment(h, stages)
        sp = h.plan
        assert (a.vw, a.stage, a.num_stages, a.layer_begin, a.layer_end) == (sp.vw, sp.stage, 2, sp.layer_begin,
                                                                             sp.layer_end)
        port = 9000 + 10 * sp.vw
        assert a.prev_address == ("" if sp.stage == 0 else f"127.0.0.1:{port}")
        assert a.next_address == ("" if sp.stage == 1 else f"127.0.0.1:{port + 1}")
        keys = models.parameter_keys(assigner.model, sp.layer_begin, sp.layer_end)
        assert list(a.key_shards) == [plan.key_shard[k] for k in keys] and keys
        # Its neighbours share its host (auto: shared memory); of the shards, the one on its host.
        assert (a.prev_shm, a.next_shm) == (sp.stage == 1, sp.stage == 0)
        assert list(a.ps_shm) == [sp.vw == 0, sp.vw == 1]
        assert not a.prev_cuda_ipc and not a.next_cuda_ipc, "CPU stages"
        assert tuple(a.activation_shape) == assigner.flows[sp.layer_begin][0]
        assert tuple(a.output_shape) == assigner.flows[sp.layer_end][0]
        assert a.trace_path == f"trace/vw{sp.vw}_stage{sp.stage}.jsonl"


def test_transport_grpc_never_uses_shared_memory(make_job: Any) -> None:
    assigner, stages = _assigner(make_job, "grpc", ["host-0", "host-1"])
    for h in stages:
        a = assigner.assignment(h, stages)
        assert not a.prev_shm and not a.next_shm and list(a.ps_shm) == [False, False]


@pytest.mark.parametrize(("host", "why"), [("elsewhere", "they do not share a host's memory"),
                                           ("", "a host identity is unknown")])
def test_transport_shm_with_a_shard_it_cannot_share_memory_with_fails_naming_both(
        make_job: Any, host: str, why: str) -> None:
    assigner, stages = _assigner(make_job, "shm", ["host-0", host])
    with pytest.raises(JobFailed, match=r"parallel.transport is shm, but stage 0 of vw 0 at 127.0.0.1:9000 and "
                                        r"ps shard 1 at 127.0.0.1:8001 cannot use it") as err:
        assigner.assignment(stages[0], stages)
    assert why in str(err.value) and "transport auto uses shared memory where it can" in str(err.value)


def test_transport_shm_with_a_neighbour_on_another_host_fails_naming_it(make_job: Any) -> None:
    assigner, stages = _assigner(make_job, "shm", ["host-0", "host-0"])
    stages[1].host_id = "host-9"   # stage 1 of vw 0
    with pytest.raises(JobFailed, match=r"stage 0 of vw 0 at 127.0.0.1:9000 and stage 1 of vw 0 cannot use it"):
        assigner.assignment(stages[0], stages)


def test_under_auto_neighbours_on_two_hosts_talk_grpc_and_the_rest_shared_memory(make_job: Any) -> None:
    assigner, stages = _assigner(make_job, "auto", ["host-0", "host-1"])
    stages[0].host_id = "host-9"   # stage 0 of vw 0
    first, second = (assigner.assignment(h, stages) for h in stages[:2])
    assert not first.next_shm and not second.prev_shm
    assert list(first.ps_shm) == [False, False] and list(second.ps_shm) == [True, False]
    other = assigner.assignment(stages[2], stages)   # stage 0 of vw 1, beside its own
    assert other.next_shm
