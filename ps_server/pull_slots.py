"""Pull replies through shared memory, shared by every VW that pulls the same keys: one
generation of the values is copied into a slot once, however many VWs pull it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from hetpipe import shm
from hetpipe.v1 import wire_pb2

MAX_GROUPS = 256  # far more key sets than a job has stages; bounds what callers can make a shard keep


@dataclass(slots=True)
class _Slot:
    segment: shm.Segment
    generation: Hashable = None
    ref: wire_pb2.ShmRef | None = None
    holders: set[int] = field(default_factory=set)  # VWs handed this slot that have not pulled since
    writing: bool = False    # claimed: a pull writes it, outside the shard's lock
    let_go: bool = False     # its group went while it was written: closed once it is


class PullSlots:
    """The shard's slots per key set (one stage's keys). A slot is written only once every VW it
    went to has pulled these keys again, so has copied its last reply out: with D = 0 all the VWs
    pull one generation and share one slot. A VW holds one slot at most, and a new one is made
    only when every slot is held, so a group holds at most one slot per VW. Not thread-safe: the
    shard calls it under its lock, except a Claim's write, which touches only its own slot."""

    def __init__(self, max_groups: int = MAX_GROUPS) -> None:
        self._groups: OrderedDict[tuple[str, ...], list[_Slot]] = OrderedDict()
        self._max_groups = max_groups
        self.bytes_written = 0

    def writing(self, keys: Sequence[str], generation: Hashable) -> bool:
        """Whether a pull is writing this generation of keys now: one that wants it too waits for
        that Claim's done() and shares the slot, rather than write a second copy."""
        return any(s.writing and s.generation == generation for s in self._groups.get(tuple(keys), ()))

    def claim(self, vw: int, keys: Sequence[str], generation: Hashable, nbytes: int) -> Claim:
        """What vw's reply goes through (as through a shm.Ring): the slot that holds this generation
        already (Claim.ref: nothing to write), else a free one reserved for this pull, whose write
        may run without the shard's lock; done() under it, either way. generation must differ
        whenever the values may; not while writing(keys, generation)."""
        group = self._group(tuple(keys))
        for held in group:
            held.holders.discard(vw)  # it pulls again, so it has copied its last reply out
        for held in group:
            if held.ref is not None and held.generation == generation:
                held.holders.add(vw)
                return Claim(self, None, held.ref, nbytes)
        slot: _Slot | None = next((s for s in group if not s.holders and not s.writing), None)
        if slot is not None and slot.segment.capacity < nbytes:
            group.remove(slot)
            slot.segment.close()
            slot = None
        if slot is None:
            try:
                slot = _Slot(shm.Segment(shm.capacity(nbytes, shm.PAGE)))
            except OSError as exc:   # /dev/shm has no room: the reply goes in gRPC frames
                return Claim(self, None, None, nbytes, exc)
            group.append(slot)
        # A write that fails leaves no handle to a half-written slot, and the slot free.
        slot.ref, slot.generation, slot.holders, slot.writing = None, generation, {vw}, True
        return Claim(self, slot, None, nbytes)

    def _group(self, keys: tuple[str, ...]) -> list[_Slot]:
        group = self._groups.pop(keys, None) or []
        self._groups[keys] = group
        while len(self._groups) > self._max_groups:
            self._let_go(self._groups.popitem(last=False)[1])
        return group

    @staticmethod
    def _let_go(slots: Sequence[_Slot]) -> None:
        for slot in slots:
            if slot.writing:
                slot.let_go = True   # its Claim closes it once written
            else:
                slot.segment.close()

    def release(self, vw: int) -> None:
        """vw left the job (Evict) and pulls no more: it holds no slot, and the slots only it held
        are closed (one per key set it pulled, otherwise pinned for the rest of the job). Evict
        runs in quiet(): no slot is being written."""
        for group in self._groups.values():
            for slot in [s for s in group if vw in s.holders]:
                slot.holders.discard(vw)
                if not slot.holders:
                    group.remove(slot)
                    slot.segment.close()

    def segments(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def close(self) -> None:
        for group in self._groups.values():
            self._let_go(group)
        self._groups.clear()


class Claim:
    """One pull's use of a slot: a shm.Writer for wire.encode. ref set: the generation is in a
    slot already. Else write() copies the reply into the reserved slot, and done(), under the
    shard's lock like the claim, hands the slot to the pulls that share it (or frees it)."""

    def __init__(self, slots: PullSlots, slot: _Slot | None, ref: wire_pb2.ShmRef | None, nbytes: int,
                 error: OSError | None = None) -> None:
        self._slots, self._slot, self.ref, self._nbytes, self._error = slots, slot, ref, nbytes, error
        self._written: wire_pb2.ShmRef | None = None

    @property
    def writes(self) -> bool:
        """Whether write() reads the values (its caller keeps them unchanged until done())."""
        return self._slot is not None

    def refs(self, pieces: Sequence[memoryview]) -> Iterator[wire_pb2.ShmRef]:
        """One handle: a reply goes whole into its slot, which pulls of its generation share."""
        yield self.write(pieces)

    def write(self, pieces: Sequence[memoryview]) -> wire_pb2.ShmRef:
        """The handle of a slot holding pieces; OSError where /dev/shm has no room."""
        if self.ref is not None:
            return self.ref
        if self._slot is None:
            assert self._error is not None
            raise self._error
        nbytes = sum(len(p) for p in pieces)
        if nbytes != self._nbytes:
            raise ValueError(f"a pull slot claimed for {self._nbytes} bytes was handed {nbytes}")
        version = self._slot.segment.write(pieces)
        self._written = wire_pb2.ShmRef(name=self._slot.segment.name, version=version, nbytes=nbytes)
        return self._written

    def done(self) -> bool:
        """After write() or in its place (a write that failed, or none); idempotent. False where
        the slot written was let go meanwhile (its group pushed out by MAX_GROUPS others): the
        handle names nothing, and the reply goes in frames instead."""
        slot, self._slot = self._slot, None
        if slot is None:
            return True
        slot.writing = False
        if slot.let_go:
            slot.segment.close()
            return self._written is None
        if self._written is not None:
            slot.ref = self._written
            self._slots.bytes_written += self._nbytes
        else:
            slot.generation, slot.holders = None, set()
        return True
