"""stage_worker/links.py: ordered delivery to a neighbour stage, retries while it is away, a prompt
failure naming the peer and the minibatch when it stays away, and an emulated link's hold."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest
import torch

from hetpipe import link_socket, rpc, shm, wire
from hetpipe.errors import Rejected
from hetpipe.rpc import handler
from hetpipe.v1 import wire_pb2
from stage_worker.links import CHUNK_BYTES, Link, Outgoing, handle_refused

pytestmark = pytest.mark.timeout(60)


class Neighbour:
    """A Stage service that records Forward calls; it can refuse the next ones with a code."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.tensors: list[list[tuple[str, torch.Tensor]]] = []
        self.frames: list[int] = []
        self.reader = shm.Reader()
        self.refuse: list[grpc.StatusCode] = []
        self.cv = threading.Condition()

    @handler
    def Forward(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> wire_pb2.Ack:
        return self._take(request_iterator)

    def _take(self, request_iterator: Iterable[bytes]) -> wire_pb2.Ack:
        frames = list(request_iterator)
        bundle = wire.decode(frames, reader=self.reader)
        with self.cv:
            if self.refuse:
                raise Rejected(self.refuse.pop(0), "not now")
            self.got.append(int(bundle.header.minibatch.minibatch))
            self.tensors.append(bundle.tensors)
            self.frames.append(len(frames))
            self.cv.notify_all()
        return wire_pb2.Ack()

    @handler
    def ForwardLink(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[wire_pb2.Ack]:
        for frame in frames:
            yield self.Forward(iter([frame]), context)

    def wait_for(self, n: int, timeout: float = 10) -> list[int]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.got) >= n, timeout), self.got
            return list(self.got)


class SocketNeighbour(Neighbour):
    """The same, offering a link socket (hetpipe/link_socket.py) as a stage does."""

    def __init__(self) -> None:
        super().__init__()
        self.server: link_socket.Server | None = None

    @handler
    def LinkSocket(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self.server is None:
            self.server = link_socket.Server(lambda method, frames: self._take(frames))
        return self.server.address()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Holding(SocketNeighbour):
    """Takes each bundle, and answers it only once released."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def _take(self, request_iterator: Iterable[bytes]) -> wire_pb2.Ack:
        ack = super()._take(request_iterator)
        self.released.wait(30)
        return ack


def _ours() -> set[str]:
    return {name for name in shm.segments() if name.startswith(f"{shm.PREFIX}{os.getpid()}-")}


def _serve(neighbour: Neighbour, port: int = 0) -> rpc.Server:
    server = rpc.Server("127.0.0.1", port, workers=4)
    server.add("Stage", neighbour)
    server.start()
    return server


def _message(p: int) -> Outgoing:
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=p, stage=0)
    return Outgoing(tag, [("activation", torch.full((4,), float(p))), ("target", torch.tensor([p]))])


def test_sends_arrive_in_order_and_are_counted() -> None:
    neighbour = Neighbour()
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append)
    try:
        for p in range(1, 21):
            link.send(_message(p))
        assert neighbour.wait_for(20) == list(range(1, 21))
        deadline = time.monotonic() + 5  # counted once the call returns, just after the receiver has it
        while link.bytes_sent < 20 * (4 * 4 + 8) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.bytes_sent == 20 * (4 * 4 + 8) and not failures
    finally:
        link.close()
        server.stop(grace=0)


class LateAnswers(Neighbour):
    """Answers a bundle on the held stream only once the next one has come (the last, `last`, at
    once): a sender that waits for each answer before it sends the next never gets one. After a
    refusal it answers each at once, as the resends go one at a time."""

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last
        self.refuse_at: dict[int, grpc.StatusCode] = {}   # p -> refused once, the first time it comes

    @handler
    def ForwardLink(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[wire_pb2.Ack]:
        waiting = 0
        for frame in frames:
            p = int(wire.decode([frame], reader=self.reader).header.minibatch.minibatch)
            if waiting:
                yield wire_pb2.Ack()
                waiting -= 1
            if p in self.refuse_at:
                self.last = 0
                raise Rejected(self.refuse_at.pop(p), f"minibatch {p}: not now")
            with self.cv:
                self.got.append(p)
                self.cv.notify_all()
            if p == self.last or not self.last:
                yield from [wire_pb2.Ack()] * (waiting + 1)
                waiting = 0
            else:
                waiting += 1


class Gate:
    """An Outgoing's `ready` that holds the link's thread until opened: the bundles after it are
    queued by then, a burst."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        assert self.open.wait(10)


def _burst(link: Link, ps: list[int]) -> None:
    gate = Gate()
    link.send(Outgoing(_message(ps[0]).tag, _message(ps[0]).tensors, ready=gate))
    for p in ps[1:]:
        link.send(_message(p))
    assert link.backlog == len(ps)   # the first, held by its gate, as much as those queued behind it
    gate.open.set()


@pytest.mark.parametrize("shared_memory", [False, True], ids=["frames", "shm"])
def test_a_burst_has_the_next_bundle_on_its_way_before_the_last_is_answered(shared_memory: bool) -> None:
    neighbour = LateAnswers(last=5)
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=shared_memory)
    try:
        _burst(link, [1, 2, 3, 4, 5])
        assert link.flush(10), "not every bundle was answered"
        assert neighbour.got == [1, 2, 3, 4, 5] and not failures
        assert link.backlog == 0 and link.bytes_sent == 5 * (4 * 4 + 8)
    finally:
        link.close()
        server.stop(grace=0)


