"""One real GPU: a GPT trained by a plain PyTorch loop, by `hetpipe run` (1x1, 1x2 and 2 VWs x 2
stages at Nm 4 or --nm) and by the torch-pipeline and ddp baselines; samples/s side by side, each as a ratio to
the plain loop, and each run's start-to-exit wall time against its training time.

    python bench/gpu.py                  # the issue's 117.8M GPT, bf16, batch 16, SGD
    python bench/gpu.py --large          # a 1.3B GPT (dim 2048, 24 layers) over 2 and 4 stages
    python bench/gpu.py --small          # a 0.4M GPT: checks the kit end to end (on the CPU if no GPU)

Every run is its own process (`hetpipe run`, or this file with --plain), so start-to-exit
includes the interpreter, CUDA initialisation and, for HetPipe, the stage and shard processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import yaml
from sync_latency import report as sync_latency

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPT_118M = {"vocab": 8192, "context": 256, "dim": 1024, "heads": 16, "layers": 8}
GPT_1_3B = {"vocab": 8192, "context": 256, "dim": 2048, "heads": 16, "layers": 24}
GPT_SMALL = {"vocab": 512, "context": 32, "dim": 64, "heads": 4, "layers": 4}
RUNS = ("plain", "h11", "h12", "h14", "h22", "tp", "ddp")   # --runs tags (h14: --large only)


def job_dict(out: Path, model: dict[str, int], *, steps: int, precision: str, batch: int = 16,
             vws: int = 1, stages: int = 1, nm: int | str = 1, D: int = 0, shards: int = 1,
             mode: str = "hetpipe") -> dict[str, Any]:
    parallel: dict[str, Any] = {"virtual_workers": vws, "stages_per_vw": stages, "nm": nm, "D": D,
                                "ps_shards": shards, "mode": mode}
    if mode == "torch-pipeline":
        parallel = {"stages_per_vw": stages, "mode": mode, "microbatches": nm}
    elif mode == "ddp":
        parallel = {"virtual_workers": vws, "stages_per_vw": 1, "mode": mode}
    return {
        "model": {"name": "gpt", "args": model},
        "data": {"name": "synthetic", "batch_size": batch, "args": {"rows": 4096}},
        "train": {"steps": steps, "loss": "cross_entropy", "precision": precision,
                  "optimizer": {"name": "sgd", "lr": 0.01}, "seed": 0},
        "parallel": parallel,
        "output": {"dir": str(out), "trace": False},
    }


STEADY_FROM = 64   # the plain loop's steady rates: after each of its first k steps (a run's nm)


def plain_loop(path: str) -> dict[str, Any]:
    """The same model, data order, optimizer and autocast, in one process on the device a
    `hetpipe run` without a cluster section uses (cuda:0, else the CPU)."""
    import torch

    from hetpipe import datasets, models
    from hetpipe.config import load_job
    from hetpipe.optim import autocast, compute_dtype, compute_loss, make_optimizer, step_at
    from hetpipe.reference import initial_model, minibatch
    from stage_worker import profiling

    job = load_job(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = initial_model(job).to(device)
    optimizer = make_optimizer([p for _, p in models.trainable(model)], job.train.optimizer)
    dataset = datasets.training_set(job)
    dtype = compute_dtype(job.train.precision)
    window = job.output.profile   # the stages' window, here: minibatches (after, after + steps]
    profile = None
    if window is not None:
        trace = Path(job.resolve(job.output.dir)) / "trace"
        trace.mkdir(parents=True, exist_ok=True)
        profile = profiling.StageProfile(str(trace / "profile_plain.json"), "plain loop", window.after,
                                         window.steps, cuda=device == "cuda")
    start = 0.0
    # The end of each of the first steps, for the steady rates below: on a GPU an event recorded
    # in the stream (no wait), elsewhere the clock (the CPU computes as it goes).
    marks: list[Any] = []
    for p in range(1, job.train.steps + 1):
        if profile is not None:
            profile.before(p - 1)
        x, y = minibatch(job, dataset, p, 0)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(dtype, device):
            loss = compute_loss(job.train.loss, model(x), y)
        loss.backward()
        step_at(optimizer, job.train, p)
        if p == 1:
            # Timed from the end of the first step: its one-time costs (CUDA's libraries, kernel
            # selection) are left out here, and kept in HetPipe's wall, so the ratios err against it.
            float(loss)
            start = time.monotonic()
        if p <= STEADY_FROM or p == job.train.steps:
            marks.append(_mark(device))
        if profile is not None:
            profile.after_task(p)
    final = float(loss)  # waits for the last step
    wall = time.monotonic() - start
    timed = max(job.train.steps - 1, 1)
    # A HetPipe run's steady rate starts after its first wave of nm minibatches: the plain loop's
    # after its first k steps, for each k a run may compare with.
    steady = {str(k): (job.train.steps - k) * job.data.batch_size / _seconds(marks[k - 1], marks[-1])
              for k in range(1, min(STEADY_FROM, job.train.steps - 1) + 1)}
    return {"samples_per_second": timed * job.data.batch_size / wall, "wall_seconds": wall, "steady_from": steady,
            "final_loss": final, "profile": profile.summary if profile is not None else {},
            "device_peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else 0}


def _mark(device: str) -> Any:
    import torch

    if device != "cuda":
        return time.monotonic()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(a: Any, b: Any) -> float:
    """Seconds from mark a to mark b (both taken once the stream has passed them)."""
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1000


def _cpu_seconds(root: psutil.Process, seen: dict[int, float]) -> None:
    """Records the user + system seconds of root and every descendant now (their own, not their
    children's: those are descendants here too)."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for proc in tree:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        seen[proc.pid] = times.user + times.system


def run(name: str, job: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """Runs one job as its own process; its summary plus start_to_exit_seconds and cpu_seconds,
    the CPU time of every process of the run (sampled every 50 ms: a process's last 50 ms before
    it exits may be missed)."""
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    plain = name == "plain loop"
    cmd = ([sys.executable, __file__, "--plain", str(path)] if plain
           else [sys.executable, "-m", "launch.cli", "run", "--quiet", str(path)])
    seen: dict[int, float] = {}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
        root = psutil.Process(proc.pid)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                _cpu_seconds(root, seen)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        elapsed = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        return {"name": name, "error": (stderr or stdout).strip().splitlines()[-5:]}
    summary = json.loads(stdout) if plain else json.loads((Path(job["output"]["dir"]) / "summary.json").read_text())
    if not plain and job["parallel"].get("nm") == "auto":
        name = name.replace("Nm auto", f"Nm auto ({summary['nm']})")   # what the planner chose
    summary.update(name=name, start_to_exit_seconds=elapsed, cpu_seconds=sum(seen.values()))
    return summary


def report(results: list[dict[str, Any]]) -> None:
    plain = next((r for r in results if r["name"] == "plain loop" and "error" not in r), None)
    base = plain["samples_per_second"] if plain else None
    print(f"{'run':<50}{'samples/s':>11}{'x plain':>9}{'steady/s':>10}{'x plain':>9}{'train s':>9}"
          f"{'start-to-exit s':>17}{'overhead s':>12}{'CPU s':>8}{'G2 wait s':>11}{'idle s':>8}")
    print("  (steady: after each run's first wave of nm minibatches, and the plain loop's after as many steps)")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<50} FAILED: {' | '.join(r['error'])}")
            continue
        ratio = r["samples_per_second"] / base if base else float("nan")
        steady = r.get("steady_samples_per_second") or float("nan")
        if r is plain:
            steady = plain["steady_from"].get("1", float("nan"))
        plain_steady = plain["steady_from"].get(str(r.get("nm", 1)), float("nan")) if plain else float("nan")
        # HetPipe's stages, summed: waiting for a pull (G2), and with no task to run at all.
        waits = f"{r['wait_seconds']:>11.1f}{r['idle_seconds']:>8.1f}" if "idle_seconds" in r else ""
        print(f"{r['name']:<50}{r['samples_per_second']:>11.1f}{ratio:>9.2f}{steady:>10.1f}{steady / plain_steady:>9.2f}"
              f"{r['wall_seconds']:>9.1f}"
              f"{r['start_to_exit_seconds']:>17.1f}{r['start_to_exit_seconds'] - r['wall_seconds']:>12.1f}"
              f"{r['cpu_seconds']:>8.1f}{waits}")
        for p in r.get("processes", []):
            print(f"    {p['process']:<28} peak RSS {p['peak_rss_bytes'] / 2**30:6.2f} GiB"
                  + (f"  GPU peak {p['device_peak_bytes'] / 2**30:6.2f} GiB" if p.get("device_peak_bytes") else "")
                  + (f"  layers {p['layers']}" if "layers" in p else ""))


@contextlib.contextmanager
def work_folder(prefix: str, keep: bool) -> Iterator[Path]:
    """A temporary folder for the runs' outputs. It goes afterwards unless kept, or unless the
    benchmark failed: then its logs are the evidence, and where they lie is printed."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    except BaseException:
        print(f"# the runs' outputs and logs are kept in {work}", file=sys.stderr, flush=True)
        raise
    if keep:
        print(f"# the runs' outputs are kept in {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", metavar="JOB", help=argparse.SUPPRESS)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--large", action="store_true", help="the 1.3B GPT over 2 and 4 stages")
    size.add_argument("--small", action="store_true", help="a tiny GPT: checks the kit (runs on the CPU too)")
    ap.add_argument("--steps", type=int, default=0, help="minibatches per run (default 150; 30 with --large)")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep each run's outputs and logs (kept anyway on a failure)")
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                    help="which runs, by tag (default: all; ddp only where there are 2 GPUs)")
    ap.add_argument("--D", type=int, default=1, help="the 2 VWs' clock distance (default 1)")
    ap.add_argument("--shards", type=int, default=2, help="the 2 VWs' parameter-server shards (default 2)")
    ap.add_argument("--nm", type=_nm, nargs="+", default=[4],
                    help="minibatches a wave of 1x2 and 2x2 (default 4; auto: the planner's; several: a row each; "
                         "--large keeps its own): "
                         "each VW pushes and pulls the whole model once a wave, so the shards' passes over it "
                         "cost 1/nm of it a minibatch")
    ap.add_argument("--trace", action="store_true",
                    help="HetPipe runs write their traces (output.trace), and each prints where its pushes and pulls "
                         "spent their time (bench/sync_latency.py); implies --keep")
    ap.add_argument("--profile", nargs=2, type=int, metavar=("AFTER", "STEPS"),
                    help="torch.profiler over minibatches (AFTER, AFTER + STEPS] of the plain loop and of each "
                         "HetPipe stage (output.profile): per minibatch wall, kernel time and launches")
    ap.add_argument("--tables", type=Path, metavar="DIR", help="with --profile: copy each run's tables here")
    args = ap.parse_args()
    if args.plain:
        print(json.dumps(plain_loop(args.plain)))
        return
    with work_folder("hetpipe-gpu-", args.keep or args.trace) as work:
        _bench(args, work)


def _nm(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, not {text!r}") from None


def _bench(args: argparse.Namespace, work: Path) -> None:
    import torch

    if torch.cuda.is_available():
        print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"driver {_driver()}, {args.precision}", flush=True)
    elif args.small:
        print(f"# no CUDA device: the CPU, torch {torch.__version__}, {args.precision}", flush=True)
    else:
        sys.exit("bench/gpu.py needs a CUDA device (--small checks the kit on the CPU)")
    steps = args.steps or (30 if args.large else 150)
    args.nm = list(dict.fromkeys(args.nm))   # one row, and one output folder, a value
    model = GPT_1_3B if args.large else GPT_SMALL if args.small else GPT_118M

    def job(tag: str, **kw: Any) -> dict[str, Any]:
        return job_dict(work / tag, model, steps=steps, precision=args.precision, **kw)

    def each(nm: int | str) -> str:   # one output folder a row
        return f"-nm{nm}" if len(args.nm) > 1 else ""

    shards = f", {args.shards} shard{'s' * (args.shards > 1)}" if args.shards != 2 else ""
    wanted = set(args.runs)
    if "ddp" in wanted and torch.cuda.device_count() < 2:
        # Both ranks on one GPU: NCCL refuses, and gloo takes the whole model through host memory
        # every step (over 100 s for 40 steps of the 117.8M GPT on an H100).
        print("# ddp left out: it needs 2 GPUs", flush=True)
        wanted.discard("ddp")
    runs = [("plain", "plain loop", job("plain"))]
    if args.large:
        runs += [("h12", "hetpipe 1 VW x 2 stages, Nm 2", job("s2", stages=2, nm=2)),
                 ("h14", "hetpipe 1 VW x 4 stages, Nm 4", job("s4", stages=4, nm=4))]
    else:
        runs += [("h11", "hetpipe 1 VW x 1 stage", job("h11")),
                 *[("h12", f"hetpipe 1 VW x 2 stages, Nm {nm}", job(f"h12{each(nm)}", stages=2, nm=nm))
                   for nm in args.nm],
                 *[("h22", f"hetpipe 2 VWs x 2 stages, Nm {nm}, D {args.D}" + shards,
                    job(f"h22{each(nm)}", vws=2, stages=2, nm=nm, D=args.D, shards=args.shards))
                   for nm in args.nm],
                 ("tp", "torch-pipeline 2 stages, 4 mb", job("tp", stages=2, nm=4, mode="torch-pipeline")),
                 ("ddp", "ddp 2 ranks", job("ddp", vws=2, mode="ddp"))]
    for _, _, spec in runs:
        spec["output"]["trace"] = args.trace
        if args.profile and spec["parallel"].get("mode", "hetpipe") == "hetpipe":
            spec["output"]["profile"] = {"after": args.profile[0], "steps": args.profile[1]}
    results = []
    for _, name, spec in (r for r in runs if r[0] in wanted):
        results.append(run(name, spec, work, timeout=1200))
        done = results[-1]
        print(f"  {done['name']}: " + ("FAILED" if "error" in done else f"{done['samples_per_second']:.1f} samples/s"),
              flush=True)
        for table in sorted((Path(spec["output"]["dir"]) / "trace").glob("profile_*.txt")):
            print(f"    {table.read_text().splitlines()[0]}", flush=True)   # each profiled process's cost
            if args.tables:
                args.tables.mkdir(parents=True, exist_ok=True)
                shutil.copy(table, args.tables / f"{Path(spec['output']['dir']).name}_{table.name}")
        if args.trace and (Path(spec["output"]["dir"]) / "trace" / "sync").is_dir():   # a HetPipe run's
            print("    " + sync_latency(Path(spec["output"]["dir"])).replace("\n", "\n    "), flush=True)
        if args.json:   # after every run: a time limit that cuts the benchmark short keeps what it measured
            args.json.write_text(json.dumps(results, indent=2))
    report(results)
    failed = [r["name"] for r in results if "error" in r]
    if failed:  # the rows above say why; a script that runs this must not read success
        sys.exit(f"bench/gpu.py: {len(failed)} of {len(results)} runs failed: {', '.join(failed)}")


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
