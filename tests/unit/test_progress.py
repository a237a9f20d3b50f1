"""`hetpipe run`'s progress bar (launch.local.follow): it ends where the job ended, shows no loss
before a minibatch has finished, and -q shows nothing."""

from __future__ import annotations

import pytest

from hetpipe.v1 import coordinator_pb2
from launch.local import follow

State = coordinator_pb2.JobStatus.State


def _job(*steps: tuple[str, int, float]) -> list[coordinator_pb2.JobStatus]:
    return [coordinator_pb2.JobStatus(state=State.Value(state), samples=samples, total_samples=80, loss=loss,
                                      samples_per_second=640.0) for state, samples, loss in steps]


@pytest.mark.parametrize("ending", ["COMPLETED", "FAILED"])
def test_the_bar_ends_at_the_jobs_last_count(ending: str, capsys: pytest.CaptureFixture[str]) -> None:
    statuses = iter(_job(("RUNNING", 0, 0.0), ("RUNNING", 32, 2.5), (ending, 48 if ending == "FAILED" else 80, 2.25)))
    seen: list[int] = []
    final = follow(lambda: next(statuses), quiet=False, on_status=lambda s: seen.append(s.samples))
    assert State.Name(final.state) == ending
    assert seen == [0, 32], "on_status sees the job only while it is under way"
    lines = capsys.readouterr().err.replace("\r", "\n").split("\n")
    bars = [line for line in lines if line.startswith("train:")]
    assert "loss" not in bars[0], "the wire's 0.0 is no loss yet"
    assert "loss=0.0000" not in "".join(bars)
    last = "80/80" if ending == "COMPLETED" else "48/80"
    assert last in bars[-1] and "loss=2.2500" in bars[-1], bars[-1]


def test_quiet_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    statuses = iter(_job(("RUNNING", 0, 0.0), ("RUNNING", 32, 2.5), ("COMPLETED", 80, 2.25)))
    assert State.Name(follow(lambda: next(statuses), quiet=True).state) == "COMPLETED"
    assert capsys.readouterr() == ("", "")