def test_a_quiet_link_puts_a_bundle_out_on_the_senders_thread_and_a_busy_one_queues_it_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-frame bundle to a connected link with nothing queued or unanswered goes out on the
    caller's thread, without a hand-off to the link's; those sent while one is unanswered go by the
    link's thread, in order after it. The first connects, on the link's thread: a connect (a locate
    over gRPC, up to its deadline) never holds the caller."""
    encoded_on: list[threading.Thread] = []
    encode = wire.encode

    def recording(*args: Any, **kwargs: Any) -> wire.Frames:
        encoded_on.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(wire, "encode", recording)
    neighbour = Holding()   # answers only once released: 1 stays unanswered
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    me = threading.current_thread()
    try:
        link.send(_message(0))   # connects
        neighbour.wait_for(1)
        assert encoded_on[0] is not me
        neighbour.released.set()
        assert link.flush(10)
        neighbour.released.clear()
        link.send(_message(1))
        assert encoded_on[1] is me
        neighbour.wait_for(2)
        link.send(_message(2))
        link.send(_message(3))
        neighbour.released.set()
        assert link.flush(10), "not every bundle was answered"
        assert neighbour.got == [0, 1, 2, 3] and not failures
        assert len(encoded_on) == 4 and me not in encoded_on[2:]
        link.send(_message(4))   # quiet again
        assert encoded_on[-1] is me
        assert link.flush(10) and neighbour.got == [0, 1, 2, 3, 4] and link.backlog == 0
        assert link.bytes_sent == 5 * (4 * 4 + 8) and link.socket_bundles == 5
    finally:
        link.close()
        neighbour.close()
        server.stop(grace=0)


@pytest.mark.parametrize("refusal", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS])
def test_a_failure_with_bundles_in_flight_sends_them_again_in_order(refusal: grpc.StatusCode) -> None:
    """Bundle 2 is refused while 3 is on its way behind it on the same stream, which the refusal
    ends: both go again, in order (2 again only if the refusal was no answer for good)."""
    neighbour = LateAnswers(last=4)
    neighbour.refuse_at = {2: refusal}
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append)
    try:
        _burst(link, [1, 2, 3, 4])
        assert link.flush(10), "not every bundle was answered"
        want = [1, 2, 3, 4] if refusal == grpc.StatusCode.UNAVAILABLE else [1, 3, 4]
        assert neighbour.got == want and not failures
        assert link.bytes_sent == 4 * (4 * 4 + 8), "each counted once"
    finally:
        link.close()
        server.stop(grace=0)


def test_a_large_bundle_behind_one_resent_again_and_again_still_arrives_whole() -> None:
    """A bundle in chunks waits for the bundle in flight before it, whose first chunk is written
    already (to learn that it takes several frames). The bundle before it, refused three times,
    takes the ring's next slots with its resends and comes round to that one: the large bundle is
    then encoded again, not sent with a handle to a chunk written over."""
    neighbour = Neighbour()
    neighbour.refuse = [grpc.StatusCode.UNAVAILABLE] * 3   # minibatch 1 on the stream, then twice resent
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    try:
        gate = Gate()
        link.send(Outgoing(_message(1).tag, _message(1).tensors, ready=gate))
        n = (2 * CHUNK_BYTES + CHUNK_BYTES // 2) // 4   # three chunks
        big = torch.arange(n, dtype=torch.float32)
        link.send(Outgoing(wire_pb2.MinibatchTag(vw=0, minibatch=2, stage=0), [("activation", big)]))
        gate.open.set()
        assert link.flush(20) and not failures, failures
        assert neighbour.got == [1, 2] and torch.equal(neighbour.tensors[1][0][1], big)
    finally:
        link.close()
        server.stop(grace=0)


def test_a_failure_while_an_earlier_bundle_is_resent_names_that_bundle(monkeypatch: pytest.MonkeyPatch) -> None:
    neighbour = Neighbour()
    neighbour.refuse = [grpc.StatusCode.UNAVAILABLE]   # minibatch 1 refused on the stream: resent
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append)
    encode, encoded = Outgoing.encode, []

    def failing_resend(item: Outgoing, ring: Any, gpu: Any = None) -> Any:
        encoded.append(item.tag.minibatch)
        if encoded.count(1) == 2:   # the resend of minibatch 1: a device error, say
            raise RuntimeError("device error")
        return encode(item, ring, gpu)

    monkeypatch.setattr(Outgoing, "encode", failing_resend)
    try:
        _burst(link, [1, 2])
        assert not link.flush(10)
        assert failures and "could not send the activation of minibatch 1 " in failures[0], failures
    finally:
        link.close()
        server.stop(grace=0)


def test_a_send_whose_preparation_failed_is_not_waited_for() -> None:
    neighbour = Neighbour()
    server = _serve(neighbour)
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=lambda m: None)
    try:
        link.send(_message(1))
        with pytest.raises(AttributeError):
            link.send(Outgoing(_message(2).tag, [("activation", None)]))   # type: ignore[list-item]
        assert link.flush(10) and neighbour.got == [1]
    finally:
        link.close()
        server.stop(grace=0)


@pytest.mark.parametrize("kind", [Neighbour, SocketNeighbour])
def test_large_bundles_go_through_shared_memory_in_chunks_and_arrive_whole(kind: type[Neighbour]) -> None:
    """A bundle over links.CHUNK_BYTES travels a chunk a frame, on the peer's link socket or a
    stream call (the receiver copies one out while the next is written): every byte arrives, in
    order."""
    neighbour = kind()
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    n = (2 * CHUNK_BYTES + CHUNK_BYTES // 2) // 4 + 3   # two chunks and a part, split mid-tensor
    sent = []
    try:
        for p in range(1, 4):
            tag = wire_pb2.MinibatchTag(vw=0, minibatch=p, stage=0)
            sent.append([("activation", torch.arange(n, dtype=torch.float32) * p), ("target", torch.tensor([p]))])
            link.send(Outgoing(tag, sent[-1]))
        assert neighbour.wait_for(3) == [1, 2, 3] and not failures
        # A handle a chunk; a peer without a socket (found out before the first bundle is
        # written) gets them whole, one frame on the held stream.
        assert neighbour.frames == ([3, 3, 3] if kind is SocketNeighbour else [1, 1, 1]), neighbour.frames
        for got, want in zip(neighbour.tensors, sent):
            assert [k for k, _ in got] == [k for k, _ in want]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
        assert link.ring is not None and link.ring.bytes_written == sum(4 * n + 8 for _ in sent)
        assert link.flush(10) and link.socket_bundles == (3 if kind is SocketNeighbour else 0)   # answers taken
    finally:
        link.close()
        server.stop(grace=0)


def test_a_link_goes_on_after_its_peer_ends_an_idle_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer ends a link socket idle for link_socket.IDLE_S (as gRPC ends a stream): the next
    bundle finds it closed, and goes over a new connection, delivered once, with no failure."""
    monkeypatch.setattr(link_socket, "IDLE_S", 0.3)
    neighbour = SocketNeighbour()
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    try:
        link.send(_message(1))
        assert neighbour.wait_for(1) == [1]
        time.sleep(1.0)
        assert neighbour.server is not None and neighbour.server._open["Forward"] == 0, "the peer ended it"
        link.send(_message(2))
        assert link.flush(10) and neighbour.wait_for(2) == [1, 2] and not failures
        assert link.socket_bundles == 2
    finally:
        link.close()
        server.stop(grace=0)


