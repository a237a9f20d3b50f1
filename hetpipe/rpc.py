"""gRPC plumbing shared by every service: servers with health, channels, deadlines, shutdown."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hetpipe import children, security
from hetpipe.errors import Rejected
from hetpipe.metrics import ServerMetricsInterceptor
from hetpipe.v1 import coordinator_pb2, ps_pb2, stage_pb2, wire_pb2

log = logging.getLogger(__name__)

# A tensor frame's payload at most (wire.encode's frames; here, so that a client that moves no
# tensors, the command line, need not import torch with the wire codec).
CHUNK_BYTES = 1 << 20
# gRPC's per-message ceiling: one chunk plus header slack. Larger messages are refused by gRPC
# itself with RESOURCE_EXHAUSTED before a handler runs.
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES
# Control calls are small and local; a peer that does not answer in this long is in trouble.
CONTROL_DEADLINE_S = 10.0
# A status poll: short, so that a frozen peer does not hold up the checks of the others.
STATUS_DEADLINE_S = 2.0
# Tensor calls move up to hundreds of MiB.
DATA_DEADLINE_S = 120.0

# At most this many calls of a method run at once on one server; more are refused with
# RESOURCE_EXHAUSTED. Calls that wait (Pull) or stream (Forward, Push) then cannot take every
# thread: RESERVED_THREADS stay for Status and health checks. Legitimate traffic stays far below:
# one link per neighbour stage, one pull and one push per stage and shard at a time.
LANES: dict[str, dict[str, int]] = {
    "Stage": {"Forward": 3, "Backward": 3, "ForwardLink": 3, "BackwardLink": 3, "GetWeights": 1, "Evaluate": 1},
    "ParameterServer": {"Pull": 56, "Push": 56, "PushFrame": 56, "Init": 8, "Exchange": 56},
}
RESERVED_THREADS = 8
# A client stream with no deadline (or a longer one) is cancelled after this long: one that opens
# and never sends would otherwise hold its lane for good.
STREAM_CAP_S = DATA_DEADLINE_S

# Codes after which the same call may succeed later: the peer is (re)starting, slow or briefly
# overloaded. Every retry loop in the project uses this one rule.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})


def server_threads(service: str) -> int:
    """Threads a server of this service needs: its lanes, and the reserve."""
    return sum(LANES.get(service, {}).values()) + RESERVED_THREADS


def options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]


# Each channel its own connections: gRPC otherwise shares them among a process's channels to one
# address, and a channel kept to a dead peer's port (backing off between attempts) failed every
# new one at once with its last "Connection refused", though a new process served there by then
# (a restarted shard, a worker given a port an earlier one had; tests/integration/test_channels.py).
# Reconnects at most a second apart: gRPC's default backoff grows to 120 s, and a stage found its
# shard, restarted after 20 s down, seconds after it served again (bench/reconnect.py). An attempt
# is one SYN; the peers are a job's few processes.
RECONNECT_BACKOFF_MS = (100, 1000)   # the first, the most
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1),
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]


F = TypeVar("F", bound=Callable[..., Any])


# A refusal's message is cut to this length: gRPC carries it in trailing metadata (8 KiB in all by
# default), and a message that echoes a hostile request's 100 KB of names would turn the intended
# status into RESOURCE_EXHAUSTED.
MAX_DETAILS_CHARS = 1000


def bounded(message: str) -> str:
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}... ({len(message) - MAX_DETAILS_CHARS} more characters)"


class RefusalLog:
    """One log line per refused request, at most `burst` per `period_s`; then one line that says
    how many were left out. A flood of bad requests must not turn into a flood of log."""

    def __init__(self, burst: int = 20, period_s: float = 10.0) -> None:
        self.burst, self.period_s = burst, period_s
        self._lock = threading.Lock()
        self._window_start = -period_s
        self._logged = self._dropped = 0

    def note(self, method: str, code: grpc.StatusCode, message: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self.period_s:
                if self._dropped:
                    log.warning("%d more refused requests not logged", self._dropped)
                self._window_start, self._logged, self._dropped = now, 0, 0
            if self._logged >= self.burst:
                self._dropped += 1
                return
            self._logged += 1
        log.warning("refused %s: %s: %s", method, code.name, message[:200])


REFUSALS = RefusalLog()


def refuse(context: grpc.ServicerContext, method: str, code: grpc.StatusCode, message: str) -> None:
    """Logs (rate-limited) and aborts the call with code and a bounded message."""
    message = bounded(message)
    REFUSALS.note(method, code, message)
    context.abort(code, message)


def status_of(name: str, exc: Exception) -> tuple[grpc.StatusCode, str, bool]:
    """The status that answers exc, and whether it is a refusal: Rejected's own; other exceptions
    one without their text (a bug, logged here with its traceback: the caller learns no internals)."""
    if isinstance(exc, Rejected):
        return exc.code, str(exc), True
    if isinstance(exc, MemoryError):
        return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{name}: the request needs more memory than this process can allocate", True)
    if isinstance(exc, OSError):  # a full disk, a lost file: the same call may succeed later
        return grpc.StatusCode.UNAVAILABLE, f"{name}: I/O error on the server: {exc.strerror or type(exc).__name__}", True
    if isinstance(exc, RecursionError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the request is nested too deeply", True
    log.exception("%s failed", name)  # a bug: it must not kill the server
    return grpc.StatusCode.INTERNAL, f"{name}: internal error ({type(exc).__name__}; the server's log has the details)", False


def handler(fn: F) -> F:
    """Turns Rejected raised by a servicer method into its gRPC status, other exceptions into one
    without their text (_status). A generator method (a streamed reply) is covered while it runs."""

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def streamed(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from fn(self, request, context)
            except Exception as exc:
                if not isinstance(exc, Rejected) and (isinstance(exc, grpc.RpcError) or context.code() is not None):
                    raise
                code, message, refusal = status_of(fn.__name__, exc)
                if refusal:
                    refuse(context, fn.__name__, code, message)
                context.abort(code, message)   # a bug's status (refuse() has raised otherwise)

        return streamed  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapped(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as exc:
            if not isinstance(exc, Rejected) and (isinstance(exc, grpc.RpcError) or context.code() is not None):
                raise
            code, message, refusal = status_of(fn.__name__, exc)
            # Raised here, in the handler's frame: raised from a helper's frame that held exc, a
            # shard's RSS floor rose about 0.6 KiB a refused call (fuzz: 9.9 MiB in 15000).
            if refusal:
                refuse(context, fn.__name__, code, message)
            context.abort(code, message)

    return wrapped  # type: ignore[return-value]


class Server:
    """A gRPC server with the standard health service, server reflection and the gRPC metrics
    interceptor, bound to host:port (0 = any free port), with this process's security
    (hetpipe.security.use): mutual TLS when it has certificates, tokens checked when it has a
    token. health_port > 0 also serves health alone there, in plaintext, for probes that cannot
    speak TLS (Kubernetes' gRPC probes)."""

    def __init__(self, host: str, port: int, *, role: str = "unknown", workers: int = 16,
                 health_port: int = 0) -> None:
        # role: the `role` label of this server's gRPC metrics (coordinator, stage_worker, ps_shard).
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options(),
                                interceptors=[ServerMetricsInterceptor(role), *security.server_interceptors()])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        credentials = security.server_credentials()
        self.port = (self.grpc.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                     else self.grpc.add_insecure_port(f"{host}:{port}"))
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{port}")
        self.address = f"{host}:{self.port}"
        self._services: list[str] = [health.SERVICE_NAME]
        self._servicers: list[object] = []   # what serves beside gRPC (a stage's link socket) ends with stop()
        self._health_only: grpc.Server | None = None
        if health_port:
            # Without SO_REUSEPORT (gRPC's default sets it), as the main port: a taken health port
            # is refused, not shared with another process that would answer the probes.
            self._health_only = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                            options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_only)
            if self._health_only.add_insecure_port(f"{host}:{health_port}") == 0:
                raise RuntimeError(f"could not bind the health port {host}:{health_port}")
        self._stopped = threading.Event()
        self._ended = threading.Event()   # stopped, its grace over: no handler runs on

    def add(self, name: str, servicer: object) -> None:
        """Serves servicer as service `name` (SERVICES), listed by server reflection."""
        add_service(self.grpc, name, servicer)
        self._services.append(SERVICES[name].full_name)
        self._servicers.append(servicer)

    def start(self) -> None:
        reflection.enable_server_reflection([*self._services, reflection.SERVICE_NAME], self.grpc)
        self.grpc.start()
        if self._health_only is not None:
            self._health_only.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 0.5) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        if self._health_only is not None:
            self._health_only.stop(0)
        self.grpc.stop(grace).wait(grace + 1)
        for servicer in self._servicers:
            close = getattr(servicer, "close", None)
            if close is not None:
                close()
        self._ended.set()

    def wait(self) -> None:
        """Returns once stop() has ended, its grace over: what the process does after, no call sees."""
        # Timed: Python runs signal handlers on the main thread, and a signal that the kernel gives
        # one of gRPC's threads never wakes an untimed wait to run them (SIGTERM went unanswered).
        while not self._ended.wait(0.2):
            pass

    def stop_on_signals(self, shutdown: Callable[[], None] | None = None, *,
                        before: Callable[[signal.Signals], None] = lambda signum: None) -> None:
        """Graceful shutdown on SIGTERM and SIGINT, through shutdown if given (it must stop us),
        after before(the signal), on a thread of its own. Once: a later signal (a launcher's
        SIGTERM right after the terminal's Ctrl-C) finds the shutdown under way, for the first."""
        first: list[signal.Signals] = []

        def stop(signum: signal.Signals) -> None:
            before(signum)
            (shutdown or self.stop)()

        def on_signal(signum: int, _frame: Any) -> None:   # on the main thread: one at a time
            log.info("signal %d: %s", signum, "shutting down" if not first else "already shutting down")
            if not first:
                first.append(signal.Signals(signum))
                threading.Thread(target=stop, args=(first[0],), daemon=True).start()

        signal.signal(signal.SIGTERM, on_signal)
        if not children.sigint_ignored():   # as its launcher does: a background job's Ctrl-C is not for it
            signal.signal(signal.SIGINT, on_signal)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})   # blocked in a fork server's children


