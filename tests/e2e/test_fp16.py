"""fp16 with dynamic loss scaling that every stage of a VW applies together: an overflow on any
stage skips that minibatch's step on every stage, the loss scale halves, and the trace says so."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from hetpipe import datasets, weight_files
from hetpipe.config import JobConfig
from hetpipe.loss_scale import INITIAL_SCALE, LossScale, Verdicts
from hetpipe.optim import compute_loss, make_optimizer, step_at
from hetpipe.reference import initial_model, minibatch
from launch.local import run_local
from trace_rules import by_stage, check_agreed_commits, check_complete, check_local_rules, clip_coefficients, load_trace

pytestmark = pytest.mark.timeout(150)

OVERFLOWS = [(1, 5), (0, 9)]  # (stage, minibatch): the last stage's gradients of 5, stage 0's of 9


def fp16_reference(job: JobConfig, overflow: set[int]) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Single-process training (nm 1) with autocast fp16 and the same loss scale rule, skipping the
    minibatches in `overflow` (and any whose gradients are not finite); also each p's scale."""
    model = initial_model(job)
    params = list(model.parameters())
    optimizer = make_optimizer(params, job.train.optimizer)
    dataset = datasets.training_set(job)
    scale, verdicts, scales = LossScale(), Verdicts(), {}
    for p in range(1, job.train.steps + 1):
        scales[p] = s = scale.for_minibatch(p, 1, verdicts)  # nm 1
        x, y = minibatch(job, dataset, p, 0)
        micro = job.parallel.microbatches   # gpipe, 1f1b: each micro-batch's loss weighted 1/micro
        grads = None
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = compute_loss(job.train.loss, model(xm).float(), ym)
            got = torch.autograd.grad(loss * s / micro, params)
            grads = got if grads is None else tuple(a + b for a, b in zip(grads, got))
        assert grads is not None
        skip = p in overflow or not all(bool(torch.isfinite(g).all()) for g in grads)
        verdicts.decide(p, skip)
        if not skip:
            for w, g in zip(params, grads):
                w.grad = g / s
            step_at(optimizer, job.train, p)   # a skipped p moves the schedule on all the same
    return model.state_dict(), scales


def test_an_overflow_on_any_stage_skips_the_minibatch_on_every_stage(make_job, inject_faults, tmp_path: Path) -> None:
    inject_faults(overflow=tuple(OVERFLOWS))
    job = make_job({"train": {"precision": "fp16", "steps": 30, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                              "lr_schedule": {"warmup_steps": 6, "decay": "linear", "min_lr": 0.005}},
                    "parallel": {"stages_per_vw": 2, "nm": 1}})
    summary = run_local(job, quiet=True)
    assert summary["precision"] == "fp16"
    rows = load_trace(tmp_path / "out" / "trace")
    check_complete(rows, vws=1, stages=2, steps=30)
    check_local_rules(rows, 1)
    want, scales = fp16_reference(job, {p for _, p in OVERFLOWS})
    for (_, q), rs in by_stage(rows).items():
        assert {r["p"] for r in rs if not r["stepped"]} == {5, 9}, f"stage {q} skipped what stage 0 decided"
        assert {r["p"]: r["loss_scale"] for r in rs} == scales, f"stage {q} unscaled by the last stage's scale"
    # nm 1: p's scale follows the verdicts <= p - 1
    assert (scales[5], scales[6], scales[9], scales[10]) == (INITIAL_SCALE, INITIAL_SCALE / 2, INITIAL_SCALE / 2,
                                                             INITIAL_SCALE / 4)
    got = weight_files.read_weights(tmp_path / "out")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=f"{key}: not the reference's weights")


@pytest.mark.parametrize(("schedule", "stages"), [("gpipe", 2), ("1f1b", 3)])
def test_flushed_schedules_skip_an_overflowed_minibatch_on_every_stage(make_job, inject_faults, tmp_path: Path,
                                                                       schedule: str, stages: int) -> None:
    """gpipe and 1f1b: the last stage scales each micro-batch's loss by p's scale, an overflow in
    any stage's gradients of p (summed over its micro-batches) skips p everywhere, and the run
    ends at the micro-batched fp16 reference's weights."""
    inject_faults(overflow=tuple(OVERFLOWS))
    job = make_job({"train": {"precision": "fp16", "steps": 20, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
                    "parallel": {"stages_per_vw": stages, "nm": 1, "schedule": schedule, "microbatches": 4}})
    run_local(job, quiet=True)
    rows = load_trace(tmp_path / "out" / "trace")
    check_complete(rows, vws=1, stages=stages, steps=20)
    want, scales = fp16_reference(job, {p for _, p in OVERFLOWS})
    for (_, q), rs in by_stage(rows).items():
        assert {r["p"] for r in rs if not r["stepped"]} == {5, 9}, f"stage {q} skipped what stage 0 decided"
        assert {r["p"]: r["loss_scale"] for r in rs} == scales, f"stage {q} unscaled by the last stage's scale"
    got = weight_files.read_weights(tmp_path / "out")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=f"{key}: not the reference's weights")