def test_a_busy_or_restarting_peer_is_retried_and_a_duplicate_counts_as_delivered() -> None:
    neighbour = Neighbour()
    neighbour.refuse = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.ALREADY_EXISTS]
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append)
    try:
        link.send(_message(1))  # refused twice, retried, then "already received": delivered
        link.send(_message(2))
        assert neighbour.wait_for(1) == [2] and not failures
    finally:
        link.close()
        server.stop(grace=0)


class _StillClock:
    """hetpipe.rpc's clock, still until the test moves it: a retry loop's give_up_s passes when
    the test says, not when a loaded machine happens to get there."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    sleep = staticmethod(time.sleep)


def _counted_attempts(monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """Released once for each attempt of a link's retrying path (rpc.send_bundle)."""
    attempts = threading.Semaphore(0)
    send = rpc.send_bundle

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.release()
        return send(*args, **kwargs)

    monkeypatch.setattr(rpc, "send_bundle", counted)
    return attempts


def test_a_peer_that_stays_away_fails_the_stage_naming_peer_and_minibatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The link retries while give_up_s has not passed and fails at its first attempt after: on
    rpc's clock, held still here, so that which of the two happened does not hang on the load."""
    failures: list[str] = []
    done = threading.Event()

    def failed(message: str) -> None:
        failures.append(message)
        done.set()

    clock = _StillClock()
    monkeypatch.setattr(rpc, "time", clock)
    attempts = _counted_attempts(monkeypatch)
    link = Link(address="127.0.0.1:9", method="Backward", peer="stage 0 of vw 1", on_failure=failed, give_up_s=1.0)
    try:
        link.send(_message(7))
        for _ in range(3):
            assert attempts.acquire(timeout=30) or failures, "the link stopped retrying"
        assert not failures, f"it gave up before give_up_s had passed: {failures}"
        clock.now += 1.5   # past give_up_s: the next refused attempt is the last
        assert done.wait(30), "the link never gave up"   # a hang's guard, not a speed bound
        (message,) = failures
        assert "could not send the gradient of minibatch 7 to stage 0 of vw 1 at 127.0.0.1:9" in message
        assert "UNAVAILABLE" in message
    finally:
        link.close()


