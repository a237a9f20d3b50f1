"""A link's calls over the peer's link socket (hetpipe/link_socket.py): what a sending stage uses
in place of its held gRPC stream (hetpipe/duplex.py) where the peer shares its host."""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from hetpipe import rpc
from hetpipe.link_socket import END, LENGTH, METHODS, PART, SocketError, peer_uid, read_answer, send
from hetpipe.v1 import wire_pb2

log = logging.getLogger(__name__)

# A connect that may work if tried again: the listener's queue is full.
_TRANSIENT = {errno.EAGAIN}


@dataclass(eq=False)
class Connection:
    """One connection to a peer's link socket."""

    sock: socket.socket | None
    broken: SocketError | None = None   # no request goes out on it any more: it failed, or never opened
    dead: bool = False                  # dropped: its answers are read no more


@dataclass(eq=False, frozen=True)
class Sent:
    """What put() returns for take(): the connection a request went out on, or why it did not."""

    connection: Connection
    error: SocketError | None = None


class SocketDuplex:
    """Duplex's calls (put, take, call, due, close) over a peer's link socket: the Link's held
    stream, at a Unix socket's cost. locate() asks the peer for its socket over gRPC; a peer that
    offers none (UNIMPLEMENTED: an older stage, a test's stand-in) is called through fallback, the
    gRPC Duplex, from then on. One caller at a time; close() from any thread, once: a put() after
    it is CANCELLED."""

    def __init__(self, locate: Callable[[], Any], method: str, deadline_s: float, fallback: Any = None,
                 on_fallback: Callable[[], None] = lambda: None) -> None:
        self._locate = locate
        self._on_fallback = on_fallback   # told once, on the caller's thread, when the fallback takes over
        self._method = METHODS.index(method)
        self._deadline_s = deadline_s
        self._fallback = fallback
        self._use_fallback = False
        self._lock = threading.Lock()
        self._open: Connection | None = None
        self._closed = False
        self.answered = 0   # requests answered OK over the socket

    def call(self, request: bytes) -> Any:
        return self.take(self.put(request))

    @property
    def due(self) -> bool:
        return self._use_fallback and self._fallback.due

    @property
    def connected(self) -> bool:
        """Whether a put() goes out without connecting first (a locate over gRPC, a connect)."""
        return self._use_fallback or self._open is not None

    def put(self, request: bytes) -> Any:
        """Sends request; returns what take() needs to read its answer. A failure is take()'s to
        raise, as a gRPC stream's would be."""
        current = self._connection()
        if current is None:
            return self._fallback.put(request)
        return self._send_on(current, len(request), request)

    def open(self) -> None:
        """Connects now where no connection is open, as put() would: the caller learns before it
        encodes a bundle whether the peer takes it here or the fallback does (on_fallback)."""
        self._connection()

    def call_bundle(self, frames: Iterator[bytes]) -> Any:
        """A bundle of several frames as one request, each frame sent as it is made (the chunk its
        handle names is written then), and its answer; with nothing else outstanding. None: the
        peer takes none here (the fallback), so it goes by a gRPC call of its own."""
        current = self._connection()
        if current is None:
            return None
        for frame in frames:
            sent = self._send_on(current, PART | len(frame), frame)
            if sent.error is not None:
                break
        else:
            sent = self._send_on(current, END, b"")
        if sent.error is not None and current.sock is not None and not current.dead:
            # The peer may have refused the bundle from its first frame and closed: its answer
            # says why, where the broken pipe would not.
            if isinstance(sent.error.__cause__, (BrokenPipeError, ConnectionResetError)):
                sent = Sent(current)
        return self.take(sent)

    def _connection(self) -> Connection | None:
        """The open connection, made if there is none (it may be broken: a put on it fails);
        None: the peer takes nothing here, the fallback does."""
        if self._use_fallback:
            return None
        current = self._open
        if current is None:
            if self._closed:   # no locate, connect and greeting for a link that is going
                return Connection(None, SocketError(grpc.StatusCode.CANCELLED, "link socket: the link is closing"))
            fresh = self._connect()   # outside the lock: close() must not wait for a locate and a connect
            if self._use_fallback:   # found out just now
                return None
            with self._lock:
                if not self._closed:
                    self._open = current = fresh
            if current is None:
                self._end(fresh)
                return Connection(None, SocketError(grpc.StatusCode.CANCELLED, "link socket: the link is closing"))
        return current

    @staticmethod
    def _send_on(current: Connection, word: int, body: bytes) -> Sent:
        if current.broken is not None:
            return Sent(current, current.broken)
        try:
            send(current.sock, LENGTH.pack(word), body)   # type: ignore[arg-type]
        except OSError as exc:
            # Part of it may have gone: nothing more goes out on this connection. The answers to
            # the requests before it can still be read.
            current.broken = SocketError(grpc.StatusCode.UNAVAILABLE, f"link socket: {exc}")
            current.broken.__cause__ = exc
            return Sent(current, current.broken)
        return Sent(current)

    def take(self, sent: Any) -> Any:
        """The answer to the oldest request put and not yet taken (wire_pb2.Ack), or its refusal
        raised as a SocketError. After an error the connection is dropped: the caller sends what
        was outstanding on it again."""
        if not isinstance(sent, Sent):
            return self._fallback.take(sent)
        current = sent.connection
        try:
            if sent.error is not None:
                raise sent.error
            if current.dead:
                raise SocketError(grpc.StatusCode.UNAVAILABLE, "link socket: the connection was dropped")
            try:
                read_answer(current.sock)   # type: ignore[arg-type]
            except TimeoutError:
                raise SocketError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"link socket: no answer within {self._deadline_s:.0f} s") from None
            except OSError as exc:
                raise SocketError(grpc.StatusCode.UNAVAILABLE, f"link socket: {exc}") from None
        except SocketError:
            self._drop(current)
            raise
        self.answered += 1
        return wire_pb2.Ack()

    def close(self, grace_s: float = 1.0) -> None:
        with self._lock:
            current, self._open, self._closed = self._open, None, True
        if current is not None:
            self._end(current)
        if self._fallback is not None:
            self._fallback.close(grace_s)

    def _connect(self) -> Connection:
        try:
            address = self._locate()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self._fallback is not None:
                log.info("the peer offers no link socket; its bundles go over a gRPC stream")
                self._fall_back()
                return Connection(None)
            return Connection(None, SocketError(exc.code(), f"LinkSocket: {exc.details()}"))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(rpc.CONTROL_DEADLINE_S)
        try:
            sock.connect("\0" + address.name)
        except OSError as exc:
            sock.close()
            if exc.errno in _TRANSIENT or self._fallback is None:
                return Connection(None, SocketError(grpc.StatusCode.UNAVAILABLE, f"link socket {address.name}: {exc}"))
            # The peer answered over gRPC just now, so its socket is out of reach from here (a
            # sandbox's rules, say), not gone: the held stream does the same job, only slower.
            log.warning("cannot reach the peer's link socket %s (%s); its bundles go over a gRPC stream",
                        address.name, exc)
            self._fall_back()
            return Connection(None)
        try:
            # The name can be taken by anyone once its owner is gone: only our own user's answer counts.
            if (uid := peer_uid(sock)) != os.getuid():
                raise SocketError(grpc.StatusCode.UNAVAILABLE,
                                  f"link socket {address.name} is served by user {uid}, not by this one")
            sock.sendall(bytes(address.nonce) + bytes([self._method]))
            read_answer(sock)
            sock.settimeout(self._deadline_s)
        except SocketError as exc:
            sock.close()
            return Connection(None, exc)
        except OSError as exc:
            sock.close()
            return Connection(None, SocketError(grpc.StatusCode.UNAVAILABLE, f"link socket {address.name}: {exc}"))
        return Connection(sock)

    def _fall_back(self) -> None:
        self._use_fallback = True
        self._on_fallback()

    def _drop(self, current: Connection) -> None:
        with self._lock:
            if self._open is current:
                self._open = None
        self._end(current)

    @staticmethod
    def _end(current: Connection) -> None:
        current.dead = True
        if current.sock is not None:
            try:
                current.sock.shutdown(socket.SHUT_RDWR)   # wakes a take() blocked in recv; close() alone would not
            except OSError:
                pass
            current.sock.close()
