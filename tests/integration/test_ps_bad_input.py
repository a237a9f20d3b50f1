"""A ps shard refuses bad input with the right gRPC status and a message naming the problem, changes
nothing, and keeps serving; a duplicate push is an OK no-op; pulls wait for c_global (G2) and
answer DEADLINE_EXCEEDED with a reason; and a shard killed with kill -9 comes back from its
checkpoint + push log with every acknowledged push exactly once (issue 3, DESIGN §3 G1/G2, O3).

The bad-input and pull tests use an in-process shard (rpc.Server + ShardServicer, with
durability, as `python -m ps_server` wires it). The crash test runs `python -m ps_server` as a
real process and kills it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hetpipe import rpc, shm, wire
from hetpipe.v1 import ps_pb2, ps_pb2_grpc, wire_pb2
from messages import messages
from shard_reference import record_fsyncs
from shm_handles import forged_handles
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard

pytestmark = pytest.mark.timeout(90)

Code = grpc.StatusCode
REPO = Path(__file__).resolve().parents[2]
SHAPES = {"l0.weight": (2, 3), "l0.bias": (3,)}
KEYS = list(SHAPES)
CALL_S = 10.0  # generous: the test host may be heavily loaded


def _frames(tensors: list[tuple[str, torch.Tensor]], **tags: Any) -> list[wire_pb2.TensorFrame]:
    return messages(wire.encode(tensors, **tags))


def w0() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(k, torch.randn(s, generator=g)) for k, s in SHAPES.items()]


def delta(vw: int, clock: int, keys: list[str] = KEYS) -> list[tuple[str, torch.Tensor]]:
    """VW vw's wave-`clock` update; the same tensor for a key whichever other keys come with it."""
    return [(k, torch.randn(SHAPES[k], generator=torch.Generator().manual_seed(1000 * KEYS.index(k) + 100 * vw + clock)))
            for k in keys]


@dataclass
class Client:
    stub: ps_pb2_grpc.ParameterServerStub

    def init(self, tensors: list[tuple[str, torch.Tensor]], vws: int = 2, **kw: Any) -> wire_pb2.Ack:
        return self.stub.Init(iter(_frames(tensors, init=wire_pb2.InitTag(virtual_workers=vws))), timeout=CALL_S, **kw)

    def push(self, vw: int, clock: int, tensors: list[tuple[str, torch.Tensor]], **kw: Any) -> ps_pb2.PushReply:
        tag = wire_pb2.PushTag(vw=vw, clock=clock)
        return self.stub.Push(iter(_frames(tensors, push=tag)), timeout=CALL_S, **kw)

    def pull(self, vw: int, keys: list[str], min_clock: int = 0, timeout: float = CALL_S, **kw: Any) -> wire.Bundle:
        request = ps_pb2.PullRequest(vw=vw, keys=keys, min_clock=min_clock)
        return wire.decode(self.stub.Pull(request, timeout=timeout, **kw))

    def status(self, **kw: Any) -> ps_pb2.ShardStatus:
        return self.stub.Status(wire_pb2.Empty(), timeout=CALL_S, **kw)


def state(s: ps_pb2.ShardStatus) -> tuple[Any, ...]:
    """What a refused request must not change."""
    return (s.values_digest, [(c.vw, c.min_clock, c.max_clock) for c in s.clocks], s.c_global,
            s.pushes_applied, s.clock_distance, s.max_clock_distance)


