"""Exact pulls (wsp at D 0, BSP): each key's wave that c_global has not reached, held back from its
values until every live VW has pushed it, then added in VW order. Pure: no I/O, no locks."""

from __future__ import annotations

from typing import Any

import torch

from hetpipe.buffers import raw_bytes


class WaveHold:
    """Per key, the deltas of the wave its c_global has not reached, by VW. The values then hold
    exactly every VW's waves below c_global, which is what a pull answers with (G2 alone is a lower
    bound: it would let a faster VW's next wave in), so O2 holds exactly; and a wave goes in as
    the same sums in the same order whatever order its pushes arrived in, so a run at D 0 repeats
    bit for bit. G4 keeps every VW within one wave of c_global at D 0 (the shard refuses a push
    past that), so a key holds one wave at most.

    It replaces keeping a copy of each key's values at c_global while a faster VW's wave was in
    them: that cost a copy per wave, and the values took the pushes in their order of arrival.
    A held delta is the push's own tensor (a log entry's mapping, or its receive buffer): no copy."""

    def __init__(self, held: dict[str, tuple[int, dict[int, torch.Tensor]]] | None = None) -> None:
        self.held: dict[str, tuple[int, dict[int, torch.Tensor]]] = held or {}   # key -> (wave, vw -> delta)

    def __bool__(self) -> bool:
        return bool(self.held)

    def keys(self) -> list[str]:
        return list(self.held)

    def wave(self, key: str) -> int | None:
        """The wave key holds, None where it holds none."""
        entry = self.held.get(key)
        return None if entry is None else entry[0]

    def hold(self, key: str, wave: int, vw: int, delta: torch.Tensor) -> None:
        entry = self.held.setdefault(key, (wave, {}))
        assert entry[0] == wave and vw not in entry[1], f"{key}: wave {wave} of vw {vw} on {entry[0]}, {sorted(entry[1])}"
        entry[1][vw] = delta

    def deltas(self, key: str, joined: tuple[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """key's held deltas in VW order; joined: (vw, delta), a push not held yet, in its place."""
        by_vw = dict(self.held[key][1]) if key in self.held else {}
        if joined is not None:
            by_vw[joined[0]] = joined[1]
        return [by_vw[v] for v in sorted(by_vw)]

    def release(self, key: str) -> list[torch.Tensor]:
        """key's held deltas in VW order, let go: its wave is complete, they go into its values."""
        deltas = self.deltas(key)
        self.held.pop(key, None)
        return deltas

    def feed(self, h: Any) -> None:
        """Adds what is held to a hash (Shard.digest): it is state, counted in the clocks."""
        for key in sorted(self.held):
            wave, by_vw = self.held[key]
            h.update(f"{key}@{wave}:{sorted(by_vw)}".encode())
            for vw in sorted(by_vw):
                h.update(raw_bytes(by_vw[vw]))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Copies, which the hold keeps from now on in place of the pushes' own tensors: those lie
        on log entries that a checkpoint covering them lets go, to be written over."""
        out: dict[str, dict[str, Any]] = {}
        for key, (wave, by_vw) in self.held.items():
            vws = sorted(by_vw)
            copies = [by_vw[v].clone() for v in vws]
            self.held[key] = (wave, dict(zip(vws, copies)))
            out[key] = {"wave": wave, "vws": torch.tensor(vws, dtype=torch.int64), "deltas": copies}
        return out

    @classmethod
    def restored(cls, snap: dict[str, dict[str, Any]]) -> WaveHold:
        return cls({k: (int(e["wave"]), {int(v): d.clone() for v, d in zip(e["vws"].tolist(), e["deltas"])})
                    for k, e in snap.items()})
