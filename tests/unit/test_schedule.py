"""StageSchedule (L1, L4) driven by a pure k-stage pipeline simulator under random interleavings."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_worker.schedule import Rejection, ScheduleError, StageSchedule, Task, TaskKind


@dataclass
class StageModel:
    """The simulator's own record of one stage, kept independently of StageSchedule."""

    schedule: StageSchedule
    arrivals: list[tuple[str, int]] = field(default_factory=list)  # ("F"|"B", p) in arrival order
    running: Task | None = None
    forwards: list[int] = field(default_factory=list)   # p of each forward (or F+B) started
    backwards: list[int] = field(default_factory=list)  # p of each backward (or F+B) started
    allowed_up_to: int = 0  # forwards of p <= this are allowed (stands in for WSP pulls)

    def allows(self, p: int) -> bool:
        return p <= self.allowed_up_to

    def ran(self, kind: str) -> list[int]:
        return self.forwards if kind == "F" else self.backwards

    def eligible(self) -> list[tuple[str, int]]:
        """Arrived inputs that L4 lets run now: the next forward (if allowed) and the next backward."""
        out = []
        for kind, p in self.arrivals:
            done = self.ran(kind)
            if p != len(done) + 1:
                continue  # in p order only
            if kind == "F" and p > self.allowed_up_to:
                continue
            if kind == "B" and p > len(self.forwards):
                continue
            out.append((kind, p))
        return out


class Pipeline:
    """One VW: k StageSchedules wired together by messages that arrive in any order."""

    def __init__(self, k: int, nm: int, steps: int, gated: bool) -> None:
        self.k, self.nm, self.steps = k, nm, steps
        self.stages = [
            StageModel(StageSchedule(stage=q, num_stages=k, nm=nm, steps=steps),
                       allowed_up_to=0 if gated else steps)
            for q in range(k)
        ]
        self.messages: list[tuple[str, int, int]] = []  # (kind, destination stage, p)
        self.completed_at_stage0 = 0
        self.in_flight = 0  # injected at stage 0, backward not finished there
        self.max_in_flight = 0
        for p in range(1, min(nm, steps) + 1):
            self.stages[0].arrivals.append(("F", p))

    # ---- actions -------------------------------------------------------------------------

    def actions(self) -> list[tuple[str, int]]:
        acts: list[tuple[str, int]] = [("deliver", i) for i in range(len(self.messages))]
        for q, s in enumerate(self.stages):
            if s.running is not None:
                acts.append(("finish", q))
            elif s.schedule.next_task(s.allows) is not None:
                acts.append(("start", q))
            if s.allowed_up_to < self.steps:
                acts.append(("pull", q))
        return acts

    def deliver(self, i: int) -> None:
        kind, q, p = self.messages.pop(i)
        s = self.stages[q]
        if kind == "F":
            s.schedule.accept_forward(p)
        else:
            s.schedule.accept_backward(p)
        s.arrivals.append((kind, p))

    def start(self, q: int) -> None:
        s = self.stages[q]
        eligible = s.eligible()
        task = s.schedule.next_task(s.allows)
        assert task is not None
        kind = "B" if task.kind is TaskKind.BACKWARD else "F"
        # FIFO among the ready tasks: the earliest-arrived eligible input runs.
        assert eligible and eligible[0] == (kind, task.p), f"stage {q}: ran {task}, eligible in arrival order {eligible}"
        last = q == self.k - 1
        assert (task.kind is TaskKind.FORWARD_BACKWARD) == (last and kind == "F"), task
        s.arrivals.remove((kind, task.p))
        if kind == "F":
            s.forwards.append(task.p)
            if last:
                s.backwards.append(task.p)
            if q == 0:
                # L1: p enters only once p - nm has completed.
                assert task.p - self.nm <= self.completed_at_stage0, (task.p, self.completed_at_stage0)
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
        else:
            s.backwards.append(task.p)
        assert s.schedule.in_flight <= self.nm
        assert len(s.forwards) - len(s.backwards) <= self.nm
        s.running = task

    def finish(self, q: int) -> None:
        s = self.stages[q]
        task = s.running
        assert task is not None
        s.running = None
        s.schedule.complete(task)
        if task.kind is TaskKind.FORWARD:
            self.messages.append(("F", q + 1, task.p))
        elif q > 0:
            self.messages.append(("B", q - 1, task.p))
        if task.kind is not TaskKind.FORWARD and q == 0:
            self.completed_at_stage0 += 1
            self.in_flight -= 1
            if task.p + self.nm <= self.steps:
                s.arrivals.append(("F", task.p + self.nm))

    def pull(self, q: int, rng: random.Random) -> None:
        s = self.stages[q]
        s.allowed_up_to = min(self.steps, s.allowed_up_to + rng.randint(1, 3))

    def run(self, rng: random.Random) -> None:
        budget = 10 * self.k * self.steps + 10 * self.steps + 100
        for _ in range(budget):
            acts = self.actions()
            if not acts:
                break
            kind, arg = rng.choice(acts)
            if kind == "deliver":
                self.deliver(arg)
            elif kind == "start":
                self.start(arg)
            elif kind == "finish":
                self.finish(arg)
            else:
                self.pull(arg, rng)
            for s in self.stages:
                # The schedule and the model agree on which tasks can run (no lost wake-ups).
                if s.running is None:
                    has = s.schedule.next_task(s.allows) is not None
                    assert has == bool(s.eligible()), (s.schedule.stage, s.eligible())
        else:
            pytest.fail("simulation did not finish within its action budget")


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 5), nm=st.integers(1, 6), steps=st.integers(1, 20), gated=st.booleans(),
    rng=st.randoms(use_true_random=False),
)
def test_random_interleavings_keep_l1_l4_and_finish(
    k: int, nm: int, steps: int, gated: bool, rng: random.Random
) -> None:
    pipe = Pipeline(k, nm, steps, gated)
    pipe.run(rng)
    # No deadlock: every stage ran every minibatch, nothing is left in transit.
    assert not pipe.messages
    expected = list(range(1, steps + 1))
    for q, s in enumerate(pipe.stages):
        assert s.schedule.done, f"stage {q} stopped at {s.schedule.completed}/{steps}"
        assert s.schedule.in_flight == 0
        assert s.forwards == expected, f"stage {q} forwards out of p order"
        assert s.backwards == expected, f"stage {q} backwards out of p order"
        assert s.schedule.next_task() is None
    assert pipe.in_flight == 0
    assert pipe.max_in_flight <= nm


