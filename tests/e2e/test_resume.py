"""Checkpoint and resume (issue 14): kill -9 of `hetpipe run` mid-job, or `hetpipe stop`, then
`hetpipe run --resume`: the final model equals an uninterrupted run's at 1e-9 (float64, D 0,
where the run is deterministic; SGD with momentum, so the optimizer's state must come back too),
and eval.jsonl holds every evaluation once, those from before the cut as the first run wrote them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import BASE_JOB, deep_update
from hetpipe import outputs, weight_files
from coordinator.checkpoints import latest
from launch import cli

pytestmark = pytest.mark.timeout(300)
STEPS = 28
JOB = deep_update(BASE_JOB, {
    "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.5}, "steps": STEPS, "checkpoint_every": 4},
    "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 2},
    "data": {"eval_fraction": 0.1}, "eval": {"every": 3, "rows": 64},   # some evaluations fall on a cut
    "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 4}]}],
                "emulate": {"forward_seconds": 0.02, "backward_seconds": 0.02}},
    "output": {"trace": False, "dir": "out"},
})


def _hetpipe(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "launch.cli", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _first_cut(out: Path, run: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 200
    while (wave := latest(out / outputs.CHECKPOINTS)) is None:
        assert run.poll() is None, run.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    return wave


Run = tuple[dict[str, torch.Tensor], list[dict]]   # the final weights, eval.jsonl's rows


def _evals(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same job, run to the end without a break (checkpoints included: they pause the stages);
    run once for both tests, each of which compares its resumed run with it."""
    folder = tmp_path_factory.mktemp("whole")
    (folder / "job.yaml").write_text(yaml.safe_dump(JOB))
    run = _hetpipe(folder, "run", "-q", "job.yaml")
    _, err = run.communicate(timeout=240)
    assert run.returncode == 0, err
    return weight_files.read_weights(folder / "out"), _evals(folder / "out")


def _start(tmp_path: Path) -> subprocess.Popen[str]:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    return _hetpipe(tmp_path, "run", "-q", "job.yaml")


