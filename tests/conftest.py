"""Shared fixtures: fixed seeds, job files in tmp dirs, and no process left behind."""

from __future__ import annotations

import fcntl
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import yaml

from hetpipe import faults, security
from hetpipe.config import JobConfig, load_job, parse_job


@pytest.fixture(autouse=True)
def _seeds() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _is_helper(process: psutil.Process) -> bool:
    """multiprocessing's fork server and resource tracker: started once, they live as long as
    this process (and exit with it); the workers they fork are checked like any child."""
    try:
        command = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return "multiprocessing.forkserver" in command or "multiprocessing.resource_tracker" in command


@pytest.fixture(autouse=True)
def _no_orphans() -> Iterator[None]:
    """Every test must stop the processes it started."""
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    yield
    leftover = []
    for child in me.children(recursive=True):
        if child.pid in before or _is_helper(child):
            continue
        try:
            child.wait(timeout=5)
        except psutil.TimeoutExpired:
            leftover.append(child)
            child.kill()
    assert not leftover, f"test left processes behind: {[c.cmdline() for c in leftover]}"


# What a failed test's report shows of each worker log under its tmp_path: CI keeps its output,
# not its files, and a failure that names a log ("...; log .../stage_worker_1.log") is read there.
LOG_TAIL_LINES, LOGS_SHOWN = 25, 8


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and call.when == "call" and tmp is not None:
        for log in sorted(Path(tmp).rglob("logs/*.log"))[:LOGS_SHOWN]:
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"worker log {log.relative_to(tmp)} (its last lines)", "\n".join(lines)))
    return report


@pytest.fixture
def host_wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Held by tests that make, or count, what every process on the host sees (POSIX semaphores
    in /dev/shm): they run one at a time across pytest-xdist's workers, which share the folder
    above their own temporary ones."""
    with open(tmp_path_factory.getbasetemp().parent / "host-wide.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def with_signals(*, default: tuple[str, ...] = ("INT", "HUP"), ignore: tuple[str, ...] = ()) -> list[str]:
    """A command prefix (coreutils env) that starts a child with these signals at their default, as
    from a terminal (a suite started in the background has SIGINT ignored, under nohup SIGHUP too,
    and an ignored signal stays ignored across exec), or ignored. Not Popen's preexec_fn: it makes
    Popen fork() where it would vfork(), and since grpcio 1.81 the child of a process that has used
    gRPC then may abort before its exec (gRPC's fork handler restarts a poller on an epoll fd that
    close_fds closes: grpc/grpc#43055; 7-9 of 300 such children here)."""
    return ["env", *(f"--default-signal={s}" for s in default), *(f"--ignore-signal={s}" for s in ignore)]


def npz_job(tmp_path: Path, path: str = "data.npz", **train: Any) -> JobConfig:
    """A job reading data.name npz from path (under tmp_path), in minibatches of 4."""
    raw = {"model": {"name": "mlp"}, "data": {"name": "npz", "path": path, "batch_size": 4}, "train": train}
    return parse_job(raw, base_dir=str(tmp_path))


def deep_update(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


BASE_JOB: dict[str, Any] = {
    "model": {"name": "mlp", "args": {"in_features": 64, "hidden": [32, 32, 32], "num_classes": 10}},
    "data": {"name": "digits", "batch_size": 16},
    "train": {"steps": 30, "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.05}, "seed": 0},
    "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 1, "D": 0},
    "output": {"dir": "out", "trace": True},
}


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_job(tmp_path: Path, name: str, overrides: dict[str, Any] | None = None) -> Path:
    """examples/<name>.yaml, or examples/<name>/job.yaml with its own files, copied under tmp_path
    with overrides and its output in tmp_path/out; returns the copied job file."""
    src = EXAMPLES / name
    dst = tmp_path / name
    if src.is_dir():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.npy", "__pycache__"))
    else:
        dst.mkdir(parents=True)
    raw = yaml.safe_load(((src / "job.yaml") if src.is_dir() else EXAMPLES / f"{name}.yaml").read_text())
    raw = deep_update(raw, {"output": {"dir": str(tmp_path / "out")}, **(overrides or {})})
    path = dst / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def make_job(tmp_path: Path):
    """make_job(**overrides) writes a job file under tmp_path and returns the parsed JobConfig."""

    def make(overrides: dict[str, Any] | None = None, name: str = "job.yaml") -> JobConfig:
        raw = deep_update(BASE_JOB, overrides or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return load_job(path)

    return make


@pytest.fixture
def inject_faults(monkeypatch: pytest.MonkeyPatch):
    """inject_faults(task_delay=..., slow_vw=..., ...) makes every process this test starts inject
    those faults (hetpipe/faults.py: HETPIPE_FAULTS, never the job file)."""

    def inject(**values: Any) -> None:
        for key, value in faults.to_env(faults.Faults(**values)).items():
            monkeypatch.setenv(key, value)

    return inject


def run_beside(job: JobConfig, interfere: Callable[[Path, threading.Event, list[Any]], None]) -> tuple[dict[str, Any], list[Any]]:
    """`hetpipe run`'s run_local(job), with interfere(out_dir, done, found) on a thread beside it
    (a kill, a SIGSTOP; it returns once done is set); returns the summary and what it found."""
    from launch.local import run_local

    done, found = threading.Event(), []
    thread = threading.Thread(target=interfere, args=(Path(job.resolve(job.output.dir)), done, found), daemon=True)
    thread.start()
    try:
        summary = run_local(job, quiet=True)
    finally:
        done.set()
        thread.join()
    return summary, found


@contextmanager
def run_token(out_dir: Path) -> Iterator[None]:
    """Calls from this process present the per-run token of the `hetpipe run` writing out_dir
    (a subprocess; an in-process run_local's token is this process's already)."""
    token = out_dir / "coordinator.token"
    if not token.exists():  # not yet written, or the run is over: calls go without it
        yield
        return
    with security.using(security.Security(token_file=str(token)), security.COORDINATOR, "test"):
        yield
