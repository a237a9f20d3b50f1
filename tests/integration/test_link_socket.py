"""A same-host link's socket (hetpipe/link_socket.py): the held stream's semantics (answers in
order, the first refusal ends the connection with its status, a lost peer is UNAVAILABLE at once),
and a real stage refusing what a hostile or broken peer sends it there, changing nothing."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import pytest

from hetpipe import link_socket, metrics, rpc, socket_duplex
from hetpipe.errors import Rejected
from hetpipe.v1 import stage_pb2, wire_pb2
from stage_rig import Rig, middle_stage

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode


class _Peer:
    """A link socket whose offer() records each frame, refuses b"bad" and waits on b"hold"."""

    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.release = threading.Event()
        self.server = link_socket.Server(self.offer)

    def offer(self, method: str, frames: Iterable[bytes]) -> None:
        got = []
        for frame in frames:
            if frame == b"bad":
                raise Rejected(Code.INVALID_ARGUMENT, f"{method}Link: frame 'bad' refused")
            if frame == b"hold":
                self.release.wait(30)
            if frame == b"stop":   # reads no further: a bundle that declares fewer frames than it sends
                break
            got.append(frame)
        self.got.append(got[0] if len(got) == 1 else b"+".join(got))

    def duplex(self) -> socket_duplex.SocketDuplex:
        return socket_duplex.SocketDuplex(self.server.address, "Forward", deadline_s=30)


@pytest.fixture
def peer() -> Iterator[_Peer]:
    p = _Peer()
    yield p
    p.release.set()
    p.server.close()


def test_answers_come_in_order_and_the_first_refusal_ends_the_connection(peer: _Peer) -> None:
    duplex = peer.duplex()
    opened = [duplex.put(frame) for frame in (b"a", b"bad", b"c")]
    assert duplex.take(opened[0]) == wire_pb2.Ack()
    with pytest.raises(link_socket.SocketError) as info:
        duplex.take(opened[1])
    assert (info.value.code(), info.value.details()) == (Code.INVALID_ARGUMENT, "ForwardLink: frame 'bad' refused")
    with pytest.raises(link_socket.SocketError) as info:   # put on the connection the refusal ended
        duplex.take(opened[2])
    assert info.value.code() == Code.UNAVAILABLE
    assert duplex.call(b"d") == wire_pb2.Ack()   # a new connection
    # A frame of 3 MiB (inline bytes, where /dev/shm is full) is more than one send takes.
    big = random.Random(5).randbytes(3 << 20)
    assert duplex.call(big) == wire_pb2.Ack()
    assert peer.got == [b"a", b"d", big] and duplex.answered == 3
    duplex.close()


def test_a_bundle_of_several_frames_is_one_request(peer: _Peer) -> None:
    """Each frame goes out as it is made; the receiver reads them as it decodes; one answer. A
    refusal from a frame inside it is the bundle's answer, though frames were still coming."""
    duplex = peer.duplex()
    made: list[int] = []

    def frames(n: int, *extra: bytes) -> Iterator[bytes]:
        for i in range(n):
            made.append(i)
            yield f"p{i}".encode()
        yield from extra

    assert duplex.call_bundle(frames(3)) == wire_pb2.Ack() and peer.got == [b"p0+p1+p2"]
    big = bytes(3 << 20)
    with pytest.raises(link_socket.SocketError) as info:
        duplex.call_bundle(frames(1, b"bad", *[big] * 8))
    assert (info.value.code(), info.value.details()) == (Code.INVALID_ARGUMENT, "ForwardLink: frame 'bad' refused")
    with pytest.raises(link_socket.SocketError) as info:   # the receiver stopped reading before its end
        duplex.call_bundle(frames(1, b"stop", b"more"))
    assert (info.value.code(), info.value.details()) == (Code.INVALID_ARGUMENT, "ForwardLink: frames past the bundle's end")
    # (This stand-in kept what it read; a stage's wire.decode refuses frames past a bundle's end
    # itself, before it offers anything.)
    assert duplex.call(b"one") == wire_pb2.Ack() and peer.got == [b"p0+p1+p2", b"p0", b"one"]


