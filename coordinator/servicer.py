"""gRPC handlers of the Coordinator service: registry, heartbeats and the job, kept thin."""

from __future__ import annotations

import importlib.machinery
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from hetpipe.config import ConfigError, JobConfig, check_coordinated
from hetpipe.errors import Rejected
from hetpipe.rpc import handler, refuse
from hetpipe.v1 import coordinator_pb2, wire_pb2
from coordinator import remote
from coordinator.job import JobRunner, JobView
from coordinator.metrics import CoordinatorSnapshot
from coordinator.registry import Registry
from coordinator.state import JobState

ProtoState = coordinator_pb2.JobStatus.State
PROTO_STATE = {state: ProtoState.Value(state.name) for state in JobState}


def job_status(view: JobView) -> coordinator_pb2.JobStatus:
    s = coordinator_pb2.JobStatus(state=PROTO_STATE[view.state], reason=view.reason, emulated=view.emulated,
                                  job_id=view.job_id, waiting=view.waiting,
                                  samples=view.samples, total_samples=view.total_samples,
                                  samples_per_second=view.samples_per_second,
                                  loss=0.0 if view.loss is None else view.loss)   # 0.0: none yet
    if view.plan is not None:
        s.plan_json = json.dumps(view.plan)
    if view.summary is not None:
        s.summary_json = json.dumps(view.summary)
    return s


class CoordinatorServicer:
    def __init__(self, registry: Registry, runner: JobRunner, data_root: str | None = None) -> None:
        self.registry = registry
        self.runner = runner
        self.data_root = Path(data_root).resolve() if data_root else None

    @handler
    def Register(self, request: coordinator_pb2.WorkerInfo, context: grpc.ServicerContext) -> coordinator_pb2.RegisterReply:
        worker_id = self.registry.register(request)
        return coordinator_pb2.RegisterReply(worker_id=worker_id, heartbeat_interval_s=self.registry.interval,
                                             job_unknown=not worker_id)

    @handler
    def Heartbeat(self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> coordinator_pb2.HeartbeatReply:
        return coordinator_pb2.HeartbeatReply(known=self.registry.heartbeat(request.worker_id, request.leaving))

    @handler
    def ListWorkers(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> coordinator_pb2.WorkerList:
        return self.registry.listing()

    @handler
    def Submit(self, request: coordinator_pb2.SubmitRequest, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        try:
            job = JobConfig.from_json(request.job_json)
            check_coordinated(job, "a coordinator it is submitted to")
        except ConfigError as exc:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"job_json: {exc}") from None
        self._check_paths(job)
        job_id = self.runner.submit(job, remote=True)
        return job_status(self.runner.view(job_id))

    def _check_paths(self, job: JobConfig) -> None:
        """PERMISSION_DENIED for a file the job names outside the data root (symbolic links
        followed), or for factories imported from a base_dir outside it: a submitted job must not
        make this host's processes read, or run code, from anywhere else."""
        if self.data_root is None:
            return
        named = {"data.path": job.data.path if job.data.name == "npz" else None, "model.init": job.model.init}
        if job.factories:  # base_dir goes first on the import path of every process that builds the job
            named[f"base_dir (where {', '.join(job.factories)} import from)"] = job.base_dir
        for field, path in named.items():
            if not path:
                continue
            try:
                where = job.resolve(path).resolve()
            except (RuntimeError, OSError, ValueError) as exc:   # a link loop (RuntimeError on 3.11), a NUL
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{field} {path[:200]!r}: {exc}") from None
            if not where.is_relative_to(self.data_root):
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED,
                               f"{field} {path[:200]!r} resolves outside this coordinator's data root "
                               f"{self.data_root} (--data-root)")
        for key, spec in job.factories.items():
            # Its folder is inside the data root, but a name such as os:system or torch:load would
            # import from elsewhere: only a module of that folder, which no process has from
            # elsewhere already (every one has the standard library, torch, numpy), is taken.
            top = spec.partition(":")[0].partition(".")[0]
            if not _own_module(top, Path(job.base_dir)):
                raise Rejected(grpc.StatusCode.PERMISSION_DENIED,
                               f"{key} {spec[:200]!r}: a submitted job's factory must be a module of the job's own "
                               f"folder {job.base_dir} (inside --data-root), and {top!r} is not one")

    @handler
    def GetJob(self, request: coordinator_pb2.JobRef, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        return job_status(self.runner.view(request.job_id))

    @handler
    def StopJob(self, request: coordinator_pb2.JobRef, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        self.runner.stop(job_id=request.job_id)
        return job_status(self.runner.view())

    @handler
    def Results(self, request: coordinator_pb2.ResultsRequest,
                context: grpc.ServicerContext) -> Iterator[coordinator_pb2.OutputChunk]:
        out_dir = self.runner.ended_outputs(request.job_id)
        try:
            pieces = remote.result_chunks(out_dir, request.skip_files, request.offset)
            first = next(pieces, None)  # the resume point is checked before anything is sent
        except ValueError as exc:
            raise Rejected(grpc.StatusCode.OUT_OF_RANGE, f"Results: {exc}") from None
        except OSError as exc:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, f"Results: reading {out_dir}: {exc.strerror}") from None

        def chunks() -> Iterator[coordinator_pb2.OutputChunk]:
            try:
                for path, offset, data, last in itertools.chain([first] if first else [], pieces):
                    yield coordinator_pb2.OutputChunk(path=path, offset=offset, data=data, last=last)
            except OSError as exc:  # a file removed or unreadable under us: the client may ask again
                refuse(context, "Results", grpc.StatusCode.UNAVAILABLE, f"Results: reading {out_dir}: {exc.strerror}")

        return chunks()

    def metrics_snapshot(self) -> CoordinatorSnapshot:
        view = self.runner.view()
        workers = [(w.info.role, alive) for w, _, alive in self.registry.workers()]
        started = view.total_samples > 0
        # The rate is the running job's: an ended one trains nothing (its last rate stayed on the
        # dashboards, flat, until the next job). Its last loss stays: it is the job's result.
        rate = view.samples_per_second if view.state.name == "RUNNING" else 0.0
        return CoordinatorSnapshot(state=view.state.name, workers=workers,
                                   samples_per_second=rate if started else None,
                                   loss=view.loss if started else None,
                                   virtual_workers=view.virtual_workers, evicted=view.evicted)


def _own_module(top: str, folder: Path) -> bool:
    """Whether importing `top` with folder first on the path gives folder's own module: found
    there, not a module of the standard library, and not one this process has from elsewhere."""
    if top in sys.builtin_module_names or top in sys.stdlib_module_names:
        return False
    if importlib.machinery.PathFinder.find_spec(top, [str(folder)]) is None:
        return False
    loaded = sys.modules.get(top)
    where = getattr(loaded, "__file__", None) if loaded is not None else None
    return loaded is None or (where is not None and Path(where).resolve().is_relative_to(folder.resolve()))
