"""One long run of bench/convergence.py for a wall-clock budget: HetPipe through `hetpipe run`'s
run_local on a thread, stopped with the coordinator's StopJob once the budget is spent; ddp
(which has no coordinator to stop it) for a number of steps that covers the budget. Both read
their learning curve from OUTPUT_DIR/eval.jsonl."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from hetpipe import faults, rpc
from hetpipe.config import JobConfig
from hetpipe.errors import JobStopped
from hetpipe.v1 import coordinator_pb2
from hetpipe.outputs import ADDRESS_FILE
from launch.local import TARGETS_FILE, run_local

State = coordinator_pb2.JobStatus.State
TERMINAL = {State.COMPLETED, State.FAILED, State.STOPPED}
SETUP_TIMEOUT_S = 300.0  # process start-up and stage loading on a loaded 2-core box
WORKER_MODULES = ("stage_worker", "ps_server", "baselines")


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One line of eval.jsonl, with the samples every VW (rank) had trained by then."""

    seconds: float      # since training started (the driver's Start; ddp: after the ranks' barrier)
    minibatches: int    # VW 0's (rank 0's) minibatches when it ran
    samples: int        # all VWs' (ranks') minibatches x batch: HetPipe's from the coordinator's count then
    loss: float
    accuracy: float


@dataclass(frozen=True, slots=True)
class Run:
    evaluations: tuple[Evaluation, ...]   # periodic ones, within the budget, in time order
    seconds: float                        # training time the run got (the budget, or ddp's wall)
    samples: int                          # trained by all VWs (ranks) in that time
    wait_seconds: float                   # HetPipe: G2 pull wait summed over every stage; ddp: allreduce wait
    vw_minibatches: tuple[int, ...]       # per VW (ddp: per rank, all equal)
    clock_distance: int | None            # fastest minus slowest VW clock at the stop (the shards')
    setup_seconds: float                  # start of run_local to training start (ddp: to the end, less training)
    cpu_cores: float                      # CPU the workers used while training, in cores (this box has os.cpu_count())
    step_seconds: float | None            # ddp: wall seconds per step over its whole run; HetPipe: None
    leftover: tuple[str, ...]             # worker processes still alive after the run: must be none

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else math.nan