def test_a_bundles_framing_is_checked(peer: _Peer) -> None:
    address = peer.server.address()

    def answer_to(*words: int) -> tuple[Code, str]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect("\0" + address.name)
        sock.sendall(bytes(address.nonce) + b"\0")
        assert _answer(sock) == (Code.OK, "")
        for word in words:
            size = word & ~(link_socket.PART | link_socket.END)
            sock.sendall(struct.pack("<I", word) + bytes(size if size <= 64 else 0))   # no body for one refused by its length
        answered = _answer(sock)
        sock.close()
        return answered

    part, end = link_socket.PART, link_socket.END
    assert answer_to(end) == (Code.INVALID_ARGUMENT, "ForwardLink: the end of a bundle that was not begun")
    assert answer_to(part | 4, 4) == (Code.INVALID_ARGUMENT, "ForwardLink: a request inside a bundle's frames")
    assert answer_to(part | 4, end | 4)[0] == Code.INVALID_ARGUMENT
    assert answer_to(part | end)[0] == Code.INVALID_ARGUMENT
    code, details = answer_to(part | 4, part | (link_socket.MAX_REQUEST_BYTES + 1))
    assert code == Code.INVALID_ARGUMENT and "passes the bound" in details
    # A frame of 0 bytes inside a bundle is a frame (an empty TensorFrame), not its end.
    assert answer_to(part | 4, part | 0, part | 2, end) == (Code.OK, "")
    assert peer.got == [bytes(4) + b"++" + bytes(2)]


@pytest.mark.parametrize(("words", "at_once", "every_s"), [
    # Each would arrive whole 2 s or more after the 1 s deadline: a slow box cannot make it in time.
    ([8], 5, 0.5),                                            # a one-frame bundle's body
    ([link_socket.PART | 4, link_socket.PART | 16], 13, 0.2),   # a later frame's body
    ([link_socket.PART | 4, link_socket.END], 9, 1.0),          # the end's length word
    ([8], 5, 30.0),                                           # silent, for less than IDLE_S
], ids=["one-frame", "part-body", "end-word", "silent"])
def test_a_request_sent_a_byte_at_a_time_is_cut_off_at_its_deadline(peer: _Peer, monkeypatch: pytest.MonkeyPatch,
                                                                    words: list[int], at_once: int,
                                                                    every_s: float) -> None:
    """A peer that never goes idle for IDLE_S still has REQUEST_S for the whole request, as a
    gRPC call has its deadline: it cannot hold a lane by dribbling a bundle. at_once: the bytes
    sent together first; the rest go one every every_s."""
    monkeypatch.setattr(link_socket, "REQUEST_S", 1.0)
    address = peer.server.address()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + address.name)
    sock.sendall(bytes(address.nonce) + b"\0")
    assert _answer(sock) == (Code.OK, "")
    request = b"".join(struct.pack("<I", w) + bytes(w & ~(link_socket.PART | link_socket.END)) for w in words)
    stop = threading.Event()

    def dribble() -> None:
        sock.sendall(request[:at_once])
        for i in range(at_once, len(request)):
            if stop.wait(every_s):
                return
            try:
                sock.sendall(request[i:i + 1])
            except OSError:
                return

    started = time.monotonic()
    threading.Thread(target=dribble, daemon=True).start()
    try:
        code, details = _answer(sock)
    finally:
        stop.set()
    assert code == Code.DEADLINE_EXCEEDED and "did not arrive within 1 s" in details, details
    assert details.startswith("ForwardLink: ") and time.monotonic() - started < 3
    assert peer.got == []
    deadline = time.monotonic() + 5
    while peer.server._open["Forward"] and time.monotonic() < deadline:   # its lane is free again
        time.sleep(0.02)
    assert peer.server._open["Forward"] == 0
    sock.close()


def _counts(code: str, method: str = "ForwardLink") -> tuple[float, float]:
    """(handled with code, messages received) of a stage's method in this process's registry."""
    labels = {"role": "stage_worker", "grpc_service": "hetpipe.v1.Stage", "grpc_method": method}
    handled = metrics.REGISTRY.get_sample_value("hetpipe_grpc_server_handled_total", {**labels, "grpc_code": code})
    received = metrics.REGISTRY.get_sample_value("hetpipe_grpc_server_msg_received_total", labels)
    return handled or 0.0, received or 0.0


