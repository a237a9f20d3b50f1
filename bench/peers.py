"""Peers side by side: one job trained as HetPipe 1 VW x 2 stages (Nm 4), HetPipe 2 VWs x 1 stage
(D 0, one shard), `parallel.mode: ddp` over 2 ranks, `parallel.mode: torch-pipeline` (GPipe, 2
stages) and a plain PyTorch loop, each its own process; samples/s, start-to-exit wall time, and
the ratios each is judged by: HetPipe 2x1 / ddp, HetPipe 1x2 / torch-pipeline, each / plain loop.

    python bench/peers.py                          # the issue's CPU job (below), 120 steps
    python bench/peers.py --job JOB.yaml --steps 50 --json peers.json
    python bench/peers.py --per-step               # also CPU and wall per step of 2x1 and ddp
    python bench/peers.py --pairs 5                # then each pair of peers 5 times more, alternating

The built-in job: an MLP 64 -> 4 x 1024 -> 10 on scikit-learn's digits, batch 128, plain SGD.
--job takes any job file; each layout replaces its whole parallel section (its eval section and
output.trace are dropped: the plain loop has neither), and the derived job files are written beside
it for the run (relative paths and factory modules resolve from there), then removed.
On a CUDA machine the job's cluster section is dropped, so every run uses this machine's GPUs (the
plain loop cuda:0; ddp NCCL when each rank has a GPU of its own, else gloo through host memory).
With a cluster section kept on the CPU, HetPipe and the baselines emulate its GPUs and the plain
loop does not: the ratios to it then mix emulated time with this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Run as `python bench/peers.py`: bench/ is sys.path[0]; gpu.py puts the repository root there too.
from gpu import report, run, work_folder

from hetpipe.config import ConfigError, JobLoader, parse_job

BUILTIN_JOB: dict[str, Any] = {
    "model": {"name": "mlp", "args": {"in_features": 64, "hidden": [1024] * 4, "num_classes": 10}},
    "data": {"name": "digits", "batch_size": 128, "shuffle": True},
    "train": {"steps": 120, "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.05}, "seed": 0},
    "output": {"dir": "out", "trace": False},
}
PLAIN = "plain loop"  # the name bench/gpu.py's run() starts as `gpu.py --plain`
NM = 4


@dataclass(frozen=True, slots=True)
class Layout:
    tag: str                  # output folder and JSON key
    name: str                 # the table's row, and the derived job file's name
    parallel: dict[str, Any]  # replaces the job's parallel section


def layouts(batch_size: int) -> list[Layout]:
    """The five runs, each pair of peers next to each other so that a drift of load hits both."""
    # torch's GPipe needs equal micro-batches: Nm of them if they divide the batch, else fewer.
    m = max(d for d in range(1, NM + 1) if batch_size % d == 0)
    return [
        Layout("plain", PLAIN, {"virtual_workers": 1, "stages_per_vw": 1}),
        Layout("hetpipe_1x2", f"hetpipe 1 VW x 2 stages, Nm {NM}",
               {"virtual_workers": 1, "stages_per_vw": 2, "nm": NM, "D": 0, "ps_shards": 1, "mode": "hetpipe"}),
        Layout("torch_pipeline", f"torch-pipeline 2 stages, {m} mb",
               {"stages_per_vw": 2, "mode": "torch-pipeline", "schedule": "gpipe", "microbatches": m}),
        Layout("hetpipe_2x1", "hetpipe 2 VWs x 1 stage, D 0",
               {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1, "mode": "hetpipe"}),
        Layout("ddp", "ddp 2 ranks", {"virtual_workers": 2, "stages_per_vw": 1, "mode": "ddp"}),
    ]


PEER_RATIOS = (("hetpipe 2x1 / ddp", "hetpipe_2x1", "ddp"),
               ("hetpipe 1x2 / torch-pipeline", "hetpipe_1x2", "torch_pipeline"))


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """samples/s over samples/s: the two peer pairs, then every run over the plain loop."""
    rate = {tag: r["samples_per_second"] for tag, r in results.items() if "error" not in r}

    def over(a: str, b: str) -> float | None:
        return rate[a] / rate[b] if a in rate and rate.get(b) else None

    out = {label: over(a, b) for label, a, b in PEER_RATIOS}
    out.update({f"{tag} / plain": over(tag, "plain") for tag in results if tag != "plain"})
    return out


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return f"{torch.cuda.device_count()} CUDA device(s): {names}; torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"the CPU, {os.cpu_count()} cores, no CUDA device; torch {torch.__version__}"


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def where(r: dict[str, Any]) -> str:
    """What a run computed on: its backend for the baselines, its stages' devices for HetPipe."""
    if "error" in r:
        return ""
    if "backend" in r:
        how = [r["backend"], r.get("schedule"), r.get("allreduce_hook")]
        return ", ".join(filter(None, how)) + " on " + ", ".join(p["device"] for p in r.get("plan", []))
    devices = [p["device"] for p in r.get("processes", []) if p.get("device")]
    return ", ".join(devices) if devices else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", type=Path, help="a job file (default: the built-in MLP job above)")
    ap.add_argument("--steps", type=int, default=0, help="overrides train.steps")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default 1200)")
    ap.add_argument("--per-step", action="store_true",
                    help="also run HetPipe 2x1 and ddp at 3x the steps: CPU and wall seconds per step, start-up excluded")
    ap.add_argument("--pairs", type=int, default=0,
                    help="then run each pair of peers N times more, which goes first alternating: each run's "
                         "ratio and the median of all, the figure a box whose load swings from one minute to the "
                         "next leaves standing")
    ap.add_argument("--keep", action="store_true", help="keep each run's outputs and logs (kept anyway on a failure)")
    args = ap.parse_args()
    if args.pairs < 0:
        ap.error(f"--pairs must be 0 or more, got {args.pairs}")
    with work_folder("hetpipe-peers-", args.keep) as work:
        _bench(args, work)


