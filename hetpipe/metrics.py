"""Prometheus helpers: one registry per service process, served on its own HTTP port, and the
gRPC server interceptor every service installs (docs/metrics.md is the contract)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server

# No `_created` series next to every counter and histogram: the contract names no such metrics,
# and they would double the series count for nothing a dashboard uses.
disable_created_metrics()
REGISTRY = CollectorRegistry(auto_describe=True)

# Latency buckets (seconds) shared by RPCs, pushes and pulls: sub-millisecond loopback calls up to
# pulls that wait minutes for the slowest virtual worker.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class MetricsServer:
    """A running metrics HTTP server; close() frees its port (a process that serves one job after
    another, such as `hetpipe run` embedded in tests, starts and stops one per job)."""

    port: int
    _httpd: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start(port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serves REGISTRY on host:port (0 = any free port) until close()."""
    httpd, thread = start_http_server(port, addr=host, registry=REGISTRY)
    return MetricsServer(int(httpd.server_address[1]), httpd, thread)


def serve(port: int, host: str = "0.0.0.0") -> int:
    """Serves REGISTRY on host:port (0 = any free port) for the life of the process; returns the port."""
    return start(port, host).port


# ---- gRPC server metrics ---------------------------------------------------------------------

GRPC_HANDLED = Counter(
    "hetpipe_grpc_server_handled", "RPCs finished on this server, by method and status code",
    ["role", "grpc_service", "grpc_method", "grpc_code"], registry=REGISTRY,
)
# Per request message: a long-lived stream (a stage Link's one-frame bundles, hetpipe/duplex.py) counts
# in GRPC_HANDLED once, when it ends, but here once per bundle as it arrives.
GRPC_RECEIVED = Counter(
    "hetpipe_grpc_server_msg_received", "Request messages received on this server, by method",
    ["role", "grpc_service", "grpc_method"], registry=REGISTRY,
)
GRPC_SECONDS = Histogram(
    "hetpipe_grpc_server_handling_seconds", "Time from the handler's start to the RPC's last response",
    ["role", "grpc_service", "grpc_method"], buckets=LATENCY_BUCKETS, registry=REGISTRY,
)


class MethodMetrics:
    """The children of one (role, service, method): label lookups paid once, not per call. A
    stage's link socket (hetpipe/link_socket.py) records through these too, under the stream it
    stands in for."""

    def __init__(self, role: str, service: str, method: str) -> None:
        self._labels = (role, service, method)
        self.seconds = GRPC_SECONDS.labels(role, service, method)
        self.received = GRPC_RECEIVED.labels(role, service, method)
        self._handled: dict[grpc.StatusCode, Any] = {}

    def record(self, code: grpc.StatusCode, started: float) -> None:
        self.seconds.observe(time.perf_counter() - started)
        child = self._handled.get(code)
        if child is None:
            child = self._handled[code] = GRPC_HANDLED.labels(*self._labels, code.name)
        child.inc()


def _code_of(context: grpc.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status the RPC ends with: what abort() or set_code() set, else what gRPC will send."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(exc, GeneratorExit):  # the client went away while responses were streaming
        return grpc.StatusCode.CANCELLED
    if exc is not None:
        return grpc.StatusCode.UNKNOWN   # gRPC's answer to an exception that did not abort
    if not context.is_active():
        left = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= 0 else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


def _received(request: Any, m: MethodMetrics, streaming: bool) -> Any:
    """request, its messages counted as they are taken (a stream) or now (one message)."""
    if not streaming:
        m.received.inc()
        return request

    def counted() -> Iterator[Any]:
        for message in request:
            m.received.inc()
            yield message

    return counted()


def _unary_response(behavior: Callable[..., Any], m: MethodMetrics, streaming: bool) -> Callable[..., Any]:
    def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            response = behavior(_received(request, m, streaming), context)
        except BaseException as exc:
            m.record(_code_of(context, exc), started)
            raise
        m.record(_code_of(context, None), started)
        return response

    return wrapped


def _stream_response(behavior: Callable[..., Any], m: MethodMetrics, streaming: bool) -> Callable[..., Any]:
    def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        # A generator: the RPC ends when the last response has been taken, not when behavior returns.
        started = time.perf_counter()
        try:
            yield from behavior(_received(request, m, streaming), context)
        except BaseException as exc:
            m.record(_code_of(context, exc), started)
            raise
        m.record(_code_of(context, None), started)

    return wrapped


class ServerMetricsInterceptor(grpc.ServerInterceptor):
    """Counts handled RPCs by (service, method, code) and times them, for unary and streaming
    methods alike; request_deserializer and response_serializer pass through untouched, so the
    Stage service's raw-bytes handlers keep their raw bytes."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._methods: dict[str, MethodMetrics] = {}
        self._lock = threading.Lock()

    def _metrics(self, full_method: str) -> MethodMetrics:
        m = self._methods.get(full_method)
        if m is None:
            service, _, method = full_method.lstrip("/").rpartition("/")
            with self._lock:
                m = self._methods.setdefault(full_method, MethodMetrics(self.role, service, method))
        return m

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        h: Any = handler
        if h.unary_stream is not None and getattr(h.unary_stream, "experimental_non_blocking", False):
            # Health.Watch: grpc calls it with a callback and holds no thread for the stream's life.
            # Wrapped, it would hold one each: an open, unauthenticated service whose streams could
            # take every server thread.
            return handler
        m = self._metrics(handler_call_details.method)
        if h.unary_unary is not None:
            return _replace(h, "unary_unary", _unary_response(h.unary_unary, m, False))
        if h.stream_unary is not None:
            return _replace(h, "stream_unary", _unary_response(h.stream_unary, m, True))
        if h.unary_stream is not None:
            return _replace(h, "unary_stream", _stream_response(h.unary_stream, m, False))
        if h.stream_stream is not None:
            return _replace(h, "stream_stream", _stream_response(h.stream_stream, m, True))
        return handler


_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _replace(handler: Any, kind: str, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """The same handler with behavior swapped in, keeping its (de)serializers."""
    if hasattr(handler, "_replace"):  # grpc's own handlers are namedtuples
        replaced: grpc.RpcMethodHandler = handler._replace(**{kind: behavior})
        return replaced
    made: grpc.RpcMethodHandler = _FACTORIES[kind](
        behavior, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    return made