def _greeted(server: link_socket.Server, nonce: bytes | None = None) -> socket.socket:
    """A connection to server's socket that has sent its greeting (nonce: the server's by default)."""
    address = server.address()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + address.name)
    sock.sendall((bytes(address.nonce) if nonce is None else nonce) + b"\0")
    return sock


def test_a_connection_counts_in_the_grpc_metrics_as_the_stream_it_stands_in_for(
        peer: _Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's refusal rate and message counts read the same whichever carried a link's
    bundles: each request a message received; each connection handled once, with the code it
    ended with (OK only where the peer closed it between requests); a connection refused at its
    greeting a LinkSocket call refused, timed from its accept."""
    codes = ("OK", "INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED")
    before = {code: _counts(code)[0] for code in codes}
    _, received = _counts("OK")
    denied, _ = _counts("PERMISSION_DENIED", "LinkSocket")
    seconds = {"role": "stage_worker", "grpc_service": "hetpipe.v1.Stage", "grpc_method": "LinkSocket"}
    waited = metrics.REGISTRY.get_sample_value("hetpipe_grpc_server_handling_seconds_sum", seconds) or 0.0

    def settled(code: str, n: int) -> None:   # counted as each connection's thread ends
        deadline = time.monotonic() + 5
        while _counts(code)[0] < before[code] + n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _counts(code)[0] == before[code] + n, code

    duplex = peer.duplex()
    assert duplex.call(b"a") == wire_pb2.Ack()
    with pytest.raises(link_socket.SocketError):
        duplex.call(b"bad")
    settled("INVALID_ARGUMENT", 1)
    assert duplex.call(b"b") == wire_pb2.Ack()   # on a new connection, closed by the peer: OK
    duplex.close()
    settled("OK", 1)
    monkeypatch.setattr(link_socket, "IDLE_S", 0.5)   # for this connection alone: a slow box's pauses end no other
    sock = _greeted(peer.server)   # idle past IDLE_S: ended as a stream past its cap
    assert _answer(sock) == (Code.OK, "") and _ended(sock)
    settled("DEADLINE_EXCEEDED", 1)
    monkeypatch.setattr(link_socket, "IDLE_S", 60.0)
    sock = _greeted(peer.server)   # gone inside a bundle: cut off, with nobody to answer
    assert _answer(sock) == (Code.OK, "")
    sock.sendall(struct.pack("<I", link_socket.PART | 4) + bytes(4))
    sock.shutdown(socket.SHUT_WR)
    assert _ended(sock)   # no answer: the peer is gone (a refusal would be logged as one)
    settled("CANCELLED", 1)
    sock = _greeted(peer.server)   # the server closes: cut off too, not a clean end
    assert _answer(sock) == (Code.OK, "")
    peer.server.close()
    settled("CANCELLED", 2)
    sock.close()
    assert _counts("OK") == (before["OK"] + 1, received + 4)
    assert all(_counts(code)[0] == before[code] + n for code, n in
               {"INVALID_ARGUMENT": 1, "DEADLINE_EXCEEDED": 1, "CANCELLED": 2}.items())

    other = _Peer()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect("\0" + other.server.address().name)
        time.sleep(0.5)
        sock.sendall(bytes(link_socket.NONCE_BYTES) + b"\0")
        assert _answer(sock)[0] == Code.PERMISSION_DENIED
        sock.close()
    finally:
        other.server.close()
    assert _counts("PERMISSION_DENIED", "LinkSocket")[0] == denied + 1
    # Timed from its accept, not as 0 s: the 0.5 s it took to greet, less however late the accept was.
    assert metrics.REGISTRY.get_sample_value("hetpipe_grpc_server_handling_seconds_sum", seconds) - waited > 0.1


def test_the_deadline_is_a_requests_not_the_connections(peer: _Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link idle between bundles for longer than REQUEST_S (and less than IDLE_S) goes on: the
    timeout of its last request's reads is not left on the socket."""
    monkeypatch.setattr(link_socket, "REQUEST_S", 0.5)
    monkeypatch.setattr(link_socket, "IDLE_S", 10.0)
    duplex = peer.duplex()
    assert duplex.call(b"a") == wire_pb2.Ack()
    time.sleep(1.0)
    assert duplex.call(b"b") == wire_pb2.Ack() and duplex.answered == 2 and peer.got == [b"a", b"b"]
    duplex.close()


def test_a_refusal_is_read_before_a_later_send_fails(peer: _Peer) -> None:
    """The peer refused the first request and closed: the second, put after that, cannot go out,
    and the first is still answered with its own refusal (which no resend would mend)."""
    duplex = peer.duplex()
    refused = duplex.put(b"bad")
    time.sleep(0.3)   # the peer has answered and closed by now
    later = duplex.put(b"e")
    with pytest.raises(link_socket.SocketError) as info:
        duplex.take(refused)
    assert info.value.code() == Code.INVALID_ARGUMENT
    with pytest.raises(link_socket.SocketError) as info:
        duplex.take(later)
    assert info.value.code() == Code.UNAVAILABLE
    assert peer.got == []


def test_a_closed_duplex_opens_nothing_more(peer: _Peer) -> None:
    duplex = peer.duplex()
    assert duplex.call(b"a") == wire_pb2.Ack()
    duplex.close()
    with pytest.raises(link_socket.SocketError) as info:
        duplex.call(b"b")
    assert info.value.code() == Code.CANCELLED and peer.got == [b"a"]
    deadline = time.monotonic() + 5
    while peer.server._open["Forward"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert peer.server._open["Forward"] == 0


def test_a_peer_that_goes_away_is_unavailable_at_once(peer: _Peer) -> None:
    """A dead stage is seen at its socket's end, not at a deadline two minutes on; close() wakes
    a take that waits, as Link.close needs."""
    duplex = peer.duplex()
    held = duplex.put(b"hold")
    started = time.monotonic()
    threading.Timer(0.2, peer.server.close).start()
    with pytest.raises(link_socket.SocketError) as info:
        duplex.take(held)
    assert info.value.code() == Code.UNAVAILABLE and time.monotonic() - started < 5
    other = _Peer()
    try:
        duplex = other.duplex()
        held = duplex.put(b"hold")
        threading.Timer(0.2, duplex.close).start()
        with pytest.raises(link_socket.SocketError):
            duplex.take(held)
        assert time.monotonic() - started < 10
    finally:
        other.release.set()
        other.server.close()


def test_a_peer_without_a_socket_is_called_over_the_fallback() -> None:
    class Unimplemented(grpc.RpcError):
        def code(self) -> Code:
            return Code.UNIMPLEMENTED

        def details(self) -> str:
            return "Method not found!"

    class Stream:
        def __init__(self) -> None:
            self.put_calls: list[bytes] = []

        def put(self, request: bytes) -> tuple[str, bytes]:
            self.put_calls.append(request)
            return ("stream", request)

        def take(self, opened: Any) -> str:
            return f"answered {opened[1]!r}"

        def close(self, grace_s: float = 1.0) -> None:
            pass

        due = False

    def locate() -> Any:
        raise Unimplemented()

    stream = Stream()
    duplex = socket_duplex.SocketDuplex(locate, "Backward", deadline_s=5, fallback=stream)
    assert duplex.call(b"x") == "answered b'x'" and duplex.call(b"y") == "answered b'y'"
    assert stream.put_calls == [b"x", b"y"] and duplex.answered == 0
    # Without a fallback the peer's answer is the link's failure.
    with pytest.raises(grpc.RpcError) as info:
        socket_duplex.SocketDuplex(locate, "Backward", deadline_s=5).call(b"x")
    assert info.value.code() == Code.UNIMPLEMENTED


# --- a real stage, and what a peer sends its socket ---------------------------------------------


@pytest.fixture
def rig(make_job) -> Iterator[Rig]:
    with middle_stage(make_job) as running:
        yield running


def _connect(rig: Rig, greeting: bytes | None = None) -> tuple[socket.socket, Any]:
    address = rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + address.name)
    sock.sendall(bytes(address.nonce) + b"\0" if greeting is None else greeting)
    return sock, address


def _answer(sock: socket.socket) -> tuple[Code, str]:
    try:
        link_socket.read_answer(sock)
    except link_socket.SocketError as exc:
        return exc.code(), exc.details()
    return Code.OK, ""


def _ended(sock: socket.socket) -> bool:
    ended = sock.recv(1) == b""
    sock.close()
    return ended


def _connected(rig: Rig) -> socket.socket:
    """A connection the stage accepted: a refused one's lane is given back once the stage's thread
    for it ends, a moment after the client sees it closed."""
    deadline = time.monotonic() + 5
    while True:
        sock, _ = _connect(rig)
        code, details = _answer(sock)
        if code == Code.OK:
            return sock
        sock.close()
        assert code == Code.RESOURCE_EXHAUSTED and time.monotonic() < deadline, (code, details)
        time.sleep(0.02)


def test_a_stage_refuses_bad_greetings_and_requests_and_changes_nothing(rig: Rig) -> None:
    before = rig.snapshot()
    address = rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5)
    assert rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5) == address   # one socket per stage

    # Greeted, gone before the answer: each one's lane comes back (else three would shut the link out).
    for _ in range(2 * link_socket.LANES):
        sock, _ = _connect(rig)
        sock.close()
    _connected(rig).close()

    sock, _ = _connect(rig, os.urandom(link_socket.NONCE_BYTES) + b"\0")
    assert _answer(sock) == (Code.PERMISSION_DENIED, "LinkSocket: wrong nonce") and _ended(sock)
    sock, _ = _connect(rig, bytes(address.nonce) + b"\7")
    assert _answer(sock)[0] == Code.INVALID_ARGUMENT and _ended(sock)

    sock = _connected(rig)
    sock.sendall(struct.pack("<I", link_socket.MAX_REQUEST_BYTES + 1))
    code, details = _answer(sock)
    assert code == Code.INVALID_ARGUMENT and "passes the bound" in details and _ended(sock)

    # Frames that do not parse, or name no bundle this stage takes: each refused, the connection ended.
    rng = random.Random(12)
    bodies = [rng.randbytes(rng.randrange(1, 300)) for _ in range(40)]
    bodies += [wire_pb2.TensorFrame(minibatch=wire_pb2.MinibatchTag(vw=99, minibatch=1)).SerializeToString(), b""]
    for body in bodies:
        sock = _connected(rig)
        sock.sendall(struct.pack("<I", len(body)) + body)
        code, details = _answer(sock)
        assert code == Code.INVALID_ARGUMENT, (body, code, details)
        assert _ended(sock)
    assert rig.snapshot() == before

    # Lanes: three connections per method; a fourth is RESOURCE_EXHAUSTED until one closes.
    held = [_connected(rig) for _ in range(link_socket.LANES)]
    sock, _ = _connect(rig)
    assert _answer(sock)[0] == Code.RESOURCE_EXHAUSTED and _ended(sock)
    held.pop().close()
    held.append(_connected(rig))   # once the stage has seen that one close
    for s in held:
        s.close()

    # A bundle of several frames with one past its end: refused before the stage takes anything
    # (once the stage has seen the held connections close: until then a new one finds no lane).
    extra = wire_pb2.TensorFrame(data=b"1234").SerializeToString()
    deadline = time.monotonic() + 5
    while True:
        duplex = socket_duplex.SocketDuplex(lambda: rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5), "Forward", 10)
        with pytest.raises(link_socket.SocketError) as info:
            duplex.call_bundle(iter([rig.activation(1)[0].SerializeToString(), extra]))
        if info.value.code() != Code.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
            break
        duplex.close()
        time.sleep(0.02)
    assert info.value.code() == Code.INVALID_ARGUMENT, info.value.details()
    assert rig.snapshot() == before

    # Still serving: a real activation over the socket is taken.
    duplex.call(rig.activation(1)[0].SerializeToString())
    duplex.close()
    rig.wait_until("forwards_done", 1)
    assert rig.snapshot()["received"] == 1