def _resume_and_compare(tmp_path: Path, uninterrupted: Run) -> None:
    want, want_evals = uninterrupted
    first = _evals(tmp_path / "out")   # what the interrupted run wrote
    resumed = _hetpipe(tmp_path, "run", "-q", "--resume", "job.yaml")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    wave = int(re.search(r"resuming from the checkpoint of wave (\d+)", err)[1])  # type: ignore[index]
    assert 0 < wave < STEPS
    # Its throughput is of the minibatches it trained, after the cut, over its own seconds.
    summary = outputs.read_summary(tmp_path / "out")
    assert summary is not None
    vws, nm, batch = JOB["parallel"]["virtual_workers"], JOB["parallel"]["nm"], JOB["data"]["batch_size"]
    assert summary["samples_per_second"] * summary["wall_seconds"] == pytest.approx((STEPS - wave * nm) * vws * batch)
    assert f"wave {wave} (after each VW's minibatch {wave * nm} of {STEPS})" in err, err
    assert summary["resumed_from_wave"] == wave
    final = weight_files.read_weights(tmp_path / "out")
    assert list(final) == list(want)
    for key in want:
        torch.testing.assert_close(final[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    # Each evaluation once, in order: those up to the cut kept as the first run wrote them (one
    # at the cut runs again, on the restored weights: its first row stays). (A periodic one scores
    # VW 0's weights as they are, and whether a pull merged just before it varies from run to run;
    # the final one scores the model written out.)
    evals = _evals(tmp_path / "out")
    assert [(e["id"], e["minibatches"], e["final"]) for e in evals] == [
        (e["id"], e["minibatches"], e["final"]) for e in want_evals]
    assert [e["minibatches"] for e in want_evals] == [*range(3, STEPS, 3), STEPS]
    kept = [e for e in first if e["minibatches"] <= wave * nm]
    assert kept and evals[:len(kept)] == kept, (first, evals)
    assert evals[-1]["loss"] == pytest.approx(want_evals[-1]["loss"], rel=0, abs=1e-9)
    # The resumed rows count training time on from the cut's, not from 0 again.
    seconds = [e["seconds"] for e in evals]
    assert seconds == sorted(seconds), seconds


def test_kill_9_of_hetpipe_run_then_resume(uninterrupted: Run, tmp_path: Path) -> None:
    run = _start(tmp_path)
    try:
        _first_cut(tmp_path / "out", run)
        family = psutil.Process(run.pid).children(recursive=True)  # the fork server and the workers
        # A forked worker's title is one string, which psutil may hand back whole: split it.
        ready = next(Path(a).parent for p in family for a in " ".join(p.cmdline()).split() if a.endswith(".ready"))
        left = [ready, Path((ready / "forkserver_dir").read_text())]  # the launcher's scratch folders
        assert all(p.is_dir() for p in left)
        # One worker stopped, as a debugger or an operator leaves it: it follows the others all the same.
        stopped = next(p for p in family if "stage_worker" in " ".join(p.cmdline()))
        stopped.suspend()
        os.kill(run.pid, signal.SIGKILL)  # the launcher alone: its workers follow it (exit with parent)
        run.wait(30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert not (tmp_path / "out" / "summary.json").exists(), "the run finished before the kill"
    # Every worker notices within a second that its launcher is gone, and the fork server then
    # exits; the stopped one once the first to notice has continued it (SIGCONT to the group).
    _, alive = psutil.wait_procs(family, timeout=20)
    for process in alive:
        process.kill()
    assert not alive, f"left behind by the killed launcher: {[(p.pid, p.cmdline()[:3]) for p in alive]}"
    _resume_and_compare(tmp_path, uninterrupted)
    assert not any(p.exists() for p in left), f"the next launcher did not sweep {left}"


def test_stop_then_resume(uninterrupted: Run, tmp_path: Path) -> None:
    run = _start(tmp_path)
    try:
        _first_cut(tmp_path / "out", run)
        # In this process: a second interpreter's start-up (a few seconds under load) once let the
        # run end before the stop reached it. `hetpipe stop` as its own process: test_coordinator.
        assert cli.main(["stop", "--job", str(tmp_path / "job.yaml")]) == 0
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0 and "stopped" in err, f"exit {run.returncode}: {err}"
    assert "\nhetpipe: `hetpipe run job.yaml --resume` goes on from its latest checkpoint, after wave " in err, err
    # A checkpoint taken for another layout, dtype or length is refused before any process starts
    # (exit 2, nothing started), naming what differs, and stays there for the resume that fits.
    other = deep_update(JOB, {"parallel": {"ps_shards": 1}, "train": {"dtype": "float32", "steps": 2 * JOB["train"]["steps"]}})
    other["train"]["optimizer"] = {"name": "adam", "lr": 0.001}   # its moments are not in the stages' cut
    other["train"]["seed"] = JOB["train"]["seed"] + 1   # other rows in each minibatch
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(other))
    refused = _hetpipe(tmp_path, "run", "-q", "--resume", "job.yaml")
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and err.startswith(
        "hetpipe: error: --resume: the checkpoint of wave "), err
    assert (f"was taken for another job: steps {JOB['train']['steps']} there, {2 * JOB['train']['steps']} now, "
            "ps_shards 2 there, 1 now, dtype float64 there, float32 now, optimizer sgd there, adam now, "
            f"seed {JOB['train']['seed']} there, {JOB['train']['seed'] + 1} now. A resumed run goes on with that job: set them "
            "back, or start again with --fresh") in err, err
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    # A stage's part cut short is refused as the cut is checked, before anything is cleared; one
    # of the right size that will not load fails the run, whose note then says that --resume
    # would start from that same cut again.
    out = tmp_path / "out"
    wave = latest(out / outputs.CHECKPOINTS)
    part = weight_files.stage_state_path(out / outputs.CHECKPOINTS, wave, 1, 1)
    whole, evals = part.read_bytes(), (out / "eval.jsonl").read_bytes()
    part.write_bytes(whole[:1000])
    refused = _hetpipe(tmp_path, "run", "-q", "--resume", "job.yaml")
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and err.startswith(
        f"hetpipe: error: --resume: the checkpoint of wave {wave} is damaged: {part} holds 1000 bytes"), err
    assert (out / "eval.jsonl").read_bytes() == evals
    part.write_bytes(b"\0" * len(whole))
    failed = _hetpipe(tmp_path, "run", "-q", "--resume", "job.yaml")
    _, err = failed.communicate(timeout=120)
    assert failed.returncode == 1 and "stage 1 of vw 1" in err, err
    assert err.endswith("\nhetpipe: `hetpipe run job.yaml --resume` starts again from the checkpoint this run "
                        f"resumed from, after wave {wave} (it took none since)\n"), err
    part.write_bytes(whole)
    _resume_and_compare(tmp_path, uninterrupted)


def test_a_resume_with_another_eval_every_writes_its_own_rows(tmp_path: Path) -> None:
    """eval is not part of a checkpoint's job: a resume may evaluate every 5 where the first run
    did every 3. The first run's rows up to the cut are kept; the resumed run's from after it are
    written, though their ids (counts of eval.every) repeat kept ones."""
    steps = 12
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(deep_update(JOB, {"train": {"steps": steps}})))
    first = _hetpipe(tmp_path, "run", "-q", "job.yaml")
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    cut = latest(tmp_path / "out" / outputs.CHECKPOINTS)
    assert cut is not None and 5 < cut < 10
    resumed = _hetpipe(tmp_path, "run", "-q", "--resume", "--set", "eval.every=5", "job.yaml")
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert "finished (its summary.json is there): this one trains again from its latest checkpoint" in err, err
    evals = _evals(tmp_path / "out")
    assert [(e["minibatches"], e["final"]) for e in evals] == [
        *[(m, False) for m in range(3, cut + 1, 3)], *[(m, False) for m in range(5, steps, 5) if m > cut],
        (steps, True)], evals