def _bench(args: argparse.Namespace, work: Path) -> None:
    import torch

    if args.job is not None:
        raw = yaml.load(args.job.read_text(), Loader=JobLoader) or {}
        folder = args.job.resolve().parent
    else:
        raw, folder = json.loads(json.dumps(BUILTIN_JOB)), work
    if args.steps:
        raw.setdefault("train", {})["steps"] = args.steps
    if torch.cuda.is_available() and raw.pop("cluster", None) is not None:
        print("# the job's cluster section is dropped: every run uses this machine's GPUs", flush=True)
    if raw.pop("eval", None) is not None:
        (raw.get("data") or {}).pop("eval_fraction", None)   # no rows held out for an evaluation that does not run
        print("# the job's eval section is dropped: the plain loop and torch-pipeline do not evaluate", flush=True)

    def derived(parallel: dict[str, Any], tag: str) -> dict[str, Any]:
        # No trace (nor the ledger in it) either: the baselines and the plain loop write none.
        output = {**raw.get("output", {}), "dir": str(work / tag), "trace": False, "ledger": False}
        return {**raw, "parallel": parallel, "output": output}

    try:
        job = parse_job(derived({}, "plain"), base_dir=str(folder))
        runs = [(layout, derived(layout.parallel, layout.tag)) for layout in layouts(job.data.batch_size)]
        for layout, spec in runs:  # every layout's job is valid before any of them runs
            parse_job(spec, base_dir=str(folder))
    except ConfigError as exc:
        sys.exit(f"bench/peers.py: {exc}")
    for layout, _ in runs:
        if (folder / f"{layout.name}.yaml").exists():
            sys.exit(f"bench/peers.py: {folder / layout.name}.yaml exists; it would be overwritten")
    steps, batch = job.train.steps, job.data.batch_size
    print(f"# {machine()}; {job.model.name or job.model.factory} {job.model.args or ''}, {job.data.name or job.data.factory}, "
          f"batch {batch}, {job.train.optimizer.name}, {steps} steps, {job.train.precision}", flush=True)
    if job.emulate is not None:
        print("# the job emulates GPUs: HetPipe and the baselines are padded to their times, the plain loop is not",
              flush=True)
    print(f"# load average at start: {load_average()}", flush=True)

    results: dict[str, dict[str, Any]] = {}
    try:
        for layout, spec in runs:
            results[layout.tag] = run(layout.name, spec, folder, timeout=args.timeout)
            print(f"  {layout.name}: done (load average {load_average()})", flush=True)
    finally:
        for layout, _ in runs:
            (folder / f"{layout.name}.yaml").unlink(missing_ok=True)
    report(list(results.values()))
    print("where each ran:")
    for layout, _ in runs:
        if where(results[layout.tag]):
            print(f"    {layout.name:<32} {where(results[layout.tag])}")
    table = ratios(results)
    print("peers, samples/s over samples/s:")
    for label, _, _ in PEER_RATIOS:
        value = table[label]
        print(f"    {label:<32} {'n/a' if value is None else f'{value:.2f}'}")
    print("samples/s counts every sample trained: ddp's 2 ranks and HetPipe's 2 VWs each train a minibatch "
          "per step; start-to-exit is the whole process, interpreter and every worker included; CPU s is "
          "the user + system time of every process of the run")
    per_step = per_step_costs(runs, results, folder, steps, args.timeout) if args.per_step else {}
    repeated = pairs(runs, table, folder, args.pairs, args.timeout) if args.pairs > 0 else {}
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "job": raw, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                                         "runs": results, "ratios": table, "per_step": per_step, "pairs": repeated},
                                        indent=2))
    failed = [r["name"] for r in results.values() if "error" in r]
    if failed:  # the rows above say why; a script that runs this must not read success
        sys.exit(f"bench/peers.py: {len(failed)} of {len(results)} runs failed: {', '.join(failed)}")


