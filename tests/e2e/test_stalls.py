"""Hangs detected and named (issue 14): a SIGSTOPped shard is reported as not responding after
train.stall_timeout_s, killed and restarted from its checkpoint, and the job completes with every
acknowledged push in the model once; the same while the stages load (the job fails, naming the
shard) and, where no one can restart it, while the final weights are read, when the driver's own
loop waits on the shard (the job fails at once, not at the call's deadline); a job
that stops moving while every process answers fails with what waits where. (A SIGSTOPped stage:
tests/integration/test_coordinator.py.)"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from hetpipe import rpc
from hetpipe.errors import JobFailed
from conftest import run_beside
from coordinator import results
from coordinator.driver import JobDriver
from coordinator.job import JobRunner
from launch.local import run_local
from tests.trace_rules import check_conservation

pytestmark = pytest.mark.timeout(300)
STALL_S = 3.0


def _stop_shard_when_busy(out: Path, done: threading.Event, stopped: list[tuple[int, float, float]]) -> None:
    """SIGSTOP ps server 0 once training is under way; records (pid, when stopped, when gone)."""
    deadline = time.monotonic() + 240
    while not done.is_set() and time.monotonic() < deadline:
        lines = sum(len(p.read_text().splitlines()) for p in (out / "trace").glob("vw*_stage*.jsonl"))
        if lines > 40:
            for proc in psutil.Process().children(recursive=True):
                if any("ps_server_0.ready" in part for part in proc.cmdline()):
                    proc.send_signal(signal.SIGSTOP)
                    at = time.monotonic()
                    proc.wait(timeout=240)  # killed by the launcher: SIGKILL works on a stopped process
                    stopped.append((proc.pid, at, time.monotonic()))
                    return
        time.sleep(0.05)


def test_a_stopped_shard_is_named_killed_and_restarted(make_job, capfd, tmp_path: Path) -> None:
    job = make_job({
        "output": {"ledger": True},   # O3 reads it (check_conservation)
        "train": {"dtype": "float64", "steps": 80, "stall_timeout_s": STALL_S},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "D": 1, "ps_shards": 2},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 4}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.01}},
    })
    out = tmp_path / "out"
    summary, stopped = run_beside(job, _stop_shard_when_busy)
    assert stopped, "the shard was never stopped: the test proved nothing"
    _, at, gone = stopped[0]
    assert gone - at >= STALL_S, "killed before the stall timeout"
    err = capfd.readouterr().err
    # The plan's shard index and the launcher's process name need not agree: both are named.
    assert re.search(r"ps shard \d not responding: no answer to health checks for \d+s; "
                     r"killed ps server 0 \(pid \d+\) to restart it", err), err
    assert "ps server 0 was killed by SIGKILL; restarting it from its checkpoint" in err, err
    assert "restored" in (out / "logs" / "ps_server_0.log").read_text()
    assert summary["steps"] == 80
    check_conservation(job, out, ledgers=2 * 2)


def test_no_progress_while_every_process_answers_is_named(make_job, inject_faults) -> None:
    """VW 1 takes 20 s a task: VW 0 runs into the clock bound, and nothing moves while all answer."""
    inject_faults(slow_vw=1, slow_factor=2000.0)
    job = make_job({
        "train": {"steps": 200, "stall_timeout_s": STALL_S},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "D": 0},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 4}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.01}},
    })
    with pytest.raises(JobFailed) as info:
        run_local(job, quiet=True)
    message = str(info.value)
    assert message.startswith("no progress for "), message
    assert "although every stage and shard answers" in message, message
    assert "stage 0 of vw 0:" in message and "blocked on a pull (clock bound)" in message, message
    assert "stage 0 of vw 1:" in message and "in flight" in message, message
    # What the slow VW's stage is stuck in, and for how long.
    assert re.search(r"stage \d of vw 1: [^;]*, running the (forward|backward|forward and backward) of minibatch "
                     r"\d+ for \d+s", message), message
    assert os.path.exists(job.resolve(job.output.dir))


FROZEN: list[float] = []   # when _freeze_shard_0 froze it (time.monotonic)


def _freeze_shard_0() -> None:
    for proc in psutil.Process().children(recursive=True):
        try:
            if any("ps_server_0.ready" in part for part in proc.cmdline()):
                proc.send_signal(signal.SIGSTOP)
                FROZEN.append(time.monotonic())
                return
        except psutil.Error:   # a process that ended meanwhile (the fork server's helpers, say)
            continue
    raise AssertionError("no ps server 0 to freeze")


def _two_vws(make_job):
    return make_job({
        "train": {"dtype": "float64", "steps": 20, "stall_timeout_s": STALL_S},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 2, "D": 0, "ps_shards": 1},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 2}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.01}},
    })


def test_a_shard_frozen_while_the_stages_load_is_named(make_job, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stages give the shard w0 while they load, and the driver waits on them: the shard is
    named once silent for the stall timeout (the stages' own call would end at its deadline, two
    minutes later, as a stage's "loading failed")."""
    setup = JobDriver.setup

    def frozen_first(driver: JobDriver) -> None:
        _freeze_shard_0()
        setup(driver)

    monkeypatch.setattr(JobDriver, "setup", frozen_first)
    with pytest.raises(JobFailed) as info:
        run_local(_two_vws(make_job), quiet=True)
    assert re.match(r"ps shard 0 at 127\.0\.0\.1:\d+ not responding: no answer to health checks for \d+s "
                    r"\(while the stages loaded\)", str(info.value)), info.value