def test_a_refusal_that_no_retry_can_fix_fails_at_once() -> None:
    neighbour = Neighbour()
    neighbour.refuse = [grpc.StatusCode.INVALID_ARGUMENT]
    server = _serve(neighbour)
    failures: list[str] = []
    # Retries for an hour, and a flush that waits an hour: only a failure at once, which also
    # ends the flush, can finish before the test's timeout. (A retry would be accepted: got.)
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                give_up_s=3600.0)
    try:
        evaluation = _message(3)
        evaluation.tag.eval = 2   # an evaluation's batch 3 is named as such, not as training's minibatch 3
        link.send(evaluation)
        assert not link.flush(3600), "a flush waits no longer once the link has failed"
        assert failures and "INVALID_ARGUMENT" in failures[0] and neighbour.got == [], failures
        assert "could not send the activation of evaluation 2's batch 3 to stage 1 of vw 0" in failures[0], failures
    finally:
        link.close()
        server.stop(grace=0)


def test_closing_a_link_that_is_retrying_returns_promptly_without_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM shutdown closes a stage's links. A link retrying a send to a dead neighbour must
    give up at once, not wait out its retry window (10 s): otherwise the launcher, after its 3 s
    grace, SIGKILLs the stages that outlived a dead one instead of stopping them. Here the window
    is an hour and close() waits for the link's thread without limit (its own join gives up
    after 5 s, and the channel it then closes would end the send by itself): only the close's
    signal to the retrying send can end it before the test's timeout."""
    failures: list[str] = []
    attempts = _counted_attempts(monkeypatch)
    link = Link(address="127.0.0.1:9", method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                give_up_s=3600.0)
    join = link._thread.join
    monkeypatch.setattr(link._thread, "join", lambda timeout=None: join())
    link.send(_message(1))
    for _ in range(2):   # two attempts of the retrying path, a wait between them: it is retrying
        assert attempts.acquire(timeout=30), "the link is not retrying"
    closer = threading.Thread(target=link.close, daemon=True)
    closer.start()
    closer.join(60)   # a hang's guard, not a speed bound
    assert not closer.is_alive(), "the send went on retrying after close()"
    assert not failures, "closing is not a send failure"


