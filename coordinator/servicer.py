"""gRPC handlers of the Coordinator service: registry, heartbeats and the job, kept thin."""

from __future__ import annotations

import grpc

from hetpipe.config import ConfigError, JobConfig
from hetpipe.rpc import Rejected, handler
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, wire_pb2
from coordinator.job import JobRunner
from coordinator.registry import Registry


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
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
        return self.runner.status()

    @handler
    def GetJob(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        return self.runner.status()

    @handler
    def StopJob(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> coordinator_pb2.JobStatus:
        self.runner.stop()
        return self.runner.status()