def _frozen_before_the_final_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    write_weights = results.write_weights

    def frozen_first(driver: JobDriver) -> list[Path]:
        _freeze_shard_0()
        return write_weights(driver)

    monkeypatch.setattr(results, "write_weights", frozen_first)


def test_a_frozen_shard_that_cannot_be_restarted_fails_the_job_before_its_calls_deadline(
        make_job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a launcher to restart it (`hetpipe worker`), the call waiting on the shard ends as
    soon as the shard is named, not at the data deadline."""
    _frozen_before_the_final_weights(monkeypatch)
    monkeypatch.setattr(JobRunner, "_restart_hung_shard", lambda self, index, address, why: False)
    FROZEN.clear()
    with pytest.raises(JobFailed) as info:
        run_local(_two_vws(make_job), quiet=True)
    failed = time.monotonic()
    assert re.match(r"ps shard 0 at 127\.0\.0\.1:\d+ not responding: no answer to health checks for \d+s;",
                    str(info.value)), info.value
    assert failed - FROZEN[0] < rpc.DATA_DEADLINE_S / 2, "the read waited out its deadline"


def _freeze_stage_worker_0(resume_after_s: float | None) -> None:
    for proc in psutil.Process().children(recursive=True):
        try:
            if any("stage_worker_0.ready" in part for part in proc.cmdline()):
                proc.send_signal(signal.SIGSTOP)
                if resume_after_s is not None:
                    threading.Timer(resume_after_s, proc.send_signal, (signal.SIGCONT,)).start()
                return
        except psutil.Error:
            continue
    raise AssertionError("no stage worker 0 to freeze")


@pytest.mark.parametrize("frozen_s", [2.5, None], ids=["2.5s", "for good"])
def test_a_stage_frozen_while_it_loads_is_waited_for_up_to_the_stall_timeout(
        make_job, monkeypatch: pytest.MonkeyPatch, frozen_s: float | None) -> None:
    """Status answers within 2 s or times out; a stage busy loading (torch's import, a large
    model's build) may miss that. Frozen 2.5 s under a stall timeout of 3.5 s the job goes on;
    frozen for good, it is named as not responding while it loads."""
    wait_loaded = JobDriver._wait_loaded

    def frozen_first(driver: JobDriver, *args: object, **kwargs: object) -> None:
        _freeze_stage_worker_0(frozen_s)
        wait_loaded(driver, *args, **kwargs)

    monkeypatch.setattr(JobDriver, "_wait_loaded", frozen_first)
    job = make_job({"train": {"steps": 6, "stall_timeout_s": 3.5}, "output": {"trace": False}})
    if frozen_s is not None:
        assert run_local(job, quiet=True)["steps"] == 6
        return
    with pytest.raises(JobFailed) as info:
        run_local(job, quiet=True)
    assert re.match(r"stage \d of vw 0 at 127\.0\.0\.1:\d+ on node local not responding while it loads: no answer "
                    r"to Status for \d+s \(train\.stall_timeout_s\)", str(info.value)), info.value
