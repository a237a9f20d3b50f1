"""Reproduces how StageRuntime._next_task splits idle time into wait_idle_seconds, on two timed scenarios."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

# Run as `python bench/wait_accounting.py`: the repository root is not on sys.path then.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpipe.v1 import stage_pb2  # noqa: E402
from stage_worker.runtime import StageRuntime  # noqa: E402
from stage_worker.schedule import Task, TaskKind  # noqa: E402


class GatedSync:
    """WspSync's contract for one forward: forward_allowed starts the wait, apply_pending ends it."""

    def __init__(self) -> None:
        self.pulled = False       # set by the "puller" thread
        self._applied = False
        self._wait_started: float | None = None

    def forward_allowed(self, p: int) -> bool:
        if self._applied:
            return True
        if self._wait_started is None:
            self._wait_started = time.monotonic()
        return False

    @property
    def waiting(self) -> bool:
        return self._wait_started is not None

    def apply_pending(self, compute: object) -> None:
        if self.pulled and not self._applied:
            self._applied = True
            self._wait_started = None  # as WspSync does once the merged weights satisfy G2

    def finished(self) -> bool:
        return True


class OneForward:
    """A stage whose only task is forward 1, runnable once its input has arrived."""

    def __init__(self) -> None:
        self.input_ready = False
        self.done = False

    def next_task(self, forward_allowed: Callable[[int], bool]) -> Task | None:
        if self.input_ready and forward_allowed(1):
            return Task(TaskKind.FORWARD, 1)
        return None


class ProposedAccounting(StageRuntime):
    """The change this diagnostic argues for: charge each idle interval to the wait state that held
    during it (sampled when the thread last looked), not to the state after this look's pull merge."""

    def _next_task(self) -> Task | None:
        with self._cv:
            idle_since = time.monotonic()
            was_waiting = self.sync.waiting  # only this thread changes it, so it holds until we look again
            while True:
                if self._stopping or self.state != stage_pb2.StageStatus.State.RUNNING:
                    return None
                now = time.monotonic()
                if was_waiting:
                    self.wait_idle_seconds += now - idle_since
                self.idle_seconds += now - idle_since
                idle_since = now
                self.sync.apply_pending(self.compute)
                task = self.schedule.next_task(self.sync.forward_allowed)
                was_waiting = self.sync.waiting
                if task is not None:
                    return task
                if self.schedule.done and self.sync.finished():
                    return None
                self._cv.wait(0.5)


def scenario(input_at: float, pull_at: float, runtime: type[StageRuntime] = StageRuntime) -> tuple[float, float]:
    """(wait_idle_seconds, idle_seconds) the runtime records when the input arrives at input_at and
    the pull that the forward waits on lands at pull_at (seconds after the stage goes idle)."""
    rt = runtime()
    sync, schedule = GatedSync(), OneForward()
    rt.state = stage_pb2.StageStatus.State.RUNNING
    rt.sync, rt.schedule, rt.compute = sync, schedule, None  # type: ignore[assignment]
    rt.wait_idle_seconds = rt.idle_seconds = 0.0

    def events() -> None:
        # The gRPC handler and the puller thread: each changes state, then notifies, as in production.
        start = time.monotonic()
        for at, what in sorted([(input_at, "input"), (pull_at, "pull")]):
            time.sleep(max(0.0, start + at - time.monotonic()))
            with rt._cv:
                if what == "input":
                    schedule.input_ready = True
                else:
                    sync.pulled = True
                rt._cv.notify_all()

    thread = threading.Thread(target=events)
    thread.start()
    task = rt._next_task()
    thread.join()
    assert task == Task(TaskKind.FORWARD, 1), task
    return rt.wait_idle_seconds, rt.idle_seconds


def main() -> int:
    print("StageRuntime._next_task: wait_idle_seconds recorded vs true idle-while-waiting (seconds)")
    print(f"{'scenario':<68} {'true':>6} {'recorded':>9} {'proposed':>9} {'idle':>6}")
    cases = [
        ("input at 0.0, pull lands at 0.3 (stage idle, gated 0.3 s)", 0.0, 0.3, 0.3),
        ("input at 0.3, pull lands at 0.4 (no input 0.3 s, gated 0.1 s)", 0.3, 0.4, 0.1),
        ("input at 0.0, pull lands at 1.2 (gated 1.2 s, two 0.5 s timeouts)", 0.0, 1.2, 1.2),
    ]
    for name, input_at, pull_at, truth in cases:
        recorded, idle = scenario(input_at, pull_at)
        proposed, _ = scenario(input_at, pull_at, ProposedAccounting)
        print(f"{name:<68} {truth:>6.2f} {recorded:>9.2f} {proposed:>9.2f} {idle:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
