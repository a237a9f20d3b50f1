"""gRPC handlers of the Coordinator service: registry, heartbeats and the job, kept thin."""

from __future__ import annotations

import json
import math

import grpc

from hetpipe.config import ConfigError, JobConfig
from hetpipe.errors import Rejected
from hetpipe.rpc import handler
from hetpipe.v1 import coordinator_pb2, wire_pb2
from coordinator.job import JobRunner, JobView
from coordinator.metrics import CoordinatorSnapshot
from coordinator.registry import Registry
from coordinator.state import JobState

ProtoState = coordinator_pb2.JobStatus.State
PROTO_STATE = {state: ProtoState.Value(state.name) for state in JobState}


def job_status(view: JobView) -> coordinator_pb2.JobStatus:
    s = coordinator_pb2.JobStatus(state=PROTO_STATE[view.state], reason=view.reason, emulated=view.emulated,
                                  samples=view.samples, total_samples=view.total_samples,
                                  samples_per_second=view.samples_per_second,
                                  loss=0.0 if math.isnan(view.loss) else view.loss)
    if view.plan is not None:
        s.plan_json = json.dumps(view.plan)
    if view.summary is not None:
        s.summary_json = json.dumps(view.summary)
    return s


class CoordinatorServicer:
    def __init__(self, registry: Registry, runner: JobRunner) -> None:
        self.registry = registry
        self.runner = runner

    @handler
    def Register(self, request: coordinator_pb2.WorkerInfo, context: grpc.ServicerContext) -> coordinator_pb2.RegisterReply:
        worker_id = self.registry.register(request)
        return coordinator_pb2.RegisterReply(worker_id=worker_id, heartbeat_interval_s=self.registry.interval)

    @handler
    def Heartbeat(self, request: coordinator_pb2.HeartbeatRequest, context: grpc.ServicerContext) -> coordinator_pb2.HeartbeatReply:
        return coordinator_pb2.HeartbeatReply(known=self.registry.heartbeat(request.worker_id))

    @handler
    def ListWorkers(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> coordinator_pb2.WorkerList:
        out = coordinator_pb2.WorkerList()
        for w, silence, alive in self.registry.workers():
            out.workers.add(worker_id=w.worker_id, info=w.info, seconds_since_heartbeat=silence,
                            alive=alive, assigned=w.assigned)
        return out

    @handler
    def Submit(self, request: coordinator_pb2.SubmitRequest, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        try:
            job = JobConfig.from_json(request.job_json)
        except ConfigError as exc:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"job_json: {exc}") from None
        self.runner.submit(job)
        return job_status(self.runner.view())

    @handler
    def GetJob(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        return job_status(self.runner.view())

    @handler
    def StopJob(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        self.runner.stop()
        return job_status(self.runner.view())

    def metrics_snapshot(self) -> CoordinatorSnapshot:
        view = self.runner.view()
        workers = [(w.info.role, alive) for w, _, alive in self.registry.workers()]
        running = view.total_samples > 0
        return CoordinatorSnapshot(state=view.state.name, workers=workers,
                                   samples_per_second=view.samples_per_second if running else None,
                                   loss=view.loss if running else None,
                                   virtual_workers=view.virtual_workers, evicted=view.evicted)