def run_again(layout: Layout, spec: dict[str, Any], folder: Path, timeout: float) -> dict[str, Any]:
    """One more run of a layout (another spec: its steps, its output folder), its derived job
    file removed after it."""
    try:
        return run(layout.name, spec, folder, timeout=timeout)
    finally:
        (folder / f"{layout.name}.yaml").unlink(missing_ok=True)


def per_step_costs(runs: list[tuple[Layout, dict[str, Any]]], results: dict[str, dict[str, Any]], folder: Path,
                   steps: int, timeout: float) -> dict[str, dict[str, float]]:
    """HetPipe 2x1 and ddp again at 3x the steps: the differences, per step, are the CPU seconds
    (every process) and wall seconds a step costs, with start-up and shutdown taken out."""
    out: dict[str, dict[str, float]] = {}
    print(f"per step, from runs of {steps} and {3 * steps} steps (the difference over {2 * steps} steps):")
    print(f"    {'run':<32}{'wall ms':>9}{'CPU ms':>9}{'cores busy':>12}")
    for layout, spec in runs:
        if layout.tag not in ("hetpipe_2x1", "ddp") or "error" in results[layout.tag]:
            continue
        longer = {**spec, "train": {**spec["train"], "steps": 3 * steps},
                  "output": {**spec["output"], "dir": spec["output"]["dir"] + "_long"}}
        long = run_again(layout, longer, folder, 3 * timeout)
        if "error" in long:
            print(f"    {layout.name:<32} FAILED: {' | '.join(long['error'])}")
            continue
        short = results[layout.tag]
        wall = (long["start_to_exit_seconds"] - short["start_to_exit_seconds"]) / (2 * steps)
        cpu = (long["cpu_seconds"] - short["cpu_seconds"]) / (2 * steps)
        out[layout.tag] = {"wall_seconds": wall, "cpu_seconds": cpu}
        print(f"    {layout.name:<32}{wall * 1e3:>9.1f}{cpu * 1e3:>9.1f}{cpu / wall:>12.2f}")
    return out


def pairs(runs: list[tuple[Layout, dict[str, Any]]], table: dict[str, float | None], folder: Path, n: int,
          timeout: float) -> dict[str, list[float]]:
    """Each pair of peers n times more, the second of the pair first every other time (a drift of
    load then favours neither); per pair, every ratio (the table's first) and their median."""
    spec = {layout.tag: (layout, s) for layout, s in runs}
    out: dict[str, list[float]] = {}
    print(f"each pair of peers {n} times more (the first ratio: the table's):")
    for label, a, b in PEER_RATIOS:
        first = table[label]
        if first is None:
            print(f"    {label:<32} n/a (a run failed above)")
            continue
        got = [first]
        for i in range(n):
            rate: dict[str, float] = {}
            for tag in ((b, a) if i % 2 == 0 else (a, b)):   # the table ran a, then b
                layout, base = spec[tag]
                again = {**base, "output": {**base["output"], "dir": f"{base['output']['dir']}_{i + 1}"}}
                r = run_again(layout, again, folder, timeout)
                if "error" in r:
                    print(f"    {layout.name} FAILED: {' | '.join(r['error'])}")
                    break
                rate[tag] = r["samples_per_second"]
            if len(rate) == 2:
                got.append(rate[a] / rate[b])
        out[label] = got
        print(f"    {label:<32} median {statistics.median(got):.2f} of {len(got)}: "
              + " ".join(f"{x:.2f}" for x in got), flush=True)
    return out


if __name__ == "__main__":
    main()
