"""Pipeline schedules side by side: one emulated VW of 2 stages per schedule, its traced forwards
and backwards drawn per stage (hetpipe/timeline.py reads the trace), with each stage's measured
bubble (idle / span) and the run's samples/s.

    .venv/bin/python bench/timeline.py                       # hetpipe, gpipe, 1f1b, nf1b -> bench/out/timelines.png
    .venv/bin/python bench/timeline.py -o /tmp/t.png --schedules hetpipe gpipe

A schedule the job-file parser refuses (or a run that fails) is skipped with the reason. Each
run pays its processes' start-up (a few seconds on 2 CPU cores) besides its ~1 s of training.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulated import job_dict, load_average

from hetpipe import timeline
from hetpipe.config import ConfigError, parse_job
from hetpipe.errors import JobFailed
from hetpipe.timeline import Span
from launch.local import run_local
from stage_worker.micro_schedule import unit_version_differences

SCHEDULES = ["hetpipe", "gpipe", "1f1b", "nf1b"]
# (nm, microbatches): gpipe and 1f1b flush after every minibatch (nm 1), its micro-batches fill
# the pipeline; nf1b keeps HetPipe's nm minibatches in flight, each split in two for its forwards.
SHAPES = {"hetpipe": (4, 1), "gpipe": (1, 4), "1f1b": (1, 4), "nf1b": (4, 2)}
COLOURS = {"F": "#4C72B0", "B": "#DD8452"}


@dataclass(frozen=True, slots=True)
class Result:
    schedule: str
    nm: int
    microbatches: int
    spans: dict[int, list[Span]]    # stage -> its forwards and backwards
    bubble: dict[int, float]        # stage -> idle / span
    samples_per_second: float
    version_difference: dict[int, int]  # nf1b: TiMePReSt's v per minibatch (measured), else empty


def run(schedule: str, out_dir: Path, *, steps: int, forward_s: float, backward_s: float,
        stages: int) -> Result | str:
    """The schedule's run, or why it was skipped."""
    nm, micro = SHAPES.get(schedule, (4, 1))
    raw: dict[str, Any] = job_dict(out_dir=out_dir, forward_s=forward_s, backward_s=backward_s, steps=steps, nm=nm,
                                   stages=stages)
    raw["parallel"].update(schedule=schedule, microbatches=micro)
    try:
        job = parse_job(raw, base_dir=str(out_dir))
    except ConfigError as exc:
        return f"the job file is refused: {exc}"
    try:
        summary = run_local(job, quiet=True)
    except (ConfigError, JobFailed) as exc:
        return f"the run failed: {exc}"
    spans: dict[int, list[Span]] = {}
    rows = timeline.load(out_dir).stages
    for row in rows:
        spans.setdefault(int(row["stage"]), []).extend(timeline.compute_spans(row))
    # nf1b: TiMePReSt's v, stage 0's backward ends against the last stage's starts
    v = {p: d for (_, p), d in timeline.nf1b_version_differences(rows).items()}
    return Result(schedule, nm, micro, spans, {q: timeline.idle_fraction(s) for q, s in spans.items()},
                  float(summary["samples_per_second"]), v)


def plot(path: Path, results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = {r.schedule: min(s.start for spans in r.spans.values() for s in spans) for r in results}
    width = max(max(s.end for spans in r.spans.values() for s in spans) - t0[r.schedule] for r in results)
    fig, axes = plt.subplots(len(results), 1, figsize=(14, 1.3 + 1.1 * sum(len(r.spans) for r in results)),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        stages = sorted(r.spans)
        for row, q in enumerate(stages):
            y = len(stages) - 1 - row   # stage 0 on top
            for s in r.spans[q]:
                start, dur = s.start - t0[r.schedule], s.end - s.start
                ax.broken_barh([(start, dur)], (y - 0.4, 0.8), facecolors=COLOURS[s.kind], edgecolors="white",
                               linewidth=0.5)
                label = s.name[2:]   # p or p.m
                if dur > width * 0.004 * (len(label) + 1):   # about a 6-point character's width, at 14 inches
                    ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(stages)), [f"stage {q}" for q in reversed(stages)])
        ax.set_xlim(0, width * 1.01)
        shape = f"nm {r.nm}" + (f", {r.microbatches} micro-batches" if r.microbatches > 1 else "")
        bubbles = ", ".join(f"{100 * r.bubble[q]:.0f}%" for q in stages)
        ax.set_title(f"{r.schedule} ({shape}): {r.samples_per_second:.0f} samples/s, bubble per stage {bubbles}",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from the first forward")
    fig.legend(handles=[Patch(color=COLOURS["F"], label="forward"), Patch(color=COLOURS["B"], label="backward")],
               loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description="pipeline schedules side by side, drawn from their traces")
    ap.add_argument("-o", "--output", type=Path, default=Path(__file__).resolve().parent / "out" / "timelines.png")
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--steps", type=int, default=12, help="minibatches (default 12)")
    ap.add_argument("--stages", type=int, default=2, help="stages of the one VW (default 2)")
    ap.add_argument("--forward-ms", type=float, default=20.0, help="emulated forward per stage and minibatch")
    ap.add_argument("--backward-ms", type=float, default=40.0, help="emulated backward per stage and minibatch")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs' outputs here (default: a temp dir)")
    args = ap.parse_args()
    print(load_average())
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hetpipe-timeline-") as tmp:
        root = args.out or Path(tmp)
        for schedule in args.schedules:
            got = run(schedule, root / schedule, steps=args.steps, forward_s=args.forward_ms / 1e3,
                      backward_s=args.backward_ms / 1e3, stages=args.stages)
            if isinstance(got, str):
                print(f"{schedule}: skipped: {got}")
                continue
            bubbles = " ".join(f"stage {q} {100 * b:.1f}%" for q, b in sorted(got.bubble.items()))
            print(f"{schedule}: nm {got.nm}, microbatches {got.microbatches}: {got.samples_per_second:.1f} samples/s; "
                  f"bubble (idle / span) {bubbles}; mean {100 * statistics.mean(got.bubble.values()):.1f}%")
            if got.version_difference:
                values = [got.version_difference[p] for p in sorted(got.version_difference)]
                # The same schedule code simulated with these emulated times (ms: a micro-batch's
                # forward, a minibatch's backward) and with TiMePReSt's unit times.
                forward = max(1, round(args.forward_ms / got.microbatches))
                simulated = unit_version_differences(args.stages, got.microbatches, args.steps, forward=forward,
                                                     backward=max(1, round(args.backward_ms)))
                unit = unit_version_differences(args.stages, got.microbatches, args.steps)
                print(f"  nf1b version difference v per minibatch: measured {values}; simulated with these times "
                      f"{[simulated[p] for p in sorted(simulated)]}; TiMePReSt's unit times (steady "
                      f"ceil(W/(N+1))) {[unit[p] for p in sorted(unit)]}")
            results.append(got)
    if not results:
        print("no schedule ran; nothing drawn")
        return
    plot(args.output, results)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