def test_a_silent_peer_is_dropped(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before its greeting after the control deadline (told why); after it, once idle as long as
    gRPC lets a stream live: a frozen peer holds no lane for good."""
    monkeypatch.setattr(rpc, "CONTROL_DEADLINE_S", 0.5)
    monkeypatch.setattr(link_socket, "IDLE_S", 1.0)
    address = rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + address.name)
    started = time.monotonic()
    assert _answer(sock) == (Code.DEADLINE_EXCEEDED, "LinkSocket: the greeting did not arrive within 0.5 s")
    assert _ended(sock) and time.monotonic() - started < 5
    sock = _connected(rig)
    started = time.monotonic()
    assert _ended(sock) and 0.9 < time.monotonic() - started < 5


def test_a_greeting_sent_a_byte_at_a_time_is_refused_at_the_control_deadline(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each byte well within the socket's timeout, the whole past the deadline: such a peer must
    not hold one of the GREETING places any longer, or a link could not get back in."""
    monkeypatch.setattr(rpc, "CONTROL_DEADLINE_S", 0.5)
    address = rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + address.name)
    greeting = bytes(address.nonce) + b"\0"
    started = time.monotonic()
    for i in range(len(greeting) - 1):   # never the last byte
        try:
            sock.sendall(greeting[i:i + 1])
        except OSError:   # refused and closed already
            break
        time.sleep(0.1)
    code, details = _answer(sock)
    assert code == Code.DEADLINE_EXCEEDED and "the greeting did not arrive within 0.5 s" in details, details
    assert time.monotonic() - started < 3
    sock.close()