def refused(call: Callable[[], Any], code: grpc.StatusCode, pattern: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value
    assert err.code() == code, f"{err.code()} {err.details()!r}, want {code}"
    assert re.search(pattern, err.details() or ""), f"message {err.details()!r} does not match {pattern!r}"
    return str(err.details())


# ---- an in-process shard ---------------------------------------------------------------------------


@dataclass
class InProcess:
    client: Client
    servicer: ShardServicer
    expected: dict[str, torch.Tensor]   # w0 + every acknowledged push


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[InProcess]:
    """A shard with 2 VWs and two float32 keys; vw 0 has pushed waves 0 and 1, vw 1 wave 0."""
    servicer = ShardServicer(Shard(), Durability(str(tmp_path / "ckpt")), max_pull_wait_s=30.0)
    server = rpc.Server("127.0.0.1", 0, workers=16)
    server.add("ParameterServer", servicer)
    server.start()
    ch = rpc.channel(server.address)
    try:
        client = Client(ps_pb2_grpc.ParameterServerStub(ch))
        assert client.init(w0()).message == "initialised"
        expected = dict(w0())
        for vw, c in [(0, 0), (1, 0), (0, 1)]:
            reply = client.push(vw, c, delta(vw, c))
            assert not reply.duplicate
            for k, d in delta(vw, c):
                expected[k] = expected[k] + d
        s = client.status()
        assert s.c_global == 1 and [(c.min_clock, c.max_clock) for c in s.clocks] == [(2, 2), (1, 1)]
        yield InProcess(client, servicer, expected)
    finally:
        ch.close()
        server.stop()


def with_data(frames: list[wire_pb2.TensorFrame], data: bytes) -> list[wire_pb2.TensorFrame]:
    frames[0].data = data
    return frames


def bad_inputs(c: Client) -> dict[str, tuple[Callable[[], Any], grpc.StatusCode, str]]:
    push_frames = lambda **tag: _frames(delta(0, 2), **tag)  # noqa: E731
    good = push_frames(push=wire_pb2.PushTag(vw=0, clock=2))
    raw = good[0].data
    other_init = [(k, v + 1.0) for k, v in w0()]
    bad_dtype = list(_frames(delta(0, 2), push=wire_pb2.PushTag(vw=0, clock=2)))
    bad_dtype[0].tensors[0].dtype = 99
    return {
        "unknown key": (lambda: c.push(0, 2, [*delta(0, 2), ("l7.weight", torch.zeros(2, 3))]),
                        Code.NOT_FOUND, r"not owned by this shard.*l7\.weight"),
        "wrong shape": (lambda: c.push(0, 2, [("l0.weight", torch.zeros(3, 2)), ("l0.bias", torch.zeros(3))]),
                        Code.INVALID_ARGUMENT, r"l0\.weight: delta is torch\.float32 \[3, 2\], the key is .*\[2, 3\]"),
        "wrong dtype": (lambda: c.push(0, 2, [(k, v.double()) for k, v in delta(0, 2)]),
                        Code.INVALID_ARGUMENT, r"l0\.weight: delta is torch\.float64.*the key is torch\.float32"),
        "clock goes backwards": (lambda: c.push(0, 0, delta(0, 0)),
                                 Code.FAILED_PRECONDITION, r"vw 0 for clock 0 goes backwards.*\[2\]"),
        "clock skips ahead": (lambda: c.push(0, 3, delta(0, 3)),
                              Code.FAILED_PRECONDITION, r"vw 0 for clock 3 skips ahead.*\[2\]"),
        "unknown vw": (lambda: c.push(2, 0, delta(2, 0)), Code.INVALID_ARGUMENT, r"unknown vw 2.*0\.\.1"),
        "pull of keys not owned": (lambda: c.pull(0, ["l0.weight", "l9.bias"]),
                                   Code.NOT_FOUND, r"not owned by this shard.*l9\.bias"),
        "pull by unknown vw": (lambda: c.pull(5, KEYS), Code.INVALID_ARGUMENT, r"unknown vw 5"),
        "push without push tag": (lambda: c.stub.Push(iter(push_frames()), timeout=CALL_S),
                                  Code.INVALID_ARGUMENT, r"lacks the push tag"),
        "push with a minibatch tag": (
            lambda: c.stub.Push(iter(push_frames(minibatch=wire_pb2.MinibatchTag(vw=0, minibatch=1))), timeout=CALL_S),
            Code.INVALID_ARGUMENT, r"lacks the push tag"),
        "too few bytes for the shape": (
            lambda: c.stub.Push(iter(with_data(push_frames(push=wire_pb2.PushTag(vw=0, clock=2)), raw[:-4])),
                                timeout=CALL_S),
            Code.INVALID_ARGUMENT, r"byte length \d+ does not match the shapes"),
        "too many bytes for the shape": (
            lambda: c.stub.Push(iter(with_data(push_frames(push=wire_pb2.PushTag(vw=0, clock=2)), raw + b"\0" * 8)),
                                timeout=CALL_S),
            Code.INVALID_ARGUMENT, r"byte length \d+\+? does not match the shapes"),
        "unknown dtype code": (lambda: c.stub.Push(iter(bad_dtype), timeout=CALL_S),
                               Code.INVALID_ARGUMENT, r"unknown dtype code 99"),
        "init again with other values": (lambda: c.init(other_init), Code.ALREADY_EXISTS, r"already initialised"),
        "init again with other vws": (lambda: c.init(w0(), vws=3), Code.ALREADY_EXISTS, r"already initialised"),
        "init without init tag": (lambda: c.stub.Init(iter(_frames(w0())), timeout=CALL_S),
                                  Code.INVALID_ARGUMENT, r"lacks the init tag"),
    }


BAD = list(bad_inputs(Client(None)))  # type: ignore[arg-type]


@pytest.mark.parametrize("what", BAD)
def test_bad_input_is_refused_and_changes_nothing(ps: InProcess, what: str) -> None:
    c = ps.client
    before = state(c.status())
    call, code, pattern = bad_inputs(c)[what]
    refused(call, code, pattern)
    assert state(c.status()) == before, f"{what} changed the shard"
    # ... and it keeps serving: a pull answers with the old values, the next wave applies.
    pulled = c.pull(1, KEYS).named()
    for k in KEYS:
        assert torch.equal(pulled[k], ps.expected[k]), k
    assert not c.push(0, 2, delta(0, 2)).duplicate
    assert c.status().pushes_applied == before[3] + 1


def test_duplicate_push_is_an_ok_no_op(ps: InProcess) -> None:
    c = ps.client
    before = c.status()
    reply = c.push(0, 1, delta(0, 1))             # vw 0's latest wave, again
    assert reply.duplicate and reply.c_global == 1
    reply = c.push(1, 0, delta(1, 0, ["l0.bias"]))  # a retry of part of a wave is a retry too
    assert reply.duplicate
    after = c.status()
    assert state(after) == state(before)
    assert after.pushes_duplicate == before.pushes_duplicate + 2
    pulled = c.pull(0, KEYS)
    assert list(pulled.header.pull.own_clock) == [2, 2]
    for k, v in pulled.tensors:
        assert torch.equal(v, ps.expected[k]), f"{k}: a duplicate was applied"


def test_a_push_that_would_overflow_w_global_is_refused_and_changes_nothing(ps: InProcess) -> None:
    """A finite push whose sum with w_global passes float32's largest value, through gRPC and the
    push log: INVALID_ARGUMENT naming the key, its log entry not replayed, and the shard serves on."""
    c = ps.client
    huge = lambda vw, clock: [(k, d + (0.75 * torch.finfo(torch.float32).max if k == "l0.bias" else 0.0))  # noqa: E731
                              for k, d in delta(vw, clock)]
    assert not c.push(1, 1, huge(1, 1)).duplicate
    before = state(c.status())
    refused(lambda: c.push(0, 2, huge(0, 2)), Code.INVALID_ARGUMENT,
            r"push of vw 0 for clock 2: adding it could overflow w_global in \['l0\.bias'\]")
    assert state(c.status()) == before
    assert torch.isfinite(c.pull(0, KEYS).named()["l0.bias"]).all()
    assert not c.push(0, 2, delta(0, 2)).duplicate, "the same wave, finite, is applied"
    ps.servicer.checkpoints_written()   # pushes' checkpoints are written after their answers
    restored = ShardServicer(Shard(), Durability(ps.servicer.durability.dir), max_pull_wait_s=1.0)
    restored.restore()
    assert restored.shard.digest() == ps.servicer.shard.digest(), "the refused push's log entry is not replayed"


def test_a_push_is_checked_and_logged_while_another_holds_the_shards_lock(ps: InProcess) -> None:
    """Only the apply takes the shard's lock: a push's header check, its log write and its scan
    for NaN read the push alone, so a push that arrives while another is applied (or a pull's
    reply is written) gets that far at once. Here one holding NaN is refused with the lock held
    elsewhere throughout, and its log entry is not replayed."""
    c = ps.client
    before = state(c.status())
    bad = [(k, d.index_fill(0, torch.tensor([0]), float("nan")) if k == "l0.bias" else d) for k, d in delta(0, 2)]
    with ps.servicer._cv:   # as another push's apply holds it
        refused(lambda: c.push(0, 2, bad), Code.INVALID_ARGUMENT, r"push of vw 0 for clock 2: NaN or Inf in \['l0\.bias'\]")
    assert state(c.status()) == before
    assert not c.push(0, 2, delta(0, 2)).duplicate
    ps.servicer.checkpoints_written()
    restored = ShardServicer(Shard(), Durability(ps.servicer.durability.dir), max_pull_wait_s=1.0)
    restored.restore()
    assert restored.shard.digest() == ps.servicer.shard.digest(), "the refused push's entry is not replayed"


def test_push_whose_log_write_fails_is_not_applied(ps: InProcess, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error writing the push log refuses the push whole, so the client's retry is applied (and
    logged) instead of being acknowledged as a 'duplicate' that a kill -9 would then lose."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    real = durability.log_stream

    def full_disk(*args: Any) -> None:
        monkeypatch.setattr(durability, "log_stream", real)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durability, "log_stream", full_disk)
    before = state(c.status())
    refused(lambda: c.push(1, 1, delta(1, 1)), Code.UNAVAILABLE, r"I/O error on the server: No space left on device")
    assert state(c.status()) == before, "a push that could not be logged must not be applied"
    assert not c.push(1, 1, delta(1, 1)).duplicate, "the retry is the first time it is applied"
    ps.servicer.checkpoints_written()
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)  # what a restart after kill -9 would see
    assert restored.digest() == ps.servicer.shard.digest()
    assert restored.c_global() == 2