def channel(address: str) -> grpc.Channel:
    """A channel to address with this process's security: TLS when it has certificates, and its
    token on every call."""
    credentials = security.channel_credentials()
    settings = options() + CHANNEL_OPTIONS
    raw = (grpc.secure_channel(address, credentials, options=settings) if credentials is not None
           else grpc.insecure_channel(address, options=settings))
    return grpc.intercept_channel(raw, security.BEARER) if security.has_token() else raw


# ---- services: TensorFrame streams travel as raw bytes both ways ---------------------------------

SERVICES: dict[str, ServiceDescriptor] = {
    "Stage": stage_pb2.DESCRIPTOR.services_by_name["Stage"],
    "ParameterServer": ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"],
    "Coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
}
_FRAME = wire_pb2.TensorFrame.DESCRIPTOR
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
_CALL_KINDS = {
    (False, False): "unary_unary", (True, False): "stream_unary",
    (False, True): "unary_stream", (True, True): "stream_stream",
}


def add_service(server: grpc.Server, name: str, servicer: object) -> None:
    """Registers servicer's methods for service `name` as the generated add_*_to_server would,
    except that TensorFrame streams reach the handlers as serialized bytes (wire.decode copies
    data frames straight into the tensors, no protobuf parse) and streamed TensorFrame replies
    are wire.encode's bytes, sent as they are."""
    service = SERVICES[name]
    handlers = {}
    for method in service.methods:
        raw_in = method.input_type is _FRAME   # one frame (XFrame methods) or a stream of them
        raw_out = method.server_streaming and method.output_type is _FRAME
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name, _unimplemented)
        if not raw_in:
            behaviour = _parsing(behaviour, request, method.name)
        if method.name in LANES.get(name, {}):
            behaviour = _laned(behaviour, method.name, LANES[name][method.name], method.client_streaming)
        handlers[method.name] = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)](
            behaviour,
            request_deserializer=None,
            response_serializer=None if raw_out else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


# The most bytes a request of each message type may take, checked before it is parsed: a control
# message is small, and parsing a 1 MiB name only to refuse it costs a megabyte per request.
# Job files (Submit, Assign) and key lists (Pull, GetWeights) of large models are the big ones.
REQUEST_BYTES = {
    "Empty": 1 << 10, "HeartbeatRequest": 1 << 10, "StatusRequest": 1 << 10, "EvalRequest": 1 << 10,
    "EvictRequest": 1 << 10, "JobRef": 1 << 10, "ResultsRequest": 1 << 10,
    "WorkerInfo": 16 << 10,
    "SubmitRequest": 1 << 20, "StageAssignment": 1 << 20,
    "PullRequest": MAX_MESSAGE_BYTES, "WeightsRequest": MAX_MESSAGE_BYTES,
}


def _parsing(behaviour: Callable[[Any, grpc.ServicerContext], Any], request_class: Any,
             name: str) -> Callable[[bytes, grpc.ServicerContext], Any]:
    """behaviour on the parsed request; a request that does not parse is INVALID_ARGUMENT.

    Parsing here rather than in grpc: grpc answers a request that fails to parse with INTERNAL,
    logs a traceback and keeps about 19 KiB per such request for good (measured on grpcio 1.85:
    +19 MiB per 1000 malformed Pulls, without levelling off)."""

    type_name = request_class.DESCRIPTOR.name
    limit = REQUEST_BYTES[type_name]

    def parse_then(data: bytes, context: grpc.ServicerContext) -> Any:
        if len(data) > limit:
            refuse(context, name, grpc.StatusCode.INVALID_ARGUMENT,
                   f"{name}: {type_name} request of {len(data)} bytes, at most {limit}")
        try:
            parsed = request_class.FromString(data)
        except (DecodeError, RecursionError) as exc:
            refuse(context, name, grpc.StatusCode.INVALID_ARGUMENT,
                   f"{name}: malformed {type_name}: {exc}")
        return behaviour(parsed, context)

    return parse_then


def _laned(behaviour: Callable[[Any, grpc.ServicerContext], Any], name: str, limit: int,
           client_streaming: bool) -> Callable[[Any, grpc.ServicerContext], Any]:
    """behaviour, at most `limit` calls at once; a client stream at most STREAM_CAP_S long."""
    slots = threading.BoundedSemaphore(limit)

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if not slots.acquire(blocking=False):
            refuse(context, name, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"{name}: {limit} calls already in progress on this server; retry later")
        # Released when the call ends, however it ends: a streamed reply holds its lane until sent.
        if not context.add_callback(slots.release):
            slots.release()
        remaining = context.time_remaining()
        if client_streaming and (remaining is None or remaining > STREAM_CAP_S):
            timer = threading.Timer(STREAM_CAP_S, context.cancel)
            timer.daemon = True
            timer.start()
            context.add_callback(timer.cancel)
        return behaviour(request, context)

    return call


def _unimplemented(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server does not implement the method")


class Stub:
    """A client of service `name`: one callable per method, TensorFrame streams as raw bytes.

    Requests of TensorFrame-stream methods are wire.encode's bytes; streamed TensorFrame replies
    arrive as bytes for wire.decode. Every other message is the generated protobuf class.
    """

    def __init__(self, channel: grpc.Channel, name: str) -> None:
        service = SERVICES[name]
        for method in service.methods:
            raw_in = method.input_type is _FRAME
            raw_out = method.server_streaming and method.output_type is _FRAME
            request = message_factory.GetMessageClass(method.input_type)
            response = message_factory.GetMessageClass(method.output_type)
            factory = getattr(channel, _CALL_KINDS[(method.client_streaming, method.server_streaming)])
            setattr(self, method.name, factory(
                f"/{service.full_name}/{method.name}",
                request_serializer=None if raw_in else request.SerializeToString,
                response_deserializer=None if raw_out else response.FromString,
                _registered_method=True,
            ))

    def __getattr__(self, name: str) -> Any:  # for type checkers: the methods are set in __init__
        raise AttributeError(name)


class HeldCalls(Protocol):
    """Where a link sends its bundles: a held stream (duplex.Duplex) or a peer's link socket
    (socket_duplex.SocketDuplex)."""

    def call(self, request: bytes) -> Any: ...

    def call_bundle(self, frames: Iterator[bytes]) -> Any:
        """A bundle of several frames, answered; None: it goes by a stream call of its own."""


def send_bundle(stub: Stub, method: str, frames: Iterator[bytes], duplex: HeldCalls | None = None,
                **kwargs: Any) -> Any:
    """Calls `method` with a TensorFrame stream; a bundle in one frame (in shared memory, or
    small) goes through duplex when there is one, else by the unary twin `methodFrame`: a stream
    call costs a thread to feed it and about twice a unary call's latency. frames: wire.encode's,
    which say whether the first is the only one; any other iterator is asked for a second."""
    first = next(frames)   # wire.encode yields at least the header
    single = getattr(frames, "single", None)
    if single is None:
        second = next(frames, None)
        single = second is None
        if second is not None:
            frames = itertools.chain([second], frames)
    if single:
        return duplex.call(first) if duplex is not None else getattr(stub, f"{method}Frame")(first, **kwargs)
    if duplex is not None and (answer := duplex.call_bundle(itertools.chain([first], frames))) is not None:
        return answer
    return getattr(stub, method)(itertools.chain([first], frames), **kwargs)


R = TypeVar("R")


def retrying(call: Callable[[], R], *, give_up_s: float, closing: threading.Event | None = None,
             on_retry: Callable[[grpc.RpcError], None] | None = None) -> R:
    """call() until it succeeds, retrying RETRYABLE codes with backoff for up to give_up_s.

    Raises the last grpc.RpcError when the code is not retryable, the time is up, or closing
    is set (a caller shutting down must not wait out give_up_s).
    """
    deadline = time.monotonic() + give_up_s
    delay = 0.02
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            stop = closing is not None and closing.is_set()
            if exc.code() not in RETRYABLE or time.monotonic() > deadline or stop:
                raise
            if on_retry is not None:
                on_retry(exc)
        if closing is not None:
            closing.wait(delay)  # once set, the next failure is raised at once
        else:
            time.sleep(delay)
        delay = min(2 * delay, 1.0)


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
