"""Task order of one stage under the micro-batch schedules (docs/design.md, "Schedules"):

- gpipe: per minibatch, the forwards of its M micro-batches, then their backwards (fill, drain);
- 1f1b: per minibatch, min(k-1-stage, M) forwards, then one forward and one backward in turn,
  then the remaining backwards (PipeDream-Flush);
- nf1b (TiMePReSt): forwards of micro-batches in order, one backward per minibatch on the
  current weights; a ready backward goes first; at most nm minibatches in flight.

gpipe and 1f1b apply a stage's update once all of p's micro-batches are back, before any forward
of p+1: one minibatch is in flight (nm 1). Pure: no gRPC, no threads.
"""

from __future__ import annotations

from collections.abc import Callable

from hetpipe.timeline import version_differences
from hetpipe.wsp import may_inject
from stage_worker.schedule import INPUT, Rejection, ScheduleError, Task, TaskKind

Unit = tuple[int, int]  # (p, micro)


def flushed_order(schedule: str, stage: int, num_stages: int, micro: int) -> list[tuple[str, int]]:
    """One minibatch's tasks at a stage under gpipe or 1f1b: ("F" | "B", micro-batch)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(1, micro + 1)] + [("B", m) for m in range(1, micro + 1)]
    warmup = min(num_stages - 1 - stage, micro)
    order = [("F", m) for m in range(1, warmup + 1)]
    for m in range(warmup + 1, micro + 1):
        order += [("F", m), ("B", m - warmup)]
    return order + [("B", m) for m in range(micro - warmup + 1, micro + 1)]


class MicroSchedule:
    """Which task a stage runs next under gpipe, 1f1b or nf1b; the same questions as StageSchedule."""

    def __init__(self, *, schedule: str, stage: int, num_stages: int, nm: int, micro: int, steps: int,
                 start: int = 1) -> None:
        # start: the first minibatch (a job resumed from a checkpoint: the first after the cut)
        if schedule not in ("gpipe", "1f1b", "nf1b"):
            raise ValueError(f"no micro-batch schedule {schedule!r}")
        self.schedule, self.stage, self.num_stages = schedule, stage, num_stages
        self.nm, self.micro, self.steps = nm, micro, steps
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.flushed = schedule != "nf1b"
        self._order = flushed_order(schedule, stage, num_stages, micro) if self.flushed else []
        self._at = 0                     # flushed: position in the current minibatch's order
        self.forward_unit: Unit = (start, 1)  # the next forward
        self.backward_unit: Unit = (start, 1 if self.flushed else 0)  # the next backward
        self._forward_ready: set[Unit] = set()
        self._backward_ready: set[Unit] = set()

    # ---- what StageSchedule's callers read --------------------------------------------------

    @property
    def next_forward(self) -> int:
        return self.forward_unit[0]

    @property
    def next_backward(self) -> int:
        return self.backward_unit[0]

    @property
    def completed(self) -> int:
        """Minibatches whose every backward has finished here."""
        return self.backward_unit[0] - 1

    @property
    def ready(self) -> int:
        """Inputs here whose task has not completed (stage 0's next forward: its data)."""
        p = self.forward_unit[0]
        data = self.first and p <= self.steps and may_inject(p, self.nm, self.completed)
        return len(self._forward_ready) + len(self._backward_ready) + int(data)

    @property
    def in_flight(self) -> int:
        """Minibatches with a forward done here and their backward not."""
        p, m = self.forward_unit
        return p - (1 if m == 1 else 0) - self.completed

    @property
    def done(self) -> bool:
        return self.completed == self.steps

    # ---- inputs ----------------------------------------------------------------------------

    def check_unit(self, p: int, m: int, what: str) -> None:
        """ScheduleError (UNKNOWN) unless p and micro-batch m exist for this input."""
        if not 1 <= p <= self.steps:
            raise ScheduleError(Rejection.UNKNOWN, f"{what} for minibatch {p}: the job has minibatches 1..{self.steps}")
        low = 0 if what == "gradient" and not self.flushed else 1
        high = 0 if low == 0 else self.micro
        if not low <= m <= high:
            want = "0 (the whole minibatch)" if high == 0 else f"1..{self.micro}"
            raise ScheduleError(Rejection.UNKNOWN, f"{what} for micro-batch {m} of minibatch {p}: expected {want}")

    def check_new(self, kind: str, p: int, m: int) -> None:
        """ScheduleError (DUPLICATE) if micro-batch m of p's activation (kind "forward") or gradient
        ("backward") came already: it is waiting here or has run (a minibatch the job does not have
        never did)."""
        if not 1 <= p <= self.steps:
            return
        if kind == "forward":
            came = (p, m) < self.forward_unit or (p, m) in self._forward_ready
        else:
            came = (p, m) < self.backward_unit or (p, m) in self._backward_ready
        if came:
            raise ScheduleError(Rejection.DUPLICATE, f"{INPUT[kind]} for micro-batch {m} of minibatch {p} "
                                                     "was already received")

    def accept_forward(self, p: int, m: int) -> None:
        """An activation for micro-batch m of p arrived from the previous stage."""
        if self.first:
            raise ScheduleError(Rejection.NOT_ACCEPTED, "stage 0 reads its own data and takes no activations")
        self.check_unit(p, m, "activation")
        self.check_new("forward", p, m)
        if p >= self.next_backward + self.nm:
            raise ScheduleError(Rejection.WINDOW, f"activation for minibatch {p} while minibatch "
                                                  f"{self.next_backward} has not finished here: at most "
                                                  f"nm={self.nm} minibatches are in flight")
        self._forward_ready.add((p, m))

    def accept_backward(self, p: int, m: int) -> None:
        """A gradient for micro-batch m of p (nf1b: m = 0, all of p) arrived from the next stage."""
        if self.last:
            raise ScheduleError(Rejection.NOT_ACCEPTED, "the last stage computes the loss and takes no gradients")
        self.check_unit(p, m, "gradient")
        self.check_new("backward", p, m)
        forwarded = (p, m) < self.forward_unit if self.flushed else p < self.next_forward
        if not forwarded:
            raise ScheduleError(Rejection.ORDER, f"gradient for micro-batch {m} of minibatch {p}, which this "
                                                 "stage has not forwarded")
        self._backward_ready.add((p, m))

    # ---- the next task -----------------------------------------------------------------------

    def _forward_task(self, forward_allowed: Callable[[int], bool]) -> Task | None:
        p, m = self.forward_unit
        if p > self.steps or not forward_allowed(p):
            return None
        if self.first:
            if not may_inject(p, self.nm, self.completed):  # L1
                return None
        elif (p, m) not in self._forward_ready:
            return None
        # nf1b's last stage: the last micro-batch's forward and p's backward are one task.
        fused = self.last and not self.flushed and m == self.micro
        return Task(TaskKind.FORWARD_BACKWARD if fused else TaskKind.FORWARD, p, micro=m)

    def _backward_task(self) -> Task | None:
        p, m = self.backward_unit
        if p > self.steps or (self.last and not self.flushed):  # nf1b's last stage: fused above
            return None
        ready = (p, m) < self.forward_unit if self.last else (p, m) in self._backward_ready
        return Task(TaskKind.BACKWARD, p, micro=m) if ready else None

    def next_task(self, forward_allowed: Callable[[int], bool] = lambda p: True) -> Task | None:
        """The next task whose input is here, or None. forward_allowed gates forwards (sync)."""
        if not self.flushed:  # nf1b: a ready backward first
            return self._backward_task() or self._forward_task(forward_allowed)
        if self.completed == self.steps:
            return None
        kind, m = self._order[self._at]
        task = self._forward_task(forward_allowed) if kind == "F" else self._backward_task()
        assert task is None or task.micro == m, f"{self.schedule} order: expected {kind}{m}, have {task}"
        return task

    def complete(self, task: Task) -> None:
        """Records that task finished."""
        p, m = task.p, task.micro
        if task.kind in (TaskKind.FORWARD, TaskKind.FORWARD_BACKWARD):
            assert (p, m) == self.forward_unit, f"forward {p}.{m} out of order"
            self._forward_ready.discard((p, m))
            self.forward_unit = (p, m + 1) if m < self.micro else (p + 1, 1)
        if task.kind in (TaskKind.BACKWARD, TaskKind.FORWARD_BACKWARD):
            unit = (p, 0) if task.kind == TaskKind.FORWARD_BACKWARD else (p, m)
            assert unit == self.backward_unit, f"backward {p}.{unit[1]} out of order"
            self._backward_ready.discard(unit)
            last_of_p = not self.flushed or m == self.micro
            self.backward_unit = (p + 1, 1 if self.flushed else 0) if last_of_p else (p, m + 1)
        if self.flushed:
            self._at = (self._at + 1) % len(self._order)

    def ends_minibatch(self, task: Task) -> bool:
        """Whether finishing task ends its minibatch here: its update is then applied (L3)."""
        return task.kind != TaskKind.FORWARD and (not self.flushed or task.micro == self.micro)


# ---- unit-time model (TiMePReSt's figures) ------------------------------------------------------


Span = tuple[int, int, Task]  # (start, end, task) in time points


def simulate_unit(schedule: str, num_stages: int, micro: int, nm: int, steps: int, *, forward: int = 1,
                  backward: int = 1) -> list[list[Span]]:
    """Every stage's tasks when each forward of a micro-batch takes `forward` time points and each
    backward `backward` (nf1b: one per minibatch; 1 and 1 are TiMePReSt's figures) and messages
    take none. The last stage's fused forward+backward takes both: the backward starts after."""
    stages = [MicroSchedule(schedule=schedule, stage=q, num_stages=num_stages, nm=nm, micro=micro, steps=steps)
              for q in range(num_stages)]
    spans: list[list[Span]] = [[] for _ in stages]
    running: list[Span | None] = [None] * num_stages
    t = 0
    while not all(s.done for s in stages):
        for q, span in enumerate(running):  # tasks ending now hand their outputs on first
            if span is None or span[1] != t:
                continue
            task, running[q] = span[2], None
            stages[q].complete(task)
            if task.kind != TaskKind.BACKWARD and q + 1 < num_stages:
                stages[q + 1].accept_forward(task.p, task.micro)
            if task.kind != TaskKind.FORWARD and q > 0:
                stages[q - 1].accept_backward(task.p, 0 if task.kind == TaskKind.FORWARD_BACKWARD else task.micro)
        for q, s in enumerate(stages):
            if running[q] is None and (ready := s.next_task()) is not None:
                took = {TaskKind.FORWARD: forward, TaskKind.BACKWARD: backward}.get(ready.kind, forward + backward)
                span = (t, t + took, ready)
                running[q] = span
                spans[q].append(span)
        t += 1
        if t > 10 * (forward + backward) * (steps * (micro + 2) + num_stages) + 100:
            raise RuntimeError(f"{schedule} with {num_stages} stages and {micro} micro-batches deadlocked")
    return spans


def unit_version_differences(num_stages: int, micro: int, steps: int, *, forward: int = 1,
                             backward: int = 1) -> dict[int, int]:
    """v per minibatch of an nf1b pipeline in the unit-time model (nm never binding)."""
    spans = simulate_unit("nf1b", num_stages, micro, steps, steps, forward=forward, backward=backward)
    first = {task.p: end for _, end, task in spans[0] if task.kind != TaskKind.FORWARD}
    last = {task.p: start + forward for start, _, task in spans[-1] if task.kind == TaskKind.FORWARD_BACKWARD}
    return version_differences(first, last)
