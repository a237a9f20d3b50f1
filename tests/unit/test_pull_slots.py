"""A shard's pull slots (ps_server/pull_slots.py): the VWs that pull one generation share one
copy, a slot is never rewritten while a VW it went to may still read it, nor handed out or closed
while a pull writes it outside the shard's lock, and none outlives its group or the shard."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from hetpipe import shm, wire
from hetpipe.v1 import wire_pb2
from ps_server.pull_slots import PullSlots

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
KEYS = ("0.weight", "0.bias")


def _values(fill: float, n: int = 1000) -> list[tuple[str, torch.Tensor]]:
    return [(KEYS[0], torch.full((n, 4), fill)), (KEYS[1], torch.full((n,), fill))]


def _nbytes(values: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in values)


def _pull(slots: PullSlots, vw: int, generation: int, fill: float, n: int = 1000) -> list[bytes]:
    """vw's reply for the values of `generation` (all `fill`), as the servicer encodes it."""
    tag = wire_pb2.PullTag(c_global=generation)
    values = _values(fill, n)
    claim = slots.claim(vw, KEYS, generation, _nbytes(values))
    try:
        return list(wire.encode(values, pull=tag, ring=claim))
    finally:
        claim.done()


def _read(frames: list[bytes], reader: shm.Reader) -> float:
    """The one value a reply holds, after checking that its slot still holds what it names."""
    tensors = wire.decode(frames, reader=reader).tensors
    fills = {float(v) for _, t in tensors for v in t.unique()}
    assert len(fills) == 1, fills
    return fills.pop()


def _ref(frames: list[bytes]) -> wire_pb2.ShmRef:
    assert len(frames) == 1, "the bytes travel in shared memory, the reply carries one frame"
    return wire_pb2.TensorFrame.FromString(frames[0]).shm


def _mine() -> set[str]:
    return {s for s in shm.segments() if s.startswith(f"{shm.PREFIX}{os.getpid()}-")}


@pytest.fixture
def slots() -> Iterator[PullSlots]:
    before = _mine()   # in-process servers of earlier tests may own some
    s = PullSlots()
    yield s
    s.close()
    assert _mine() == before, "a closed PullSlots left a segment in /dev/shm"


def test_every_vw_that_pulls_one_generation_shares_one_copy(slots: PullSlots) -> None:
    reader = shm.Reader()
    first = _pull(slots, vw=0, generation=5, fill=1.0)
    nbytes = _ref(first).nbytes
    # The same generation again, for three more VWs: the values are not read again (the fill
    # differs to prove it) and the slot is not written again.
    others = [_pull(slots, vw, generation=5, fill=9.0) for vw in (1, 2, 3)]
    assert all(_ref(o) == _ref(first) for o in others)
    assert slots.bytes_written == nbytes and slots.segments() == 1
    assert {_read(f, reader) for f in [first, *others]} == {1.0}


def test_a_slot_is_rewritten_only_once_every_vw_it_went_to_pulled_again(slots: PullSlots) -> None:
    reader = shm.Reader()
    a0 = _pull(slots, vw=0, generation=0, fill=0.0)
    a1 = _pull(slots, vw=1, generation=0, fill=0.0)
    # VW 1 pulls a newer generation while VW 0 may still be copying generation 0 out: a new slot.
    b1 = _pull(slots, vw=1, generation=1, fill=1.0)
    assert _ref(b1).name != _ref(a0).name
    assert _read(a0, reader) == 0.0 and _read(a1, reader) == 0.0, "a held slot was overwritten"
    # VW 1 pulls again, so it is done with slot B; VW 0 still holds A: B is rewritten.
    b2 = _pull(slots, vw=1, generation=2, fill=2.0)
    assert _ref(b2).name == _ref(b1).name and _read(a0, reader) == 0.0
    with pytest.raises(wire.WireError, match="stale shared-memory handle"):
        _read(b1, reader)   # what VW 1 was done with is gone, and a late read of it is refused
    # VW 0 catches up to generation 2: it shares B, which frees A for the next generation.
    assert _ref(_pull(slots, vw=0, generation=2, fill=2.0)) == _ref(b2)
    c0 = _pull(slots, vw=0, generation=3, fill=3.0)
    assert _ref(c0).name == _ref(a0).name and _read(c0, reader) == 3.0 and _read(b2, reader) == 2.0
    assert slots.segments() == 2


def test_a_group_holds_at_most_one_slot_per_vw_however_the_generations_fall(slots: PullSlots) -> None:
    vws = 3
    for generation in range(40):
        vw = (generation * 7) % vws
        _pull(slots, vw, generation, float(generation))
        assert slots.segments() <= vws
    assert slots.bytes_written == 40 * _ref(_pull(slots, 0, 39, 39.0)).nbytes


def test_a_larger_reply_replaces_a_free_slot_too_small_for_it(slots: PullSlots) -> None:
    reader = shm.Reader()
    small = _pull(slots, vw=0, generation=0, fill=1.0, n=10)
    large = _pull(slots, vw=0, generation=1, fill=2.0, n=100_000)
    assert _ref(large).name != _ref(small).name and slots.segments() == 1
    assert _ref(small).name not in shm.segments(), "the replaced segment is unlinked"
    assert _read(large, reader) == 2.0