def test_fp16_and_clipping_verdicts_keep_the_rules_with_minibatches_in_flight_and_two_vws(
        make_job, inject_faults, tmp_path: Path) -> None:
    """nm 3: a stage after 0 commits p when the verdict (a skip, a clip coefficient) arrives, with
    p + nm's activation or alone after the last minibatch, so the forward of m sees exactly the
    updates <= m - nm; every stage commits p with stage 0's coefficient."""
    inject_faults(overflow=((2, 4), (1, 11), (0, 20)))
    steps = 22
    job = make_job({"train": {"precision": "fp16", "steps": steps, "max_grad_norm": 0.3},
                    "parallel": {"virtual_workers": 2, "stages_per_vw": 3, "nm": 3, "D": 1, "ps_shards": 2}})
    summary = run_local(job, quiet=True)
    rows = load_trace(tmp_path / "out" / "trace")
    check_agreed_commits(rows, vws=2, stages=3, steps=steps, nm=3)
    assert summary["max_clock_distance"] <= 2
    for (v, q), rs in by_stage(rows).items():
        assert {r["p"] for r in rs if not r["stepped"]} == {4, 11, 20}, f"vw {v} stage {q}"
    scale = {(r["vw"], r["p"]): r["loss_scale"] for r in rows}
    assert len(scale) == 2 * steps and all(scale[(v, p)] == scale[(0, p)] for v, p in scale), "one scale rule"
    assert scale[(0, 7)] == INITIAL_SCALE / 2 and scale[(0, 6)] == INITIAL_SCALE  # p sees verdicts <= p - 3
    clips = clip_coefficients(rows)
    assert all(clips[(v, p)] == 1.0 for v in (0, 1) for p in (4, 11, 20)), "a skipped minibatch is not clipped"
    assert any(c < 1.0 for c in clips.values())
    assert math.isfinite(summary["final_loss"])


def test_a_run_resumed_from_a_cut_goes_on_at_the_loss_scale_it_had(make_job, inject_faults, tmp_path: Path) -> None:
    """Overflows before the first cut halve the scale twice; the run is stopped after the cut and
    resumed: the minibatches after it run at a quarter of the initial scale, as without the stop."""
    import threading

    from coordinator.checkpoints import latest
    from hetpipe import outputs
    from hetpipe.errors import JobStopped
    from launch import cli

    inject_faults(overflow=((1, 2), (0, 3)))   # nm 1: S_3 = S/2, S_p = S/4 from p = 4 on
    job = make_job({"train": {"precision": "fp16", "steps": 40, "checkpoint_every": 4},
                    "parallel": {"stages_per_vw": 2, "nm": 1},
                    "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 2}]}],
                                "emulate": {"forward_seconds": 0.02, "backward_seconds": 0.02}}})
    out = tmp_path / "out"

    def stop_after_the_first_cut() -> None:
        while latest(out / outputs.CHECKPOINTS) is None:
            time.sleep(0.02)
        cli.main(["stop", "--job", str(tmp_path / "job.yaml")])

    stopper = threading.Thread(target=stop_after_the_first_cut, daemon=True)
    stopper.start()
    with pytest.raises(JobStopped):
        run_local(job, quiet=True)
    stopper.join(10)
    cut = latest(out / outputs.CHECKPOINTS)
    assert cut is not None and cut < 40
    run_local(job, quiet=True, resume=True)
    after = [r for r in load_trace(out / "trace") if r["p"] > cut]
    assert {r["p"] for r in after} == set(range(cut + 1, 41))
    assert {r["loss_scale"] for r in after} == {INITIAL_SCALE / 4}, "the scale at the cut, not the initial one"


def test_a_run_that_ends_on_skipped_steps_says_its_final_loss_is_not_a_number(tmp_path: Path) -> None:
    """fp16 ends a job only once its loss scale is at the smallest; a short run with a huge rate
    ends first, every last step skipped: it said nothing, and its progress showed loss 0.0000."""
    import json
    import subprocess
    import sys

    import yaml

    job = {"model": {"name": "mlp", "args": {"in_features": 64, "hidden": [32, 32], "num_classes": 10}},
           "data": {"name": "digits", "batch_size": 16},
           "train": {"steps": 12, "precision": "fp16", "optimizer": {"name": "sgd", "lr": 1e6}},
           "parallel": {"virtual_workers": 1, "stages_per_vw": 2}, "output": {"dir": "out", "trace": False}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "launch.cli", "run", "-q", "job.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["final_loss"] is None
    assert "hetpipe: warning: the final loss is not a number: training diverged (under fp16" in done.stderr, done.stderr
