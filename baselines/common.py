"""What both baselines share: the worker launcher (parent side), the worker's process group and
progress files (worker side), emulated-time padding, and the outputs (model.safetensors, summary.json)."""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hetpipe import children, progress, threads
from hetpipe.children import Child
from hetpipe.config import JobConfig
from hetpipe.errors import JobFailed
from hetpipe.optim import autocast, compute_dtype

# Hard limit (seconds) for the rendezvous and for every collective or point-to-point operation,
# and for the launcher to see no progress at all; raised for long emulated steps.
DEFAULT_TIMEOUT_S = float(os.environ.get("HETPIPE_BASELINE_TIMEOUT_S", "300"))
STOP_GRACE_S = 3.0
WORK_DIR = "baseline"  # under output.dir: spec, per-rank progress and results


def timeout_for(step_seconds: float) -> float:
    """The per-operation limit: the default, or 20 emulated steps if those are longer."""
    return max(DEFAULT_TIMEOUT_S, 20.0 * step_seconds)


# ---- parent side ------------------------------------------------------------------------------


class BaselineFailed(JobFailed):
    """A worker failed or stalled; the message names the rank, its device and its log."""


@dataclass
class _Worker(Child):
    rank: int = 0


@dataclass
class WorkerGroup:
    """One `python -m baselines` process per rank, rendezvous through a TCPStore this process
    serves on 127.0.0.1 (a free port); every process is stopped when the group closes."""

    mode: str
    out_dir: Path
    names: Sequence[str]            # per rank, e.g. "rank 1 (titan-v (emulated) on n0)"
    spec: dict[str, Any]
    timeout_s: float
    workers: list[_Worker] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work = self.out_dir / WORK_DIR
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        from torch.distributed import TCPStore

        # The parent serves the store: the port is bound before any worker needs it (no race
        # for a "free" port), and a worker that never comes times out on its own.
        self._store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=self.timeout_s),
                               wait_for_workers=False)
        spec = {**self.spec, "mode": self.mode, "world_size": len(self.names), "store_port": self._store.port,
                "timeout_s": self.timeout_s, "work_dir": str(self.work)}
        spec_path = self.work / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # `python -m baselines` must resolve to this source tree whatever the working folder.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, whatever the hostname resolves to
        env[threads.THREADS_ENV] = threads.threads_for(len(self.names))
        for rank, name in enumerate(self.names):
            log_path = self.out_dir / "logs" / f"{self.mode}_rank{rank}.log"
            popen = children.start([sys.executable, "-m", "baselines", "--spec", str(spec_path), "--rank", str(rank)],
                                   log_path, env=env)
            self.workers.append(_Worker(name, popen, log_path, rank))

    def _reports(self) -> list[tuple[int, float]]:
        """Each rank's progress file: the steps it has finished and its last loss (NaN: none)."""
        reports = []
        for w in self.workers:
            try:
                steps, loss = (self.work / f"rank{w.rank}.progress").read_text().split()[:2]
                reports.append((int(steps), float(loss)))
            except (OSError, ValueError):
                reports.append((0, math.nan))
        return reports

    def progress(self) -> list[int]:
        """Minibatches (steps) each rank has finished, from its progress file."""
        return [steps for steps, _ in self._reports()]

    def loss(self) -> float | None:
        """The ranks' last losses, averaged over those that have one: ddp's global minibatch, a
        pipeline's last stage (the others compute none); None before the first."""
        losses = [loss for _, loss in self._reports() if math.isfinite(loss)]
        return sum(losses) / len(losses) if losses else None

    def _failure(self) -> BaselineFailed | None:
        if not any(w.popen.poll() not in (None, 0) for w in self.workers):
            return None
        time.sleep(0.5)  # its peers fail right after it: collect them, then name the first cause
        codes = {w.rank: w.popen.poll() for w in self.workers}
        dead = [w for w in self.workers if codes[w.rank] not in (None, 0)]
        # A rank killed by a signal (or by the OS) is the cause; its peers only lost their connection.
        dead.sort(key=lambda w: (int(codes[w.rank] or 0) >= 0, w.rank))
        first = dead[0]
        others = "; ".join(f"{w.name} {w.exit_description()}" for w in dead[1:])
        return BaselineFailed(
            f"{self.mode}: {first.name} {first.exit_description()} (log {first.log_path})"
            + (f"; then {others}" if others else "") + f":\n{first.log_tail()}"
        )

    def wait(self, on_progress: Any = None, poll_s: float = 0.1) -> None:
        """Returns when every rank exited 0; raises BaselineFailed on a failed or stalled rank."""
        last_change, last_seen = time.monotonic(), None
        while True:
            failure = self._failure()
            if failure is not None:
                raise failure
            if all(w.popen.poll() == 0 for w in self.workers):
                return
            done = self.progress()
            if done != last_seen:
                last_seen, last_change = done, time.monotonic()
                if on_progress is not None:
                    on_progress(done)
            # Start-up (imports, rendezvous) and every step are bounded by timeout_s in the
            # workers; this is the launcher's own bound, in case a worker hangs outside them.
            if time.monotonic() - last_change > self.timeout_s + 60.0:
                raise BaselineFailed(
                    f"{self.mode}: no progress for {time.monotonic() - last_change:.0f}s; steps done per rank "
                    f"{done}; logs in {self.out_dir / 'logs'}")
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM every live worker, SIGKILL what is still alive after a grace period."""
        children.stop(self.workers, STOP_GRACE_S)
        store = getattr(self, "_store", None)
        if store is not None:
            del self._store

    def result(self, rank: int) -> dict[str, Any]:
        return json.loads((self.work / f"rank{rank}.json").read_text())

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_group(group: WorkerGroup, *, total_steps: int, samples_per_step: int, quiet: bool,
              emulated: bool) -> None:
    """Starts the group and shows progress until every rank is done (a bar on a terminal, else a
    line now and then, as `hetpipe run` shows it); stops all on any exit."""
    total = total_steps * samples_per_step
    desc = f"{group.mode}{' (emulated GPUs)' if emulated else ''}"
    shown: progress.Bar | progress.Lines | None = None
    first: tuple[int, float] | None = None

    def show(done: list[int], last: bool = False) -> None:
        nonlocal shown, first
        samples = min(done) * samples_per_step
        if quiet or not samples:
            return
        now = time.monotonic()
        if first is None or shown is None:
            # The rate from the ranks' first steps on, the samples so far its start, as summary.json's
            # samples_per_second counts: the ranks' start-up (interpreters, torch, the rendezvous)
            # took most of a short run's seconds, and a rate over them read several times too low.
            first = (samples, now)
            shown = progress.shown(total, desc, samples)
        rate = (samples - first[0]) / (now - first[1]) if samples > first[0] else None
        shown.show(samples, total, group.loss(), rate, last=last)

    with group:
        try:
            group.start()
            group.wait(show)
            show(group.progress(), last=True)
        finally:
            if shown is not None:
                shown.close()


def prepare_out_dir(job: JobConfig) -> Path:
    from hetpipe import outputs

    out_dir = Path(job.resolve(job.output.dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    # A failed run must not leave an old result behind, nor an earlier HetPipe run's trace, logs
    # and status pass for this one's. Checkpoints stay: --resume and --fresh are HetPipe's.
    outputs.start_local(out_dir, keep_checkpoints=True)
    return out_dir


# ---- worker side ------------------------------------------------------------------------------


class Progress:
    """Writes `steps loss` to the rank's progress file, at most every 0.25 s (and at the end)."""

    def __init__(self, work_dir: str, rank: int) -> None:
        self.path = Path(work_dir) / f"rank{rank}.progress"
        self._last = 0.0
        self.write(0, float("nan"), force=True)

    def write(self, steps: int, loss: float, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.25:
            return
        self._last = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{steps} {loss}\n")
        tmp.replace(self.path)


def save_weights(module: torch.nn.Module, path: str) -> None:
    """module's state_dict into a safetensors file at path (through a temporary). A parameter
    tied within a layer is one tensor under two keys, which safetensors refuses to save ("Some
    tensors share memory"): each later key gets a copy, written alike, as HetPipe's run writes it."""
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in module.state_dict().items():
        tensor = value.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        state[key] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    save_file(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def write_result(work_dir: str, rank: int, result: dict[str, Any]) -> None:
    path = Path(work_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def init_process_group(spec: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
    store = dist.TCPStore("127.0.0.1", int(spec["store_port"]), None, False, timeout)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=int(spec["world_size"]),
                            timeout=timeout)


def watch_parent() -> None:
    """Exit at once if the launcher dies: a killed `hetpipe run` leaves no worker behind."""
    children.exit_with_parent(children.launcher_pid(), lambda: os._exit(3))


def recent_mean(losses: Sequence[float]) -> float:
    tail = list(losses)[-10:]
    return sum(tail) / len(tail) if tail else float("nan")


@torch.no_grad()
def evaluate(job: JobConfig, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """The held-out evaluation of a whole model (eval.rows rows, as the HetPipe stages read them):
    eval_loss, eval_accuracy and eval_rows for the summary; nothing without an eval section."""
    from hetpipe import data, datasets, draws
    from hetpipe.models import evaluating
    from hetpipe.optim import for_loss, score

    held_out = datasets.held_out_set(job) if job.eval is not None else None
    if held_out is None or job.eval is None:
        return {}
    loss, counted, correct, rows = 0.0, 0, 0, 0
    dtype = compute_dtype(job.train.precision)
    # As the stages evaluate: dropout off, batch norm on its running statistics, then each module
    # back in its own mode.
    with torch.no_grad(), evaluating(model):
        for i, batch in enumerate(data.eval_batches(job, held_out, job.eval.rows_read), 1):
            x, y = data.read_rows(job, held_out, batch, (draws.EVAL_DRAW, i))   # as the stages draw it
            with autocast(dtype, device.type):
                out = for_loss(dtype, model(x.to(device)))  # as the stages score it
            scored = score(job.train.loss, out, y.to(device))   # as the stages score it
            loss, counted, correct = loss + scored.loss_sum, counted + scored.counted, correct + scored.correct
            rows += len(batch)
    classification = job.train.loss == "cross_entropy"
    return {"eval_loss": loss / counted if counted else None, "eval_rows": rows,
            "eval_accuracy": correct / counted if classification and counted else None}
