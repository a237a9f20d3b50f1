"""The results of bench/convergence.py: one run's point, time (and steps) to the target
interpolated between the runs that bracket it, and the plot of accuracy against wall time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Point:
    config: str
    mode: str
    D: int
    steps: int
    wall_seconds: float
    accuracy: float          # held-out: the summary's eval_accuracy
    samples_per_second: float
    samples: int             # minibatches x batch over every VW / rank
    final_loss: float
    wait_seconds: float
    lr: float
    workers: int             # VWs (HetPipe) or ranks (ddp)
    reached: bool


def bracket(points: list[Point]) -> tuple[Point | None, Point | None]:
    """(the longest run below the target that is shorter than hi, hi = the shortest run that reached it)."""
    hits = [p for p in points if p.reached]
    if not hits:
        return None, None
    hi = min(hits, key=lambda p: p.steps)
    below = [p for p in points if not p.reached and p.steps < hi.steps]
    return (max(below, key=lambda p: p.steps) if below else None), hi


def time_to_target(points: list[Point], target: float) -> tuple[float, str]:
    """Seconds to the target, interpolated between the bracketing runs; NaN if never reached.
    The note says how it was obtained."""
    lo, hi = bracket(points)
    if hi is None:
        return float("nan"), "not reached"
    if lo is None:
        return hi.wall_seconds, "<= (shortest run)"
    frac = (target - lo.accuracy) / (hi.accuracy - lo.accuracy)
    return lo.wall_seconds + frac * (hi.wall_seconds - lo.wall_seconds), "interpolated"


def steps_to_target(points: list[Point], target: float) -> float:
    """Steps to the target, interpolated like time_to_target (NaN if never reached)."""
    lo, hi = bracket(points)
    if hi is None:
        return float("nan")
    if lo is None:
        return float(hi.steps)
    return lo.steps + (target - lo.accuracy) / (hi.accuracy - lo.accuracy) * (hi.steps - lo.steps)


def faster(a: float, b: float) -> float:
    """How much less time a takes than b (0.28 = 28% faster); NaN when either is missing."""
    return 1.0 - a / b if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def plot(path: Path, curves: dict[str, list[Point]], ttt: dict[str, float], target: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, pts in curves.items():
        xs = [p.wall_seconds for p in sorted(pts, key=lambda p: p.steps)]
        ys = [p.accuracy for p in sorted(pts, key=lambda p: p.steps)]
        (line,) = ax.plot(xs, ys, marker="o", linestyle="--" if name == "horovod" else "-", label=name)
        if math.isfinite(ttt.get(name, float("nan"))):
            ax.axvline(ttt[name], color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(target, color="grey", linestyle="-.", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training wall time (s): one point per run, each a fresh job of that many steps")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