def test_the_least_recent_key_sets_give_their_slots_back() -> None:
    before = _mine()
    slots = PullSlots(max_groups=2)
    try:
        names = []
        for i in range(3):
            claim = slots.claim(0, [f"key{i}"], generation=0, nbytes=64)
            names.append(claim.write([memoryview(bytes(64))]).name)
            claim.done()
        assert names[0] not in shm.segments() and set(names[1:]) <= set(shm.segments())
        assert slots.segments() == 2
    finally:
        slots.close()
    assert _mine() == before


def test_an_evicted_vw_holds_no_slot(slots: PullSlots) -> None:
    """An evicted VW never pulls again, so it never lets go of what it was handed: release()
    closes the slots only it held, and takes it off those it shares (which then turn over)."""
    reader = shm.Reader()
    a = _pull(slots, vw=0, generation=0, fill=0.0)
    b = _pull(slots, vw=1, generation=1, fill=1.0)
    assert _ref(_pull(slots, vw=2, generation=1, fill=1.0)) == _ref(b)
    assert slots.segments() == 2
    slots.release(1)
    assert slots.segments() == 2 and _read(a, reader) == 0.0 and _read(b, reader) == 1.0
    slots.release(0)
    assert slots.segments() == 1 and _ref(a).name not in shm.segments(), "the evicted VW's own slot stays"
    slots.release(2)
    assert slots.segments() == 0 and _ref(b).name not in shm.segments()
    slots.release(2)   # an Evict retried
    assert _pull(slots, vw=3, generation=2, fill=2.0) and slots.segments() == 1


def test_a_slot_being_written_is_neither_shared_nor_reused_until_done(slots: PullSlots) -> None:
    """The servicer writes a claimed slot with its lock let go: until done(), writing() holds back
    the pulls of that generation (they share it after), and no other claim takes the slot."""
    reader = shm.Reader()
    values = _values(1.0)
    claim = slots.claim(0, KEYS, generation=1, nbytes=_nbytes(values))
    assert claim.writes and claim.ref is None
    assert slots.writing(KEYS, 1) and not slots.writing(KEYS, 2) and not slots.writing(("other",), 1)
    other = _pull(slots, vw=1, generation=2, fill=2.0)   # another generation meanwhile: another slot
    frames = list(wire.encode(values, pull=wire_pb2.PullTag(c_global=1), ring=claim))
    assert _ref(other).name != _ref(frames).name and slots.bytes_written == _ref(other).nbytes
    assert claim.done() and claim.done()   # idempotent
    assert not slots.writing(KEYS, 1) and slots.bytes_written == _ref(other).nbytes + _ref(frames).nbytes
    shared = _pull(slots, vw=2, generation=1, fill=9.0)
    assert _ref(shared) == _ref(frames) and _read(shared, reader) == 1.0


def test_a_claim_that_wrote_nothing_leaves_its_slot_free_and_holding_no_generation(slots: PullSlots) -> None:
    values = _values(1.0)
    claim = slots.claim(0, KEYS, generation=1, nbytes=_nbytes(values))
    with pytest.raises(ValueError, match="claimed for"):
        claim.write([memoryview(bytes(8))])   # not the bytes it was claimed for
    claim.done()
    assert slots.bytes_written == 0 and slots.segments() == 1
    again = _pull(slots, vw=1, generation=1, fill=3.0)   # generation 1 is written afresh, into that slot
    assert _read(again, shm.Reader()) == 3.0 and slots.segments() == 1


def test_a_slot_let_go_while_it_is_written_is_closed_once_written() -> None:
    before = _mine()
    slots = PullSlots(max_groups=1)
    try:
        claim = slots.claim(0, ["key0"], generation=0, nbytes=64)
        slots.claim(0, ["key1"], generation=0, nbytes=64).done()   # key0's group is let go meanwhile
        ref = claim.write([memoryview(bytes(64))])
        assert ref.name in shm.segments(), "closed under the writer"
        assert not claim.done(), "a reply naming a closed slot: it must go in frames"
        assert ref.name not in shm.segments() and slots.segments() == 1
        busy = slots.claim(0, ["key2"], generation=0, nbytes=64)
        slots.close()   # at shutdown, with a pull still writing
        busy.write([memoryview(bytes(64))])
        busy.done()
    finally:
        slots.close()
    assert _mine() == before


def test_a_vw_that_pulls_again_while_its_last_pull_writes_gets_another_slot(slots: PullSlots) -> None:
    """Pulling again frees what the VW held, but not a slot its last pull is still writing."""
    values = _values(1.0)
    claim = slots.claim(0, KEYS, generation=1, nbytes=_nbytes(values))
    again = _pull(slots, vw=0, generation=2, fill=2.0)
    frames = list(wire.encode(values, pull=wire_pb2.PullTag(c_global=1), ring=claim))
    assert claim.done() and _ref(again).name != _ref(frames).name
    reader = shm.Reader()
    assert _read(frames, reader) == 1.0 and _read(again, reader) == 2.0
