"""gRPC plumbing shared by every service: servers with health, channels, deadlines, shutdown."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetpipe.metrics import ServerMetricsInterceptor

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
# gRPC's per-message ceiling: one chunk plus header slack. Larger messages are refused by gRPC
# itself with RESOURCE_EXHAUSTED before a handler runs.
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES
# Control calls are small and local; a peer that does not answer in this long is in trouble.
CONTROL_DEADLINE_S = 10.0
# Tensor calls move up to hundreds of MiB.
DATA_DEADLINE_S = 120.0


class Rejected(Exception):
    """A request refused with a specific gRPC status; the servicer answers with it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


F = TypeVar("F", bound=Callable[..., Any])


def handler(fn: F) -> F:
    """Turns Rejected (and bugs) raised by a servicer method into the right gRPC status."""

    @functools.wraps(fn)
    def wrapped(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Rejected as exc:
            context.abort(exc.code, str(exc))
        except Exception as exc:  # a bug must not kill the server; report it as INTERNAL
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {type(exc).__name__}: {exc}")

    return wrapped  # type: ignore[return-value]


class Server:
    """A gRPC server with the standard health service and the gRPC metrics interceptor, bound to
    host:port (0 = any free port)."""

    def __init__(self, host: str, port: int, *, role: str = "unknown", workers: int = 16) -> None:
        # role: the `role` label of this server's gRPC metrics (coordinator, stage_worker, ps_shard).
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options(),
                                interceptors=[ServerMetricsInterceptor(role)])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._stopped = threading.Event()

    def start(self) -> None:
        self.grpc.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 0.5) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.grpc.stop(grace).wait(grace + 1)

    def wait(self) -> None:
        self._stopped.wait()

    def stop_on_signals(self, shutdown: Callable[[], None] | None = None) -> None:
        """Graceful shutdown on SIGTERM and SIGINT, through shutdown if given (it must stop us)."""

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("signal %d: shutting down", signum)
            threading.Thread(target=shutdown or self.stop, daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=options())


def wait_ready(address: str, timeout: float = CONTROL_DEADLINE_S) -> None:
    """Blocks until address answers health checks with SERVING, or raises TimeoutError."""
    deadline = time.monotonic() + timeout
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy within {timeout:.0f}s")
            time.sleep(0.05)


def exit_with_parent(parent_pid: int, on_orphaned: Callable[[], None]) -> None:
    """Calls on_orphaned once the parent process is gone, so a killed launcher leaves no orphans."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        log.warning("parent %d is gone: exiting", parent_pid)
        on_orphaned()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def write_ready_file(path: str, address: str) -> None:
    """Atomically publishes the bound address for a launcher that asked for port 0."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(address)
    os.replace(tmp, path)
