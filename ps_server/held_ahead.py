"""Exact pulls (wsp at D 0, BSP): the waves a shard holds ahead of c_global. Pure: no I/O, no locks."""

from __future__ import annotations

from typing import Any

import torch

from hetpipe.buffers import raw_bytes


class HeldAhead:
    """Per key, the sum of each wave pushed at or past the key's c_global. Those sums are in the
    key's values already; a pull's answer takes them out (without()), so that it holds every VW's
    waves below c_global and none of the later ones, which WSP would allow (a lower bound): a run
    then does not depend on whether a pull arrives before or after a faster VW's next push, and
    O2 holds exactly. D 0 keeps every VW within one wave of c_global, so this costs at most one
    more copy of a key while a VW is ahead."""

    def __init__(self, waves: dict[str, dict[int, torch.Tensor]] | None = None) -> None:
        self.waves: dict[str, dict[int, torch.Tensor]] = waves or {}   # key -> wave >= c_global -> its sum
        self._spare: dict[str, torch.Tensor] = {}   # a trimmed sum's buffer, for the key's next wave

    def __contains__(self, key: object) -> bool:
        return key in self.waves

    def __bool__(self) -> bool:
        return bool(self.waves)

    def keys(self) -> list[str]:
        return list(self.waves)

    def of(self, key: str) -> dict[int, torch.Tensor]:
        """key's waves held, by wave (empty when none)."""
        return self.waves.get(key, {})

    def hold(self, key: str, wave: int, c_global: int, delta: torch.Tensor) -> None:
        """A push of `wave` for key was applied, whose c_global is now c_global: a wave it has not
        reached is held as well (a copy: delta may lie on a log entry that is written over later),
        and waves it has reached are let go."""
        if wave >= c_global:
            waves = self.waves.setdefault(key, {})
            if wave in waves:
                waves[wave].add_(delta)
            else:   # into the last trimmed buffer: a fresh one costs its pages' faults, each wave
                spare = self._spare.pop(key, None)
                waves[wave] = delta.clone() if spare is None else spare.copy_(delta)
        self.trim(key, c_global)

    def trim(self, key: str, c_global: int) -> None:
        """Drops key's waves below c_global, which every pull now includes."""
        waves = self.waves.get(key, {})
        for wave in [w for w in waves if w < c_global]:
            self._spare[key] = waves.pop(wave)
        if not waves:
            self.waves.pop(key, None)

    def without(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """A copy of key's value without the waves held for it."""
        out = value.clone()
        for delta in self.of(key).values():
            out.sub_(delta)
        return out

    def feed(self, h: Any) -> None:
        """Adds what is held to a hash (Shard.digest): what pulls take out is state."""
        for key in sorted(self.waves):
            for wave in sorted(self.waves[key]):
                h.update(f"{key}:{wave}".encode())
                h.update(raw_bytes(self.waves[key][wave]))

    def snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {str(w): d.clone() for w, d in waves.items()} for k, waves in self.waves.items()}

    @classmethod
    def restored(cls, snap: dict[str, dict[str, torch.Tensor]]) -> HeldAhead:
        return cls({k: {int(w): d.clone() for w, d in waves.items()} for k, waves in snap.items()})