def test_pipeline_fills_to_nm_in_flight() -> None:
    """L1 is tight: with slow backwards, exactly nm minibatches enter before the first completes."""
    for nm in range(1, 7):
        pipe = Pipeline(k=3, nm=nm, steps=20, gated=False)
        # Run forwards first whenever possible: the pipeline fills as far as L1 allows.
        while True:
            acts = pipe.actions()
            if not acts:
                break
            kind, arg = min(acts, key=lambda a: (a[0] != "deliver", a[0] != "start", a[1]))
            getattr(pipe, kind)(arg)
        assert pipe.max_in_flight == nm


# ---- rejections ------------------------------------------------------------------------------


def snapshot(s: StageSchedule) -> tuple[int, int, int, Task | None]:
    return s.next_forward, s.next_backward, s.in_flight, s.next_task()


def rejects(call: Callable[[], None], reason: Rejection, s: StageSchedule) -> ScheduleError:
    before = snapshot(s)
    with pytest.raises(ScheduleError) as err:
        call()
    assert err.value.reason is reason, err.value
    assert str(err.value), "a rejection explains itself"
    assert snapshot(s) == before, "a rejected input leaves the schedule unchanged"
    return err.value


def run_next(s: StageSchedule) -> Task:
    task = s.next_task()
    assert task is not None
    s.complete(task)
    return task


def middle(nm: int = 2, steps: int = 10) -> StageSchedule:
    return StageSchedule(stage=1, num_stages=3, nm=nm, steps=steps)


def test_duplicate_activation_pending_or_processed() -> None:
    s = middle()
    s.accept_forward(1)
    rejects(lambda: s.accept_forward(1), Rejection.DUPLICATE, s)
    task = s.next_task()
    assert task == Task(TaskKind.FORWARD, 1)
    s.complete(task)
    rejects(lambda: s.accept_forward(1), Rejection.DUPLICATE, s)


def test_duplicate_gradient_pending_or_processed() -> None:
    s = middle()
    s.accept_forward(1)
    run_next(s)
    s.accept_backward(1)
    rejects(lambda: s.accept_backward(1), Rejection.DUPLICATE, s)
    task = s.next_task()
    assert task == Task(TaskKind.BACKWARD, 1)
    s.complete(task)
    rejects(lambda: s.accept_backward(1), Rejection.DUPLICATE, s)


