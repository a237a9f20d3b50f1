"""A stage that says it is stopping (HeartbeatRequest.leaving: a signal on its host) fails its job
naming that, unless the job is stopped within LEAVING_GRACE_S: a Ctrl-C at a local run's
terminal reaches its stages and its launcher at once, and the launcher's stop is the cause. And how
long a shard's missed heartbeats are waited out before they fail the job."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from coordinator import job as job_module
from coordinator.job import JobRunner
from coordinator.registry import Awake, Registry
from hetpipe.errors import JobFailed, JobStopped, StageLost
from hetpipe.v1 import coordinator_pb2

Info = coordinator_pb2.WorkerInfo


def _runner_with_a_stage_that_left() -> tuple[JobRunner, SimpleNamespace]:
    registry = Registry()
    wid = registry.register(Info(role=Info.STAGE_WORKER, address="127.0.0.1:7001", node="hostb", device="cpu",
                                 name="pid 42"))
    registry.claim(Info.STAGE_WORKER, [("stage 0 of vw 1", "", "")], 1)
    assert registry.heartbeat(wid, "stopped by SIGINT")
    stage = SimpleNamespace(address="127.0.0.1:7001", plan=SimpleNamespace(vw=1),
                            progress=lambda: "it had finished 3 forwards and 3 backwards")
    return JobRunner(registry), SimpleNamespace(stages=[stage], ps_addresses=[])


def test_a_stage_that_left_fails_the_job_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_module, "LEAVING_GRACE_S", 0.05)
    runner, driver = _runner_with_a_stage_that_left()
    with pytest.raises(StageLost) as lost:
        runner._check_alive(driver)  # type: ignore[arg-type]
    assert str(lost.value) == ("stage 0 of vw 1 (pid 42 at 127.0.0.1:7001 on hostb) stopped by SIGINT on its host; "
                               "it had finished 3 forwards and 3 backwards")
    assert lost.value.vw == 1


def test_a_stop_that_comes_within_the_grace_is_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop comes once the runner waits for one, and the grace is an hour: only the stop
    ending the wait, not the grace running out (StageLost), can end it before the test's timeout."""
    monkeypatch.setattr(job_module, "LEAVING_GRACE_S", 3600.0)
    runner, driver = _runner_with_a_stage_that_left()
    wait = runner._stop.wait

    def stopped_while_waiting(timeout: float | None = None) -> bool:
        threading.Thread(target=runner.stop, args=("interrupted (Ctrl-C)",)).start()
        return wait(timeout)

    monkeypatch.setattr(runner._stop, "wait", stopped_while_waiting)
    with pytest.raises(JobStopped, match=r"interrupted \(Ctrl-C\)"):
        runner._check_alive(driver)  # type: ignore[arg-type]


def _runner_with_a_shard_silent_for(seconds: float) -> tuple[JobRunner, SimpleNamespace]:
    registry = Registry(awake=Awake(pause_s=3600.0))   # no pause of this process to count from (a busy suite)
    wid = registry.register(Info(role=Info.PS_SHARD, address="127.0.0.1:7002", node="local", device="cpu",
                                 name="pid 43"))
    registry.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)
    registry._workers[wid].last_heartbeat -= seconds   # frozen (SIGSTOP) that long ago
    driver = SimpleNamespace(stages=[], ps_addresses=["127.0.0.1:7002"],
                             job=SimpleNamespace(train=SimpleNamespace(stall_timeout_s=90.0)))
    return JobRunner(registry), driver


def test_a_hung_shard_the_launcher_restarts_is_not_failed_on_heartbeats_before_its_stall_timeout() -> None:
    """A local launcher kills a shard silent for train.stall_timeout_s (90 s here) and restarts
    it: its missed heartbeats must not fail the job first (they did, after 65 s)."""
    runner, driver = _runner_with_a_shard_silent_for(70.0)
    runner.kill_hung = lambda address, why: None
    runner._check_alive(driver)  # type: ignore[arg-type]
    runner, driver = _runner_with_a_shard_silent_for(70.0 + 90.0)   # killed, and still not back
    runner.kill_hung = lambda address, why: None
    with pytest.raises(JobFailed, match=r"ps shard 0 \(pid 43 at 127\.0\.0\.1:7002 on local\) not responding"):
        runner._check_alive(driver)  # type: ignore[arg-type]


def test_a_silent_shard_no_one_restarts_fails_the_job_after_the_restart_grace() -> None:
    runner, driver = _runner_with_a_shard_silent_for(70.0)   # compose, `hetpipe worker`: no kill_hung
    with pytest.raises(JobFailed, match="no heartbeat for"):
        runner._check_alive(driver)  # type: ignore[arg-type]
