"""Task order of one stage (L1, L4): forwards in p order, backwards in p order, FIFO among ready."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from hetpipe.wsp import may_inject


class TaskKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    FORWARD_BACKWARD = "FB"  # the last stage runs a minibatch's forward and backward as one task
    EVAL = "E"               # forward-only on held-out rows (stage_worker/evaluation.py)
    MERGE_FINAL = "M"        # merge w_global after the run, before the final evaluation


@dataclass(frozen=True, slots=True)
class Task:
    kind: TaskKind
    p: int
    eval: int = 0            # which evaluation an EVAL task belongs to
    micro: int = 0           # schedules gpipe, 1f1b, nf1b: the micro-batch of p, from 1 (0: all of p)


class Rejection(enum.Enum):
    UNKNOWN = "unknown"        # p outside 1..steps
    DUPLICATE = "duplicate"    # already received or already processed
    WINDOW = "window"          # cannot be in flight under L1
    ORDER = "order"            # a gradient for a minibatch not forwarded here
    NOT_ACCEPTED = "not_accepted"  # this stage takes no such input


INPUT = {"forward": "activation", "backward": "gradient"}   # what a forward or a backward takes in


class ScheduleError(Exception):
    def __init__(self, reason: Rejection, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class StageSchedule:
    """Which task a stage runs next. Inputs carry an arrival sequence number for FIFO."""

    def __init__(self, *, stage: int, num_stages: int, nm: int, steps: int, start: int = 1) -> None:
        # start: the first minibatch (a job resumed from a checkpoint: the first after the cut)
        self.stage, self.num_stages, self.nm, self.steps = stage, num_stages, nm, steps
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.next_forward = start
        self.next_backward = start
        self._forward_ready: dict[int, int] = {}  # p -> arrival sequence
        self._backward_ready: dict[int, int] = {}
        self._seq = 0
        if self.first:
            for p in range(start, min(start + nm - 1, steps) + 1):
                self._arrive(self._forward_ready, p)

    def _arrive(self, ready: dict[int, int], p: int) -> None:
        ready[p] = self._seq
        self._seq += 1

    @property
    def completed(self) -> int:
        """Minibatches whose backward has finished here."""
        return self.next_backward - 1

    @property
    def ready(self) -> int:
        """Tasks whose input is here and that have not completed (the running one included)."""
        return len(self._forward_ready) + len(self._backward_ready)

    @property
    def in_flight(self) -> int:
        return self.next_forward - self.next_backward

    @property
    def done(self) -> bool:
        return self.completed == self.steps

    def _check_known(self, p: int, what: str) -> None:
        if not 1 <= p <= self.steps:
            raise ScheduleError(Rejection.UNKNOWN, f"{what} for minibatch {p}: the job has minibatches 1..{self.steps}")

    def check_new(self, kind: str, p: int, m: int = 0) -> None:
        """ScheduleError (DUPLICATE) if p's activation (kind "forward") or gradient ("backward")
        came already: it is waiting here or has run (a minibatch the job does not have never did).
        m: a micro-batch, which this schedule's inputs do not have."""
        if not 1 <= p <= self.steps:
            return
        if kind == "forward":
            came = p < self.next_forward or p in self._forward_ready
        else:
            came = p < self.next_backward or p in self._backward_ready
        if came:
            raise ScheduleError(Rejection.DUPLICATE, f"{INPUT[kind]} for minibatch {p} was already received")

    def accept_forward(self, p: int) -> None:
        """An activation for p arrived from the previous stage."""
        if self.first:
            raise ScheduleError(Rejection.NOT_ACCEPTED, "stage 0 reads its own data and takes no activations")
        self._check_known(p, "activation")
        self.check_new("forward", p)
        # p is only injected once p - nm has completed everywhere (L1), so its backward is done here.
        if p >= self.next_backward + self.nm:
            raise ScheduleError(
                Rejection.WINDOW,
                f"activation for minibatch {p} while minibatch {self.next_backward} has not finished here: "
                f"at most nm={self.nm} minibatches are in flight",
            )
        self._arrive(self._forward_ready, p)

    def accept_backward(self, p: int) -> None:
        """A gradient for p arrived from the next stage."""
        if self.last:
            raise ScheduleError(Rejection.NOT_ACCEPTED, "the last stage computes the loss and takes no gradients")
        self._check_known(p, "gradient")
        self.check_new("backward", p)
        if p >= self.next_forward:
            raise ScheduleError(Rejection.ORDER, f"gradient for minibatch {p}, which this stage has not forwarded")
        self._arrive(self._backward_ready, p)

    def next_task(self, forward_allowed: Callable[[int], bool] = lambda p: True) -> Task | None:
        """The earliest-arrived ready task, or None. forward_allowed gates forwards (WSP pulls)."""
        candidates: list[tuple[int, Task]] = []
        p = self.next_forward
        if p in self._forward_ready and forward_allowed(p):
            kind = TaskKind.FORWARD_BACKWARD if self.last else TaskKind.FORWARD
            candidates.append((self._forward_ready[p], Task(kind, p)))
        p = self.next_backward
        if p in self._backward_ready:
            candidates.append((self._backward_ready[p], Task(TaskKind.BACKWARD, p)))
        return min(candidates, key=lambda c: c[0])[1] if candidates else None

    def complete(self, task: Task) -> None:
        """Records that task finished."""
        if task.kind in (TaskKind.FORWARD, TaskKind.FORWARD_BACKWARD):
            assert task.p == self.next_forward, f"forward {task.p} out of order"
            del self._forward_ready[task.p]
            self.next_forward += 1
        if task.kind in (TaskKind.BACKWARD, TaskKind.FORWARD_BACKWARD):
            assert task.p == self.next_backward, f"backward {task.p} out of order"
            self._backward_ready.pop(task.p, None)
            self.next_backward += 1
            if self.first:  # L1: finishing p lets p + nm in
                q = task.p + self.nm
                if q <= self.steps and may_inject(q, self.nm, self.completed):
                    self._arrive(self._forward_ready, q)
