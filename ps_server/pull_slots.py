"""Pull replies through shared memory, shared by every VW that pulls the same keys: one
generation of the values is copied into a slot once, however many VWs pull it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
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


class PullSlots:
    """The shard's slots per key set (one stage's keys). A slot is written only once every VW it
    went to has pulled these keys again, so has copied its last reply out: with D = 0 all the VWs
    pull one generation and share one slot. A VW holds one slot at most, and a new one is made
    only when every slot is held, so a group holds at most one slot per VW. Not thread-safe: the
    shard calls it under its lock, as it reads the values."""

    def __init__(self, max_groups: int = MAX_GROUPS) -> None:
        self._groups: OrderedDict[tuple[str, ...], list[_Slot]] = OrderedDict()
        self._max_groups = max_groups
        self.bytes_written = 0

    def writer(self, vw: int, keys: Sequence[str], generation: Hashable) -> _Writer:
        """What wire.encode writes vw's reply through (as through a shm.Ring): the slot that holds
        this generation already, else a free one. generation must differ whenever the values may."""
        group = self._group(tuple(keys))
        for slot in group:
            slot.holders.discard(vw)  # it pulls again, so it has copied its last reply out
        return _Writer(self, group, vw, generation)

    def _group(self, keys: tuple[str, ...]) -> list[_Slot]:
        group = self._groups.pop(keys, None) or []
        self._groups[keys] = group
        while len(self._groups) > self._max_groups:
            for slot in self._groups.popitem(last=False)[1]:
                slot.segment.close()
        return group

    def release(self, vw: int) -> None:
        """vw left the job (Evict) and pulls no more: it holds no slot, and the slots only it held
        are closed (one per key set it pulled, otherwise pinned for the rest of the job)."""
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
            for slot in group:
                slot.segment.close()
        self._groups.clear()


class _Writer:
    def __init__(self, slots: PullSlots, group: list[_Slot], vw: int, generation: Hashable) -> None:
        self._slots, self._group, self._vw, self._generation = slots, group, vw, generation

    def write(self, pieces: Sequence[memoryview]) -> wire_pb2.ShmRef:
        """The handle of a slot holding pieces; OSError where /dev/shm has no room."""
        group = self._group
        for held in group:
            if held.ref is not None and held.generation == self._generation:
                held.holders.add(self._vw)
                return held.ref
        nbytes = sum(len(p) for p in pieces)
        slot = next((s for s in group if not s.holders), None)
        if slot is not None and slot.segment.capacity < nbytes:
            group.remove(slot)
            slot.segment.close()
            slot = None
        if slot is None:
            slot = _Slot(shm.Segment(shm.capacity(nbytes, shm.PAGE)))
            group.append(slot)
        slot.ref = None  # a write that fails leaves no handle to a half-written slot
        version = slot.segment.write(pieces)
        ref = slot.ref = wire_pb2.ShmRef(name=slot.segment.name, version=version, nbytes=nbytes)
        slot.generation = self._generation
        slot.holders = {self._vw}
        self._slots.bytes_written += nbytes
        return ref
