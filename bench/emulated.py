"""Shared helpers for the emulated-device benchmarks: build a job, run it locally, read its trace."""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as `python bench/NAME.py`: the repository root is not on sys.path then.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpipe import faults  # noqa: E402
from hetpipe.config import parse_job  # noqa: E402
from launch.local import run_local  # noqa: E402


def job_dict(
    *, out_dir: Path, forward_s: float, backward_s: float, steps: int, nm: int,
    virtual_workers: int = 1, stages: int = 4, D: int = 0, ps_shards: int = 1,
) -> dict[str, Any]:
    """A job whose every stage is padded to forward_s / backward_s, on a tiny MLP.

    The MLP (32 wide, 7 layers) computes in well under a millisecond per task on one CPU core,
    so the emulated pad, not real compute, sets every task's length even on a loaded machine.
    """
    job: dict[str, Any] = {
        "cluster": {
            "nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": virtual_workers * stages}]}],
            "emulate": {"forward_seconds": forward_s, "backward_seconds": backward_s},
        },
        "model": {"name": "mlp", "args": {"in_features": 32, "hidden": [32, 32, 32], "num_classes": 10}},
        "data": {"name": "synthetic", "batch_size": 16, "args": {"rows": 1024}},
        "train": {"steps": steps, "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.01}, "seed": 0},
        "parallel": {"virtual_workers": virtual_workers, "stages_per_vw": stages, "nm": nm, "D": D,
                     "ps_shards": ps_shards},
        "output": {"dir": str(out_dir), "trace": True},
    }
    return job


@dataclass(frozen=True, slots=True)
class Run:
    summary: dict[str, Any]
    rows: dict[tuple[int, int, int], dict[str, Any]]  # (vw, stage, p) -> trace row


def run_job(raw: dict[str, Any], injected: faults.Faults = faults.Faults()) -> Run:
    """Runs the job with every process on this machine, injecting faults (a straggler, jitter);
    returns its summary and trace."""
    out_dir = Path(raw["output"]["dir"])
    with faults.injected(injected):
        summary = run_local(parse_job(raw, base_dir=str(out_dir)), quiet=True)
    rows: dict[tuple[int, int, int], dict[str, Any]] = {}
    for path in sorted((out_dir / "trace").glob("vw*_stage*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[(row["vw"], row["stage"], row["p"])] = row
    return Run(summary, rows)


@dataclass(frozen=True, slots=True)
class Interval:
    start: float
    end: float
    kind: str  # "F", "B" or "FB"
    p: int


def stage_tasks(rows: dict[tuple[int, int, int], dict[str, Any]], vw: int, stage: int, last: bool) -> list[Interval]:
    """Every task the stage ran, in start order; the last stage's forward+backward is one task (L4)."""
    out: list[Interval] = []
    for (v, q, p), r in rows.items():
        if (v, q) != (vw, stage):
            continue
        if last:
            out.append(Interval(r["fwd_start"], r["bwd_end"], "FB", p))
        else:
            out.append(Interval(r["fwd_start"], r["fwd_end"], "F", p))
            out.append(Interval(r["bwd_start"], r["bwd_end"], "B", p))
    return sorted(out, key=lambda t: t.start)


def covered(tasks: Iterable[Interval], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] during which one of the (non-overlapping) tasks ran."""
    return sum(max(0.0, min(t.end, hi) - max(t.start, lo)) for t in tasks)


def median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"
