"""How far each key of w_global is from overflowing: an update whose sum with w_global could pass
the dtype's largest finite value is refused before anything is applied, as a NaN one is. Pure:
no I/O, no locks.

Finite updates can still make w_global infinite (a diverging run's huge step), and an Inf
in w_global reaches every VW at its next pull and stays. Checking every sum element by element
would cost a pass over w_global per push. Instead each key keeps a bound on |w| that grows by
each accepted update's largest |u|, and only a bound that comes near the limit has the key
looked at again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from ps_server.sync_rule import ShardError


def magnitude(t: torch.Tensor) -> float:
    """max |t| in one pass: NaN where t holds a NaN, inf where it holds an Inf; 0 when empty.
    (A sum would overflow for finite values, and |t| would allocate a copy.)"""
    if t.numel() == 0:
        return 0.0
    low, high = (float(x) for x in torch.aminmax(t))
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def magnitudes(what: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Each floating-point tensor's magnitude (max |t|). NaN or Inf would poison w_global for
    every VW for good: refused, naming the keys. Reads the tensors alone: a caller may measure a
    push before it takes the shard's lock (push_sizes)."""
    sizes = {k: magnitude(t) for k, t in tensors if t.is_floating_point()}
    bad = [k for k, m in sizes.items() if not math.isfinite(m)]
    if bad:
        raise ShardError(ShardError.Kind.INVALID, f"{what}: NaN or Inf in {bad[:5]}")
    return sizes


def push_sizes(vw: int, clock: int, deltas: Sequence[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """magnitudes() of VW vw's push for clock, a refusal naming it as Shard.push does."""
    return magnitudes(push_what(vw, clock), deltas)


def push_what(vw: int, clock: int) -> str:
    return f"push of vw {vw} for clock {clock}"


def grow(bound: float, added: float, dtype: torch.dtype) -> float:
    """A bound on |w + u| from |w| <= bound and |u| <= added, with room for the sum's rounding
    (one rounding each: |fl(w + u)| <= (|w| + |u|)(1 + eps))."""
    return (bound + added) * (1 + 2 * torch.finfo(dtype).eps)


class Headroom:
    """Per floating-point key, an upper bound on |x| for every element x that the key's w_global
    may hold: its values, plus every accepted update that is not in them yet (quorum rounds).
    A key with no bound yet (new, or restored) is measured on first use."""

    def __init__(self) -> None:
        self.bounds: dict[str, float] = {}

    def room(self, updates: Sequence[tuple[str, torch.Tensor]], sizes: dict[str, float],
             reach: Callable[[str], float],
             after: Callable[[str, torch.Tensor], float] | None,
             dtypes: Mapping[str, torch.dtype] | None = None) -> tuple[dict[str, float], list[str]]:
        """Each key's bound once its update is in, and the keys whose update could overflow.

        sizes: each floating-point update's magnitude; one that is not finite is over. reach(key):
        a fresh bound of the key as it is now, for a cached one that has grown loose. after(key, u):
        max |x| over what the key holds once u is in, computed (rare: only where the bound says it
        could overflow); None where that is not the next state (quorum), and the bound decides.
        dtypes: each key's dtype where its update is narrower (a bf16 push to a float32 key): the
        sum lives in the key's. Changes no bound: commit() does."""
        grown: dict[str, float] = {}
        over: list[str] = []
        for key, update in updates:
            if key not in sizes:
                continue
            if not math.isfinite(sizes[key]):   # an Inf delta: replica - master overflowed (elastic)
                over.append(key)
                continue
            dtype = update.dtype if dtypes is None else dtypes.get(key, update.dtype)
            limit = torch.finfo(dtype).max
            known = self.bounds.get(key)
            bound = math.inf if known is None else grow(known, sizes[key], dtype)
            if not bound <= limit:
                bound = grow(reach(key), sizes[key], dtype)
            if not bound <= limit and after is not None:
                bound = after(key, update)   # the sums themselves: no rounding left to allow for
            if not bound <= limit:   # NaN too
                over.append(key)
            else:
                grown[key] = bound
        return grown, over

    def commit(self, grown: dict[str, float]) -> None:
        """The updates room() measured are applied (or, quorum, accepted into a round)."""
        self.bounds.update(grown)