def test_an_init_or_evict_whose_checkpoint_fails_is_checkpointed_by_its_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Init and Evict change the shard, then checkpoint it. When that write fails the client gets
    UNAVAILABLE and retries; the retry changes nothing, so it must write the checkpoint: without
    one a restart would come back without keys (every logged push refused) or wait for the
    evicted VW again."""
    durability = Durability(str(tmp_path / "ckpt"))
    servicer = ShardServicer(Shard(), durability, max_pull_wait_s=5.0)
    server = rpc.Server("127.0.0.1", 0, workers=4)
    server.add("ParameterServer", servicer)
    server.start()
    real = durability.checkpoint

    def full_disk(*args: Any) -> None:
        monkeypatch.setattr(durability, "checkpoint", real)
        raise OSError(28, "No space left on device")

    def restored() -> Shard:   # what a restart after kill -9 would see
        servicer.checkpoints_written()
        shard = Shard()
        Durability(str(tmp_path / "ckpt")).restore(shard)
        return shard

    try:
        with rpc.channel(server.address) as ch:
            c = Client(ps_pb2_grpc.ParameterServerStub(ch))
            monkeypatch.setattr(durability, "checkpoint", full_disk)
            refused(lambda: c.init(w0()), Code.UNAVAILABLE, r"Init: I/O error on the server: No space left")
            assert c.init(w0()).message == "already initialised"
            assert not c.push(0, 0, delta(0, 0)).duplicate
            assert restored().digest() == servicer.shard.digest()
            monkeypatch.setattr(durability, "checkpoint", full_disk)
            refused(lambda: c.stub.Evict(ps_pb2.EvictRequest(vw=1), timeout=CALL_S), Code.UNAVAILABLE,
                    r"Evict: I/O error on the server")
            assert c.stub.Evict(ps_pb2.EvictRequest(vw=1), timeout=CALL_S).message == "vw 1 was evicted already"
            assert restored().evicted == {1} and restored().c_global() == 1
    finally:
        server.stop(0)


def test_push_is_acknowledged_once_its_log_entry_is_on_disk(ps: InProcess, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Under WSP a push's log entry is fsynced after the push is applied (off the path to the pulls
    it releases) and before it is acknowledged, then renamed to its number and its folder fsynced.
    An fsync that fails leaves it applied but not acknowledged; its retry, a duplicate, is
    acknowledged once the original's entry is on disk."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    durability.every_clocks = 10**6  # no checkpoint: it would cover the entry (and fsync itself)
    synced = record_fsyncs(monkeypatch, [OSError(5, "Input/output error")])
    refused(lambda: c.push(1, 1, delta(1, 1)), Code.UNAVAILABLE, r"Input/output error")
    (written,) = durability.log_dir.glob("*.written")
    number = written.name.removesuffix(".written")
    assert c.status().c_global == 2, "applied before its fsync, so pulls need not wait for the disk"
    assert not synced
    assert c.push(1, 1, delta(1, 1)).duplicate
    assert synced == [written.name, "log"], "a duplicate was acknowledged before its original's entry was on disk"
    assert durability.entries()[-1].name == number and not written.exists()
    assert not c.push(0, 2, delta(0, 2)).duplicate
    assert synced[2:] == [durability.entries()[-1].name + ".written", "log"]
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == ps.servicer.shard.digest()


def test_a_push_through_shared_memory_is_acknowledged_once_its_entry_is_written(ps: InProcess, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A pusher that shares the shard's machine (its push came through shared memory) is answered
    once the entry is whole in the page cache, without an fsync: a kill -9 of the shard keeps the
    entry (a restart replays it), and a restart of the machine would end the pusher as well. A
    push in gRPC frames, from a pusher that may be elsewhere, still waits for the disk."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    durability.every_clocks = 10**6   # no checkpoint: it would cover the entries
    synced = record_fsyncs(monkeypatch)
    ring = shm.Ring(slots=1)
    try:
        tag = wire_pb2.PushTag(vw=1, clock=1)
        assert not c.stub.Push(iter(_frames(delta(1, 1), push=tag, ring=ring)), timeout=CALL_S).duplicate
        assert ps.servicer.shard.c_global() == 2 and not synced, "acknowledged without waiting for the disk"
        (written,) = durability.log_dir.glob("*.written")
        assert c.stub.Push(iter(_frames(delta(1, 1), push=tag, ring=ring)), timeout=CALL_S).duplicate
        assert not synced and written.exists()
    finally:
        ring.close()
    restored = Shard()   # what a restart after kill -9 sees: the entry, replayed
    assert Durability(str(tmp_path / "ckpt")).restore(restored) >= 1
    assert restored.digest() == ps.servicer.shard.digest()
    synced.clear()
    assert not c.push(0, 2, delta(0, 2)).duplicate
    assert synced[-1] == "log" and durability.entries()[-1].name + ".written" in synced, "gRPC frames wait for the disk"


def test_a_push_is_answered_before_the_checkpoint_it_captured_is_written(ps: InProcess, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A push that moves c_global captures a checkpoint (every clock here), which the checkpoint
    thread writes after the push is answered: the pusher does not wait for a snapshot of every
    key to reach the disk. Until it is written the log keeps the push; one that fails to be
    written changes nothing that a restart needs, and the next one covers the log."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    real_write, release, failed = durability.write, threading.Event(), [False]

    def slow_write(snapshot: Any) -> None:
        assert release.wait(CALL_S), "the push was not answered while its checkpoint was being written"
        if not failed[0]:
            failed[0] = True
            raise OSError(28, "No space left on device")
        real_write(snapshot)

    monkeypatch.setattr(durability, "write", slow_write)
    assert not c.push(1, 1, delta(1, 1)).duplicate   # c_global 1 -> 2: a checkpoint captured, not yet written
    assert not c.push(0, 2, delta(0, 2)).duplicate   # answered too, the first write still held
    assert ps.servicer.shard.c_global() == 2
    release.set()
    ps.servicer.checkpoints_written()
    assert failed[0], "the first write failed: logged, and the push was answered all the same"
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == ps.servicer.shard.digest()


def test_pull_past_deadline_says_why(ps: InProcess) -> None:
    c = ps.client
    before = state(c.status())
    started = time.monotonic()
    message = refused(lambda: c.pull(0, KEYS, min_clock=3, timeout=1.5), Code.DEADLINE_EXCEEDED,
                      r"c_global is 1.*min_clock 3")
    assert time.monotonic() - started < 5.0, message
    assert state(c.status()) == before
    # A pull the shard can answer right away still works after that.
    assert c.pull(0, KEYS, min_clock=1).header.pull.c_global == 1


def test_blocked_pull_returns_when_the_last_vw_pushes(ps: InProcess) -> None:
    c = ps.client
    got: dict[str, Any] = {}

    def pull() -> None:
        try:
            got["bundle"] = c.pull(0, KEYS, min_clock=2, timeout=30.0)
        except Exception as exc:  # surfaced by the assertions below
            got["error"] = exc
        got["at"] = time.monotonic()

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not got, f"the pull answered before c_global reached 2: {got}"
    # vw 1 pushes wave 1 in two parts (two stages owning different keys): still not enough after the first.
    assert not c.push(1, 1, delta(1, 1, ["l0.weight"])).duplicate
    time.sleep(0.3)
    assert t.is_alive(), "c_global over the pulled keys is still 1"
    pushed_at = time.monotonic()
    reply = c.push(1, 1, delta(1, 1, ["l0.bias"]))
    assert reply.c_global == 2
    t.join(10.0)
    assert not t.is_alive() and "error" not in got, got
    assert got["at"] - pushed_at < 2.0, "the pull must wake on the push, not poll slowly"
    tag = got["bundle"].header.pull
    assert tag.c_global == 2 and list(tag.vw_clocks) == [2, 2] and list(tag.own_clock) == [2, 2]
    expected = dict(ps.expected)
    for k, d in delta(1, 1):
        expected[k] = expected[k] + d
    for k, v in got["bundle"].tensors:
        assert torch.equal(v, expected[k]), k


# ---- a real shard process, killed with kill -9 ------------------------------------------------------


@dataclass
class ShardProcess:
    args: list[str]
    ready: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""

    def start(self, port: int = 0) -> None:
        self.ready.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.args, "--port", str(port)], cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            assert self.proc.poll() is None, f"shard exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "shard did not get ready"
            time.sleep(0.05)
        address, metrics_port = self.ready.read_text().split()
        assert int(metrics_port) > 0
        self.address = address

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_kill_9_loses_no_acknowledged_push(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shard = ShardProcess(
        [sys.executable, "-m", "ps_server", "--ready-file", str(tmp_path / "shard.ready"), "--checkpoint-dir",
         str(ckpt), "--checkpoint-every", "2", "--exit-with-parent"],
        tmp_path / "shard.ready", tmp_path / "shard.log")
    ch = None
    try:
        shard.start()
        ch = rpc.channel(shard.address)
        c = Client(ps_pb2_grpc.ParameterServerStub(ch))
        assert c.init(w0()).message == "initialised"
        expected = dict(w0())
        acked: list[tuple[int, int, list[str]]] = []

        def push(vw: int, clock: int, keys: list[str] = KEYS) -> None:
            reply = c.push(vw, clock, delta(vw, clock, keys))
            assert not reply.duplicate
            acked.append((vw, clock, keys))
            for k, d in delta(vw, clock, keys):
                expected[k] = expected[k] + d

        # Checkpoints at c_global 2 and 4 (every 2 clocks); what follows lives only in the push log.
        for clock in range(4):
            push(1, clock)
            push(0, clock)
        push(0, 4)
        push(1, 4, ["l0.bias"])   # half of vw 1's wave 4: keys of one VW at different clocks
        before = c.status()
        assert before.c_global == 4 and before.pushes_applied == len(acked) == 10
        assert len(list((ckpt / "log").glob("*.safetensors"))) == 2, "the last two pushes are only in the log"

        assert shard.proc is not None
        shard.proc.send_signal(signal.SIGKILL)
        assert shard.proc.wait(10) == -signal.SIGKILL
        port = int(shard.address.rsplit(":", 1)[1])
        shard.start(port)  # same port: clients reconnect on their old channel

        after = c.status(wait_for_ready=True)
        assert after.values_digest == before.values_digest
        assert after.pushes_applied == len(acked), "every acknowledged push exactly once"
        assert after.restored_pushes >= 2, "the pushes after the last checkpoint came back from the log"
        assert [(x.vw, x.min_clock, x.max_clock) for x in after.clocks] == [(0, 5, 5), (1, 4, 5)]
        assert after.c_global == 4
        pulled = c.pull(1, KEYS, min_clock=4)
        assert list(pulled.header.pull.own_clock) == [4, 5]
        for k, v in pulled.tensors:
            assert torch.equal(v, expected[k]), f"{k}: w_global != w0 + the acknowledged pushes (O3)"

        # A client that never saw the last acknowledgements retries: duplicates, changing nothing.
        assert c.push(1, 4, delta(1, 4, ["l0.bias"])).duplicate
        assert c.push(0, 4, delta(0, 4)).duplicate
        assert c.status().values_digest == before.values_digest
        # ... and the job goes on.
        push(1, 4, ["l0.weight"])
        assert c.status().c_global == 5

        # SIGTERM: a graceful stop that checkpoints everything.
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(30) == 0, shard.log.read_text()[-2000:]
        final = Shard()
        Durability(str(ckpt)).restore(final)
        assert final.pushes_applied == len(acked) and final.c_global() == 5
        for k in KEYS:
            assert torch.equal(final.values[k], expected[k]), k
    finally:
        if ch is not None:
            ch.close()
        shard.stop()


def test_bad_shared_memory_handles_are_refused_and_change_nothing(ps: InProcess) -> None:
    """parallel.transport shm: a push whose bytes a handle names in /dev/shm, and pulls answered
    through the shard's own segments. A forged, stale or malformed handle is refused before the
    push is logged or applied; a current one is applied once, like gRPC frames."""
    c = ps.client
    before = state(c.status())
    assert ps.servicer.durability is not None
    logged = ps.servicer.durability.entries()
    with forged_handles(delta(0, 2), push=wire_pb2.PushTag(vw=0, clock=2)) as handles:
        for name, (frames, code, pattern) in handles.bad.items():
            try:
                refused(lambda: c.stub.Push(iter(frames), timeout=CALL_S), code, pattern)
                if len(frames) == 1:  # the unary twin, which one-frame bundles take, checks the same
                    refused(lambda: c.stub.PushFrame(frames[0], timeout=CALL_S), code, pattern)
                assert state(c.status()) == before, "a refused handle changed the shard"
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
        assert ps.servicer.durability.entries() == logged, "a refused push was logged"
        assert not c.stub.PushFrame(handles.good[0], timeout=CALL_S).duplicate
    assert c.status().pushes_applied == before[3] + 1
    for k, d in delta(0, 2):
        ps.expected[k] = ps.expected[k] + d
    # A pull through shared memory answers the same values as one in gRPC frames.
    reader = shm.Reader()
    request = ps_pb2.PullRequest(vw=1, keys=KEYS, shm=True)
    first = list(c.stub.Pull(request, timeout=CALL_S))
    assert len(first) == 1 and first[0].shm.name.startswith(shm.PREFIX)
    pulled = wire.decode(iter(first), reader=reader).named()
    for k in KEYS:
        assert torch.equal(pulled[k], ps.expected[k]), k
        assert torch.equal(pulled[k], c.pull(1, KEYS).named()[k]), k
    # Without a reader the client cannot take such an answer: it must ask in gRPC frames.
    with pytest.raises(wire.WireError, match="takes no shared-memory handles"):
        wire.decode(iter(first))


def test_pulls_through_shared_memory_share_a_generation_and_see_every_push(ps: InProcess) -> None:
    """Two VWs that pull one generation of the values share the shard's one copy, each with its own
    clocks; a duplicate push leaves that copy current, an applied one makes the next pull a new
    copy, and the old one stays intact for a VW that may still be reading it."""
    c, reader = ps.client, shm.Reader()

    def shm_pull(vw: int) -> tuple[wire_pb2.TensorFrame, wire.Bundle]:
        frames = list(c.stub.Pull(ps_pb2.PullRequest(vw=vw, keys=KEYS, shm=True), timeout=CALL_S))
        assert len(frames) == 1
        return frames[0], wire.decode(iter(frames), reader=reader)

    def assert_values(bundle: wire.Bundle, expected: dict[str, torch.Tensor]) -> None:
        for k, v in bundle.tensors:
            assert torch.equal(v, expected[k]), k

    written = ps.servicer.pull_slots.bytes_written
    frame1, pulled1 = shm_pull(1)
    frame0, pulled0 = shm_pull(0)
    assert frame0.shm == frame1.shm, "the second VW's pull of one generation was copied again"
    assert ps.servicer.pull_slots.bytes_written == written + frame0.shm.nbytes
    assert list(pulled1.header.pull.own_clock) == [1, 1] and list(pulled0.header.pull.own_clock) == [2, 2]
    assert_values(pulled0, ps.expected)
    assert_values(pulled1, ps.expected)
    old = dict(ps.expected)

    assert c.push(0, 1, delta(0, 1)).duplicate
    assert shm_pull(1)[0].shm == frame0.shm, "a duplicate push changed the generation"
    assert not c.push(1, 1, delta(1, 1)).duplicate
    for k, d in delta(1, 1):
        ps.expected[k] = ps.expected[k] + d
    frame1, pulled1 = shm_pull(1)
    assert frame1.shm.name != frame0.shm.name, "a slot that VW 0 may still read was rewritten"
    assert_values(pulled1, ps.expected)
    assert_values(wire.decode(iter([frame0]), reader=reader), old)


def test_evict_releases_the_evicted_vws_pull_slots(ps: InProcess) -> None:
    """An evicted VW pulls no more, so it never lets go of the pull slots it was handed: Evict
    releases them, or each would stay pinned in /dev/shm, never rewritten, for the rest of the job."""
    c, slots = ps.client, ps.servicer.pull_slots

    def shm_pull(vw: int) -> wire_pb2.ShmRef:
        frames = list(c.stub.Pull(ps_pb2.PullRequest(vw=vw, keys=KEYS, shm=True), timeout=CALL_S))
        return frames[0].shm

    before = slots.segments()
    held = shm_pull(1)                                  # vw 1 is handed a slot ...
    assert not c.push(0, 2, delta(0, 2)).duplicate      # ... a new generation ...
    mine = shm_pull(0)                                  # ... so vw 0 gets another
    assert mine.name != held.name and slots.segments() == before + 2
    assert c.stub.Evict(ps_pb2.EvictRequest(vw=1), timeout=CALL_S).message == "vw 1 evicted"
    assert held.name not in shm.segments(), "the evicted VW's slot stays in /dev/shm"
    assert slots.segments() == before + 1
    for clock in (3, 4):                                # vw 0 goes on alone in one slot
        assert not c.push(0, clock, delta(0, clock)).duplicate
        assert shm_pull(0).name == mine.name and slots.segments() == before + 1

