"""Runs one submitted job through its states: plan, claim workers, drive them, write outputs."""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Any

import grpc

from hetpipe import rpc
from hetpipe.config import ConfigError, JobConfig
from hetpipe.v1 import coordinator_pb2, stage_pb2_grpc, wire_pb2
from coordinator import state as st
from coordinator.driver import JobDriver, JobFailed, JobStopped, Progress
from coordinator.plan import Plan, make_plan
from coordinator.registry import Registry, Role

log = logging.getLogger(__name__)
# A shard is durable: the launcher (or compose) restarts it and it restores its checkpoint, so
# it may be silent this much longer than a stage before the job gives up on it.
SHARD_RESTART_GRACE_S = 60.0


class JobRunner:
    """Owns the coordinator's one job at a time; all transitions go through JobStateMachine."""

    def __init__(self, registry: Registry, *, claim_timeout_s: float = 120.0) -> None:
        self.registry = registry
        self.claim_timeout_s = claim_timeout_s
        self.machine = st.JobStateMachine()
        self._progress: Progress | None = None
        self._plan: Plan | None = None
        self._summary: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._dead: dict[str, str] = {}  # address -> why, reported by a local launcher
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: JobConfig) -> None:
        with self._lock:
            if not self.machine.try_to(st.PENDING):
                raise rpc.Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"a job is already {st.State.Name(self.machine.state)}; stop it first",
                )
            self._stop.clear()
            self._dead.clear()
            self._progress, self._plan, self._summary = None, None, None
            self._thread = threading.Thread(target=self._run, args=(job,), name="job", daemon=True)
            self._thread.start()

    def stop(self, reason: str = "stopped by request") -> None:
        self._stop.set()
        if self.machine.state in (st.PENDING, st.PLANNED):
            self.machine.try_to(st.STOPPED, reason)

    def report_dead(self, address: str, why: str) -> None:
        """A launcher saw a worker process die: fail fast instead of waiting for heartbeats."""
        with self._lock:
            self._dead[address] = why

    @property
    def progress(self) -> Progress | None:
        """The running (or last) job's latest progress; None before it runs."""
        return self._progress

    def status(self) -> coordinator_pb2.JobStatus:
        s = coordinator_pb2.JobStatus(state=self.machine.state, reason=self.machine.reason)
        if self._plan is not None:
            s.plan_json = json.dumps(self._plan.describe())
            s.emulated = self._plan.emulated
        if self._progress is not None:
            p = self._progress
            s.samples, s.total_samples, s.samples_per_second = p.samples, p.total, p.samples_per_second
            s.loss = p.loss if not math.isnan(p.loss) else 0.0
        if self._summary is not None:
            s.summary_json = json.dumps(self._summary)
        return s

    # ---- the job thread -----------------------------------------------------------------------

    def _check_alive(self, driver: JobDriver) -> None:
        with self._lock:
            dead = dict(self._dead)
        for h in driver.stages:
            if h.address in dead:
                raise JobFailed(f"{h.name} ({h.address}) {dead[h.address]}; {h.progress()}")
        for i, address in enumerate(driver.ps_addresses):
            if address in dead and "restart" not in dead[address]:
                raise JobFailed(f"ps shard {i} ({address}) {dead[address]}")
        for role, grace in ((Role.STAGE_WORKER, 0.0), (Role.PS_SHARD, SHARD_RESTART_GRACE_S)):
            for worker, silence in self.registry.silent(role, grace):
                progress = next((f"; {h.progress()}" for h in driver.stages if h.address == worker.info.address), "")
                raise JobFailed(f"{worker.label} missed its heartbeats for {silence:.1f}s{progress}")
        if self._stop.is_set():
            raise JobStopped("stopped by request")

    def _run(self, job: JobConfig) -> None:
        driver: JobDriver | None = None
        try:
            plan = self._plan = make_plan(job)
            self.machine.to(st.PLANNED)
            stages = self.registry.claim(
                Role.STAGE_WORKER, [(f"stage {s.stage} of vw {s.vw}", s.node, s.gpu) for s in plan.stages],
                self.claim_timeout_s,
            )
            shards = plan.shards if plan.virtual_workers > 1 else 0
            ps = self.registry.claim(Role.PS_SHARD, [(f"ps shard {i}", "", "") for i in range(shards)],
                                     self.claim_timeout_s)
            driver = JobDriver(job, plan, [w.info.address for w in stages],
                               ps_addresses=[w.info.address for w in ps])
            driver.check_processes = lambda: self._check_alive(driver)  # type: ignore[union-attr]
            driver.setup()
            self.machine.to(st.RUNNING)
            wall = driver.run(self._on_progress)
            self._summary = driver.write_outputs(driver.fetch_weights(), wall)
            self.machine.try_to(st.COMPLETED)
        except JobStopped as exc:
            self.machine.try_to(st.STOPPED, str(exc))
        except (JobFailed, ConfigError, TimeoutError) as exc:
            self.machine.try_to(st.FAILED, str(exc))
        except Exception as exc:  # a coordinator bug must still end the job visibly
            log.exception("job crashed")
            self.machine.try_to(st.FAILED, f"coordinator error: {type(exc).__name__}: {exc}")
        finally:
            if driver is not None:
                self._stop_workers(driver)
                driver.close()
            self.registry.release()

    def _on_progress(self, progress: Progress) -> None:
        self._progress = progress

    @staticmethod
    def _stop_workers(driver: JobDriver) -> None:
        """Tells every stage to stop, so none keeps computing or waiting after the job ended."""
        for h in driver.stages:
            try:
                stage_pb2_grpc.StageStub(h.channel).Stop(wire_pb2.Empty(), timeout=2.0)
            except grpc.RpcError:
                pass  # already gone
