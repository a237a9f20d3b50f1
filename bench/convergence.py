"""Time to target accuracy: Horovod-style allreduce vs HetPipe at D = 0, 4 and 32, on an emulated
heterogeneous cluster with a straggler (hetpipe.txt §8.4, Figures 5-6). Writes convergence.csv
(one row per run), time_to_target.csv and convergence.png (accuracy against wall time).

Data: scikit-learn's digits (1797 8x8 images, shipped inside its wheel: no download), split once
with a fixed seed into the rows the jobs train on (an npz, data.name: npz) and held-out rows
(--holdout): "accuracy" and the target here are on the held-out rows (the summary's eval_accuracy,
evaluated through the pipeline on the final weights), as the paper's top-1 is on validation data.
Model: the quickstart MLP (64-256-256-256-10), sgd with momentum, batch 32, shuffled.

Cluster: two nodes, one per GPU type as in the paper's: --vws TITAN Vs and --vws Quadro P4000s
(2.8x slower), emulated: cluster.emulate.time_scale stretches the catalog's times for this tiny
MLP to tens of ms, so the emulated devices, not this CPU, set the pace (links are loopback as is
unless --network). Both systems get the same GPUs:
- HetPipe: --vws virtual workers x 2 stages, policy ED (each VW one V and one Q, as the paper's
  ED gives each VW one GPU of every node), nm 2, one parameter-server shard. VW 1 is the straggler (faults.slow_vw: every task
  of its two GPUs takes --slow-factor times as long).
- Horovod-style (parallel.mode: ddp, baselines/ddp.py): one rank per GPU (all of them hold the
  model), gradients allreduce-averaged every step. Its straggler is the slowest GPU of HetPipe's
  straggler VW: the allreduce waits for the slowest rank, so slowing that one GPU costs ddp
  exactly what slowing both of the VW's GPUs would.

Learning rates, for a fair comparison: HetPipe's shards SUM the VWs' updates while ddp AVERAGES
the ranks' gradients, so ddp gets lr = ranks x --lr. Then every sample's gradient moves the
weights by the same amount in both (the linear scaling rule; with plain SGD, Nm = 1 and D = 0
this is exactly DESIGN §3 O2), and what differs is what the paper compares: throughput on
heterogeneous GPUs with a straggler, against the staleness WSP accepts for it. Same momentum in
both; the defaults (lr 0.02, momentum 0.5) were picked for HetPipe to train stably, not tuned
per system (with momentum 0.9, lr 0.02 left HetPipe at 16% accuracy after 100 steps).

Method: every point is one real run through launch.local.run_local, the entry point of
`hetpipe run`, which sends parallel.mode ddp to the baseline: the same job dict, only mode, D,
lr and the straggler's index differ. A configuration's job (same seed) runs at a ladder of
train.steps, up or down by --factor, until two runs bracket the target, then --refine
bisections. A point is (the summary's wall_seconds: training time measured by the runtime,
without process start-up; held-out accuracy of that run's final weights). Time to target is linear
interpolation between the bracketing runs (the shortest run that reached it is shown too). Each
later configuration of a mode starts its ladder around the previous one's crossing.

Caveats: a run of S steps gives every VW (or rank) S minibatches, so with a persistent straggler
a HetPipe run ends when the slow VW has done its S, whatever D let the fast VWs run ahead in the
meantime (the paper evaluates checkpoints of one long run instead). Accuracy at one step count
varies from run to run by a few points (HetPipe's staleness depends on timing), which limits the
resolution of small differences such as the paper's 4.7%.

    .venv/bin/python bench/convergence.py --quick    # 2 VWs; D = 0, 4, Horovod; target 0.75: 6 runs, ~2.5 min
    .venv/bin/python bench/convergence.py            # 4 VWs; D = 0, 4, 32, Horovod; target 0.90: ~13 runs

Each run pays its processes' start-up (10-25 s on 2 CPU cores) besides its training time.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


# Run as `python bench/NAME.py`: the repository root is not on sys.path then.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baselines.ddp import select_devices  # noqa: E402
from launch.local import run_local  # noqa: E402
from coordinator.planner import make_plan  # noqa: E402
from hetpipe import faults  # noqa: E402
from hetpipe.config import JobConfig, parse_job  # noqa: E402
# The results' helpers sit beside this script: bench/ is sys.path[0] when it runs.
from convergence_results import Point, bracket, faster, plot, steps_to_target, time_to_target  # noqa: E402

FAST, SLOW = "titan-v", "quadro-p4000"
STAGES = 2
MODEL = {"name": "mlp", "args": {"in_features": 64, "hidden": [256, 256, 256], "num_classes": 10}}
BATCH = 32
SLOW_VW = 1

# hetpipe.txt §8.4 (VGG-19, 16 GPUs, ED-local, Figure 6; D=0 vs Horovod also Figure 6).
PAPER = {
    "D4 vs D0": ("faster", 0.28),       # "faster by 28% ... compared to D=0"
    "D32 vs D4": ("slower", 0.047),     # "degraded by 4.7%, compared to D=4"
    "best HetPipe vs Horovod": ("faster", 0.49),   # "49% [faster] compared to ... Horovod"
    "D0 vs Horovod": ("faster", 0.29),  # "roughly 29% faster than that with Horovod"
}


@dataclass(frozen=True, slots=True)
class Config:
    name: str        # "horovod", "hetpipe D=4"
    mode: str        # parallel.mode
    D: int


# ---- the job -----------------------------------------------------------------------------------


def job_dict(cfg: Config, *, steps: int, lr: float, args: argparse.Namespace,
             out_dir: Path, slow_rank: int) -> dict[str, Any]:
    # One node per GPU type, as in the paper's cluster: ED deals each VW one GPU of each node.
    nodes = [{"name": "nV", "gpus": [{"type": FAST, "count": args.vws}]},
             {"name": "nQ", "gpus": [{"type": SLOW, "count": args.vws}]}]
    emulate: dict[str, Any] = {"time_scale": args.time_scale}
    if args.network:
        emulate["network"] = {}
    return {
        "cluster": {"nodes": nodes, "emulate": emulate},
        "model": MODEL,
        # The same seeded held-out rows in every run; one evaluation of all of them at the end.
        "data": {"name": "digits", "batch_size": BATCH, "shuffle": True, "eval_fraction": args.holdout},
        "eval": {"rows": 10_000},
        "train": {"steps": steps, "loss": "cross_entropy",
                  "optimizer": {"name": "sgd", "lr": lr, "momentum": args.momentum}, "seed": args.seed},
        "parallel": {"virtual_workers": args.vws, "stages_per_vw": STAGES, "nm": args.nm, "D": cfg.D,
                     "ps_shards": 1, "policy": "ED", "mode": cfg.mode},
        "output": {"dir": str(out_dir), "trace": False},
    }


def ddp_setup(hetpipe_job: JobConfig) -> tuple[int, int, str]:
    """(ranks, straggler rank, its description) of ddp on the cluster of the HetPipe job: the rank
    of the slowest GPU that the plan gives the straggler VW."""
    plan = make_plan(hetpipe_job)
    ranks = select_devices(hetpipe_job).ranks
    mine = {(s.node, s.gpu) for s in plan.stages if s.vw == SLOW_VW}
    node, gpu = max(mine, key=lambda ng: next(r.step_seconds for r in ranks if (r.node, r.gpu) == ng))
    # ED deals VW v the v-th GPU of each node; ranks follow the cluster order too.
    same = [r for r in ranks if (r.node, r.gpu) == (node, gpu)]
    slow = same[SLOW_VW % len(same)]
    return len(ranks), slow.rank, f"rank {slow.rank} ({slow.gpu} on {slow.node})"


# ---- running -----------------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace, work: Path, csv_path: Path) -> None:
        self.args = args
        self.work = work
        probe = parse_job(self._raw(Config("probe", "hetpipe", 0), 1, args.lr, 0), base_dir=str(work))
        self.ranks, self.slow_rank, self.slow_desc = ddp_setup(probe)
        self.points: list[Point] = []
        self.t0 = time.monotonic()
        self.csv_path = csv_path
        with csv_path.open("w", newline="") as f:
            csv.writer(f).writerow([fl.name for fl in fields(Point)])

    def _raw(self, cfg: Config, steps: int, lr: float, slow_rank: int) -> dict[str, Any]:
        out_dir = self.work / "runs" / cfg.name.replace(" ", "_").replace("=", "") / f"steps{steps}"
        return job_dict(cfg, steps=steps, lr=lr, args=self.args, out_dir=out_dir, slow_rank=slow_rank)

    def lr(self, cfg: Config) -> float:
        return self.args.lr * self.ranks if cfg.mode == "ddp" else self.args.lr

    def run(self, cfg: Config, steps: int) -> Point:
        lr = self.lr(cfg)
        raw = self._raw(cfg, steps, lr, self.slow_rank)
        out_dir = Path(raw["output"]["dir"])
        job = parse_job(raw, base_dir=str(out_dir))
        straggler = faults.Faults(slow_vw=SLOW_VW if cfg.mode == "hetpipe" else self.slow_rank,
                                  slow_factor=self.args.slow_factor, task_delay=(0.0, self.args.jitter_ms / 1e3))
        with faults.injected(straggler):
            summary = run_local(job, quiet=True)
        workers = int(summary["virtual_workers"])
        acc = float(summary["eval_accuracy"])
        point = Point(
            config=cfg.name, mode=cfg.mode, D=cfg.D, steps=steps, wall_seconds=float(summary["wall_seconds"]),
            accuracy=acc,
            samples_per_second=float(summary["samples_per_second"]), samples=steps * workers * BATCH,
            final_loss=float(summary["final_loss"]), wait_seconds=float(summary.get("wait_seconds", 0.0)),
            lr=lr, workers=workers, reached=acc >= self.args.target,
        )
        if not self.args.keep_runs:
            shutil.rmtree(out_dir, ignore_errors=True)
        self.points.append(point)
        with self.csv_path.open("a", newline="") as f:
            csv.writer(f).writerow(list(asdict(point).values()))
        print(f"  {cfg.name:<13} steps {steps:>4}: wall {point.wall_seconds:6.2f} s, accuracy {acc:.3f} "
              f"(training loss {point.final_loss:.3f}), {point.samples_per_second:7.1f} samples/s "
              f"[{time.monotonic() - self.t0:5.0f} s; {load_average()}]", flush=True)
        return point

    def ladder(self, cfg: Config, start: int) -> list[Point]:
        """Runs cfg from `start` steps up (or down, if that already reached the target) by --factor
        until two runs bracket the target, then bisects the bracket --refine times."""
        a = self.args
        mine = [self.run(cfg, start)]
        steps = start
        while True:
            lo, hi = bracket(mine)
            if lo is not None and hi is not None:
                break
            if hi is None:  # all below: go up
                if steps >= a.max_steps:
                    return sorted(mine, key=lambda p: p.steps)
                steps = min(a.max_steps, max(steps + 1, math.ceil(steps * a.factor)))
            else:  # all reached: go down
                if steps <= a.min_gap:
                    return sorted(mine, key=lambda p: p.steps)
                steps = max(a.min_gap, min(steps - 1, math.floor(steps / a.factor)))
            mine.append(self.run(cfg, steps))
        for _ in range(a.refine):
            lo, hi = bracket(mine)
            if lo is None or hi is None or hi.steps - lo.steps < 2 * a.min_gap:
                break
            mine.append(self.run(cfg, (lo.steps + hi.steps) // 2))
        return sorted(mine, key=lambda p: p.steps)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="2 VWs, D = 0 and 4 and Horovod, target 0.75, a coarser ladder, no bisection")
    ap.add_argument("--out", type=Path, default=Path("runs/convergence"),
                    help="where the CSVs and convergence.png go (default runs/convergence)")
    ap.add_argument("--target", type=float, default=None, help="held-out accuracy to reach (0.90; quick 0.75)")
    ap.add_argument("--D", type=int, nargs="+", default=None, help="HetPipe clock bounds (0 4 32; quick 0 4)")
    ap.add_argument("--no-horovod", dest="horovod", action="store_false", help="skip the ddp baseline")
    ap.add_argument("--vws", type=int, default=None,
                    help="virtual workers = GPUs of each type (4; quick 2)")
    ap.add_argument("--nm", type=int, default=2, help="minibatches in flight per VW (wave size)")
    ap.add_argument("--slow-factor", type=float, default=2.0, help="how much slower the straggler's GPUs are")
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="HETPIPE_FAULTS task_delay [0, this] ms on every task of both systems (transient stragglers)")
    ap.add_argument("--time-scale", type=float, default=8000.0, help="cluster.emulate.time_scale")
    ap.add_argument("--network", action="store_true",
                    help="cluster.emulate.network: {} (the paper's links; needs a runtime that emulates them)")
    ap.add_argument("--lr", type=float, default=0.02, help="HetPipe's sgd lr per VW (ddp: ranks x this)")
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--holdout", type=float, default=0.2, help="held-out fraction of digits")
    ap.add_argument("--start-steps", type=int, default=None,
                    help="first rung of each mode's first configuration (100; quick 80); later ones start "
                         "next to the previous configuration's crossing")
    ap.add_argument("--factor", type=float, default=None, help="ladder step, up or down (1.5; quick 2)")
    ap.add_argument("--refine", type=int, default=None, help="bisections of the bracket (1; quick 0)")
    ap.add_argument("--min-gap", type=int, default=5, help="no bisection of a bracket narrower than this")
    ap.add_argument("--max-steps", type=int, default=1200, help="give up on a configuration past this")
    ap.add_argument("--keep-runs", action="store_true", help="keep every run's output under OUT/runs")
    args = ap.parse_args(argv)
    q = args.quick
    args.vws = args.vws or (2 if q else 4)
    args.target = args.target if args.target is not None else (0.75 if q else 0.90)
    args.start_steps = args.start_steps or (80 if q else 100)
    args.factor = args.factor or (2.0 if q else 1.5)
    args.refine = args.refine if args.refine is not None else (0 if q else 1)
    ds = args.D if args.D is not None else ([0, 4] if q else [0, 4, 32])
    configs = ([Config("horovod", "ddp", 0)] if args.horovod else []) + [Config(f"hetpipe D={d}", "hetpipe", d)
                                                                         for d in ds]
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out / "convergence.csv", args.out / "convergence.png"

    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-convergence-") as tmp:
        work = args.out if args.keep_runs else Path(tmp)
        runner = Runner(args, work, csv_path)
        title = (f"digits, MLP 64-256x3-10, {args.vws} x {FAST} + {args.vws} x {SLOW}, emulated x{args.time_scale:g}"
                 f"{', network' if args.network else ''};\nstraggler {args.slow_factor:g}x: HetPipe VW {SLOW_VW}, "
                 f"ddp {runner.slow_desc}" + (f"; jitter 0-{args.jitter_ms:g} ms" if args.jitter_ms else ""))
        print(f"convergence: {title.replace(chr(10), ' ')}")
        print(f"HetPipe {args.vws} VWs x {STAGES} stages, ED, nm {args.nm}, 1 shard, lr {args.lr:g}; "
              f"Horovod (ddp) {runner.ranks} ranks, lr {args.lr * runner.ranks:g} (ranks x lr: it averages, "
              f"HetPipe sums); momentum {args.momentum:g}, batch {BATCH}; target {args.target:g} held-out "
              f"accuracy ({args.holdout:g} of the images held out)")
        print(f"ladder: from {args.start_steps} steps, x{args.factor:g} per rung, {args.refine} bisection(s); "
              f"start: {load_average()}")
        curves: dict[str, list[Point]] = {}
        guess: dict[str, float] = {}  # mode -> steps to target of its previous configuration
        for cfg in configs:
            start = args.start_steps
            if cfg.mode in guess:  # two rungs around the previous crossing: one bracket if it is close
                start = max(args.min_gap, round(guess[cfg.mode] / math.sqrt(args.factor)))
            curves[cfg.name] = runner.ladder(cfg, start)
            s = steps_to_target(curves[cfg.name], args.target)
            if math.isfinite(s):
                guess[cfg.mode] = s
        elapsed = time.monotonic() - runner.t0

    ttt: dict[str, float] = {}
    rows = []
    print()
    print(f"{'configuration':<14}{'runs':>5}{'samples/s':>11}{'steps':>7}{'first hit s':>13}"
          f"{'time to target s':>18}  how")
    for name, pts in curves.items():
        t, how = time_to_target(pts, args.target)
        ttt[name] = t
        _, hi = bracket(pts)
        rate = sum(p.samples_per_second for p in pts) / len(pts)
        print(f"{name:<14}{len(pts):>5}{rate:>11.1f}{hi.steps if hi else '-':>7}"
              f"{hi.wall_seconds if hi else float('nan'):>13.2f}{t:>18.2f}  {how}")
        rows.append([name, pts[0].mode, pts[0].D, args.target, f"{t:.4f}", how,
                     hi.steps if hi else "", hi.wall_seconds if hi else "", f"{rate:.2f}", len(pts)])
    with (args.out / "time_to_target.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "mode", "D", "target", "time_to_target_s", "how", "first_hit_steps",
                    "first_hit_wall_s", "mean_samples_per_second", "runs"])
        w.writerows(rows)

    def get(name: str) -> float:
        return ttt.get(name, float("nan"))

    hetpipe = {n: t for n, t in ttt.items() if n.startswith("hetpipe") and math.isfinite(t)}
    best = min(hetpipe, key=lambda n: hetpipe[n]) if hetpipe else None
    ours = {
        "D4 vs D0": faster(get("hetpipe D=4"), get("hetpipe D=0")),
        "D32 vs D4": -faster(get("hetpipe D=32"), get("hetpipe D=4")),
        "best HetPipe vs Horovod": faster(hetpipe[best], get("horovod")) if best else float("nan"),
        "D0 vs Horovod": faster(get("hetpipe D=0"), get("horovod")),
    }
    print()
    print("time to target: x% faster = takes x% less time; x% slower = takes x% more (negative: the other way)")
    print(f"{'comparison':<28}{'ours':>14}{'paper (VGG-19, Fig. 6)':>26}")
    for key, value in ours.items():
        word, paper = PAPER[key]
        label = f"{best} vs Horovod" if key.startswith("best") and best else key
        mine = f"{value:.1%} {word}" if math.isfinite(value) else "n/a"
        print(f"{label:<28}{mine:>14}{('up to ' if key.startswith('best') else '') + f'{paper:.1%} {word}':>26}")

    plot(png_path, curves, ttt, args.target, title)
    print(f"\nwrote {csv_path}, {args.out / 'time_to_target.csv'} and {png_path}; {len(runner.points)} runs "
          f"in {elapsed:.0f} s; end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