# A Python that another user may run: a venv under /root is not one.
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="connecting as another user needs root and a system Python")
def test_another_user_may_not_connect(rig: Rig) -> None:
    address = rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5)
    # The stage refuses before it reads the greeting, and may have closed before it is sent.
    script = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect('\\0' + sys.argv[1])\n"
              "try: s.sendall(bytes.fromhex(sys.argv[2]) + bytes(1))\nexcept OSError: pass\n"
              "sys.stdout.write(s.recv(1000).decode(errors='replace'))")
    done = subprocess.run([SYSTEM_PYTHON, "-c", script, address.name, bytes(address.nonce).hex()],
                          user=65534, capture_output=True, text=True, timeout=30)
    assert "may not connect" in done.stdout, (done.stdout, done.stderr)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="serving as another user needs root and a system Python")
def test_a_socket_served_by_another_user_is_not_trusted() -> None:
    """A name taken over by another user (its owner gone) answers OK to anything: the sender
    checks who serves it before it sends a bundle there."""
    name = f"hetpipe-test-{os.getpid()}-{random.Random().getrandbits(32):08x}"
    script = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind('\\0' + sys.argv[1]); s.listen(1);"
              "print('ready', flush=True); c,_=s.accept(); c.settimeout(10); c.recv(100); c.sendall(bytes(3));"
              "c.recv(100)")
    squatter = subprocess.Popen([SYSTEM_PYTHON, "-c", script, name], user=65534, stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready"
        address = stage_pb2.LinkSocketAddress(name=name, nonce=bytes(link_socket.NONCE_BYTES))
        duplex = socket_duplex.SocketDuplex(lambda: address, "Forward", deadline_s=5)
        with pytest.raises(link_socket.SocketError) as info:
            duplex.call(b"x")
        assert info.value.code() == Code.UNAVAILABLE and "served by user 65534" in info.value.details()
    finally:
        squatter.kill()
        squatter.wait(10)


def test_a_stopped_stage_server_ends_its_link_socket() -> None:
    from stage_rig import serve
    from stage_worker.runtime import StageRuntime
    from stage_worker.servicer import StageServicer

    server = serve(StageServicer(StageRuntime(), on_stop=lambda: None))
    with rpc.channel(server.address) as channel:
        address = rpc.Stub(channel, "Stage").LinkSocket(wire_pb2.Empty(), timeout=5)
    server.stop(grace=0)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        sock.connect("\0" + address.name)
    sock.close()


def test_a_link_sends_a_real_stage_its_activations_over_the_socket_and_a_resend_counts_as_delivered(
        rig: Rig) -> None:
    """stage_worker.links.Link through shared memory to a real stage: every bundle over the socket,
    and one sent again (its answer lost, say) answered ALREADY_EXISTS, which is a delivery, not a
    failure; the stage takes it once."""
    from hetpipe import wire
    from stage_worker.links import Link, Outgoing

    failures: list[str] = []
    link = Link(address=rig.address, method="Forward", peer="stage 1 of vw 0", on_failure=failures.append,
                shared_memory=True)
    try:
        for p in (1, 2, 2):
            bundle = wire.decode(rig.activation(p))
            link.send(Outgoing(bundle.header.minibatch, bundle.tensors))
        assert link.flush(10) and not failures
        assert link.socket_bundles == 2 and link.ring is not None and link.ring.bytes_written > 0
    finally:
        link.close()
    rig.wait_until("forwards_done", 2)
    assert rig.snapshot()["received"] == 2
