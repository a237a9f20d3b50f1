"""A worker's side of the coordinator registry: register, then heartbeat until stopped."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import grpc

from hetpipe import reach, rpc
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# A process holding a job leaves it once the coordinator has refused connections (UNAVAILABLE)
# for this many heartbeat intervals: the coordinator holds the job's state, and by then it has
# died and the job with it, or declared this process lost (after 5 missed heartbeats). Training on
# would keep a GPU busy on a job whose results nobody collects. Calls that time out do not count:
# a paused coordinator (SIGSTOP of `hetpipe run`, a starved host) blames no worker when it runs
# again (coordinator/registry.py), and its workers wait for it too.
UNREACHABLE_HEARTBEATS = 10
# How long a process stopping may take to tell the coordinator so (Registration.leave): on a
# healthy network it answers in milliseconds, and a paused one must not hold the shutdown up.
LEAVE_DEADLINE_S = 1.0
# The heartbeat intervals a worker keeps, whatever a registration reply says, and so the ones a
# coordinator may be given: a shorter one would find every worker silent.
HEARTBEAT_BOUNDS_S = (0.05, 60.0)
# Answers to a registration that asking again cannot change: its fields (a GPU type or address
# this coordinator refuses), its credentials, or a server that serves no coordinator (another
# service's port: a coordinator serves its service from its start). The process ends naming the
# refusal; retrying for ever would leave it running and never used.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNIMPLEMENTED)
NO_COORDINATOR = "no coordinator serves there: another service's port?"
TOKEN_HINT = "; give every worker the coordinator's --token-file"
# The way out each refusal's words end with, wherever it is seen (a worker's log, hetpipe worker).
REFUSAL_HINTS = {grpc.StatusCode.UNIMPLEMENTED: f" ({NO_COORDINATOR})", grpc.StatusCode.UNAUTHENTICATED: TOKEN_HINT,
                 grpc.StatusCode.PERMISSION_DENIED: TOKEN_HINT}


class Registration:
    """A process's registration with its coordinator, kept by a daemon thread (keep_registered)."""

    def __init__(self, coordinator: str) -> None:
        self.coordinator = coordinator
        self.channel = rpc.channel(coordinator)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.worker_id = ""
        self.thread: threading.Thread | None = None
        self._left = threading.Event()

    def leave(self, why: str) -> None:
        """Tells the coordinator this process is stopping, and why (a signal on its host), so that
        a job it serves fails naming that rather than its neighbours' failed calls to it. Once,
        with a short deadline: a coordinator gone or paused must not hold up the shutdown."""
        if not self.worker_id or self._left.is_set():
            return
        self._left.set()
        try:
            self.stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=self.worker_id, leaving=why),
                                timeout=LEAVE_DEADLINE_S)
        except grpc.RpcError as exc:
            log.info("could not tell coordinator %s that this process is stopping: %s", self.coordinator,
                     reach.failure(exc))


def keep_registered(coordinator: str, info: coordinator_pb2.WorkerInfo, stopped: threading.Event, *,
                    holds_job: Callable[[], bool] = lambda: False,
                    on_orphaned: Callable[[bool], None] = lambda job_ended: None,
                    on_refused: Callable[[str], None] = lambda why: None) -> Registration:
    """Registers with the coordinator and heartbeats on a daemon thread; re-registers whenever
    the coordinator has forgotten us (it restarted) and retries while it is unreachable.

    A process that holds a job (holds_job) when the coordinator has forgotten it does not
    register again: the job ended with the coordinator that ran it, and a new job must not find
    it assigned (a stage) or holding another job's clocks (a shard). Nor does it when the
    coordinator has refused connections for UNREACHABLE_HEARTBEATS intervals, nor when it holds
    a job at its first registration (a shard restored from its checkpoint) and the coordinator
    answers job_unknown. on_orphaned(job_ended) ends it, and its launcher starts a fresh one;
    job_ended: the coordinator said it runs no such job (not merely unreachable, when it may
    still run it). on_refused(why) ends it when the coordinator refuses its registration or
    credentials (REFUSALS); a coordinator that cannot tell it from another process at the same
    address (ALREADY_EXISTS) is asked again, as that one may be leaving."""
    registration = Registration(coordinator)
    stub = registration.stub

    def loop() -> None:
        interval = 1.0
        unreachable_since: float | None = None
        while not stopped.is_set():
            worker_id = registration.worker_id
            try:
                if not worker_id:
                    request = coordinator_pb2.WorkerInfo()
                    request.CopyFrom(info)
                    request.holds_job = holds_job()
                    reply = stub.Register(request, timeout=rpc.CONTROL_DEADLINE_S)
                    if reply.job_unknown:
                        log.warning("coordinator %s runs no job of the state this process holds (restored after "
                                    "the coordinator restarted): exiting, for a fresh process in its place", coordinator)
                        on_orphaned(True)
                        break
                    registration.worker_id, interval = reply.worker_id, reply.heartbeat_interval_s
                    # Bounded: a reply's nan or 0 would heartbeat in a tight loop, its inf never.
                    low, high = HEARTBEAT_BOUNDS_S
                    interval = min(max(interval, low), high) if math.isfinite(interval) else 1.0
                    log.info("registered with coordinator %s as %s", coordinator, reply.worker_id)
                elif not stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=worker_id),
                                        timeout=rpc.CONTROL_DEADLINE_S).known:
                    if holds_job():
                        log.warning("coordinator %s restarted and no longer knows this process: the job it served "
                                    "ended there; exiting, for a fresh process in its place", coordinator)
                        on_orphaned(True)
                        break
                    registration.worker_id = ""
                    continue
                unreachable_since = None
            except grpc.RpcError as exc:
                if exc.code() in REFUSALS:
                    why = f"coordinator {coordinator} refused this process: {reach.failure(exc)}"
                    why += REFUSAL_HINTS.get(exc.code(), "")
                    log.error("%s; exiting", why)
                    on_refused(why)
                    break
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    log.error("coordinator refused registration: %s", exc.details())
                    stopped.wait(5 * interval)
                else:
                    log.warning("coordinator %s", reach.unreachable(coordinator, exc))
                    now = time.monotonic()
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        unreachable_since = None
                    elif unreachable_since is None:
                        unreachable_since = now
                    elif worker_id and holds_job() and now - unreachable_since >= UNREACHABLE_HEARTBEATS * interval:
                        log.warning("coordinator %s unreachable for %.0fs while this process serves its job: the "
                                    "job is lost with it; exiting, for a fresh process in its place",
                                    coordinator, now - unreachable_since)
                        on_orphaned(False)
                        break
            stopped.wait(interval)
        registration.channel.close()

    registration.thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
    registration.thread.start()
    return registration
