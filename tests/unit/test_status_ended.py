"""`hetpipe status --job` of a run that has ended: how it ended, and when (a run stopped before it
started leaves the last one's status.json, told apart by its time); a status.json without a usable
time still reads."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from launch.status import _ended


@pytest.mark.parametrize("finished, when", [
    (time.mktime((2026, 11, 29, 14, 5, 9, 0, 0, -1)), " 2026-11-29 14:05:09"),
    (None, ""), ("yesterday", ""), (float("nan"), ""), (True, ""),
], ids=["a time", "null", "text", "nan", "bool"])
def test_an_ended_run_says_how_and_when(tmp_path: Path, capsys: pytest.CaptureFixture[str], finished: object,
                                        when: str) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"state": "FAILED", "reason": "stage 1 of vw 0 died",
                                                      "finished": finished}))
    assert _ended(tmp_path, as_json=False) == 1
    out = capsys.readouterr().out
    assert out == f"job: FAILED (ended{when}; no coordinator is running): stage 1 of vw 0 died\n"
    (tmp_path / "status.json").write_text(json.dumps({"state": "FAILED"}))
    assert _ended(tmp_path, as_json=False) == 1 and re.match(r"job: FAILED \(ended; ", capsys.readouterr().out)


def test_a_completed_run_whose_loss_or_rate_is_null_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """summary.json writes a NaN loss as null (fp16 that skipped its last steps): the report
    formatted None and ended in a TypeError traceback."""
    from hetpipe import outputs

    (tmp_path / "status.json").write_text(json.dumps({"state": "COMPLETED"}))
    outputs.write_summary(tmp_path, {"samples_per_second": float("nan"), "final_loss": None})
    assert _ended(tmp_path, as_json=False) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"result: n/a samples/s, final loss n/a in {tmp_path}"
    outputs.write_summary(tmp_path, {"samples_per_second": 812.4, "final_loss": 0.25})
    assert _ended(tmp_path, as_json=False) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"result: 812 samples/s, final loss 0.2500 in {tmp_path}"


def test_status_json_of_a_running_job_is_shaped_as_an_ended_ones() -> None:
    """`status --json` keeps one shape while a job runs and after: snake_case keys, numbers as
    numbers (protobuf's JSON writes uint64 as strings), the plan and summary as objects, workers a list."""
    from hetpipe.v1 import coordinator_pb2
    from launch.status import job_json, plain

    status = coordinator_pb2.JobStatus(state=coordinator_pb2.JobStatus.RUNNING, samples=896, total_samples=12800,
                                       plan_json=json.dumps({"nm": 2}), job_id="j1")
    job = job_json(status)
    assert (job["state"], job["samples"], job["total_samples"], job["plan"], job["summary"]) == (
        "RUNNING", 896, 12800, {"nm": 2}, None)
    assert {"state", "reason", "summary"} <= job.keys() and not any(k.endswith("_json") for k in job)
    entry = coordinator_pb2.WorkerList.Entry(worker_id="w1", alive=True, info=coordinator_pb2.WorkerInfo(
        role=coordinator_pb2.WorkerInfo.STAGE_WORKER, memory_bytes=1 << 40))
    assert plain(entry)["info"] == {**plain(entry)["info"], "role": "STAGE_WORKER", "memory_bytes": 1 << 40}
    workers = coordinator_pb2.WorkerList(workers=[entry])
    assert [plain(w)["worker_id"] for w in workers.workers] == ["w1"]
    # Strict JSON: a diverged loss is null, not Infinity; a state a newer coordinator has stays its number.
    odd = coordinator_pb2.JobStatus(state=8, loss=float("inf"), samples_per_second=float("nan"))   # type: ignore[arg-type]
    text = json.dumps(job_json(odd), allow_nan=False)
    assert json.loads(text)["loss"] is None and json.loads(text)["state"] == 8


@pytest.mark.parametrize("finished", [None, "yesterday", True])
def test_a_run_that_ended_before_its_coordinator_was_up_is_told_apart_whatever_finished_holds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], finished: object) -> None:
    """`hetpipe stop --job` of a run that ended before its coordinator was up compares the last
    ending's time with the run's start: one that is no time is an earlier run's ending (it ended
    in a TypeError's traceback)."""
    import argparse

    from launch import run_marker
    from launch.status import _never_up

    (tmp_path / "status.json").write_text(json.dumps({"state": "FAILED", "reason": "x", "finished": finished}))
    run = run_marker.Run(pid=2**22 + 1, created=time.time())   # no such process: it ended
    assert _never_up(argparse.Namespace(job="job.yaml", json=False), tmp_path, run) == 0
    assert "ended before its coordinator was up" in capsys.readouterr().out


def test_a_status_json_that_cannot_be_read_is_named_not_taken_for_no_run(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged status.json read as absent: status said only "is `hetpipe run` running?"."""
    from launch import cli

    (tmp_path / "job.yaml").write_text("model: {name: mlp}\noutput: {dir: out}\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "status.json").write_text("{bad")
    assert cli.main(["status", "--job", str(tmp_path / "job.yaml")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{tmp_path / 'out' / 'status.json'} cannot be read, or is not what a run writes" in err, err
