"""A real shard process (`python -m ps_server`) under parallel.sync elastic: bad Exchange input is
refused with the right gRPC status and a message naming the problem, and changes nothing (same
digest, same counts); a retried exchange gets the stored delta; and after kill -9 the shard comes
back from its checkpoint + log with the same master and stored deltas (O3 for elastic: the master
= w0 + every acknowledged delta)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hetpipe import rpc, wire
from hetpipe.v1 import ps_pb2, wire_pb2
from ps_rig import refused

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode
REPO = Path(__file__).resolve().parents[2]
CALL_S = 10.0
SHAPES = {"w": (2, 3), "b": (3,)}
KEYS = list(SHAPES)
ELASTIC = wire_pb2.InitTag(virtual_workers=2, sync="elastic", alpha=0.25, period=2, total_waves=4)  # 2 exchanges


def w0() -> list[tuple[str, torch.Tensor]]:
    return [(k, torch.arange(torch.Size(s).numel(), dtype=torch.float64).reshape(s) / 8) for k, s in SHAPES.items()]


def replica(vw: int, clock: int, keys: list[str] = KEYS) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 * vw + clock)
    return [(k, torch.randint(-64, 64, SHAPES[k], generator=g).to(torch.float64) / 4) for k in keys]


@dataclass
class ShardProcess:
    tmp: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""

    def start(self, port: int = 0) -> None:
        ready = self.tmp / "shard.ready"
        ready.unlink(missing_ok=True)
        with open(self.tmp / "shard.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                 "--ready-file", str(ready), "--checkpoint-dir", str(self.tmp / "ckpt"), "--checkpoint-every", "2",
                 "--exit-with-parent"],
                cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text().strip()):
            assert self.proc.poll() is None and time.monotonic() < deadline, (self.tmp / "shard.log").read_text()[-2000:]
            time.sleep(0.05)
        self.address = ready.read_text().split()[0]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Client:
    stub: Any

    def init(self, tag: wire_pb2.InitTag = ELASTIC, tensors: list[tuple[str, torch.Tensor]] | None = None) -> str:
        ack = self.stub.Init(wire.encode(tensors or w0(), init=tag), timeout=CALL_S)
        return str(ack.message)

    def exchange(self, vw: int, clock: int, tensors: list[tuple[str, torch.Tensor]], **kw: Any) -> wire.Bundle:
        frames = wire.encode(tensors, exchange=wire_pb2.ExchangeTag(vw=vw, clock=clock))
        return wire.decode(self.stub.Exchange(frames, timeout=CALL_S, **kw))

    def status(self, **kw: Any) -> ps_pb2.ShardStatus:
        return self.stub.Status(wire_pb2.Empty(), timeout=CALL_S, **kw)


def state(s: ps_pb2.ShardStatus) -> tuple[Any, ...]:
    return (s.values_digest, s.exchanges_applied, s.c_global, [(c.vw, c.min_clock, c.max_clock) for c in s.clocks])


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[ShardProcess, Client, dict[str, torch.Tensor]]]:
    """An elastic shard, 2 VWs, 2 exchanges each; vw 0 has done both, vw 1 its first."""
    yield from _elastic_shard(tmp_path)


@pytest.fixture(scope="module")
def refusing_shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ShardProcess, Client, dict[str, torch.Tensor]]]:
    """The same, shared by the bad-input cases: each is refused and changes nothing, so each
    finds the shard as the last left it (a shard process per case cost 1.3 s each)."""
    yield from _elastic_shard(tmp_path_factory.mktemp("shard"))


def _elastic_shard(tmp_path: Path) -> Iterator[tuple[ShardProcess, Client, dict[str, torch.Tensor]]]:
    process = ShardProcess(tmp_path)
    process.start()
    ch = rpc.channel(process.address)
    try:
        client = Client(rpc.Stub(ch, "ParameterServer"))
        assert client.init() == "initialised"
        master = dict(w0())
        for vw, clock in [(0, 0), (1, 0), (0, 1)]:
            reply = client.exchange(vw, clock, replica(vw, clock))
            assert not reply.header.exchange.duplicate
            for key, delta in reply.tensors:
                assert torch.equal(delta, 0.25 * (replica(vw, clock)[KEYS.index(key)][1] - master[key]))
                master[key] = master[key] + delta
        yield process, client, master
    finally:
        ch.close()
        process.kill()


def bad_inputs(c: Client) -> dict[str, tuple[Callable[[], Any], grpc.StatusCode, str]]:
    good = list(wire.encode(replica(1, 1), exchange=wire_pb2.ExchangeTag(vw=1, clock=1)))
    short = [wire_pb2.TensorFrame.FromString(good[0])]
    short[0].data = short[0].data[:-8]
    nan = replica(1, 1)
    nan[1][1][0] = float("nan")
    untagged = wire.encode(replica(1, 1))
    pushed = wire.encode(replica(1, 1), push=wire_pb2.PushTag(vw=1, clock=1))
    return {
        "unknown vw": (lambda: c.exchange(2, 0, replica(2, 0)), Code.INVALID_ARGUMENT, r"unknown vw 2: .*0\.\.1"),
        "foreign key": (lambda: c.exchange(1, 1, [*replica(1, 1), ("l9.weight", torch.zeros(2, dtype=torch.float64))]),
                        Code.NOT_FOUND, r"not owned by this shard.*l9\.weight"),
        "wrong shape": (lambda: c.exchange(1, 1, [("w", torch.zeros(3, 2, dtype=torch.float64))]),
                        Code.INVALID_ARGUMENT, r"w: value is torch\.float64 \[3, 2\], the key is torch\.float64 \[2, 3\]"),
        "wrong dtype": (lambda: c.exchange(1, 1, [(k, v.float()) for k, v in replica(1, 1)]),
                        Code.INVALID_ARGUMENT, r"w: value is torch\.float32"),
        "NaN": (lambda: c.exchange(1, 1, nan), Code.INVALID_ARGUMENT, r"exchange of vw 1 for clock 1: NaN or Inf in \['b'\]"),
        "a key twice": (lambda: c.exchange(1, 1, [replica(1, 1)[0], replica(1, 1)[0]]), Code.INVALID_ARGUMENT,
                        r"a key is named twice"),
        "clock skips ahead": (lambda: c.exchange(1, 2, replica(1, 2)), Code.FAILED_PRECONDITION,
                              r"exchange of vw 1 for clock 2 skips ahead: its exchanges for these keys are \[1\]"),
        "clock goes backwards": (lambda: c.exchange(0, 0, replica(0, 0)), Code.FAILED_PRECONDITION,
                                 r"exchange of vw 0 for clock 0 goes backwards.*\[2\]"),
        "past the last exchange": (lambda: c.exchange(0, 2, replica(0, 2)), Code.FAILED_PRECONDITION,
                                   r"the job has 2 exchanges per virtual worker"),
        "no exchange tag": (lambda: list(c.stub.Exchange(untagged, timeout=CALL_S)), Code.INVALID_ARGUMENT,
                            r"Exchange: first frame lacks the exchange tag"),
        "a push tag": (lambda: list(c.stub.Exchange(pushed, timeout=CALL_S)), Code.INVALID_ARGUMENT,
                       r"lacks the exchange tag"),
        "too few bytes": (lambda: list(c.stub.Exchange(iter([f.SerializeToString() for f in short]), timeout=CALL_S)),
                          Code.INVALID_ARGUMENT, r"byte length \d+ does not match the shapes"),
        "a push to an elastic shard": (
            lambda: c.stub.Push(wire.encode(replica(1, 1), push=wire_pb2.PushTag(vw=1, clock=0)), timeout=CALL_S),
            Code.FAILED_PRECONDITION, r"this shard runs sync elastic"),
        "init as wsp": (lambda: c.init(wire_pb2.InitTag(virtual_workers=2)), Code.ALREADY_EXISTS,
                        r"already initialised for SyncRule\(mode='elastic'"),
        "init with alpha 0.75": (
            lambda: c.init(wire_pb2.InitTag(virtual_workers=2, sync="elastic", alpha=0.75, period=2, total_waves=4)),
            Code.INVALID_ARGUMENT, r"sync elastic: alpha must be in \(0, 0\.5\], got 0\.75"),
        "init with quorum 3 of 2": (
            lambda: c.init(wire_pb2.InitTag(virtual_workers=2, sync="quorum", quorum=3, total_waves=4)),
            Code.INVALID_ARGUMENT, r"sync quorum: quorum 3 is more than the 2 virtual workers"),
    }


BAD = list(bad_inputs(Client(None)))


@pytest.mark.parametrize("what", BAD)
def test_bad_exchange_is_refused_and_changes_nothing(
        refusing_shard: tuple[ShardProcess, Client, dict[str, torch.Tensor]], what: str) -> None:
    _, c, master = refusing_shard
    before = state(c.status())
    call, code, pattern = bad_inputs(c)[what]
    refused(call, code, pattern)
    assert state(c.status()) == before, f"{what} changed the shard"
    # ... and it keeps serving exchanges: vw 0's retry of its last gets the delta stored for it,
    # made against the master of before any refusal (and a retry changes nothing either).
    retry = c.exchange(0, 1, replica(0, 1))
    assert retry.header.exchange.duplicate
    for key, delta in retry.tensors:
        assert torch.equal(delta, 0.25 * (replica(0, 1)[KEYS.index(key)][1] - (master[key] - delta))), key
    assert state(c.status()) == before


def test_retried_exchange_gets_the_stored_delta(shard: tuple[ShardProcess, Client, dict[str, torch.Tensor]]) -> None:
    _, c, _ = shard
    first = c.exchange(1, 1, replica(1, 1))
    before = state(c.status())
    again = c.exchange(1, 1, replica(1, 1, ["b"]))   # a retry, of part of it: that key's stored delta
    assert again.header.exchange.duplicate and [k for k, _ in again.tensors] == ["b"]
    assert torch.equal(again.named()["b"], first.named()["b"])
    assert state(c.status()) == before


def test_an_exchange_to_a_wsp_shard_is_refused(tmp_path: Path) -> None:
    process = ShardProcess(tmp_path)
    process.start()
    try:
        with rpc.channel(process.address) as ch:
            c = Client(rpc.Stub(ch, "ParameterServer"))
            c.init(wire_pb2.InitTag(virtual_workers=2, sync="wsp"))
            before = state(c.status())
            refused(lambda: c.exchange(0, 0, replica(0, 0)), Code.FAILED_PRECONDITION,
                    r"this shard runs sync wsp; exchanges are for sync elastic")
            assert state(c.status()) == before and c.status().sync == "wsp"
    finally:
        process.kill()


def test_kill_9_keeps_the_master_and_the_stored_deltas(
        shard: tuple[ShardProcess, Client, dict[str, torch.Tensor]]) -> None:
    process, c, master = shard
    before = c.status()   # checkpointed at c_global 2; vw 0's exchange 1 is only in the log
    assert before.exchanges_applied == 3 and before.c_global == 2 and before.sync == "elastic"
    assert process.proc is not None
    process.proc.send_signal(signal.SIGKILL)
    assert process.proc.wait(10) == -signal.SIGKILL
    process.start(int(process.address.rsplit(":", 1)[1]))   # the same port: the old channel reconnects
    after = c.status(wait_for_ready=True)
    assert state(after) == state(before) and after.restored_pushes == 1, "the last exchange came from the log"
    assert c.exchange(0, 1, replica(0, 1)).header.exchange.duplicate, "a retry of the logged exchange"
    last = c.exchange(1, 1, replica(1, 1))
    for key, delta in last.tensors:
        assert torch.equal(delta, 0.25 * (replica(1, 1)[KEYS.index(key)][1] - master[key])), "the master came back"
        master[key] = master[key] + delta
    retry = c.exchange(1, 1, replica(1, 1))
    assert retry.header.exchange.duplicate
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(retry.tensors, last.tensors))
    # The final pull (what the driver writes out): the master, w0 + every acknowledged delta.
    pulled = wire.decode(c.stub.Pull(ps_pb2.PullRequest(vw=0, keys=KEYS, min_clock=4), timeout=CALL_S))
    assert pulled.header.pull.c_global == 4
    for key, value in pulled.tensors:
        assert torch.equal(value, master[key]), key
