"""Duplex: unary calls over one long-lived stream, against a real gRPC server.

A stage's Link sends its one-frame bundles this way (ForwardLink/BackwardLink); these tests pin
what it promises: one stream for many calls, answers in order, a refusal's exact status with the
stream reopened after it, renewal before the deadline, a deadline on every wait, and no thread
left behind by close().
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from hetpipe import duplex as duplex_module
from hetpipe import rpc
from hetpipe.duplex import Duplex
from hetpipe.errors import Rejected
from hetpipe.v1 import wire_pb2

pytestmark = pytest.mark.timeout(60)


class Echo:
    """ForwardLink answers each request with its own bytes, refuses b"bad", and holds b"hold"
    unanswered until the test releases it (never by itself: a client that waited for it would hang)."""

    def __init__(self) -> None:
        self.opened = 0
        self.ended: list[str] = []
        self.release = threading.Event()
        self.holding = threading.Event()   # a b"hold" has come
        self.contexts: list[grpc.ServicerContext] = []

    @rpc.handler
    def ForwardLink(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[wire_pb2.Ack]:
        self.opened += 1
        self.contexts.append(context)
        try:
            for frame in frames:
                if frame == b"bad":
                    raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "ForwardLink: frame 'bad' refused")
                if frame == b"hold":
                    self.holding.set()
                    self.release.wait()   # the fixture releases it at the latest
                    continue
                yield wire_pb2.Ack(message=frame.decode())
        finally:
            self.ended.append("closed by the client" if context.is_active() else "cancelled")


@pytest.fixture
def echo() -> Iterator[tuple[Echo, rpc.Stub]]:
    servicer = Echo()
    server = rpc.Server("127.0.0.1", 0, workers=4)
    server.add("Stage", servicer)
    server.start()
    channel = rpc.channel(server.address)
    try:
        yield servicer, rpc.Stub(channel, "Stage")
    finally:
        servicer.release.set()
        channel.close()
        server.stop()


def test_many_calls_share_one_stream_and_are_answered_in_order(echo: tuple[Echo, rpc.Stub]) -> None:
    servicer, stub = echo
    duplex = Duplex(stub.ForwardLink, deadline_s=30)
    answers = [duplex.call(f"m{i}".encode()).message for i in range(50)]
    assert answers == [f"m{i}" for i in range(50)]
    assert servicer.opened == 1
    duplex.close()
    assert servicer.ended == ["closed by the client"]   # ended in good order, not cancelled


def test_a_refusal_has_its_status_and_the_next_call_opens_a_new_stream(echo: tuple[Echo, rpc.Stub]) -> None:
    servicer, stub = echo
    duplex = Duplex(stub.ForwardLink, deadline_s=30)
    assert duplex.call(b"a").message == "a"
    with pytest.raises(grpc.RpcError) as info:
        duplex.call(b"bad")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "ForwardLink: frame 'bad' refused"
    assert duplex.call(b"b").message == "b"
    assert servicer.opened == 2
    duplex.close()


class _StillClock:
    """hetpipe.duplex's clock, still until the test moves it: a stream's age is what the test says,
    not what a loaded machine makes of the time between two calls."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_stream_is_renewed_past_half_its_deadline(echo: tuple[Echo, rpc.Stub],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    servicer, stub = echo
    clock = _StillClock()
    monkeypatch.setattr(duplex_module, "time", clock)
    duplex = Duplex(stub.ForwardLink, deadline_s=60.0)   # gRPC's own deadline, on the real clock, never near
    duplex.call(b"a")
    clock.now += 30.0   # half its deadline, not past it: the same stream
    duplex.call(b"b")
    assert servicer.opened == 1
    clock.now += 0.5
    duplex.call(b"c")   # the first stream has under half its deadline left: a fresh one
    assert servicer.opened == 2
    duplex.close()
    assert servicer.ended == ["closed by the client"] * 2   # the renewed one too: not cancelled


def test_an_unanswered_call_ends_at_the_deadline_and_the_next_one_goes_through(echo: tuple[Echo, rpc.Stub]) -> None:
    """The server holds the call until released, after the call has ended: only the stream's
    gRPC deadline, deadline_s, can end it (a wait without one hangs to the test's timeout)."""
    servicer, stub = echo
    deadlines: list[float] = []

    def forward_link(requests: Iterator[bytes], timeout: float) -> Any:
        deadlines.append(timeout)
        return stub.ForwardLink(requests, timeout=timeout)

    duplex = Duplex(forward_link, deadline_s=1.0)
    with pytest.raises(grpc.RpcError) as info:
        duplex.call(b"hold")
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert deadlines == [1.0], "the stream carries deadline_s as its deadline"
    assert info.value.code() in rpc.RETRYABLE
    servicer.release.set()
    assert duplex.call(b"after").message == "after"
    duplex.close()


def test_close_leaves_no_thread_behind(echo: tuple[Echo, rpc.Stub]) -> None:
    _, stub = echo
    warm = Duplex(stub.ForwardLink, deadline_s=30)
    warm.call(b"x")   # the server's first handler thread, which its pool keeps
    warm.close()
    before = threading.active_count()
    for _ in range(5):
        duplex = Duplex(stub.ForwardLink, deadline_s=30)
        duplex.call(b"x")
        duplex.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


def test_close_cancels_a_stream_the_server_does_not_end(echo: tuple[Echo, rpc.Stub]) -> None:
    """A peer that holds its side open does not hold up close() for more than its grace. The
    stream's deadline is an hour, so that only the cancel can end the held call."""
    servicer, stub = echo
    duplex = Duplex(stub.ForwardLink, deadline_s=3600)
    duplex.call(b"a")
    caller = threading.Thread(target=lambda: pytest.raises(grpc.RpcError, duplex.call, b"hold"), daemon=True)
    caller.start()
    assert servicer.holding.wait(30), "the held request never came"
    # The server holds it until released, which comes only after: a close() that waited for the
    # server to end the stream, or a call not ended by the cancel, would hang to the test's timeout.
    duplex.close(grace_s=0.3)
    caller.join(30)   # a hang's guard, as are the deadlines below: not speed bounds
    assert not caller.is_alive(), "the call on the cancelled stream did not end"
    # The cancellation reaches the server's side of the stream on gRPC's own threads: on a busy
    # machine that can come after close() returns. Released before it, the handler would see the
    # client's half-close first and end as if closed in good order.
    deadline = time.monotonic() + 30
    while servicer.contexts[-1].is_active() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not servicer.contexts[-1].is_active(), "close() did not cancel a stream the server held open"
    servicer.release.set()
    deadline = time.monotonic() + 30
    while not servicer.ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servicer.ended == ["cancelled"]
