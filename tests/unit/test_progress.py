"""`hetpipe run`'s progress (launch.local.follow): a bar on a terminal, a line at each tenth in a
log; either ends where the job ended and shows no loss before a minibatch has finished, and -q
shows nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from hetpipe.v1 import coordinator_pb2
from launch import local
from launch.local import follow

State = coordinator_pb2.JobStatus.State


def _clock(monkeypatch: pytest.MonkeyPatch, monotonic: Callable[[], float] = time.monotonic) -> None:
    """launch.local's own clock, and sleeps that return at once: its `time`, not the module every
    thread shares (a thread of an earlier test in this process would take the fake clock's ticks)."""
    monkeypatch.setattr(local, "time", SimpleNamespace(monotonic=monotonic, sleep=lambda seconds: None))


def _job(*steps: tuple[str, int, float], total: int = 80) -> list[coordinator_pb2.JobStatus]:
    return [coordinator_pb2.JobStatus(state=State.Value(state), samples=samples, total_samples=total, loss=loss,
                                      samples_per_second=640.0) for state, samples, loss in steps]


@pytest.mark.parametrize("stderr_kind", ["terminal", "log"])
@pytest.mark.parametrize("ending", ["COMPLETED", "FAILED"])
def test_progress_ends_at_the_jobs_last_count(ending: str, stderr_kind: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: stderr_kind == "terminal")   # capsys's stream, in the test
    statuses = iter(_job(("RUNNING", 0, 0.0), ("RUNNING", 32, 2.5), (ending, 48 if ending == "FAILED" else 80, 2.25)))
    seen: list[int] = []
    final = follow(lambda: next(statuses), quiet=False, on_status=lambda s: seen.append(s.samples))
    assert State.Name(final.state) == ending
    assert seen == [0, 32], "on_status sees the job only while it is under way"
    err = capsys.readouterr().err
    assert ("\r" in err) == (stderr_kind == "terminal"), "a log gets lines, not a bar redrawn in place"
    shown = [line for line in err.replace("\r", "\n").split("\n") if line.startswith("train:")]
    assert "loss" not in shown[0], "the wire's 0.0 is no loss yet"
    assert "0.0000" not in "".join(shown)
    last = "80/80" if ending == "COMPLETED" else "48/80"
    loss = "loss=2.2500" if stderr_kind == "terminal" else "loss 2.2500"
    assert last in shown[-1] and loss in shown[-1], shown[-1]


def test_a_log_gets_a_line_at_each_tenth_of_the_run(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    _clock(monkeypatch)
    polls = [("RUNNING", n, 1.0) for n in range(0, 1000, 7)] + [("COMPLETED", 1000, 0.5)]
    statuses = iter(_job(*polls, total=1000))
    follow(lambda: next(statuses), quiet=False)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("%")[0] for line in lines] == [f"train: {10 * k}" for k in range(11)]
    assert lines[-1] == "train: 100% (1000/1000 samples), 640 samples/s, loss 0.5000"


def test_quiet_shows_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    statuses = iter(_job(("RUNNING", 0, 0.0), ("RUNNING", 32, 2.5), ("COMPLETED", 80, 2.25)))
    assert State.Name(follow(lambda: next(statuses), quiet=True).state) == "COMPLETED"
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("stderr_kind", ["terminal", "log"])
def test_the_progress_waits_for_the_total_that_comes_after_running(stderr_kind: str, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # The job is RUNNING a moment before its first progress report brings the total: a display
    # made then read "9600% (96/0 samples)".
    monkeypatch.setattr(sys.stderr, "isatty", lambda: stderr_kind == "terminal")
    _clock(monkeypatch)
    statuses = iter([*_job(("RUNNING", 0, 0.0), total=0), *_job(("RUNNING", 96, 2.3), ("COMPLETED", 128, 2.2), total=128)])
    follow(lambda: next(statuses), quiet=False)
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "/0 " not in err and "/128" in err, err
    assert "100%" in err and not any(f"{p}%" in err for p in range(101, 10000)), err


def test_a_job_that_ends_before_its_first_report_still_shows_its_last_line(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    statuses = iter([*_job(("RUNNING", 0, 0.0), total=0), *_job(("COMPLETED", 128, 2.2), total=128)])
    follow(lambda: next(statuses), quiet=False)
    assert capsys.readouterr().err == "train: 100% (128/128 samples), 640 samples/s, loss 2.2000\n"


def test_a_log_does_not_repeat_the_last_line_when_the_job_ends_on_it(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The final status is often the last report again: one line for it, not two alike."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    _clock(monkeypatch)
    statuses = iter(_job(("RUNNING", 40, 2.5), ("RUNNING", 80, 2.2), ("COMPLETED", 80, 2.2)))
    follow(lambda: next(statuses), quiet=False)
    assert capsys.readouterr().err.splitlines() == ["train: 50% (40/80 samples), 640 samples/s, loss 2.5000",
                                                    "train: 100% (80/80 samples), 640 samples/s, loss 2.2000"]


def test_a_resumed_run_shows_no_loss_before_its_own_first_minibatch(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """It starts at the cut's samples, with no loss and no rate of its own yet: not "loss 0.0000"."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    statuses = iter([coordinator_pb2.JobStatus(state=State.Value("RUNNING"), samples=40, total_samples=80),
                     *_job(("COMPLETED", 80, 1.5))])
    follow(lambda: next(statuses), quiet=False)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "train: 50% (40/80 samples), 0 samples/s", lines


@pytest.mark.parametrize("stderr_kind", ["terminal", "log"])
def test_the_progress_follows_a_total_that_shrinks_when_a_vw_leaves(stderr_kind: str, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """parallel.on_vw_failure continue: the job's total drops to what the VWs left will train, and
    the display goes on to it, not to "65% (4160/6400 samples)" at the end of a completed job."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: stderr_kind == "terminal")
    _clock(monkeypatch)
    statuses = iter([*_job(("RUNNING", 960, 2.0), total=6400), *_job(("RUNNING", 1920, 2.0), total=4160),
                     *_job(("COMPLETED", 4160, 1.0), total=4160)])
    follow(lambda: next(statuses), quiet=False)
    shown = [line for line in capsys.readouterr().err.replace("\r", "\n").split("\n") if line.startswith("train")]
    assert "4160/4160" in shown[-1] and "100%" in shown[-1], shown[-1]
    assert any("1920/4160" in line for line in shown), shown


def test_a_resumed_runs_bar_rates_only_the_samples_it_trained(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The bar's own rate and ETA count from the cut's samples: not 3200 of them in its first
    tenth of a second, a rate fifty times too high and an ETA of none."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    statuses = iter(_job(("RUNNING", 3200, 0.0), ("RUNNING", 3264, 2.0), ("COMPLETED", 6400, 1.0), total=6400))
    follow(lambda: next(statuses), quiet=False)   # 0.1 s between polls
    line = next(line for line in capsys.readouterr().err.split("\r") if "3264/6400" in line)
    rate = float(line.split(", ")[1].split("sample/s")[0])
    assert rate < 64 / 0.1 * 1.5, line


@pytest.mark.parametrize("unsaid_wait_s", [0.0, 5.0])
def test_a_wait_for_workers_is_said_once_it_lasts(unsaid_wait_s: float, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A local run's own workers register a moment after they are ready: a wait shorter than
    unsaid_wait_s goes unsaid, a longer one is said (once, while it does not change)."""
    clock = iter(range(0, 1000))   # a second a poll
    _clock(monkeypatch, monotonic=lambda: float(next(clock)))
    brief = "stage_workers needed: 2 x cpu on local; free and alive: 1 x any"
    long = "stage_workers needed: 1 x t4 on hostb; free and alive: none"
    polls = [*_job(("PLANNED", 0, 0.0)), *[coordinator_pb2.JobStatus(state=State.PLANNED, waiting=brief)] * 2,
             *_job(("PLANNED", 0, 0.0)), *[coordinator_pb2.JobStatus(state=State.PLANNED, waiting=long)] * 8,
             *_job(("COMPLETED", 80, 2.2))]
    statuses = iter(polls)
    follow(lambda: next(statuses), quiet=False, unsaid_wait_s=unsaid_wait_s)
    said = [line for line in capsys.readouterr().err.splitlines() if "waiting for workers" in line]
    told = [f"hetpipe: waiting for workers: {text}" for text in ([long] if unsaid_wait_s else [brief, long])]
    assert said == told, said
