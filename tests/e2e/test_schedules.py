"""The micro-batch schedules on HetPipe's own stages (docs/design.md, "Schedules"): O1 for gpipe
and 1f1b, and their trace rules on real runs with random delays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe import timeline, weight_files
from hetpipe.reference import initial_model, train_reference
from launch.local import run_local
from tests import schedule_rules, trace_rules

pytestmark = pytest.mark.timeout(180)


def run_and_compare(job: Any, tmp_path: Path) -> None:
    """Runs the job and compares its written weights with the reference (float64, 1e-9)."""
    run_local(job, quiet=True)
    got = weight_files.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    start = initial_model(job).state_dict()
    assert max(float((got[k] - start[k]).abs().max()) for k in want) > 1e-3, (
        "training must move the weights for the comparison to mean anything")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", [2, 4])
def test_flushed_schedules_match_single_process(make_job, tmp_path: Path, schedule: str, k: int) -> None:
    """O1: gpipe and 1f1b are synchronous within a VW: the weights after T steps equal plain
    training with the same micro-batching (float64, 1e-9)."""
    job = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 12},
        "parallel": {"stages_per_vw": k, "nm": 1, "schedule": schedule, "microbatches": 4},
        "output": {"trace": False},
    })
    run_and_compare(job, tmp_path)


@pytest.mark.parametrize(("schedule", "n"), [("gpipe", 1), ("1f1b", 2)])
def test_flushed_schedules_resume_from_a_cut_as_if_never_stopped(make_job, tmp_path: Path, schedule: str,
                                                                  n: int) -> None:
    """train.checkpoint_every under gpipe and 1f1b: the cuts change nothing (O1 against the
    reference), and a run resumed from the last one ends with the same weights (1e-9, float64,
    D 0; SGD with momentum for one VW, so the optimizer's state must come back too)."""
    job = make_job({
        "train": {"dtype": "float64", "steps": 12, "checkpoint_every": 4,
                  "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9 if n == 1 else 0.0}},
        "parallel": {"virtual_workers": n, "stages_per_vw": 3 if n == 1 else 2, "nm": 1, "D": 0,
                     "schedule": schedule, "microbatches": 4},
        "output": {"trace": False},
    })
    run_and_compare(job, tmp_path)
    whole = weight_files.read_weights(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["cut000008"]
    summary = run_local(job, quiet=True, resume=True)   # minibatches 9-12 again, from the cut
    assert summary["steps"] == 12
    resumed = weight_files.read_weights(tmp_path / "out")
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=1e-9, msg=f"{key} differs")


# k 2: two VWs under WSP (D 1), so G2 is checked too; k 4: one VW.
CASES = [("gpipe", 2, 1, 3), ("gpipe", 4, 1, 4), ("1f1b", 2, 1, 3), ("1f1b", 4, 1, 6),
         ("nf1b", 2, 3, 2), ("nf1b", 4, 2, 2)]


@pytest.mark.parametrize(("schedule", "k", "nm", "micro"), CASES)
def test_schedule_trace_rules(make_job, inject_faults, tmp_path: Path, schedule: str, k: int, nm: int,
                              micro: int) -> None:
    """Each schedule's rules hold on a real run with random task delays."""
    inject_faults(task_delay=(0.0, 0.01))
    vws = 2 if k == 2 else 1
    steps = 10
    job = make_job({
        "data": {"batch_size": 12},
        "train": {"steps": steps},
        "parallel": {"virtual_workers": vws, "stages_per_vw": k, "nm": nm, "D": 1, "schedule": schedule,
                     "microbatches": micro},
    })
    summary = run_local(job, quiet=True)
    assert summary["final_loss"] == summary["final_loss"], "a loss was computed"
    rows = trace_rules.load_trace(tmp_path / "out" / "trace")
    trace_rules.check_complete(rows, vws=vws, stages=k, steps=steps)
    trace_rules.check_min_clock(rows, nm, 1)
    if schedule == "nf1b":
        exported = timeline.chrome_trace(timeline.load(tmp_path / "out"))["traceEvents"]
        recorded = {(e["pid"], e["args"]["p"]): e["args"]["version_difference"] for e in exported
                    if e["ph"] == "X" and "version_difference" in e.get("args", {})}
        for v, diffs in schedule_rules.check_nf1b(rows, nm, micro).items():
            assert all(1 <= d <= nm for d in diffs.values()), f"vw {v}: version differences {diffs} outside 1..{nm}"
            assert {p: recorded[(timeline.vw_pid(v), p)] for p in diffs} == diffs, "the export records v per minibatch"
    else:
        schedule_rules.check_flushed(rows, schedule, k, micro)


def test_gpipe_under_quorum_of_all_is_synchronous_data_parallelism(make_job, tmp_path: Path) -> None:
    """Schedule and sync compose: 2 VWs running gpipe inside, quorum of all VWs across, plain SGD,
    D 0 equal the summed-updates reference with the same micro-batching (O2, float64, 1e-9)."""
    job = make_job({
        "train": {"dtype": "float64", "steps": 8},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 1, "D": 0, "schedule": "gpipe",
                     "microbatches": 2, "sync": "quorum", "sync_args": {"quorum": "all"}},
        "output": {"trace": False},
    })
    run_and_compare(job, tmp_path)


def test_nf1b_trains_under_elastic_averaging(make_job, tmp_path: Path) -> None:
    """nf1b inside, elastic averaging across: the run completes and writes the shards' master."""
    job = make_job({
        "train": {"steps": 12},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "schedule": "nf1b", "microbatches": 2,
                     "sync": "elastic", "sync_args": {"alpha": 0.25}},
    })
    summary = run_local(job, quiet=True)
    assert summary["steps"] == 12 and weight_files.read_weights(tmp_path / "out")
    rows = trace_rules.load_trace(tmp_path / "out" / "trace")
    schedule_rules.check_nf1b(rows, 2, 2)
