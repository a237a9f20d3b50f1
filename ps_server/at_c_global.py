"""Exact pulls (wsp at D 0, BSP): each key's values as they stood at its c_global, kept while a
faster VW's next wave is in them. Pure: no I/O, no locks."""

from __future__ import annotations

from typing import Any

import torch

from hetpipe.buffers import raw_bytes


class AtCGlobal:
    """Per key, a copy of its values taken right before the first wave that c_global has not
    reached was added to them: every VW's waves below c_global and none later, bit for bit. A
    pull answers with it while it is kept (WSP alone would let the later wave in: G2 is a lower
    bound), so a run at D 0 does not depend on whether a pull arrives before or after a faster
    VW's next push, and O2 holds exactly. G4 keeps every VW within one wave of c_global at D 0
    (the shard refuses a push past that), so one copy per key is enough: once c_global moves on,
    the values hold exactly the waves below it again, and the copy is let go.

    It replaces keeping each early wave's sum and taking it out of the values for a pull: that
    cost the same copy, and (w + u) - u differs from w in the last bit of about 2% of the
    elements, so the answer depended on the timing after all."""

    def __init__(self, kept: dict[str, tuple[int, torch.Tensor]] | None = None) -> None:
        self.kept: dict[str, tuple[int, torch.Tensor]] = kept or {}   # key -> (its c_global, its values then)
        self._spare: dict[str, torch.Tensor] = {}   # a let-go copy's buffer, for the key's next one

    def __bool__(self) -> bool:
        return bool(self.kept)

    def keys(self) -> list[str]:
        return list(self.kept)

    def value(self, key: str) -> torch.Tensor | None:
        """key's values at its c_global, where a later wave is in its values; None where none is."""
        held = self.kept.get(key)
        return None if held is None else held[1]

    def keep(self, key: str, c_global: int, value: torch.Tensor) -> None:
        """value, the key's values at c_global, is about to take a wave c_global has not reached:
        a copy of it now (into the last let-go buffer: a fresh one costs its pages' faults), unless
        one is kept already."""
        if key in self.kept:
            return
        spare = self._spare.pop(key, None)
        self.kept[key] = (c_global, value.clone() if spare is None else spare.copy_(value))

    def trim(self, key: str, c_global: int) -> None:
        """Lets key's copy go once the key's c_global has moved past the one it was taken at."""
        held = self.kept.get(key)
        if held is not None and held[0] < c_global:
            del self.kept[key]
            self._spare[key] = held[1]

    def feed(self, h: Any) -> None:
        """Adds what is kept to a hash (Shard.digest): what pulls answer with is state."""
        for key in sorted(self.kept):
            c_global, value = self.kept[key]
            h.update(f"{key}@{c_global}".encode())
            h.update(raw_bytes(value))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {k: {"c_global": c, "values": v.clone()} for k, (c, v) in self.kept.items()}

    @classmethod
    def restored(cls, snap: dict[str, dict[str, Any]]) -> AtCGlobal:
        return cls({k: (int(held["c_global"]), held["values"].clone()) for k, held in snap.items()})
