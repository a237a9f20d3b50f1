"""Pure Wave Synchronous Parallel rules (DESIGN §3); no gRPC, no threads."""

from __future__ import annotations

from collections.abc import Iterable


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


def clock_distance(clocks: Iterable[int]) -> int:
    """Difference between the fastest and the slowest VW's clock."""
    values = list(clocks)
    return max(values) - min(values) if values else 0


def s_global(nm: int, D: int) -> int:
    """The paper's global staleness bound (D+1)*Nm + Nm - 2, in minibatches."""
    return (D + 1) * nm + nm - 2
