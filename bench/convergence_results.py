"""The results of bench/convergence.py: each configuration's learning curve (held-out accuracy
against training wall time, from one long run), time to the target read off it, the CSV files,
the printed tables and the plot."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from convergence_runs import Run

# hetpipe.txt §8.4 (VGG-19, 16 GPUs, ED-local, Figure 6; D=0 vs Horovod also Figure 6).
PAPER = {
    "D=4 vs D=0": ("faster", 0.28),       # "faster by 28% ... compared to D=0"
    "D=32 vs D=4": ("slower", 0.047),     # "degraded by 4.7%, compared to D=4"
    "best WSP vs Horovod": ("faster", 0.49),   # "49% [faster] compared to ... Horovod"
    "D=0 vs Horovod": ("faster", 0.29),  # "roughly 29% faster than that with Horovod"
}


@dataclass(frozen=True, slots=True)
class Curve:
    config: str
    lr: float
    run: Run

    @property
    def points(self) -> list[tuple[float, float]]:
        """(seconds, accuracy), from training start; the origin is chance, before any step."""
        return [(e.seconds, e.accuracy) for e in self.run.evaluations]

    @property
    def final_accuracy(self) -> float:
        """The mean of the last three evaluations within the budget: one is noisy (SGD, the rows)."""
        tail = [e.accuracy for e in self.run.evaluations[-3:]]
        return sum(tail) / len(tail) if tail else math.nan


def time_to_target(points: list[tuple[float, float]], target: float) -> float:
    """Seconds until the accuracy first reaches target, interpolated linearly between the last
    evaluation below it and the first at or above it (NaN if it never does)."""
    before = (0.0, 0.0)
    for seconds, accuracy in points:
        if accuracy >= target:
            s0, a0 = before
            return s0 + (target - a0) / (accuracy - a0) * (seconds - s0) if accuracy > a0 else seconds
        before = (seconds, accuracy)
    return math.nan


def faster(a: float, b: float) -> float:
    """How much less time a takes than b (0.28 = 28% faster); NaN when either is missing."""
    return 1.0 - a / b if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b) else math.nan


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b) else "-"


# ---- files -------------------------------------------------------------------------------------


def write_curves(path: Path, curves: list[Curve]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "lr", "seconds", "samples", "vw0_minibatches", "accuracy", "loss"])
        for c in curves:
            for e in c.run.evaluations:
                w.writerow([c.config, f"{c.lr:g}", f"{e.seconds:.3f}", e.samples, e.minibatches,
                            f"{e.accuracy:.4f}", f"{e.loss:.4f}"])


def write_time_to_target(path: Path, curves: list[Curve], target: float) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "lr", "target", "time_to_target_s", "final_accuracy", "samples_per_second",
                    "samples", "seconds", "wait_seconds", "vw_minibatches", "clock_distance", "evaluations",
                    "worker_cpu_cores", "setup_seconds"])
        for c in curves:
            t = time_to_target(c.points, target)
            r = c.run
            w.writerow([c.config, f"{c.lr:g}", target, f"{t:.2f}" if math.isfinite(t) else "",
                        f"{c.final_accuracy:.4f}", f"{r.samples_per_second:.1f}", r.samples, f"{r.seconds:.1f}",
                        f"{r.wait_seconds:.2f}", " ".join(map(str, r.vw_minibatches)),
                        "" if r.clock_distance is None else r.clock_distance, len(r.evaluations),
                        f"{r.cpu_cores:.2f}", f"{r.setup_seconds:.1f}"])


def write_lr_grid(path: Path, rows: list[tuple[str, float, Run, float, bool]]) -> None:
    """rows: (config, lr, its short run, the accuracy it was judged by, picked)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "lr", "seconds", "end_accuracy", "samples_per_second", "evaluations", "picked"])
        for config, lr, run, accuracy, picked in rows:
            w.writerow([config, f"{lr:g}", f"{run.seconds:.1f}", f"{accuracy:.4f}" if math.isfinite(accuracy) else "",
                        f"{run.samples_per_second:.1f}", len(run.evaluations), int(picked)])


# ---- the printed tables --------------------------------------------------------------------------


