"""Time to target accuracy, read off ONE long run per configuration as the HetPipe paper does
(hetpipe.txt §8.4, Figures 5-6): Horovod-style allreduce, HetPipe's WSP at D = 0, 4 and 32,
and the quorum (solo, majority) and elastic syncs, on an emulated heterogeneous cluster with a
straggler. Writes convergence.csv (every evaluation of every long run), time_to_target.csv,
lr_grid.csv and convergence.png (held-out accuracy against training wall time) into --out.

Method. Each configuration trains once for --budget seconds of training (process start-up not
counted) with `eval: {every: E, rows: R}`: every E minibatches VW 0 (ddp: rank 0) evaluates its
current weights on R held-out rows, and the line lands in OUTPUT_DIR/eval.jsonl with the seconds
since training started. HetPipe runs through launch.local.run_local (the entry point of `hetpipe
run`) on a thread, with train.steps far more than the budget allows; once the budget is spent
the bench reads every stage's counters from its metrics endpoint and sends the coordinator a
StopJob, as `hetpipe stop` does, and run_local tears every process down (checked after each
run: none may be left). The samples of an evaluation are the coordinator's count of every VW's
trained minibatches at that moment. The ddp baseline (parallel.mode ddp, baselines/ddp.py, rank
0 evaluating every E steps) has no coordinator to stop: its steps are synchronous at a steady
pace, so it gets the steps that cover the budget at the pace its previous run measured (the
first: the planner's step time, a lower bound), and its evaluations past the budget are dropped.
Time to target is the first crossing of --target on the curve, interpolated between the two
evaluations around it; the output also gives the time to 0.8 .. 0.92, since near the plateau one
noisy evaluation decides the crossing. The method this replaces (a fresh run of S steps per
point) was biased against large D: a run ended when the straggler had done its S, whatever the
fast VWs could have added meanwhile; here the fast VWs run as far ahead as the sync lets them
for the whole budget.

Data: a fixed-seed teacher network's classification set, generated into a temporary npz
(data.name: npz): x ~ N(0, I) with 64 features, y = the argmax of a random 64-64-10 tanh network
(input scale 0.3), 10 classes, without the 10% of draws whose top two teacher logits are closest
(label noise for a student); --rows 50000, of which data.eval_fraction 0.1 are held out. Not
digits: its 1437 training rows would be seen 80-240 times in one long run, so the runs would
measure memorisation, where staleness, not throughput, decides. Here 0.9 takes the MLP 75-120 k
samples (elastic: 170 k), 2-3 passes over 45000 rows: throughput has room to matter, as on the
paper's ImageNet. Model: the quickstart MLP (64-256-256-256-10), sgd with momentum 0.5, batch
128 per VW and per rank, shuffled. Why 128: a task costs this CPU about the same whatever the
batch (gRPC, Python), while its emulated time grows with it; at batch 32 a 4-VW D=32 job needed
1.9 of this box's 2 cores and its fast VWs reached only 1.25x the straggler's pace, not 2x; at
128 the workers use 0.5-0.8 cores and the emulated devices set every pace (the `cpu` column).

Cluster: two nodes, one per GPU type as in the paper's: --vws TITAN Vs and --vws Quadro P4000s
(2.8x slower), emulated: cluster.emulate.time_scale stretches the catalog's times for this tiny
MLP to tens of ms (links are loopback as is unless --network). Both systems get the same GPUs:
- HetPipe: --vws virtual workers x 2 stages, policy ED (each VW one V and one Q, as the paper's
  ED gives each VW one GPU of every node), nm 2, one parameter-server shard. VW 1 is the
  straggler (faults.slow_vw: every task of its two GPUs takes --slow-factor times as long), for
  the whole run. Under WSP that caps what D can buy: once the fast VWs are D+1 clocks ahead
  ((D+1) x nm minibatches) they run at the straggler's pace, so D is a one-off lead, not a rate.
  --jitter-ms adds a random delay to every task of both systems instead (or as well): transient
  stragglers, the waits that the paper's D absorbs (--slow-factor 1 for none that persists).
- Horovod-style (parallel.mode: ddp): one rank per GPU (all of them hold the model), gradients
  allreduce-averaged every step. Its straggler is the slowest GPU of HetPipe's straggler VW: the
  allreduce waits for the slowest rank, so slowing that one GPU costs ddp exactly what slowing
  both of the VW's GPUs would.
- parallel.sync quorum with sync_args quorum solo (1) and majority (3 of 4 VWs: the fast ones),
  and elastic (sync_args alpha, period), on the same VWs at D 0; a sync this tree's job parser
  refuses is skipped with its message.

Learning rates. HetPipe's shards SUM the VWs' updates while ddp AVERAGES the ranks' gradients,
so ddp gets lr = ranks x the per-VW lr: then every sample's gradient moves the weights by the
same amount in both (the linear scaling rule; with plain SGD, Nm = 1 and D = 0 this is exactly
DESIGN §3 O2). Elastic averaging sums nothing either (each replica steps alone, the master
follows their mean), so it gets VWs x the per-VW lr. Each configuration then gets its own lr
from --lrs: a short run of --tune-fraction x --budget per value, and the value whose run ends
with the best held-out accuracy (mean of its last three evaluations) is used for the long run.
Staleness (large D), partial rounds (quorum) and elastic averaging each move the best lr, so
one fixed lr would compare the tuning, not the systems. Same momentum everywhere.

Evaluations cost VW 0 its pipeline's drain and refill plus the forward of R rows (not padded):
about 8% of a fast VW's minibatches at E = 10, which slows only configurations where VW 0's pace
is the one that matters (quorum majority: the three fast VWs wait for each other).

    .venv/bin/python bench/convergence.py --quick   # 2 VWs, 4 configurations, 2 lrs, 30 s runs: ~4 min
    .venv/bin/python bench/convergence.py           # 4 VWs, 7 configurations, 3 lrs, 80 s runs: ~20 min
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Run as `python bench/NAME.py`: the repository root is not on sys.path then.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baselines.ddp import select_devices  # noqa: E402
from coordinator.planner import make_plan  # noqa: E402
from hetpipe import faults  # noqa: E402
from hetpipe.config import ConfigError, JobConfig, parse_job  # noqa: E402
# The helpers sit beside this script: bench/ is sys.path[0] when it runs.
from convergence_results import (  # noqa: E402
    Curve, paper_table, plot, table, targets_table, time_to_target, write_curves, write_lr_grid, write_time_to_target,
)
from convergence_runs import Run, leftover_workers, run_ddp, run_hetpipe  # noqa: E402

FAST, SLOW = "titan-v", "quadro-p4000"
STAGES = 2
FEATURES, CLASSES = 64, 10
MODEL = {"name": "mlp", "args": {"in_features": FEATURES, "hidden": [256, 256, 256], "num_classes": CLASSES}}
SLOW_VW = 1
HOLDOUT = 0.1


@dataclass(frozen=True, slots=True)
class Config:
    name: str            # "horovod", "wsp D=4", "quorum solo"
    mode: str            # parallel.mode
    D: int = 0
    sync: str = "wsp"
    sync_args: dict[str, Any] = field(default_factory=dict)


def configurations(args: argparse.Namespace) -> list[Config]:
    out = [Config("horovod", "ddp")]
    out += [Config(f"wsp D={d}", "hetpipe", d) for d in args.D]
    out += [Config("quorum solo", "hetpipe", args.quorum_D, "quorum", {"quorum": "solo"}),
            Config("quorum majority", "hetpipe", args.quorum_D, "quorum", {"quorum": "majority"}),
            Config("elastic", "hetpipe", 0, "elastic", {"alpha": args.alpha, "period": args.period})]
    return [c for c in out if c.name in args.only] if args.only else out


# ---- the data and the job ----------------------------------------------------------------------


def teacher_dataset(path: Path, rows: int, seed: int) -> None:
    """The npz described in the module docstring: rows of (64 features, one of 10 classes)."""
    rng = np.random.default_rng([seed, 0xDA7A])
    drawn = int(rows / 0.9) + 1
    x = rng.standard_normal((drawn, FEATURES)).astype(np.float32)
    w1 = rng.standard_normal((FEATURES, 64)) / math.sqrt(FEATURES)
    w2 = rng.standard_normal((64, CLASSES)) / math.sqrt(64)
    logits = np.tanh(0.3 * x @ w1) @ w2
    top = np.sort(logits, axis=1)
    margin = top[:, -1] - top[:, -2]
    keep = np.flatnonzero(margin > np.quantile(margin, 0.1))[:rows]
    np.savez(path, x=x[keep], y=logits[keep].argmax(axis=1).astype(np.int64))


def job_dict(cfg: Config, *, lr: float, steps: int, every: int, out_dir: Path, npz: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    # One node per GPU type, as in the paper's cluster: ED deals each VW one GPU of each node.
    nodes = [{"name": "nV", "gpus": [{"type": FAST, "count": args.vws}]},
             {"name": "nQ", "gpus": [{"type": SLOW, "count": args.vws}]}]
    emulate: dict[str, Any] = {"time_scale": args.time_scale}
    if args.network:
        emulate["network"] = {}
    parallel: dict[str, Any] = {"virtual_workers": args.vws, "stages_per_vw": STAGES, "nm": args.nm, "D": cfg.D,
                                "ps_shards": 1, "policy": "ED", "mode": cfg.mode}
    if cfg.sync != "wsp":
        parallel |= {"sync": cfg.sync, "sync_args": dict(cfg.sync_args)}
    return {
        "cluster": {"nodes": nodes, "emulate": emulate},
        "model": MODEL,
        # The same seeded held-out rows in every run, the first --eval-rows of them per evaluation.
        "data": {"name": "npz", "path": str(npz), "batch_size": args.batch, "shuffle": True, "eval_fraction": HOLDOUT},
        "eval": {"every": every, "rows": args.eval_rows},
        "train": {"steps": steps, "loss": "cross_entropy",
                  "optimizer": {"name": "sgd", "lr": lr, "momentum": args.momentum}, "seed": args.seed},
        "parallel": parallel,
        "output": {"dir": str(out_dir), "trace": False},
    }


def ddp_setup(hetpipe_job: JobConfig, slow_factor: float) -> tuple[int, int, str, float]:
    """(ranks, straggler rank, its description, predicted step seconds) of ddp on the cluster of
    the HetPipe job: the straggler is the slowest GPU that the plan gives the straggler VW."""
    plan = make_plan(hetpipe_job)
    ranks = select_devices(hetpipe_job).ranks
    mine = {(s.node, s.gpu) for s in plan.stages if s.vw == SLOW_VW}
    node, gpu = max(mine, key=lambda ng: next(r.step_seconds for r in ranks if (r.node, r.gpu) == ng))
    # ED deals VW v the v-th GPU of each node; ranks follow the cluster order too.
    same = [r for r in ranks if (r.node, r.gpu) == (node, gpu)]
    slow = same[SLOW_VW % len(same)]
    step = max(r.step_seconds * (slow_factor if r.rank == slow.rank else 1.0) for r in ranks)
    return len(ranks), slow.rank, f"rank {slow.rank} ({slow.gpu} on {slow.node})", step


# ---- running -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, npz: Path) -> None:
        self.args, self.work, self.npz = args, work, npz
        probe = parse_job(job_dict(Config("probe", "hetpipe"), lr=0.01, steps=1, every=1, out_dir=work / "probe",
                                   npz=npz, args=args), base_dir=str(work))
        self.ranks, self.slow_rank, self.slow_desc, self.ddp_step = ddp_setup(probe, args.slow_factor)
        self.ddp_measured: float | None = None  # seconds per ddp step, from its last run
        self.runs = 0
        self.t0 = time.monotonic()

    def lr(self, cfg: Config, per_vw: float) -> float:
        """The lr of cfg's job for a per-VW lr: what averages (ddp's ranks, elastic's replicas
        around the master) takes the count times it, what sums (WSP, quorum rounds) takes it as is."""
        if cfg.mode == "ddp":
            return per_vw * self.ranks
        return per_vw * self.args.vws if cfg.sync == "elastic" else per_vw

    def refused(self, cfg: Config) -> str | None:
        """Why this tree's job parser refuses cfg (a sync not landed yet), or None."""
        try:
            self.job(cfg, self.args.lrs[0], 10.0, "check")
        except ConfigError as exc:
            return str(exc)
        return None

    def job(self, cfg: Config, per_vw: float, budget: float, tag: str) -> JobConfig:
        a = self.args
        out_dir = self.work / "runs" / f"{cfg.name.replace(' ', '_').replace('=', '')}_{tag}"
        shutil.rmtree(out_dir, ignore_errors=True)
        if cfg.mode == "ddp":
            # The first run: the planner's step time, which the padding makes a lower bound (more steps).
            step = self.ddp_measured or self.ddp_step
            steps = math.ceil(budget * 1.08 / step) + 1
            every = max(1, round(a.eval_seconds / step))
        else:
            # A fast VW's minibatch takes about 0.6x of half a Quadro's whole-model step: 4x the steps
            # at that pace leave the run far from its end when it is stopped.
            steps = math.ceil(budget / (self.ddp_step / a.slow_factor / 2)) * 4 + 1000
            every = a.eval_every
        raw = job_dict(cfg, lr=self.lr(cfg, per_vw), steps=steps, every=every, out_dir=out_dir, npz=self.npz, args=a)
        return parse_job(raw, base_dir=str(out_dir))

    def run(self, cfg: Config, per_vw: float, budget: float, tag: str) -> Run:
        job = self.job(cfg, per_vw, budget, tag)
        straggler = faults.Faults(slow_vw=SLOW_VW if cfg.mode == "hetpipe" else self.slow_rank,
                                  slow_factor=self.args.slow_factor, task_delay=(0.0, self.args.jitter_ms / 1e3))
        if cfg.mode == "ddp":
            run = run_ddp(job, budget, straggler, self.ranks)
            self.ddp_measured = run.step_seconds
        else:
            run = run_hetpipe(job, budget, straggler, self.args.vws)
        self.runs += 1
        if run.leftover:
            raise RuntimeError(f"{cfg.name}: worker processes left behind: {'; '.join(run.leftover)}")
        if not self.args.keep_runs:
            shutil.rmtree(Path(job.resolve(job.output.dir)), ignore_errors=True)
        last = run.evaluations[-1].accuracy if run.evaluations else math.nan
        print(f"  {cfg.name:<16} lr {job.train.optimizer.lr:<6g} {tag:<5} {run.seconds:5.1f} s: "
              f"{run.samples_per_second:6.0f} samples/s, {len(run.evaluations):2d} evaluations, last accuracy "
              f"{last:.3f}; VW minibatches {'/'.join(map(str, run.vw_minibatches))}, set-up {run.setup_seconds:4.1f} s, "
              f"workers' CPU {run.cpu_cores:.2f} cores "
              f"[{time.monotonic() - self.t0:5.0f} s; {load_average()}]", flush=True)
        return run


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="2 VWs; horovod, wsp D=0, D=4, quorum solo; 2 lrs; a 30 s budget: about 5 minutes")
    ap.add_argument("--out", type=Path, default=Path("bench/out/convergence"),
                    help="where the CSVs and convergence.png go (default bench/out/convergence)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of training per long run (80; quick 30)")
    ap.add_argument("--tune-fraction", type=float, default=None,
                    help="the lr grid's short runs last this fraction of --budget (0.25; quick 0.33)")
    ap.add_argument("--lrs", type=float, nargs="+", default=None,
                    help="per-VW sgd lrs to try (0.08 0.16 0.32; quick 0.16 0.32); ddp: ranks x each")
    ap.add_argument("--target", type=float, default=None, help="held-out accuracy to reach (0.9; quick 0.8)")
    ap.add_argument("--D", type=int, nargs="+", default=[0, 4, 32], help="WSP clock bounds (0 4 32)")
    ap.add_argument("--quorum-D", type=int, default=0, help="parallel.D of the quorum runs")
    ap.add_argument("--alpha", type=float, default=0.1, help="elastic sync_args alpha")
    ap.add_argument("--period", type=int, default=1, help="elastic sync_args period (waves between exchanges)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these configurations (by name)")
    ap.add_argument("--vws", type=int, default=None, help="virtual workers = GPUs of each type (4; quick 2)")
    ap.add_argument("--nm", type=int, default=2, help="minibatches in flight per VW (wave size)")
    ap.add_argument("--slow-factor", type=float, default=2.0, help="how much slower the straggler's GPUs are")
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="HETPIPE_FAULTS task_delay [0, this] ms on every task of both systems (transient stragglers)")
    ap.add_argument("--time-scale", type=float, default=6000.0, help="cluster.emulate.time_scale")
    ap.add_argument("--network", action="store_true",
                    help="cluster.emulate.network: {} (the paper's links; needs a runtime that emulates them)")
    ap.add_argument("--batch", type=int, default=128, help="data.batch_size (per VW, per rank)")
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=50_000, help="rows of the teacher dataset (10%% held out)")
    ap.add_argument("--eval-every", type=int, default=10, help="HetPipe: VW 0's minibatches between evaluations")
    ap.add_argument("--eval-seconds", type=float, default=2.0, help="ddp: about this long between evaluations")
    ap.add_argument("--eval-rows", type=int, default=2048, help="held-out rows per evaluation")
    ap.add_argument("--keep-runs", action="store_true", help="keep every run's output under OUT/runs")
    args = ap.parse_args(argv)
    q = args.quick
    args.vws = args.vws or (2 if q else 4)
    args.budget = args.budget or (30.0 if q else 80.0)
    args.tune_fraction = args.tune_fraction or (0.33 if q else 0.25)
    args.lrs = args.lrs or ([0.16, 0.32] if q else [0.08, 0.16, 0.32])
    args.target = args.target if args.target is not None else (0.8 if q else 0.9)
    if q and args.only is None:
        args.only = ["horovod", "wsp D=0", "wsp D=4", "quorum solo"]
    args.out.mkdir(parents=True, exist_ok=True)

    curves: list[Curve] = []
    grid: list[tuple[str, float, Run, float, bool]] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-convergence-") as tmp:
        work = args.out if args.keep_runs else Path(tmp)
        npz = Path(tmp) / "teacher.npz"
        teacher_dataset(npz, args.rows, args.seed)
        bench = Bench(args, work, npz)
        title = (f"teacher set {args.rows} x {FEATURES} ({HOLDOUT:g} held out), MLP 64-256x3-10, {args.vws} x {FAST} "
                 f"+ {args.vws} x {SLOW}, emulated x{args.time_scale:g}{', network' if args.network else ''};\n"
                 f"straggler {args.slow_factor:g}x: HetPipe VW {SLOW_VW}, ddp {bench.slow_desc}; "
                 f"{args.budget:g} s per run, lr tuned per configuration"
                 + (f"; jitter 0-{args.jitter_ms:g} ms" if args.jitter_ms else ""))
        print(f"convergence: {title.replace(chr(10), ' ')}")
        print(f"HetPipe {args.vws} VWs x {STAGES} stages, ED, nm {args.nm}, 1 shard; Horovod (ddp) {bench.ranks} "
              f"ranks (lr = {bench.ranks} x the per-VW lr); momentum {args.momentum:g}, batch {args.batch}; "
              f"target {args.target:g}; lr grid {' '.join(f'{x:g}' for x in args.lrs)} per VW, short runs of "
              f"{args.budget * args.tune_fraction:g} s; start: {load_average()}", flush=True)
        for cfg in configurations(args):
            why = bench.refused(cfg)
            if why is not None:
                print(f"  {cfg.name}: skipped: this tree refuses the job: {why}", flush=True)
                skipped.append(f"{cfg.name}: {why}")
                continue
            short = args.budget * args.tune_fraction
            tried = [(lr, bench.run(cfg, lr, short, f"lr{i}")) for i, lr in enumerate(args.lrs)]
            scores = [Curve(cfg.name, bench.lr(cfg, lr), run).final_accuracy for lr, run in tried]
            best = max(range(len(tried)), key=lambda i: scores[i] if math.isfinite(scores[i]) else -1.0)
            for i, (lr, run) in enumerate(tried):
                grid.append((cfg.name, bench.lr(cfg, lr), run, scores[i], i == best))
            curves.append(Curve(cfg.name, bench.lr(cfg, tried[best][0]), bench.run(cfg, tried[best][0], args.budget, "long")))
        elapsed = time.monotonic() - bench.t0
        left = leftover_workers()

    write_curves(args.out / "convergence.csv", curves)
    write_time_to_target(args.out / "time_to_target.csv", curves, args.target)
    write_lr_grid(args.out / "lr_grid.csv", grid)
    plot(args.out / "convergence.png", curves, args.target, title)
    print()
    print(f"lr grid (end accuracy of each {args.budget * args.tune_fraction:g} s run; * = picked):")
    for name in dict.fromkeys(g[0] for g in grid):
        row = [f"{lr:g}: {acc:.3f}{'*' if picked else ''}" for n, lr, _, acc, picked in grid if n == name]
        print(f"  {name:<18}" + "   ".join(row))
    print()
    print(f"one {args.budget:g} s run per configuration; target {args.target:g} held-out accuracy")
    print(table(curves, args.target))
    print("cpu: the workers' CPU while training, in cores of this box's " f"{os.cpu_count()}; wait s: G2 pull wait "
          "summed over every stage (ddp: allreduce wait over every rank); VW minibatches: each VW's at the end\n"
          "(VW 1 the straggler); dist: the shards' clock distance at the stop; /ddp, /D=0: time to target over "
          "theirs (< 1: sooner); final acc: mean of the last 3 evaluations")
    print()
    print("the same runs, time to other accuracies (first crossing):")
    print(targets_table(curves, sorted({0.8, 0.85, 0.88, 0.9, 0.92, args.target})))
    print()
    print(paper_table(curves, args.target))
    for s in skipped:
        print(f"skipped {s}")
    reached = [c.config for c in curves if math.isfinite(time_to_target(c.points, args.target))]
    print(f"\nwrote {args.out}/convergence.csv, time_to_target.csv, lr_grid.csv, convergence.png; {bench.runs} runs in "
          f"{elapsed:.0f} s ({len(reached)}/{len(curves)} reached the target); worker processes left: {len(left)}; "
          f"end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
