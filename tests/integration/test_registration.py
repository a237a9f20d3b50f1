"""A worker's registration (hetpipe/registration.py) against a coordinator that dies: a process
holding a job leaves it once the coordinator has refused connections for UNREACHABLE_HEARTBEATS
intervals (the job is gone with it, and a GPU would train on for nobody); one holding none keeps
trying, to register with the coordinator when it comes back."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from hetpipe import rpc
from hetpipe.registration import NO_COORDINATOR, REFUSALS, TOKEN_HINT, UNREACHABLE_HEARTBEATS, keep_registered
from hetpipe.v1 import coordinator_pb2

pytestmark = pytest.mark.timeout(60)
INTERVAL_S = 0.05


class _Coordinator:
    """Registers anyone and knows them: the two calls a worker's heartbeat thread makes."""

    def __init__(self) -> None:
        self.heartbeats = 0

    def Register(self, request: coordinator_pb2.WorkerInfo, context: object) -> coordinator_pb2.RegisterReply:
        return coordinator_pb2.RegisterReply(worker_id="w1", heartbeat_interval_s=INTERVAL_S)

    def Heartbeat(self, request: coordinator_pb2.HeartbeatRequest, context: object) -> coordinator_pb2.HeartbeatReply:
        self.heartbeats += 1
        return coordinator_pb2.HeartbeatReply(known=True)


@pytest.mark.parametrize("holds_job", [True, False], ids=["serving a job", "free"])
def test_a_worker_leaves_its_job_once_its_coordinator_is_gone(holds_job: bool) -> None:
    coordinator = _Coordinator()
    server = rpc.Server("127.0.0.1", 0)
    server.add("Coordinator", coordinator)
    server.start()
    stopped, orphaned = threading.Event(), threading.Event()
    ended: list[bool] = []   # on_orphaned's job_ended: False, as it may still run the job
    info = coordinator_pb2.WorkerInfo(role=coordinator_pb2.WorkerInfo.STAGE_WORKER, address="127.0.0.1:1")
    thread = keep_registered(server.address, info, stopped, holds_job=lambda: holds_job, on_orphaned=lambda job_ended: (ended.append(job_ended), orphaned.set())).thread
    assert thread is not None
    try:
        deadline = time.monotonic() + 10
        while coordinator.heartbeats < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert coordinator.heartbeats >= 3 and not orphaned.is_set(), "registered, heartbeating"
        server.stop()
        gone = time.monotonic()
        if holds_job:
            assert orphaned.wait(10), "the job outlived its coordinator"
            assert ended == [False], "unreachable is not a coordinator that said the job ended"
            assert time.monotonic() - gone >= UNREACHABLE_HEARTBEATS * INTERVAL_S, "not at the first refusal"
            thread.join(5)
            assert not thread.is_alive()
        else:
            assert not orphaned.wait(3 * UNREACHABLE_HEARTBEATS * INTERVAL_S), "a free worker waits for a coordinator"
            assert thread.is_alive()
    finally:
        stopped.set()
        thread.join(5)


@pytest.mark.parametrize("interval", [float("nan"), 0.0, -1.0])
def test_a_worker_heartbeats_at_a_bounded_rate_whatever_interval_it_is_told(interval: float) -> None:
    """A reply's heartbeat interval, nan or 0, made the thread heartbeat in a tight loop: it is
    bounded to [0.05, 60] s, a non-number read as 1 s. A machine under load only heartbeats
    less, so the bound on the count cannot fail for slowness."""
    class Told(_Coordinator):
        def Register(self, request: coordinator_pb2.WorkerInfo, context: object) -> coordinator_pb2.RegisterReply:
            return coordinator_pb2.RegisterReply(worker_id="w1", heartbeat_interval_s=interval)

    coordinator = Told()
    server = rpc.Server("127.0.0.1", 0)
    server.add("Coordinator", coordinator)
    server.start()
    stopped = threading.Event()
    info = coordinator_pb2.WorkerInfo(role=coordinator_pb2.WorkerInfo.STAGE_WORKER, address="127.0.0.1:1")
    thread = keep_registered(server.address, info, stopped).thread
    assert thread is not None
    try:
        time.sleep(1.0)
        assert coordinator.heartbeats <= 1.0 / 0.05 + 1, coordinator.heartbeats
    finally:
        stopped.set()
        thread.join(5)
        server.stop()


@pytest.mark.parametrize("code", [*REFUSALS, grpc.StatusCode.ALREADY_EXISTS], ids=lambda c: c.name)
def test_a_worker_the_coordinator_refuses_ends_rather_than_asking_for_ever(code: grpc.StatusCode) -> None:
    """Its fields or credentials refused, or no coordinator at that port (UNIMPLEMENTED), asking
    again cannot help: on_refused names the refusal and the thread ends. Another process at the same address (ALREADY_EXISTS) may be leaving:
    that one is asked again."""
    class Refusing(_Coordinator):
        registers = 0

        def Register(self, request: coordinator_pb2.WorkerInfo, context: grpc.ServicerContext) -> coordinator_pb2.RegisterReply:
            self.registers += 1
            context.abort(code, "gpu_type 'z80': expected one of ...")

    coordinator = Refusing()
    server = rpc.Server("127.0.0.1", 0)
    server.add("Coordinator", coordinator)
    server.start()
    stopped, said = threading.Event(), threading.Event()
    why: list[str] = []
    info = coordinator_pb2.WorkerInfo(role=coordinator_pb2.WorkerInfo.STAGE_WORKER, address="127.0.0.1:1")
    thread = keep_registered(server.address, info, stopped, on_refused=lambda w: (why.append(w), said.set())).thread
    assert thread is not None
    try:
        if code == grpc.StatusCode.ALREADY_EXISTS:
            assert not said.wait(1.0) and thread.is_alive(), why
        else:
            assert said.wait(10), "refused, and still asking"
            thread.join(5)
            assert not thread.is_alive()
            hint = {grpc.StatusCode.UNIMPLEMENTED: f" ({NO_COORDINATOR})", grpc.StatusCode.UNAUTHENTICATED: TOKEN_HINT,
                    grpc.StatusCode.PERMISSION_DENIED: TOKEN_HINT}.get(code, "")
            assert why == [f"coordinator {server.address} refused this process: {code.name}: "
                           f"gpu_type 'z80': expected one of ...{hint}"], why
            assert coordinator.registers == 1
    finally:
        stopped.set()
        thread.join(5)
        server.stop()
