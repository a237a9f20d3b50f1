"""Runs one submitted job through its states: plan, claim workers, drive them, write outputs."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hetpipe.cluster import ClusterConfig
from hetpipe.config import ConfigError, JobConfig
from hetpipe.errors import JobFailed, JobStopped, Rejected, StageLost
from hetpipe import data, outputs
from hetpipe.v1 import wire_pb2
from coordinator import remote, results
from coordinator.driver import JobDriver, Progress
from coordinator.planner import Plan, PlanError, make_plan
from coordinator.registry import Registry, Role
from coordinator.state import JobState, JobStateMachine

log = logging.getLogger(__name__)
# A shard is durable: the launcher (or compose) restarts it and it restores its checkpoint, so
# it may be silent this much longer than a stage before the job gives up on it.
SHARD_RESTART_GRACE_S = 60.0
# A stage that says it is stopping (a signal on its host) fails the job after this long, unless
# the job is stopped meanwhile: then the stop was the cause.
LEAVING_GRACE_S = 1.0
JOB_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex, as submit gives it


@dataclass(frozen=True, slots=True)
class JobView:
    state: JobState
    reason: str
    plan: list[dict[str, Any]] | None    # which GPU and layers each stage has, once planned
    emulated: bool
    samples: int
    total_samples: int
    samples_per_second: float
    loss: float | None                   # None: no minibatch finished yet; NaN: a NaN loss
    summary: dict[str, Any] | None       # summary.json's content, once completed
    virtual_workers: int = 0             # the plan's, once planned
    evicted: tuple[int, ...] = ()        # VWs that left the job (parallel.on_vw_failure: continue)
    job_id: str = ""                     # given at submit; empty before any
    waiting: str = ""                    # before it runs: the workers it waits for, and what is free


class JobRunner:
    """Owns the coordinator's one job at a time; all transitions go through JobStateMachine."""

    def __init__(self, registry: Registry, *, claim_timeout_s: float = 120.0, output_root: str | None = None) -> None:
        self.registry = registry
        self.claim_timeout_s = claim_timeout_s
        # Where jobs submitted from other hosts write (--output-root); None: their own output.dir.
        self.output_root = output_root
        self.out_dir: Path | None = None  # the current (or last) job's output.dir, once known
        self.job_id = ""  # the current (or last) job's, given at submit
        self.machine = JobStateMachine()
        self._progress: Progress | None = None
        self._plan: Plan | None = None
        self._summary: dict[str, Any] | None = None
        self._waiting = ""   # what the job waits for before it runs: workers to register, or to free
        self._stop = threading.Event()
        self._stop_reason = "stopped by request"  # the first stop()'s: a launcher's failure, Ctrl-C
        self._dead: dict[str, str] = {}  # address -> why, reported by a local launcher
        # Set by a local launcher: kills the process at an address, which it then restarts (a
        # shard) or reports dead. Without one (compose), a hung shard fails the job.
        self.kill_hung: Callable[[str, str], None] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: JobConfig, plan: Plan | None = None, *, resume_wave: int = 0, remote: bool = False) -> str:
        """Starts job (planned here unless the caller already did) in the background; returns its
        job_id. resume_wave: from the checkpoint of that wave in output.dir (0: from the beginning).
        remote: submitted from another host (Submit): its outputs go under output_root, and
        without a cluster section its cluster is the registered workers."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                what = "is stopping" if self.machine.terminal else f"is {self.machine.state.name}"
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"a job {what}; stop it first or wait")
            if not self.machine.try_to(JobState.PENDING):
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                               f"a job is already {self.machine.state.name}; stop it first")
            self._stop.clear()
            self._stop_reason = "stopped by request"
            self._dead.clear()
            self._progress, self._plan, self._summary, self.out_dir = None, None, None, None
            self._waiting = ""
            self.job_id = uuid.uuid4().hex
            self._thread = threading.Thread(target=self._run, args=(job, plan, resume_wave, remote), name="job",
                                            daemon=True)
            self._thread.start()
            return self.job_id

    def _check_id(self, job_id: str) -> None:
        """Rejected unless job_id is empty (the current job) or the current job's. Under _lock, so
        that a job submitted meanwhile is never the one acted on."""
        if not job_id or job_id == self.job_id:
            return
        if not JOB_ID.fullmatch(job_id):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"job_id {job_id[:64]!r}: expected the 32 hex digits Submit answered, or empty")
        now = f"job {self.job_id} now" if self.job_id else "no job"
        raise Rejected(grpc.StatusCode.NOT_FOUND, f"job_id {job_id}: this coordinator holds {now}")

    def stop(self, reason: str = "stopped by request", job_id: str = "") -> None:
        """Stops the job in whatever state it is: before it runs at once, while it runs as soon as
        the job thread sees it (within a poll). A job that already ended stays as it ended. The
        first reason given is the one the job ends with. job_id: see _check_id."""
        with self._lock:   # the check and the move together: a Submit in between is another job
            self._check_id(job_id)
            if not self._stop.is_set():
                self._stop_reason = reason
                self._stop.set()
            if self.machine.state in (JobState.NONE, JobState.PENDING, JobState.PLANNED):
                self.machine.try_to(JobState.STOPPED, self._stop_reason)

    def join(self, timeout: float) -> None:
        """Waits for the job thread to end (after stop, or after its processes went away): a
        launcher that exits under a running job thread can abort inside torch. A job still not
        ended then (its thread stuck in a call) ends STOPPED with the stop's reason."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self._stop.is_set():
            self.machine.try_to(JobState.STOPPED, self._stop_reason)

    def report_dead(self, address: str, why: str) -> None:
        """A launcher saw a worker process die: fail fast instead of waiting for heartbeats."""
        with self._lock:
            self._dead[address] = why

    @property
    def progress(self) -> Progress | None:
        """The running (or last) job's latest progress; None before it runs."""
        return self._progress

    def view(self, job_id: str = "") -> JobView:
        """The job as the servicer and the metrics show it. job_id: see _check_id."""
        with self._lock:
            self._check_id(job_id)
            return self._view()

    def ended_outputs(self, job_id: str) -> Path:
        """The output.dir of the job named (see _check_id), FAILED_PRECONDITION until it ended."""
        with self._lock:
            self._check_id(job_id)
            state, out_dir = self.machine.state, self.out_dir
            if not state.is_terminal:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the job is {state.name}: its outputs are handed out once it has ended")
            if out_dir is None:   # refused, failed or stopped before it had an output folder
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the job ended {state.name} before it was planned: it has no outputs")
            return out_dir

    def _view(self) -> JobView:
        p = self._progress
        return JobView(
            state=self.machine.state, reason=self.machine.reason,
            plan=self._plan.describe() if self._plan is not None else None,
            emulated=self._plan.emulated if self._plan is not None else False,
            samples=p.samples if p else 0, total_samples=p.total if p else 0,
            samples_per_second=p.samples_per_second if p else 0.0, loss=p.loss if p else None,
            summary=self._summary, evicted=p.evicted if p else (),
            virtual_workers=self._plan.virtual_workers if self._plan is not None else 0,
            job_id=self.job_id, waiting=self._waiting,
        )

    # ---- the job thread -----------------------------------------------------------------------

    def _check_alive(self, driver: JobDriver) -> None:
        with self._lock:
            dead = dict(self._dead)
        stages = {h.address: h for h in driver.stages}  # not those of a VW that left
        for address, h in stages.items():
            if address in dead:
                raise StageLost(h.plan.vw, f"{h.name} ({address}) {dead[address]}; {h.progress()}")
        for i, address in enumerate(driver.ps_addresses):
            if address in dead and "restart" not in dead[address]:
                raise JobFailed(f"ps shard {i} ({address}) {dead[address]}")
        for worker in self.registry.leaving(Role.STAGE_WORKER):
            # Before its neighbours' failures to reach it, which its going causes: it said why first.
            left = stages.get(worker.info.address)
            if left is not None:
                # A Ctrl-C at a local run's terminal reaches its stages and its launcher at once:
                # the launcher's stop is the cause, and it comes within moments.
                if self._stop.wait(LEAVING_GRACE_S):
                    raise JobStopped(self._stop_reason)
                raise StageLost(left.plan.vw, f"{worker.label} {worker.leaving} on its host; {left.progress()}")
        for worker, silence in self.registry.silent(Role.STAGE_WORKER, 0.0):
            silent = stages.get(worker.info.address)
            if silent is not None:
                raise StageLost(silent.plan.vw, f"{worker.label} not responding: no heartbeat for {silence:.1f}s; "
                                                f"{silent.progress()}")
        # A hung shard that the launcher kills and restarts is silent from its freeze until back:
        # train.stall_timeout_s before the kill, then the restart's grace.
        grace = SHARD_RESTART_GRACE_S + (driver.job.train.stall_timeout_s if self.kill_hung is not None else 0.0)
        for worker, silence in self.registry.silent(Role.PS_SHARD, grace):
            raise JobFailed(f"{worker.label} not responding: no heartbeat for {silence:.1f}s")
        if self._stop.is_set():
            raise JobStopped(self._stop_reason)

    def _advance(self, new: JobState) -> None:
        """Moves the job on, unless it was stopped meanwhile (then JobStopped ends the thread)."""
        if self._stop.is_set() or not self.machine.try_to(new):
            raise JobStopped(self.machine.reason or self._stop_reason)

    def _remote_job(self, job: JobConfig) -> JobConfig:
        """A job from another host: its outputs in a fresh folder under output_root, and without a
        cluster section the registered stage workers as its cluster."""
        if self.output_root is not None:
            job = remote.place_outputs(job, self.output_root)
            outputs.check_reads(Path(job.output.dir), job.read_paths, folders=("ps", outputs.CHECKPOINTS))
            outputs.start_fresh(Path(job.output.dir), keep_checkpoints=False)
        if job.cluster is None:
            job = dataclasses.replace(job, cluster=self._registered_cluster(job))
        return job

    def _registered_cluster(self, job: JobConfig) -> ClusterConfig | None:
        """remote.cluster_from_workers, once as many stage workers as the job has stages are free
        (up to the claim timeout)."""
        par = job.parallel
        need = par.virtual_workers * par.stages_per_vw
        deadline = time.monotonic() + self.claim_timeout_s
        try:
            while True:
                entries = self.registry.listing().workers
                cluster = remote.cluster_from_workers(entries)
                have = (sum(g.count for n in cluster.nodes for g in n.gpus) if cluster is not None
                        else len(remote.free_stage_workers(entries)))
                if have >= need:
                    break
                if self._stop.is_set():
                    raise JobStopped("stopped by request while waiting for workers")
                shortfall = (f"the job needs {need} stage workers ({par.virtual_workers} virtual workers x "
                             f"{par.stages_per_vw} stages); {have} free ones registered with this coordinator"
                             + (f" ({remote.describe(cluster)})" if cluster is not None else ""))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{shortfall} after {self.claim_timeout_s:.0f}s")
                self._wait_for(shortfall)
                time.sleep(0.2)
        finally:
            self._wait_for("")
        if cluster is not None:
            log.info("planning over the registered workers: %s", remote.describe(cluster))
        return cluster

    def _wait_for(self, shortfall: str) -> None:
        """What the job waits for ('' once it is over): Registry.claim's report (under the
        registry's lock: an assignment, no lock of ours), or _registered_cluster's."""
        self._waiting = shortfall and f"{shortfall} (waiting up to {self.claim_timeout_s:.0f}s)"

    def _run(self, job: JobConfig, plan: Plan | None, resume_wave: int, from_remote: bool = False) -> None:
        driver: JobDriver | None = None
        try:
            if from_remote:
                job = self._remote_job(job)
            self.out_dir = Path(job.resolve(job.output.dir))
            if plan is None:
                # A standing coordinator's jobs: this one's data may have changed since the last.
                data.forget_batch_shapes()
                plan = make_plan(job, cancel=self._stop)
            self._plan = plan
            self._advance(JobState.PLANNED)
            stages = self.registry.claim(
                Role.STAGE_WORKER, [(f"stage {s.stage} of vw {s.vw}", s.node, s.gpu) for s in plan.stages],
                self.claim_timeout_s, cancel=self._stop, waiting=self._wait_for,
            )
            ps = self.registry.claim(Role.PS_SHARD, [(f"ps shard {i}", "", "") for i in range(job.parallel.started_shards)],
                                     self.claim_timeout_s, cancel=self._stop, waiting=self._wait_for)
            driver = JobDriver(job, plan, [w.info.address for w in stages],
                               ps_addresses=[w.info.address for w in ps], resume_wave=resume_wave,
                               nodes=[w.info.node for w in stages],
                               host_ids=[w.info.host_id for w in stages], ps_host_ids=[w.info.host_id for w in ps],
                               # On each stage's host, under its --output-root (`hetpipe worker` runs there).
                               trace_dir="trace" if from_remote else None)
            driver.check_processes = lambda: self._check_alive(driver)  # type: ignore[union-attr]
            driver.restart_hung_shard = self._restart_hung_shard
            driver.stopping = self._stop
            if self._stop.is_set():   # stopped while the workers were claimed: nothing assigned, nothing loaded
                raise JobStopped(self._stop_reason)
            driver.setup()
            self._advance(JobState.RUNNING)
            wall = driver.run(self._on_progress)
            self._summary = results.write_outputs(driver, wall)
            self.machine.try_to(JobState.COMPLETED)
        except JobStopped as exc:
            self.machine.try_to(JobState.STOPPED, str(exc))
        except ConfigError as exc:  # the job's files and factories as found here, not on the client
            where = f"on the coordinator host {socket.gethostname()}: " if from_remote else ""
            self.machine.try_to(JobState.FAILED, f"{where}{exc}")
        except (JobFailed, PlanError, TimeoutError) as exc:
            if self._stop.is_set():   # what the stop did (a Ctrl-C to the group ends the shards too)
                self.machine.try_to(JobState.STOPPED, self._stop_reason)
            else:   # a call that failed because a shard stopped answering: the shard is the cause
                self.machine.try_to(JobState.FAILED, driver.silent_shard if driver and driver.silent_shard else str(exc))
        except OSError as exc:  # this host's disk (full, a folder removed): the job's to name, no coordinator bug
            where = f" on the coordinator host {socket.gethostname()}" if from_remote else ""
            what = f"{exc.filename}: " if exc.filename else ""
            self.machine.try_to(JobState.FAILED, f"I/O error{where}: {what}{exc.strerror or exc}")
        except Exception as exc:  # a coordinator bug must still end the job visibly
            if driver is not None and driver.silent_shard:   # a call on the shard's channel, closed
                self.machine.try_to(JobState.FAILED, driver.silent_shard)
            else:
                log.exception("job crashed")
                self.machine.try_to(JobState.FAILED, f"coordinator error: {type(exc).__name__}: {exc}")
        finally:
            # At INFO: a standing coordinator's log (compose's, k8s's) says how its job ended, and
            # `hetpipe run`, which reports that itself, shows only warnings.
            log.info("job %s%s", self.machine.state.name, f": {self.machine.reason}" if self.machine.reason else "")
            if driver is not None:
                driver.stop_watching()
                self._stop_workers(driver)
                driver.close()
            self.registry.release()

    def _restart_hung_shard(self, index: int, address: str, why: str) -> bool:
        """A local launcher kills a hung shard, to restart it from its checkpoint like a dead one."""
        if self.kill_hung is None:
            return False
        self.kill_hung(address, f"ps shard {index} {why}")
        return True

    def _on_progress(self, progress: Progress) -> None:
        self._progress = progress

    @staticmethod
    def _stop_workers(driver: JobDriver) -> None:
        """Tells every stage to stop, so none keeps computing or waiting after the job ended."""
        for h in driver.stages:
            try:
                h.stub.Stop(wire_pb2.Empty(), timeout=2.0)
            except grpc.RpcError:
                pass  # already gone
