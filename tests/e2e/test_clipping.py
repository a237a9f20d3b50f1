"""train.max_grad_norm: a VW's gradients of each minibatch clipped to one L2 norm over all its
stages, as torch.nn.utils.clip_grad_norm_ clips a whole model's. Stage 0 learns the norm with the
last gradient, decides the coefficient, and it travels forward with the activations: every stage
commits p with the same coefficient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe import weight_files
from hetpipe.config import with_overrides
from hetpipe.reference import train_reference
from launch.local import run_local
from tests import schedule_rules
from trace_rules import check_complete, check_local_rules, clip_coefficients, load_trace

pytestmark = pytest.mark.timeout(150)

MAX_NORM = 0.3   # the base job's gradient norms are 0.2-0.4: some minibatches are clipped, some not


def run_against_the_reference(job: Any, tmp_path: Path) -> list[dict[str, Any]]:
    """Runs job and compares its weights with the clipped reference (float64, 1e-9), checking
    that clipping changed them; returns the trace's rows."""
    run_local(job, quiet=True)
    got = weight_files.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    unclipped = train_reference(with_overrides(job, train={"max_grad_norm": 0.0})).state_dict()
    assert max(float((want[key] - unclipped[key]).abs().max()) for key in want) > 1e-4, "clipping must matter"
    return load_trace(tmp_path / "out" / "trace")


@pytest.mark.parametrize(("n", "k", "optimizer"), [
    (1, 3, {"name": "sgd", "lr": 0.05, "momentum": 0.9}),
    (2, 2, {"name": "sgd", "lr": 0.05}),
], ids=["O1", "O2-wsp"])
def test_clipped_training_equals_one_process_clipped_by_torch(make_job, tmp_path: Path, n: int, k: int,
                                                                optimizer: dict[str, Any]) -> None:
    job = make_job({
        "train": {"dtype": "float64", "steps": 30, "optimizer": optimizer, "max_grad_norm": MAX_NORM},
        "parallel": {"virtual_workers": n, "stages_per_vw": k, "nm": 1, "D": 0, "ps_shards": 2},
    })
    rows = run_against_the_reference(job, tmp_path)
    clips = clip_coefficients(rows)
    assert len(clips) == n * 30
    assert 0 < sum(c < 1 for c in clips.values()) < len(clips), "some minibatches clipped, not all"
    # Stage 0 traces the VW's norm it clipped by, and every row the rate it stepped with.
    norms = {(r["vw"], r["p"]): r["grad_norm"] for r in rows if r["stage"] == 0}
    assert len(norms) == n * 30 and not any("grad_norm" in r for r in rows if r["stage"] > 0)
    assert all(clips[key] == min(1.0, MAX_NORM / (norm + 1e-6)) for key, norm in norms.items())
    assert {r["lr"] for r in rows} == {optimizer["lr"]}


@pytest.mark.parametrize(("schedule", "n", "k", "momentum"), [("gpipe", 1, 3, 0.9), ("1f1b", 1, 3, 0.9),
                                                            ("1f1b", 2, 2, 0.0)])
def test_flushed_schedules_clip_as_torch_does(make_job, tmp_path: Path, schedule: str, n: int, k: int,
                                              momentum: float) -> None:
    """gpipe and 1f1b: p's gradient summed over its micro-batches is clipped as a whole, by the
    VW's norm over every stage (O1 float64; two VWs under WSP at D 0 too)."""
    job = make_job({
        "train": {"dtype": "float64", "steps": 20, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": momentum},
                  "max_grad_norm": MAX_NORM},
        "parallel": {"virtual_workers": n, "stages_per_vw": k, "nm": 1, "D": 0, "schedule": schedule,
                     "microbatches": 4},
    })
    rows = run_against_the_reference(job, tmp_path)
    clips = clip_coefficients(rows)
    assert len(clips) == n * 20 and 0 < sum(c < 1 for c in clips.values()) < len(clips), clips
    # Still synchronous: every stage steps p, with its coefficient, before its forwards of p + 1.
    schedule_rules.check_flushed(rows, schedule, k, 4)


def test_ddp_clips_its_averaged_gradient_as_torch_does(make_job, tmp_path: Path) -> None:
    job = make_job({"train": {"dtype": "float64", "steps": 20, "max_grad_norm": MAX_NORM},
                    "parallel": {"virtual_workers": 1, "stages_per_vw": 1, "mode": "ddp"},
                    "output": {"trace": False}})
    run_local(job, quiet=True)
    got = weight_files.read_weights(tmp_path / "out")
    for key, value in train_reference(job).state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-9, msg=f"{key} differs")


def test_a_checkpoint_cut_does_not_wait_for_a_coefficient_that_only_the_next_wave_would_carry(
        make_job, tmp_path: Path) -> None:
    """Stages after 0 commit a cut's last minibatch once its coefficient arrives, and no activation
    comes until the driver lets the stages past the cut: stage 0 sends the verdicts alone."""
    job = make_job({"train": {"steps": 12, "max_grad_norm": MAX_NORM, "checkpoint_every": 2},
                    "parallel": {"stages_per_vw": 3, "nm": 2}})
    run_local(job, quiet=True)
    cuts = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert cuts == ["cut000004"], "the last cut kept (waves 2 and 4 cut; 6 is the end)"
    assert sorted(f.name for f in (tmp_path / "out" / "checkpoints" / "cut000004").glob("vw0_stage*.pt")) == [
        "vw0_stage0.pt", "vw0_stage1.pt", "vw0_stage2.pt"]
    rows = load_trace(tmp_path / "out" / "trace")
    check_complete(rows, vws=1, stages=3, steps=12)
    check_local_rules(rows, 2)
