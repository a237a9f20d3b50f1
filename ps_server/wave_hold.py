"""Exact pulls (wsp at D 0, BSP): each key's waves that c_global has not reached, held back from its
values until every live VW has pushed them, then added in wave and VW order. Pure: no I/O, no locks."""

from __future__ import annotations

from typing import Any

import torch

from hetpipe.buffers import raw_bytes


class WaveHold:
    """Per key, the deltas of the waves its c_global has not reached, by wave and VW. The values
    then hold exactly every VW's waves below c_global, which is what a pull answers with (G2 alone
    is a lower bound: it would let a faster VW's next wave in), so O2 holds exactly; and a wave goes
    in as the same sums in the same order whatever order its pushes arrived in, so a run at D 0
    repeats bit for bit. Live, G4 keeps every VW within one wave of c_global at D 0 (the shard
    refuses a push past that), so a key holds one wave. Log replay after a power cut can hold more:
    a VW on another machine whose pushes were on disk may be waves ahead of a co-located one whose
    unsynced push the cut took, and its acknowledged pushes are kept, not refused.

    It replaces keeping a copy of each key's values at c_global while a faster VW's wave was in
    them: that cost a copy per wave, and the values took the pushes in their order of arrival.
    A held delta is the push's own tensor (a log entry's mapping, or its receive buffer): no copy."""

    def __init__(self, held: dict[str, dict[int, dict[int, torch.Tensor]]] | None = None) -> None:
        self.held: dict[str, dict[int, dict[int, torch.Tensor]]] = held or {}   # key -> wave -> vw -> delta

    def __bool__(self) -> bool:
        return bool(self.held)

    def keys(self) -> list[str]:
        return list(self.held)

    def wave(self, key: str) -> int | None:
        """The lowest wave key holds, None where it holds none."""
        waves = self.held.get(key)
        return min(waves) if waves else None

    def hold(self, key: str, wave: int, vw: int, delta: torch.Tensor) -> None:
        by_vw = self.held.setdefault(key, {}).setdefault(wave, {})
        assert vw not in by_vw, f"{key}: wave {wave} of vw {vw} held twice"
        by_vw[vw] = delta

    def deltas(self, key: str, joined: tuple[int, int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """key's held deltas in wave then VW order, the order they go into its values; joined:
        (wave, vw, delta), a push not held yet, in its place."""
        order = {(wave, vw): self.held[key][wave][vw] for wave, vw in self._at(key)}
        if joined is not None:
            order[joined[:2]] = joined[2]
        return [order[at] for at in sorted(order)]

    def release(self, key: str, below: int) -> list[torch.Tensor]:
        """key's held deltas of the waves below `below` (its c_global: every live VW pushed them),
        in wave then VW order, let go: they go into its values."""
        waves = self.held.get(key, {})
        out = [waves[wave][vw] for wave, vw in self._at(key) if wave < below]
        for wave in [w for w in waves if w < below]:
            del waves[wave]
        if not waves:
            self.held.pop(key, None)
        return out

    def _at(self, key: str) -> list[tuple[int, int]]:
        """key's held (wave, vw) pairs, in the order they go into its values."""
        return sorted((wave, vw) for wave, by_vw in self.held.get(key, {}).items() for vw in by_vw)

    def feed(self, h: Any) -> None:
        """Adds what is held to a hash (Shard.digest): it is state, counted in the clocks."""
        for key in sorted(self.held):
            for wave, vw in self._at(key):
                h.update(f"{key}@{wave}:{vw}".encode())
                h.update(raw_bytes(self.held[key][wave][vw]))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Copies, which the hold keeps from now on in place of the pushes' own tensors: those lie
        on log entries that a checkpoint covering them lets go, to be written over."""
        out: dict[str, dict[str, Any]] = {}
        for key, waves in self.held.items():
            at = self._at(key)
            copies = []
            for wave, vw in at:
                copy = waves[wave][vw] = waves[wave][vw].clone()
                copies.append(copy)
            out[key] = {"waves": torch.tensor([w for w, _ in at], dtype=torch.int64),
                        "vws": torch.tensor([v for _, v in at], dtype=torch.int64), "deltas": copies}
        return out

    @classmethod
    def restored(cls, snap: dict[str, dict[str, Any]]) -> WaveHold:
        hold = cls()
        for key, e in snap.items():
            vws = e["vws"].tolist()
            # A checkpoint from before several waves could be held names its one wave.
            waves = e["waves"].tolist() if "waves" in e else [int(e["wave"])] * len(vws)
            for wave, vw, delta in zip(waves, vws, e["deltas"]):
                hold.hold(key, int(wave), int(vw), delta.clone())
        return hold
