"""A same-host link's control channel: a stage's one-frame bundles and their answers over a Unix
socket, where gRPC would carry them on a held stream (hetpipe/duplex.py). The protocol and the
receiving stage's server are here; the sending stage's end is hetpipe/socket_duplex.py.

Through shared memory a bundle's frame is a few hundred bytes that name a slot. Over a gRPC
stream its round trip costs about 0.55 ms on two cores (the sync Python machinery's threads, each
handing the GIL on), where gloo moves a whole 1 MiB message in 0.6; over a Unix socket it costs a
few tens of µs (docs/benchmarks.md, thirty-fourth pass). gRPC still finds the socket
(`Stage.LinkSocket`, authenticated like every call) and carries every bundle where the peer
offers no socket.

The protocol, both ends ours: the client sends the nonce and one byte naming the method; the
server answers; then each request is a 4-byte length and a serialized TensorFrame, and each
answer is a status code byte, a 2-byte length and the status's details (empty when OK), in
order. A bundle of several frames (chunks in shared memory) is one request: its frames with the
length's PART bit set, each sent as it is made, then the END bit alone. The first refusal ends
the connection, as it ends a gRPC stream. The server takes only
connections from its own user (SO_PEERCRED; same-user processes are trusted with the shared
memory anyway) that present the nonce: an abstract socket's name is listed in /proc/net/unix.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

import grpc

from hetpipe import rpc
from hetpipe.errors import Rejected
from hetpipe.metrics import MethodMetrics
from hetpipe.v1 import stage_pb2

log = logging.getLogger(__name__)

METHODS = ("Forward", "Backward")
NONCE_BYTES = 16
LENGTH = struct.Struct("<I")
# Flags in a request's length word: a frame of a bundle of several, and the end of that bundle (a
# frame of its own, since a frame of 0 bytes is an empty TensorFrame).
PART, END = 1 << 31, 1 << 30
_SIZE = END - 1
_ANSWER = struct.Struct("<BH")
_CREDENTIALS = struct.Struct("iII")   # pid, uid, gid (uid_t and gid_t are unsigned)
# A request's bound: a one-frame bundle is at most one frame of wire.encode's.
MAX_REQUEST_BYTES = rpc.MAX_MESSAGE_BYTES
# Connections at once per method, as the gRPC lanes of ForwardLink and BackwardLink.
LANES = 3
# Connections not yet past their greeting: more are closed unanswered, so a flood of connections
# costs a thread each only this many at a time.
GREETING = 8
# A greeted connection that sends nothing (or reads no answer) this long is ended, as gRPC cancels
# a stream after rpc.STREAM_CAP_S: a frozen peer must not hold a lane for good. The sender sends
# what it had outstanding again, which is safe: a request that was not read was not taken.
IDLE_S = rpc.STREAM_CAP_S
# A request, every frame of it, arrives within this once its first word has: a gRPC call carrying
# a bundle has the same deadline. A peer cannot hold a lane by sending a bundle a byte at a time.
REQUEST_S = rpc.DATA_DEADLINE_S


class SocketError(grpc.RpcError):
    """A failure on a link socket, as the gRPC status a held stream would have ended with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _answer(code: grpc.StatusCode, details: str = "") -> bytes:
    text = rpc.bounded(details).encode()[:0xFFFF]
    return _ANSWER.pack(code.value[0], len(text)) + text


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None, name: str = "",
                what: str = "the request's frames", within_s: float | None = None) -> bytearray | None:
    """n bytes, or None where the peer closed first. With a deadline (time.monotonic, within_s
    after the read began: REQUEST_S unless told), name's `what`: DEADLINE_EXCEEDED past it; else
    TimeoutError past the socket's timeout for any one read."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                limit = REQUEST_S if within_s is None else within_s
                raise Rejected(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: {what} did not arrive within {limit:g} s")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            if deadline is None:
                raise
            continue   # the deadline passed: refused above
        if k == 0:
            return None
        got += k
    return buf


def send(sock: socket.socket, head: bytes, body: bytes) -> None:
    """head then body, in one call where the socket takes them whole (a request in shared memory is
    a few hundred bytes), else the rest after it."""
    sent = sock.sendmsg([head, body])
    if sent < len(head) + len(body):
        sock.sendall((head + body)[sent:])


def peer_uid(sock: socket.socket) -> int:
    _, uid, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return int(uid)


def read_answer(sock: socket.socket) -> None:
    """Returns on OK; raises SocketError with the answer's status otherwise, or UNAVAILABLE where the
    peer closed first."""
    head = _read_exact(sock, _ANSWER.size)
    if head is None:
        raise SocketError(grpc.StatusCode.UNAVAILABLE, "the peer closed its link socket without answering")
    code, size = _ANSWER.unpack(head)
    details = _read_exact(sock, size) if size else bytearray()
    if details is None:
        raise SocketError(grpc.StatusCode.UNAVAILABLE, "the peer closed its link socket without answering")
    if code != 0:
        raise SocketError(_CODES.get(code, grpc.StatusCode.UNKNOWN), details.decode(errors="replace"))


class Server:
    """Serves a stage's link socket: offer(method, frames) takes each bundle, as the ForwardLink and
    BackwardLink handlers do, and a Rejected it raises is the answer's status.

    Its gRPC metrics are those of the streams it stands in for: a connection counts as a
    ForwardLink or BackwardLink stream (a message received per bundle; handled once, when it ends,
    with OK or the refusal that ended it), and a connection refused at its greeting as a LinkSocket
    call refused."""

    def __init__(self, offer: Callable[[str, Iterable[bytes]], None], role: str = "stage_worker") -> None:
        self._offer = offer
        service = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name
        self._metrics = {name: MethodMetrics(role, service, name)
                         for name in (*(f"{method}Link" for method in METHODS), "LinkSocket")}
        self.name = f"hetpipe-{os.getpid()}-{secrets.token_hex(8)}"
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._lock = threading.Lock()
        self._open = {method: 0 for method in METHODS}
        self._connections: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)   # abstract: gone with the process, however it ends
        self._listener.listen(16)
        self._greeting = threading.BoundedSemaphore(GREETING)
        self._closed = False
        threading.Thread(target=self._accept, name="link-socket", daemon=True).start()

    def address(self) -> stage_pb2.LinkSocketAddress:
        return stage_pb2.LinkSocketAddress(name=self.name, nonce=self.nonce)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # Out of file descriptors, a connection aborted before it was taken: the listener
                # still queues peers, so it must go on taking them.
                log.warning("link socket %s: accept failed (%s); going on", self.name, exc)
                time.sleep(0.05)
                continue
            if not self._greeting.acquire(blocking=False):
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, time.perf_counter()), name="link-socket-peer",
                                 daemon=True).start()
            except RuntimeError as exc:   # no thread to be had
                log.warning("link socket %s: no thread for a connection (%s)", self.name, exc)
                self._greeting.release()
                sock.close()

    def _serve(self, sock: socket.socket, started: float) -> None:
        """One connection, taken at started (time.perf_counter), to its end."""
        method = None
        code = grpc.StatusCode.CANCELLED   # the connection broke, as a stream whose client went away
        try:
            with sock:
                sock.settimeout(rpc.CONTROL_DEADLINE_S)   # for the greeting: a peer that connects and says nothing
                try:
                    method = self._greet(sock)   # counted in its lane from here on
                except Rejected as exc:   # counted as a LinkSocket call refused, timed from the accept
                    self._metrics["LinkSocket"].record(exc.code, started)
                    self._refuse(sock, exc.code, str(exc))
                    return
                finally:
                    self._greeting.release()
                if method is None:
                    return
                sock.sendall(_answer(grpc.StatusCode.OK))
                sock.settimeout(IDLE_S)
                code = self._serve_requests(sock, method)
        except TimeoutError as exc:
            code = grpc.StatusCode.DEADLINE_EXCEEDED   # idle past IDLE_S, as a held stream past its cap
            log.debug("link socket connection ended: %s", exc)
        except OSError as exc:
            log.debug("link socket connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(sock)
                if method is not None:
                    self._open[method] -= 1
            if method is not None:
                self._metrics[f"{method}Link"].record(code, started)

    def _greet(self, sock: socket.socket) -> str | None:
        """The method this connection carries, once its peer passed the checks, counted in its lane;
        None: the peer closed first. Rejected: refused."""
        if (uid := peer_uid(sock)) != os.getuid():
            raise Rejected(grpc.StatusCode.PERMISSION_DENIED, f"LinkSocket: a process of user {uid} may not connect")
        # Whole within the control deadline: a peer that sends it a byte at a time must not hold a
        # greeting's place (GREETING of them) for longer, or a link could not get back in.
        greeting = _read_exact(sock, NONCE_BYTES + 1, time.monotonic() + rpc.CONTROL_DEADLINE_S, "LinkSocket",
                               "the greeting", rpc.CONTROL_DEADLINE_S)
        if greeting is None:
            return None
        if not hmac.compare_digest(bytes(greeting[:NONCE_BYTES]), self.nonce):
            raise Rejected(grpc.StatusCode.PERMISSION_DENIED, "LinkSocket: wrong nonce")
        if greeting[NONCE_BYTES] >= len(METHODS):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"LinkSocket: no method {greeting[NONCE_BYTES]} (0 Forward, 1 Backward)")
        method = METHODS[greeting[NONCE_BYTES]]
        with self._lock:
            full = self._closed or self._open[method] >= LANES
            if not full:
                self._open[method] += 1
                self._connections.add(sock)
        if full:
            raise Rejected(grpc.StatusCode.UNAVAILABLE if self._closed else grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "LinkSocket: the stage is stopping" if self._closed
                           else f"LinkSocket: {LANES} {method} connections are open already")
        return method

    @staticmethod
    def _refuse(sock: socket.socket, code: grpc.StatusCode, message: str, name: str = "LinkSocket") -> None:
        """Answers with a refusal, logged."""
        rpc.REFUSALS.note(name, code, message)
        sock.sendall(_answer(code, message))

    def _serve_requests(self, sock: socket.socket, method: str) -> grpc.StatusCode:
        """Answers requests until the peer closes (OK), one is refused (its code), or the peer goes
        away inside a request or the server closes (CANCELLED, as a stream cut off)."""
        name = f"{method}Link"
        received = self._metrics[name].received
        while (head := _read_exact(sock, LENGTH.size)) is not None:
            received.inc()
            (word,) = LENGTH.unpack(head)
            deadline = time.monotonic() + REQUEST_S
            try:
                size, kind = _checked_length(name, word)
                if kind == END:
                    raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the end of a bundle that was not begun")
                frame = _read_exact(sock, size, deadline, name)
                if frame is None:   # the peer went away inside a request
                    return grpc.StatusCode.CANCELLED
                frames = _Parts(sock, name, bytes(frame), deadline) if kind == PART else [bytes(frame)]
                self._offer(method, frames)
                if isinstance(frames, _Parts) and not frames.ended:   # the socket must be at a request's start again
                    raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: frames past the bundle's end")
            except _PeerGone:
                return grpc.StatusCode.CANCELLED
            except Exception as exc:   # noqa: BLE001 - answered as rpc.handler answers a gRPC call
                code, message, _ = rpc.status_of(name, exc)   # a bug's is logged there
                sock.settimeout(IDLE_S)
                self._refuse(sock, code, message, name)
                return code
            sock.settimeout(IDLE_S)
            sock.sendall(_answer(grpc.StatusCode.OK))
        return grpc.StatusCode.CANCELLED if self._closed else grpc.StatusCode.OK


def _checked_length(name: str, word: int) -> tuple[int, int]:
    """(size, PART, END or 0) of a length word."""
    size, kind = word & _SIZE, word & ~_SIZE
    if size > MAX_REQUEST_BYTES:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{name}: a frame of {size} bytes passes the bound of {MAX_REQUEST_BYTES}")
    if kind == PART | END or (kind == END and size):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: a length word {word:#x} that means nothing")
    return size, kind


class _PeerGone(Exception):
    """The peer closed its link socket inside a bundle: nobody is left to answer."""


class _Parts:
    """The frames of a bundle of several, read from the socket as decode asks for them (the
    sender writes the next chunk meanwhile)."""

    def __init__(self, sock: socket.socket, name: str, first: bytes, deadline: float) -> None:
        self._sock, self._name, self._deadline = sock, name, deadline
        self._next: bytes | None = first
        self.ended = False

    def __iter__(self) -> _Parts:
        return self

    def __next__(self) -> bytes:
        if self._next is not None:
            frame, self._next = self._next, None
            return frame
        if self.ended:
            raise StopIteration
        head = _read_exact(self._sock, LENGTH.size, self._deadline, self._name)
        if head is None:
            raise _PeerGone
        size, kind = _checked_length(self._name, LENGTH.unpack(head)[0])
        if kind == END:
            self.ended = True
            raise StopIteration
        if kind != PART:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{self._name}: a request inside a bundle's frames")
        body = _read_exact(self._sock, size, self._deadline, self._name)
        if body is None:
            raise _PeerGone
        return bytes(body)
