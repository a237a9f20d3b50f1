"""Pure Wave Synchronous Parallel rules (DESIGN §3); no gRPC, no threads."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


# G1 on the wire: the one narrowing a wave's sum may be pushed in (a bf16 job's float32 keys, half
# the bytes), and so the one a shard takes for a key besides its own dtype. Init, pulls and elastic
# exchanges stay in the key's dtype.
NARROWED_PUSH = {torch.float32: torch.bfloat16}


def wave_of(p: int, nm: int) -> int:
    """Wave c holds minibatches c*nm+1 .. (c+1)*nm."""
    if p < 1 or nm < 1:
        raise ValueError(f"minibatch {p} / nm {nm}: both must be >= 1")
    return (p - 1) // nm


def closes_wave(p: int, nm: int, steps: int) -> bool:
    """Whether finishing p completes a wave: its last minibatch, or the final partial wave."""
    return p % nm == 0 or p == steps


def may_inject(p: int, nm: int, completed: int) -> bool:
    """L1: stage 0 injects p only once minibatch p-nm has completed (backwards finish in order)."""
    return p - nm <= completed


def required_min_clock(p: int, nm: int, D: int, steps: int | None = None) -> int:
    """G2: the c_global a stage's weights must include before the forward of p.

    floor(p/nm) - 1 - D: waves <= floor(p/nm) - D - 2 of every VW are then included. The last
    minibatch of a run (steps) closes its wave even when the wave is partial, so it asks what
    that wave's full last minibatch would: otherwise the final push could leave a VW D+2
    clocks ahead of the slowest, past G4's bound.
    """
    if steps is not None and p == steps:
        p = (wave_of(p, nm) + 1) * nm
    return max(0, p // nm - 1 - D)


def exact_pulls(sync: str, D: int) -> bool:
    """Whether the shards answer pulls with exactly the waves below c_global (D = 0, BSP): the
    run is then the same whatever the timing of its pulls. Above 0, a pull also includes the
    later waves pushed by then, which G2, a lower bound, allows."""
    return sync == "wsp" and D == 0


def shard_bound(sync: str, D: int) -> dict[str, Any]:
    """The InitTag fields that tell a shard WSP's bound: exact pulls at D = 0, and D, against which
    the shard checks every push (G4), whatever a stage does."""
    return {"exact": exact_pulls(sync, D), "distance_bound": D} if sync == "wsp" else {}


def total_waves(steps: int, nm: int) -> int:
    """Waves in a run of `steps` minibatches per VW: the last one may be partial."""
    return math.ceil(steps / nm)


@dataclass(frozen=True, slots=True)
class PullDecision:
    """G2 at the forward of p: whether it may run on the weights at hand, and the min_clock to
    pull for now (None: no pull needed). A pull for a later wave's forwards may go out early:
    G2 is a lower bound, so fresher weights are always allowed, and asking now hides the trip."""

    allowed: bool
    pull: int | None


def g2_decision(p: int, nm: int, D: int, steps: int, have: int) -> PullDecision:
    """G2 for the forward of p when the local weights include c_global `have`."""
    need = required_min_clock(p, nm, D, steps)
    if need > have:
        return PullDecision(False, need)
    ahead = required_min_clock(min(p + nm, steps), nm, D, steps)
    return PullDecision(True, ahead if ahead > have else None)


def merge_pulled(pulled: Sequence[torch.Tensor], own_clock: Sequence[int],
                 own_waves: Mapping[int, Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """G3: the local weights after a pull. Per parameter i: the pulled w_global, which holds this
    VW's own waves < own_clock[i], plus this stage's own wave updates it does not hold yet
    (waves >= own_clock[i]). Nothing lost, nothing counted twice."""
    merged = []
    for i, value in enumerate(pulled):
        for update in unpulled(i, own_clock, own_waves):
            value = value + update
        merged.append(value)
    return merged


def unpulled(i: int, own_clock: Sequence[int], own_waves: Mapping[int, Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """G3's addends for parameter i: this stage's own wave updates that w_global, pulled with
    own_clock, does not hold yet, in wave order (merge_pulled adds them, or a stage in place)."""
    return [own_waves[wave][i] for wave in sorted(own_waves) if wave >= own_clock[i]]


def waves_included(own_clock: Sequence[int]) -> int:
    """Own waves below this are in w_global for every parameter: their local sums can go."""
    return min(own_clock) if own_clock else 0


def clock_distance(clocks: Iterable[int]) -> int:
    """Difference between the fastest and the slowest VW's clock."""
    values = list(clocks)
    return max(values) - min(values) if values else 0


def s_global(nm: int, D: int) -> int:
    """The paper's global staleness bound (D+1)*Nm + Nm - 2, in minibatches."""
    return (D + 1) * nm + nm - 2
