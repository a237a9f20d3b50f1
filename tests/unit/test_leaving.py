"""A stage that says it is stopping (HeartbeatRequest.leaving: a signal on its host) fails its job
naming that, unless the job is stopped within LEAVING_GRACE_S: a Ctrl-C at a local run's
terminal reaches its stages and its launcher at once, and the launcher's stop is the cause."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from coordinator import job as job_module
from coordinator.job import JobRunner
from coordinator.registry import Registry
from hetpipe.errors import JobStopped, StageLost
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