def read_evaluations(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "eval.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _workers() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if any(f"-m {m}" in cmd for m in WORKER_MODULES) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def worker_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) each live worker process has used so far, by pid."""
    used = {}
    for p in _workers():
        try:
            t = p.cpu_times()
            used[p.pid] = t.user + t.system
        except psutil.Error:
            continue
    return used


def cores_between(readings: list[tuple[float, dict[int, float]]]) -> float:
    """CPU cores the workers used from the first reading to the last: each process's CPU seconds
    between its first and its last appearance, summed, over the time between the readings."""
    if len(readings) < 2 or readings[-1][0] <= readings[0][0]:
        return math.nan
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for _, used in readings:
        for pid, seconds in used.items():
            first.setdefault(pid, seconds)
            last[pid] = seconds
    return sum(last[pid] - first[pid] for pid in last) / (readings[-1][0] - readings[0][0])


def leftover_workers() -> tuple[str, ...]:
    """Worker processes (stage workers, shards, baseline ranks) among this process's descendants:
    run_local and the baselines must have stopped every one they started."""
    found = []
    for p in _workers():
        try:
            found.append(f"pid {p.pid}: {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            continue
    return tuple(found)


def _interpolate(series: list[tuple[float, int]], t: float) -> int:
    """Samples at time t from the coordinator's (seconds, samples) progress readings."""
    before = [(s, n) for s, n in series if s <= t]
    after = [(s, n) for s, n in series if s > t]
    if not before:
        return after[0][1] if after else 0
    if not after:
        return before[-1][1]
    (s0, n0), (s1, n1) = before[-1], after[0]
    return round(n0 + (n1 - n0) * (t - s0) / (s1 - s0))


# ---- HetPipe: stopped at the budget ---------------------------------------------------------


def _scrape(out_dir: Path) -> tuple[dict[tuple[int, int], dict[str, float]], int | None]:
    """Every stage's counters ((vw, stage) -> name -> value) and the shards' clock distance,
    from the metrics endpoints the run lists in prometheus_targets.json."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"hetpipe_stage_samples", "hetpipe_stage_pull_wait_seconds", "hetpipe_stage_local_clock",
              "hetpipe_ps_clock_distance"}
    stages: dict[tuple[int, int], dict[str, float]] = {}
    distance: int | None = None
    try:
        targets = json.loads((out_dir / TARGETS_FILE).read_text())
    except (OSError, ValueError):
        return stages, distance
    for entry in targets:
        if entry["labels"]["role"] not in ("stage_worker", "ps_shard"):
            continue
        for target in entry["targets"]:
            try:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                if family.name not in wanted:
                    continue
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    if family.name == "hetpipe_ps_clock_distance":
                        distance = max(distance or 0, int(sample.value))
                    else:
                        key = (int(sample.labels["vw"]), int(sample.labels["stage"]))
                        stages.setdefault(key, {})[family.name] = sample.value
    return stages, distance


def run_hetpipe(job: JobConfig, budget: float, injected: faults.Faults, vws: int) -> Run:
    """Trains job (train.steps more than the budget allows) for `budget` seconds of training,
    then stops it through the coordinator, as `hetpipe stop` does; run_local tears down."""
    out_dir = Path(job.resolve(job.output.dir))
    (out_dir / ADDRESS_FILE).unlink(missing_ok=True)
    ended: dict[str, Any] = {}

    def train() -> None:
        try:
            ended["summary"] = run_local(job, quiet=True)
        except JobStopped as exc:
            ended["stopped"] = str(exc)
        except BaseException as exc:  # handed to the main thread, which raises it
            ended["error"] = exc

    launched = time.monotonic()
    with faults.injected(injected):
        thread = threading.Thread(target=train, name="run_local", daemon=True)
        thread.start()
        try:
            progress, stages, distance, started, cpu = _follow(out_dir, thread, budget, launched)
        finally:
            thread.join(120.0)
    if "error" in ended:
        raise ended["error"]
    if "summary" in ended:
        raise RuntimeError(f"{out_dir}: the run completed before the budget: raise train.steps")
    if thread.is_alive():
        raise RuntimeError(f"{out_dir}: run_local did not return within 120 s of the stop")
    k = max((q for _, q in stages), default=0)  # the last stage: its samples are the VW's trained ones
    vw_minibatches = tuple(int(stages.get((v, k), {}).get("hetpipe_stage_samples", 0) // job.data.batch_size)
                           for v in range(vws))
    samples = progress[-1][1]
    evaluations = tuple(
        Evaluation(float(e["seconds"]), int(e["minibatches"]), _interpolate(progress, float(e["seconds"])),
                   float(e["loss"]), float(e["accuracy"]))
        for e in read_evaluations(out_dir) if not e["final"] and float(e["seconds"]) <= budget)
    return Run(evaluations, budget, samples,
               sum(v.get("hetpipe_stage_pull_wait_seconds", 0.0) for v in stages.values()),
               vw_minibatches, distance, started, cpu, None, leftover_workers())


def _follow(out_dir: Path, thread: threading.Thread, budget: float, launched: float,
            ) -> tuple[list[tuple[float, int]], dict[tuple[int, int], dict[str, float]], int | None, float, float]:
    """Waits for training to start, records the coordinator's progress for `budget` seconds,
    reads the stages' counters and stops the job. Returns (progress readings, counters, clock
    distance, seconds from launch to training start, the workers' CPU cores meanwhile)."""
    address_file = out_dir / ADDRESS_FILE
    while not address_file.exists():
        if not thread.is_alive() or time.monotonic() - launched > SETUP_TIMEOUT_S:
            raise RuntimeError(f"{out_dir}: no coordinator address (run_local ended or took too long)")
        time.sleep(0.05)
    with rpc.channel(address_file.read_text().strip()) as channel:
        stub = rpc.Stub(channel, "Coordinator")
        while True:
            status = stub.GetJob(coordinator_pb2.JobRef(), timeout=rpc.CONTROL_DEADLINE_S)
            if status.state == State.RUNNING:
                break
            if status.state in TERMINAL or time.monotonic() - launched > SETUP_TIMEOUT_S:
                raise RuntimeError(f"{out_dir}: the job did not start: {State.Name(status.state)} {status.reason}")
            time.sleep(0.02)
        start, cpu_at_start = time.monotonic(), worker_cpu_seconds()
        progress: list[tuple[float, int]] = [(0.0, 0)]
        try:
            while (now := time.monotonic()) < start + budget:
                if not thread.is_alive():
                    raise RuntimeError(f"{out_dir}: run_local ended during the budget")
                status = stub.GetJob(coordinator_pb2.JobRef(), timeout=rpc.CONTROL_DEADLINE_S)
                if status.state != State.RUNNING:
                    raise RuntimeError(f"{out_dir}: the job left RUNNING: {State.Name(status.state)} {status.reason}")
                progress.append((now - start, int(status.samples)))
                time.sleep(min(0.5, max(0.0, start + budget - time.monotonic())))
            status = stub.GetJob(coordinator_pb2.JobRef(), timeout=rpc.CONTROL_DEADLINE_S)
            progress.append((time.monotonic() - start, int(status.samples)))
            cpu = cores_between([(start, cpu_at_start), (time.monotonic(), worker_cpu_seconds())])
            stages, distance = _scrape(out_dir)
        finally:
            stub.StopJob(coordinator_pb2.JobRef(), timeout=rpc.CONTROL_DEADLINE_S)
    return progress, stages, distance, start - launched, cpu


# ---- ddp: as many steps as cover the budget ---------------------------------------------------


def run_ddp(job: JobConfig, budget: float, injected: faults.Faults, ranks: int) -> Run:
    """Trains job (parallel.mode ddp; train.steps chosen by the caller to cover the budget) to
    the end: baselines/ddp.py has no coordinator to stop it. Evaluations past the budget are
    dropped, so its curve ends where HetPipe's do."""
    out_dir = Path(job.resolve(job.output.dir))
    launched = time.monotonic()
    box: dict[str, Any] = {}

    def train() -> None:
        try:
            box["summary"] = run_local(job, quiet=True)
        except BaseException as exc:  # handed to the main thread, which raises it
            box["error"] = exc

    with faults.injected(injected):
        thread = threading.Thread(target=train, name="run_ddp", daemon=True)
        thread.start()
        # The ranks' CPU seconds, read while they live (their times vanish with them).
        readings: list[tuple[float, dict[int, float]]] = []
        while thread.is_alive():
            readings.append((time.monotonic(), worker_cpu_seconds()))
            thread.join(0.5)
    if "error" in box:
        raise box["error"]
    summary = box["summary"]
    total = time.monotonic() - launched
    wall = float(summary["wall_seconds"])
    per_step = ranks * job.data.batch_size
    evaluations = tuple(
        Evaluation(float(e["seconds"]), int(e["minibatches"]), int(e["minibatches"]) * per_step,
                   float(e["loss"]), float(e["accuracy"]))
        for e in read_evaluations(out_dir) if not e["final"] and float(e["seconds"]) <= budget)
    seconds = min(budget, wall)
    # Synchronous steps at a steady pace: the samples of the budget, in proportion.
    samples = round(job.train.steps * per_step * seconds / wall)
    steps = samples // per_step
    wait = float(summary.get("wait_seconds", 0.0)) * seconds / wall
    # CPU while training: from a reading a second into training to the last one of the ranks.
    alive = [(t, used) for t, used in readings if len(used) == ranks]
    cores = cores_between([(t, used) for t, used in alive if t >= alive[-1][0] - wall + 1.0] if alive else [])
    return Run(evaluations, seconds, samples, wait, (steps,) * ranks, None, total - wall, cores,
               wall / job.train.steps, leftover_workers())
