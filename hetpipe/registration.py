"""A worker's side of the coordinator registry: register, then heartbeat until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from hetpipe import rpc
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


def keep_registered(coordinator: str, info: coordinator_pb2.WorkerInfo, stopped: threading.Event, *,
                    holds_job: Callable[[], bool] = lambda: False,
                    on_orphaned: Callable[[], None] = lambda: None) -> threading.Thread:
    """Registers with the coordinator and heartbeats on a daemon thread; re-registers whenever
    the coordinator has forgotten us (it restarted) and retries while it is unreachable.

    A process that holds a job (holds_job) when the coordinator has forgotten it does not
    register again: the job ended with the coordinator that ran it, and a new job must not find
    it assigned (a stage) or holding another job's clocks (a shard). on_orphaned() ends it, and
    its launcher starts a fresh one."""

    def loop() -> None:
        channel = rpc.channel(coordinator)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        worker_id, interval = "", 1.0
        while not stopped.is_set():
            try:
                if not worker_id:
                    reply = stub.Register(info, timeout=rpc.CONTROL_DEADLINE_S)
                    worker_id, interval = reply.worker_id, reply.heartbeat_interval_s
                    log.info("registered with coordinator %s as %s", coordinator, worker_id)
                elif not stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=worker_id),
                                        timeout=rpc.CONTROL_DEADLINE_S).known:
                    if holds_job():
                        log.warning("coordinator %s restarted and no longer knows this process: the job it served "
                                    "ended there; exiting, for a fresh process in its place", coordinator)
                        on_orphaned()
                        break
                    worker_id = ""
                    continue
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
                    log.error("coordinator refused registration: %s", exc.details())
                    stopped.wait(5 * interval)
                else:
                    log.warning("coordinator %s unreachable: %s", coordinator, exc.code().name)
            stopped.wait(interval)
        channel.close()

    thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
    thread.start()
    return thread