def test_an_emulated_link_holds_each_message() -> None:
    neighbour = Neighbour()
    server = _serve(neighbour)
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=lambda m: None,
                hold_s=0.2)
    try:
        started = time.monotonic()
        for p in (1, 2, 3):
            link.send(_message(p))
        neighbour.wait_for(3)
        # One sender: the three holds queue behind each other, as on one wire.
        assert time.monotonic() - started >= 0.6
    finally:
        link.close()
        server.stop(grace=0)


def test_a_link_closed_while_its_bundle_awaits_an_answer_ends_at_once_and_leaves_no_segment() -> None:
    """close() wakes the thread waiting for the answer, which sends nothing again: no segment made
    after the ring closed (nobody's to close), no reconnect to a peer it is leaving."""
    neighbour = Holding()
    server = _serve(neighbour)
    failures: list[str] = []
    before = _ours()
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    try:
        link.send(_message(1))
        assert neighbour.wait_for(1) == [1]   # taken, its answer held back
        started = time.monotonic()
        link.close()
        assert time.monotonic() - started < 2, "close() waited for the thread"
        time.sleep(0.2)
        assert _ours() <= before and not failures
    finally:
        neighbour.released.set()
        link.close()
        neighbour.close()
        server.stop(grace=0)


def test_a_link_closed_while_a_bundle_of_several_frames_awaits_its_answer_over_grpc_ends_at_once() -> None:
    """A peer on another host: a bundle over 1 MiB goes by a call of its own, which close() cancels
    (it waited out the thread's 5 s join, the call's answer held back, then cancelled it)."""
    neighbour = Holding()
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append)
    try:
        link.send(Outgoing(wire_pb2.MinibatchTag(vw=0, minibatch=1, stage=0), [("activation", torch.zeros(3 << 20))]))
        assert neighbour.wait_for(1) == [1] and neighbour.frames == [12]   # taken, its answer held back
        started = time.monotonic()
        link.close()
        assert time.monotonic() - started < 2, "close() waited for the thread"
        assert not link._thread.is_alive() and not failures
    finally:
        neighbour.released.set()
        link.close()
        neighbour.close()
        server.stop(grace=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_are_copied_to_pinned_memory_off_the_compute_stream() -> None:
    from stage_worker.links import to_host

    tag = wire_pb2.MinibatchTag(vw=0, minibatch=1, stage=0)
    x = torch.randn(1 << 20, device="cuda") * 3   # queued on the compute (current) stream
    staged = to_host(Outgoing(tag, [("activation", x)]))
    (_, host), = staged.tensors
    assert staged.ready is not None and host.device.type == "cpu" and host.is_pinned()
    staged.ready.synchronize()
    assert torch.equal(host, x.cpu())
    # Received into pinned memory, a copy to the GPU does not block and lands intact.
    bundle = wire.decode(wire.encode([("activation", host)], minibatch=tag), pinned=True)
    (_, got), = bundle.tensors
    assert got.is_pinned() and torch.equal(got.to("cuda", non_blocking=True), x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_link_delivers_gpu_tensors_through_shared_memory() -> None:
    neighbour = Neighbour()
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    try:
        for p in range(1, 4):
            link.send(Outgoing(wire_pb2.MinibatchTag(vw=0, minibatch=p, stage=0),
                               [("activation", torch.full((1 << 18,), float(p), device="cuda"))]))
        assert neighbour.wait_for(3) == [1, 2, 3] and not failures
        assert link.ring is not None and link.ring.bytes_written == 3 * (1 << 20)
    finally:
        link.close()
        server.stop(grace=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_link_whose_peer_refuses_its_handles_goes_through_host_memory_and_closes_its_gpu_ring() -> None:
    neighbour = Neighbour()   # takes no CUDA IPC handles: refused with FAILED_PRECONDITION
    server = _serve(neighbour)
    failures: list[str] = []
    link = Link(address=server.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True, cuda_ipc=True)
    try:
        for p in range(1, 6):
            link.send(Outgoing(wire_pb2.MinibatchTag(vw=0, minibatch=p, stage=0),
                               [("activation", torch.full((1 << 18,), float(p), device="cuda"))]))
        assert neighbour.wait_for(5) == [1, 2, 3, 4, 5] and not failures
        assert [float(t[0][1][0]) for t in neighbour.tensors] == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert link.flush(timeout=10)
        assert link.cuda_ipc_bytes == 0 and link.gpu_ring is None   # nothing kept for a path it left
    finally:
        link.close()
        server.stop(grace=0)


class _Answered(grpc.RpcError):
    """The status a receiver answered a bundle with, as the Link's call raises it."""

    def __init__(self, refused: Rejected) -> None:
        self._code, self._details = refused.code, str(refused)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _refusal(check: Callable[[], object]) -> Rejected:
    with pytest.raises(Rejected) as refused:
        check()
    return refused.value


def test_only_a_refused_handle_sends_a_gpu_link_through_host_memory() -> None:
    """A receiver's refusal of the handle itself (here: a forged CUDA IPC handle, a gone header
    segment) turns CUDA IPC off for the link; the same codes refusing the bundle do not."""
    from hetpipe import cuda_ipc
    from stage_worker.inbox import _SCHEDULE_CODES
    from stage_worker.schedule import ScheduleError, StageSchedule

    forged = _refusal(lambda: cuda_ipc.check_ref(wire_pb2.CudaRef(handle=b"x" * 3), 4))
    gone = _refusal(lambda: shm.Reader().header(wire_pb2.ShmRef(name="hetpipe-1-0123456789abcdef", version=2,
                                                                nbytes=4), 4))
    assert handle_refused(_Answered(forged)) and handle_refused(_Answered(gone))
    schedule = StageSchedule(stage=1, num_stages=2, nm=1, steps=4)
    for offer in (lambda: schedule.accept_forward(3), lambda: schedule.accept_backward(1),
                  lambda: schedule.accept_forward(9)):   # out of the window, not forwarded, unknown
        with pytest.raises(ScheduleError) as refused:
            offer()
        code = _SCHEDULE_CODES[refused.value.reason]
        assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
        assert not handle_refused(_Answered(Rejected(code, str(refused.value))))