def table(curves: list[Curve], target: float) -> str:
    """Time to target beside its ratio to Horovod-style (ddp) and to WSP D=0, measured in this run."""
    ttt = {c.config: time_to_target(c.points, target) for c in curves}
    ddp, d0 = ttt.get("horovod", math.nan), ttt.get("wsp D=0", math.nan)
    lines = [f"{'configuration':<18}{'lr':>7}{'samples/s':>10}{'cpu':>5}{'wait s':>8}{'VW minibatches':>22}{'dist':>5}"
             f"{'t->' + format(target, 'g') + ' s':>10}{'/ddp':>6}{'/D=0':>6}{'final acc':>10}"]
    for c in curves:
        r, t = c.run, ttt[c.config]
        vws = "/".join(map(str, r.vw_minibatches)) if c.config != "horovod" else f"{r.vw_minibatches[0]} each"
        lines.append(f"{c.config:<18}{c.lr:>7g}{r.samples_per_second:>10.0f}{r.cpu_cores:>5.2f}{r.wait_seconds:>8.1f}{vws:>22}"
                     f"{'' if r.clock_distance is None else r.clock_distance:>5}"
                     f"{format(t, '.1f') if math.isfinite(t) else 'not reached':>10}{ratio(t, ddp):>6}"
                     f"{ratio(t, d0):>6}{c.final_accuracy:>10.3f}")
    return "\n".join(lines)


def targets_table(curves: list[Curve], targets: list[float]) -> str:
    """Time to each of several accuracies: how much the ordering depends on where the target sits
    (near the plateau one noisy evaluation decides the first crossing)."""
    lines = [f"{'configuration':<18}" + "".join(f"{'t->' + format(t, 'g') + ' s':>11}" for t in targets)]
    for c in curves:
        times = [time_to_target(c.points, t) for t in targets]
        lines.append(f"{c.config:<18}" + "".join(f"{x:>11.1f}" if math.isfinite(x) else f"{'-':>11}" for x in times))
    return "\n".join(lines)


def paper_table(curves: list[Curve], target: float) -> str:
    ttt = {c.config: time_to_target(c.points, target) for c in curves}

    def get(name: str) -> float:
        return ttt.get(name, math.nan)

    wsp = {n: t for n, t in ttt.items() if n.startswith("wsp") and math.isfinite(t)}
    best = min(wsp, key=lambda n: wsp[n]) if wsp else None
    ours = {
        "D=4 vs D=0": faster(get("wsp D=4"), get("wsp D=0")),
        "D=32 vs D=4": -faster(get("wsp D=32"), get("wsp D=4")),
        "best WSP vs Horovod": faster(wsp[best], get("horovod")) if best else math.nan,
        "D=0 vs Horovod": faster(get("wsp D=0"), get("horovod")),
    }
    lines = ["time to target: x% faster = takes x% less time; x% slower = x% more (negative: the other way)",
             f"{'comparison':<28}{'ours':>16}{'paper (VGG-19, Fig. 6)':>26}"]
    for key, value in ours.items():
        word, paper = PAPER[key]
        label = f"{best} vs Horovod" if key.startswith("best") and best else key
        mine = f"{value:.1%} {word}" if math.isfinite(value) else "n/a"
        lines.append(f"{label:<28}{mine:>16}{('up to ' if key.startswith('best') else '') + f'{paper:.1%} {word}':>26}")
    return "\n".join(lines)


def plot(path: Path, curves: list[Curve], target: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    for c in curves:
        xs, ys = zip(*c.points) if c.points else ((), ())
        style = "--" if c.config == "horovod" else ":" if not c.config.startswith("wsp") else "-"
        (line,) = ax.plot(xs, ys, linestyle=style, linewidth=1.4, label=f"{c.config} (lr {c.lr:g})")
        t = time_to_target(c.points, target)
        if math.isfinite(t):
            ax.plot([t], [target], marker="o", color=line.get_color())
    ax.axhline(target, color="grey", linestyle="-.", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training wall time (s), one run per configuration")
    ax.set_ylabel("held-out accuracy (VW 0's / rank 0's weights)")
    ax.set_title(title, fontsize=8)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
