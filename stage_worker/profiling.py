"""output.profile: torch.profiler over one stage's minibatches (after, after + steps], written as a
Chrome trace (Perfetto, chrome://tracing) and, beside it, a table of its operators headed by what
a minibatch cost: wall time, kernels on the device and their launches. The profiler records the
operators of every thread of the stage while the window is open."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def summary(prof: Any, minibatches: int, wall: float) -> dict[str, float]:
    """Per minibatch: wall ms, device ms (the kernels' own time, each counted once), kernel
    launches, and the host ms of the recorded operators (their own time, summed)."""
    events = prof.key_averages()
    device = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    host = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU) / 1e3
    n = max(minibatches, 1)
    return {"minibatches": minibatches, "wall_ms": wall * 1e3 / n, "device_ms": device / n,
            "launches": launches / n, "host_ms": host / n}


def write(prof: Any, path: Path, title: str, minibatches: int, wall: float) -> dict[str, float]:
    """The Chrome trace at path and the table at path with .txt; returns the summary."""
    prof.export_chrome_trace(str(path))
    s = summary(prof, minibatches, wall)
    sort = "self_device_time_total" if s["device_ms"] > 0 else "self_cpu_time_total"
    head = (f"{title}: {minibatches} minibatches, per minibatch {s['wall_ms']:.2f} ms wall, "
            f"{s['device_ms']:.2f} ms of kernels, {s['launches']:.0f} kernel launches, "
            f"{s['host_ms']:.2f} ms in operators on the host\n\n")
    path.with_suffix(".txt").write_text(head + prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    return s


class StageProfile:
    """Profiles the stage's tasks from when it has finished `after` minibatches until it has
    finished `after + steps`; the compute thread calls it around each task (bench/gpu.py's plain
    loop around each step). summary: the window's, once written."""

    def __init__(self, path: str, title: str, after: int, steps: int, cuda: bool) -> None:
        self.path, self.title, self.after, self.steps = Path(path), title, after, steps
        self.cuda = cuda
        self._activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof: Any = None
        self._started = 0.0
        self.done = False
        self.summary: dict[str, float] = {}

    def before(self, completed: int) -> None:
        if self._prof is None and not self.done and completed >= self.after:
            self._prof = profile(activities=self._activities)
            self._prof.__enter__()
            self._started = time.perf_counter()

    def after_task(self, completed: int) -> None:
        if self._prof is not None and completed >= self.after + self.steps:
            self._finish(completed - self.after)

    def close(self, completed: int) -> None:
        """The run ended inside the window (a failure, a stop): what was recorded is written."""
        if self._prof is not None:
            self._finish(completed - self.after)

    def _finish(self, minibatches: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()   # the window's kernels, done, inside its wall time
        wall = time.perf_counter() - self._started
        prof, self._prof, self.done = self._prof, None, True
        prof.__exit__(None, None, None)
        self.summary = write(prof, self.path, self.title, minibatches, wall)