@pytest.mark.parametrize("p", [0, -3, 11, 1000])
def test_unknown_minibatch(p: int) -> None:
    s = middle(steps=10)
    err = rejects(lambda: s.accept_forward(p), Rejection.UNKNOWN, s)
    assert str(p) in str(err)
    rejects(lambda: s.accept_backward(p), Rejection.UNKNOWN, s)


@pytest.mark.parametrize("nm", [1, 2, 4])
def test_activation_outside_the_nm_window(nm: int) -> None:
    s = middle(nm=nm, steps=20)
    for p in range(nm, 0, -1):
        s.accept_forward(p)  # any order inside the window is fine
    rejects(lambda: s.accept_forward(nm + 1), Rejection.WINDOW, s)
    rejects(lambda: s.accept_forward(nm + 5), Rejection.WINDOW, s)
    # Once minibatch 1 has gone forward and back here, nm+1 may be in flight.
    run_next(s)
    s.accept_backward(1)
    backward = s.next_task(lambda p: False)
    assert backward == Task(TaskKind.BACKWARD, 1)
    s.complete(backward)
    s.accept_forward(nm + 1)
    rejects(lambda: s.accept_forward(nm + 2), Rejection.WINDOW, s)


def test_activation_window_counts_unfinished_backwards() -> None:
    """L1 at every stage: activation p can only legally arrive once p - nm's backward finished here."""
    s = middle(nm=2, steps=10)
    s.accept_forward(1)
    s.accept_forward(2)
    run_next(s)
    run_next(s)
    assert s.in_flight == 2
    rejects(lambda: s.accept_forward(3), Rejection.WINDOW, s)


def test_gradient_before_forward() -> None:
    s = StageSchedule(stage=0, num_stages=2, nm=2, steps=10)
    rejects(lambda: s.accept_backward(1), Rejection.ORDER, s)
    run_next(s)  # forward 1
    s.accept_backward(1)
    rejects(lambda: s.accept_backward(2), Rejection.ORDER, s)


def test_stage0_refuses_activations() -> None:
    for k in (1, 3):
        s = StageSchedule(stage=0, num_stages=k, nm=2, steps=10)
        rejects(lambda: s.accept_forward(1), Rejection.NOT_ACCEPTED, s)
        rejects(lambda: s.accept_forward(3), Rejection.NOT_ACCEPTED, s)


def test_last_stage_refuses_gradients() -> None:
    s = StageSchedule(stage=2, num_stages=3, nm=2, steps=10)
    s.accept_forward(1)
    run_next(s)
    rejects(lambda: s.accept_backward(1), Rejection.NOT_ACCEPTED, s)
    solo = StageSchedule(stage=0, num_stages=1, nm=2, steps=10)
    rejects(lambda: solo.accept_backward(1), Rejection.NOT_ACCEPTED, solo)


def test_last_stage_runs_forward_and_backward_as_one_task() -> None:
    s = StageSchedule(stage=1, num_stages=2, nm=3, steps=4)
    s.accept_forward(2)
    assert s.next_task() is None, "minibatch 2 waits for 1 (p order)"
    s.accept_forward(1)
    for p in (1, 2):
        task = s.next_task()
        assert task == Task(TaskKind.FORWARD_BACKWARD, p)
        s.complete(task)
        assert s.completed == p and s.in_flight == 0


def test_forward_gate_blocks_forwards_not_backwards() -> None:
    """A stage waiting on a WSP pull still runs the backwards of minibatches already in flight."""
    s = StageSchedule(stage=0, num_stages=2, nm=2, steps=10)
    run_next(s)  # forward 1
    s.accept_backward(1)
    assert s.next_task(lambda p: False) == Task(TaskKind.BACKWARD, 1)
    s.complete(Task(TaskKind.BACKWARD, 1))
    assert s.next_task(lambda p: False) is None
    assert s.next_task(lambda p: True) == Task(TaskKind.FORWARD, 2)


def test_a_stage_that_fails_names_the_task_it_was_running() -> None:
    from stage_worker.runtime import _where

    assert _where(Task(TaskKind.BACKWARD, 7), 6) == " at minibatch 7"
    assert _where(Task(TaskKind.FORWARD, 7, micro=2), 6) == " at minibatch 7, micro-batch 2"
    assert _where(Task(TaskKind.EVAL, 3, eval=2), 6) == " at evaluation 2, its minibatch 3"
    assert _where(Task(TaskKind.MERGE_FINAL, 0), 6) == " in the final merge of w_global"
    assert _where(None, 6) == " between tasks, after 6 minibatches"
