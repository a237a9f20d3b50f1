"""A shard adds a push's sums outside its lock (ps_server/servicer.py, Shard.accept then add): while
one push's keys are being added, the pushes and pulls of other keys go on, and everything that
reads or adds to those keys (a pull, another VW's push, a digest) waits for the add to end. What
restore replays is still each key's order of applies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe import rpc, shm, wire
from hetpipe.v1 import ps_pb2, ps_pb2_grpc, wire_pb2
from ps_rig import CALL_S, Client, Code, InProcess, delta, in_process_shard, refused
from ps_server import servicer as servicer_module
from ps_server.adds import Adder
from ps_server.durability import Durability
from ps_server.pull_slots import Claim, PullSlots
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard

pytestmark = pytest.mark.timeout(120)
HOLD_S = 60.0   # a held add's own limit: the test lets it go long before (a serial shard fails at CALL_S)


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[InProcess]:
    with in_process_shard(tmp_path) as shard:
        yield shard


class Call(threading.Thread):
    """f() on a thread of its own; result() once it has returned (or raised)."""

    def __init__(self, f: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._f, self._out, self._error = f, None, None

    def run(self) -> None:
        try:
            self._out = self._f()
        except Exception as exc:   # handed to result(), in the test's thread
            self._error = exc

    def result(self) -> Any:
        self.join(CALL_S)
        assert not self.is_alive(), "the call did not return"
        if self._error is not None:
            raise self._error
        return self._out


def hold_adds_to(monkeypatch: pytest.MonkeyPatch, value: torch.Tensor) -> tuple[threading.Event, threading.Event]:
    """Adds to `value` (one key's w_global) wait, once begun, until `release` is set."""
    entered, release = threading.Event(), threading.Event()
    add = Adder.add

    def held(adder: Adder, target: torch.Tensor, update: torch.Tensor) -> None:
        if target is value and not release.is_set():
            entered.set()
            release.wait(HOLD_S)
        add(adder, target, update)

    monkeypatch.setattr(Adder, "add", held)
    return entered, release


def test_while_a_key_is_being_added_other_keys_go_on_and_its_readers_wait(
        ps: InProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c, servicer = ps.client, ps.servicer
    assert servicer.durability is not None
    servicer.durability.every_clocks = 10**6   # no checkpoint due: it would wait for the add (below)
    entered, release = hold_adds_to(monkeypatch, servicer.shard.values["l0.weight"])
    weight = Call(lambda: c.push(1, 1, delta(1, 1, ["l0.weight"])))
    weight.start()
    assert entered.wait(CALL_S), "the push of l0.weight never began its add"

    # Another key: its push is applied and its pull answered while l0.weight is being added.
    assert not c.push(1, 1, delta(1, 1, ["l0.bias"])).duplicate
    bias = c.pull(0, ["l0.bias"])
    assert weight.is_alive(), "the push of l0.bias waited for the add of l0.weight"
    expected_bias = ps.expected["l0.bias"] + delta(1, 1, ["l0.bias"])[0][1]
    assert torch.equal(dict(bias.tensors)["l0.bias"], expected_bias)

    # The key being added: its pull, another VW's push of it, and a digest of every key wait.
    pull = Call(lambda: dict(c.pull(0, ["l0.weight"]).tensors)["l0.weight"])
    other = Call(lambda: c.push(0, 2, delta(0, 2, ["l0.weight"])))
    status = Call(c.status)
    for call in (pull, other, status):
        call.start()
    weight.join(0.5)
    assert pull.is_alive() and other.is_alive() and status.is_alive(), "read or added to a key being added"
    release.set()

    assert not weight.result().duplicate and not other.result().duplicate
    first = ps.expected["l0.weight"] + delta(1, 1, ["l0.weight"])[0][1]
    both = first + delta(0, 2, ["l0.weight"])[0][1]
    pulled = pull.result()
    assert torch.equal(pulled, first) or torch.equal(pulled, both), "a pull read a sum half added"
    assert status.result().c_global == 2
    assert torch.equal(servicer.shard.values["l0.weight"], both)
    assert torch.equal(servicer.shard.values["l0.bias"], expected_bias)

    servicer.checkpoints_written()
    restored = Shard()   # what a restart after kill -9 replays: each key's applies in their order
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == servicer.shard.digest()


def test_a_checkpoint_waits_for_the_adds_under_way(ps: InProcess, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint captured while another push's sums are being added holds them whole, or not
    at all: its snapshot is taken once no add is under way."""
    c, servicer = ps.client, ps.servicer
    durability = servicer.durability
    assert durability is not None
    durability.every_clocks = 1
    entered, release = hold_adds_to(monkeypatch, servicer.shard.values["l0.weight"])
    weight = Call(lambda: c.push(1, 1, delta(1, 1, ["l0.weight"])))
    weight.start()
    assert entered.wait(CALL_S)
    # vw 1's push of l0.bias brings c_global to 2 once l0.weight's is in: a checkpoint is due.
    bias = Call(lambda: c.push(1, 1, delta(1, 1, ["l0.bias"])))
    bias.start()
    bias.join(0.5)
    assert bias.is_alive(), "the checkpoint it made due did not wait for the add under way"
    release.set()
    assert not weight.result().duplicate and not bias.result().duplicate
    servicer.checkpoints_written()
    snap = torch.load(durability.checkpoint_path, weights_only=True)
    for key in ("l0.weight", "l0.bias"):
        clocks = snap["clocks"][key].tolist()
        values = snap["values"][key]
        if clocks[1] == 2:   # the checkpoint counts vw 1's wave 1 for this key: it holds its sum
            assert torch.equal(values, servicer.shard.values[key]), key
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == servicer.shard.digest()


def test_a_retry_and_an_evict_wait_for_the_add_under_way(ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry of a push whose sums are being added is its duplicate once they are in; an Evict
    (which may close quorum rounds and checkpoints every key) waits for them too, here another VW's."""
    c, servicer = ps.client, ps.servicer
    entered, release = hold_adds_to(monkeypatch, servicer.shard.values["l0.weight"])
    first = Call(lambda: c.push(1, 1, delta(1, 1)))
    first.start()
    assert entered.wait(CALL_S)
    retry = Call(lambda: c.push(1, 1, delta(1, 1)))
    evict = Call(lambda: c.stub.Evict(ps_pb2.EvictRequest(vw=0), timeout=CALL_S))
    retry.start()
    evict.start()
    first.join(0.5)
    assert retry.is_alive() and evict.is_alive(), "a retry or an Evict did not wait for the add"
    release.set()
    assert not first.result().duplicate and retry.result().duplicate
    assert evict.result().message == "vw 0 evicted"
    for key, d in delta(1, 1):
        assert torch.equal(servicer.shard.values[key], ps.expected[key] + d), key


def hold_slot_writes(monkeypatch: pytest.MonkeyPatch, *, first_only: bool = False) -> tuple[threading.Event, threading.Event]:
    """A pull's write into its shared-memory slot waits, once begun, until `release` is set
    (first_only: only the first write; the later ones go straight through)."""
    entered, release = threading.Event(), threading.Event()
    write = Claim.write

    def held(claim: Claim, pieces: Any) -> Any:
        if claim.writes and not release.is_set() and not (first_only and entered.is_set()):
            entered.set()
            release.wait(HOLD_S)
        return write(claim, pieces)

    monkeypatch.setattr(Claim, "write", held)
    return entered, release


def pull_through_shm(c: Client, vw: int, key: str) -> tuple[wire_pb2.ShmRef, torch.Tensor]:
    """vw's pull of key through shared memory: the slot it names, and what it holds."""
    frames = list(c.stub.Pull(ps_pb2.PullRequest(vw=vw, keys=[key], shm=True), timeout=CALL_S))
    return frames[0].shm, wire.decode(frames, reader=shm.Reader()).tensors[0][1]


def test_while_a_pull_writes_its_slot_other_keys_go_on_and_what_changes_its_keys_waits(
        ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull through shared memory copies the live values into its slot with the shard's lock let
    go: pushes and pulls of other keys go on, and a push of its keys and a Status wait for the copy."""
    c, servicer = ps.client, ps.servicer
    entered, release = hold_slot_writes(monkeypatch)
    first = Call(lambda: pull_through_shm(c, 1, "l0.weight"))
    first.start()
    assert entered.wait(CALL_S), "the pull never began its slot write"

    assert not c.push(1, 1, delta(1, 1, ["l0.bias"])).duplicate
    bias = dict(c.pull(0, ["l0.bias"]).tensors)["l0.bias"]
    assert first.is_alive(), "the push or pull of l0.bias waited for the slot write of l0.weight"
    assert torch.equal(bias, ps.expected["l0.bias"] + delta(1, 1, ["l0.bias"])[0][1])

    push = Call(lambda: c.push(1, 1, delta(1, 1, ["l0.weight"])))
    push.start()
    push.join(0.5)
    assert push.is_alive(), "a push changed a key being written out"
    status = Call(c.status)   # (a quiet() of its own would hold the push back too)
    status.start()
    status.join(0.5)
    assert status.is_alive(), "Status read every key while one was being written out"
    release.set()

    _, answered = first.result()   # the values as they were answered, without the push that waited
    assert torch.equal(answered, ps.expected["l0.weight"])
    assert not push.result().duplicate and status.result().c_global in (1, 2)   # before or after the push
    assert torch.equal(servicer.shard.values["l0.weight"], ps.expected["l0.weight"] + delta(1, 1, ["l0.weight"])[0][1])
    assert not servicer._reading, "a key stayed marked as read"


def test_a_pull_of_the_generation_being_written_waits_for_it_and_shares_the_slot(
        ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    c = ps.client
    entered, release = hold_slot_writes(monkeypatch)
    first = Call(lambda: pull_through_shm(c, 1, "l0.weight"))
    first.start()
    assert entered.wait(CALL_S)
    same = Call(lambda: pull_through_shm(c, 0, "l0.weight"))
    same.start()
    same.join(0.5)
    assert same.is_alive(), "a second pull of the generation being written did not wait for it"
    release.set()
    (ref, value), (shared_ref, shared) = first.result(), same.result()
    assert ref.name and shared_ref == ref, "two copies of one generation"
    assert torch.equal(value, ps.expected["l0.weight"]) and torch.equal(shared, value)
    assert ps.servicer.pull_slots.bytes_written == ref.nbytes


def test_a_quiet_under_way_holds_new_pulls_back(ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Status waiting for an add under way (quiet()) holds back the pulls that arrive meanwhile,
    even of other keys: pulls through shared memory mark their keys as read, and a stream of them
    could otherwise keep the reader of every key waiting for good."""
    c, servicer = ps.client, ps.servicer
    entered, release = hold_adds_to(monkeypatch, servicer.shard.values["l0.weight"])
    weight = Call(lambda: c.push(1, 1, delta(1, 1, ["l0.weight"])))
    weight.start()
    assert entered.wait(CALL_S)
    status = Call(c.status)
    status.start()
    status.join(0.5)
    bias = Call(lambda: pull_through_shm(c, 0, "l0.bias"))
    bias.start()
    bias.join(0.5)
    assert status.is_alive() and bias.is_alive(), "a pull went ahead of the quiet() waiting for the add"
    release.set()
    assert not weight.result().duplicate and status.result().c_global == 1
    assert torch.equal(bias.result()[1], ps.expected["l0.bias"])


def test_a_slot_write_that_fails_leaves_no_key_marked(ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    c, servicer = ps.client, ps.servicer

    def broken(claim: Claim, pieces: Any) -> Any:
        raise RuntimeError("no slot today")

    monkeypatch.setattr(Claim, "write", broken)
    refused(lambda: pull_through_shm(c, 1, "l0.weight"), Code.INTERNAL, "RuntimeError")
    assert not servicer._reading, "a failed write left its keys marked: their pushes would wait forever"
    assert not c.push(1, 1, delta(1, 1, ["l0.weight"])).duplicate
    assert c.status().c_global == 1


def test_a_slot_let_go_while_written_sends_its_reply_in_frames(ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_GROUPS key sets the least recent lose their slots, one being written too: that
    reply goes in frames, its keys still marked, instead of naming a segment that is gone."""
    c, servicer = ps.client, ps.servicer
    servicer.pull_slots = PullSlots(max_groups=1)
    entered, release = hold_slot_writes(monkeypatch, first_only=True)
    first = Call(lambda: pull_through_shm(c, 1, "l0.weight"))
    first.start()
    assert entered.wait(CALL_S)
    _, bias = pull_through_shm(c, 0, "l0.bias")   # pushes l0.weight's key set out
    release.set()
    ref, weight = first.result()
    assert not ref.name, "the reply named a slot"
    assert torch.equal(weight, ps.expected["l0.weight"]) and torch.equal(bias, ps.expected["l0.bias"])
    assert not servicer._reading


def test_an_add_that_fails_ends_the_shard_and_its_restart_replays_the_push_once(
        ps: InProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push whose clocks moved but whose sums could not all be added leaves no state to serve
    from: the shard exits (exit_now), its entry unsettled in the log, and a restore applies the
    push exactly once."""
    c, servicer = ps.client, ps.servicer
    servicer.checkpoints_written()
    exits: list[int] = []
    monkeypatch.setattr(servicer_module, "exit_now", exits.append)

    def no_memory(adder: Adder, target: torch.Tensor, update: torch.Tensor) -> None:
        raise RuntimeError("out of memory")

    add = Adder.add
    monkeypatch.setattr(Adder, "add", no_memory)
    refused(lambda: c.push(1, 1, delta(1, 1, ["l0.bias"])), Code.INTERNAL, r"internal error \(RuntimeError")
    assert exits == [70]
    monkeypatch.setattr(Adder, "add", add)   # the restarted shard's
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.key_clocks(1) == [1, 2]   # l0.weight, l0.bias
    assert torch.equal(restored.values["l0.bias"], ps.expected["l0.bias"] + delta(1, 1, ["l0.bias"])[0][1])
    assert torch.equal(restored.values["l0.weight"], ps.expected["l0.weight"])


def test_an_evict_that_fails_ends_the_shard(ps: InProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """An Evict that fails part way (the VW marked evicted, its released waves taken from the hold
    and half added) leaves no state to serve from, nor one its retry ("evicted already") would
    checkpoint: the shard exits, and its restart replays the log without the eviction."""
    exits: list[int] = []
    monkeypatch.setattr(servicer_module, "exit_now", exits.append)

    def no_memory(shard: Shard, vw: int) -> bool:
        raise MemoryError("no room for the released waves' sums")

    monkeypatch.setattr(Shard, "evict", no_memory)
    refused(lambda: ps.client.stub.Evict(ps_pb2.EvictRequest(vw=0), timeout=CALL_S), Code.RESOURCE_EXHAUSTED, "")
    assert exits == [70]


def test_two_vws_of_two_stages_pushing_and_pulling_at_once_never_read_a_sum_half_added(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two VWs x two stages, each stage on a thread of its own pushing its key (2M elements; one
    stage's in bf16, added a chunk at a time) and pulling it for every wave (one VW through shared
    memory, one in frames): each pull holds every push its clocks count, whole in every element,
    and the end holds each push once, as the log replays it. Integer sums from zeros: exact in
    any order. Each slot write starts 20 ms late, which widens the window in which a change of its
    keys would tear it: without the pushes' wait for the readers it failed in 5 of 5 runs here."""
    write = Claim.write

    def late(claim: Claim, pieces: Any) -> Any:
        time.sleep(0.02)
        return write(claim, pieces)

    monkeypatch.setattr(Claim, "write", late)
    waves, n = 16, 1 << 21
    servicer = ShardServicer(Shard(), Durability(str(tmp_path / "ckpt")), max_pull_wait_s=30.0)
    server = rpc.Server("127.0.0.1", 0, workers=16)
    server.add("ParameterServer", servicer)
    server.start()
    try:
        with rpc.channel(server.address) as ch:
            c = Client(ps_pb2_grpc.ParameterServerStub(ch))
            c.init([("a", torch.zeros(n)), ("b", torch.zeros(n))])
            torn: list[str] = []

            def stage(vw: int, key: str, dtype: torch.dtype) -> None:
                reader = shm.Reader()
                for clock in range(waves):
                    assert not c.push(vw, clock, [(key, torch.full((n,), float(vw + 1), dtype=dtype))]).duplicate
                    # vw 0 pulls through shared memory (its slot written outside the lock), vw 1 in frames.
                    request = ps_pb2.PullRequest(vw=vw, keys=[key], min_clock=clock, shm=vw == 0)
                    bundle = wire.decode(c.stub.Pull(request, timeout=CALL_S), reader=reader)
                    want = float(sum((v + 1) * k for v, k in enumerate(bundle.header.pull.vw_clocks)))
                    value = dict(bundle.tensors)[key]
                    if not bool((value == want).all()):
                        torn.append(f"vw {vw} {key} wave {clock}: {sorted(set(value.unique().tolist()))[:4]}, want {want}")

            calls = [Call(lambda vw=vw, key=key, dtype=dtype: stage(vw, key, dtype))
                     for vw in (0, 1) for key, dtype in (("a", torch.float32), ("b", torch.bfloat16))]
            for call in calls:
                call.start()
            for call in calls:
                call.result()
            assert not torn, torn[:3]
            for key in ("a", "b"):
                assert bool((servicer.shard.values[key] == 3.0 * waves).all()), key
            servicer.checkpoints_written()
            restored = Shard()
            Durability(str(tmp_path / "ckpt")).restore(restored)
            assert restored.digest() == servicer.shard.digest()
    finally:
        server.stop(0)
