"""The micro-batch schedules' pure task order (stage_worker/micro_schedule.py): TiMePReSt's
version difference in the unit-time model, every schedule free of deadlock and in its stated
order, inputs refused as they should be, and the trace checkers failing on broken traces."""

from __future__ import annotations

import math
from typing import Any

import pytest

from stage_worker.micro_schedule import MicroSchedule, simulate_unit, unit_version_differences
from stage_worker.schedule import Rejection, ScheduleError, Task, TaskKind
from tests import schedule_rules


@pytest.mark.parametrize("stages", range(2, 9))
@pytest.mark.parametrize("micro", range(1, 7))
def test_nf1b_version_difference_matches_the_papers_notes(stages: int, micro: int) -> None:
    """v = 1 for every minibatch iff W <= N + 1; the steady v is ceil(W / (N + 1)) (TiMePReSt
    §4.4 with W stages and N micro-batches; its closed form for v is not used: measured here)."""
    v = unit_version_differences(stages, micro, 40)
    assert (set(v.values()) == {1}) == (stages <= micro + 1)
    assert v[40] == math.ceil(stages / (micro + 1))
    assert v[1] == 1 and max(v.values()) == v[40], "v grows to its steady value and stays"


def rows_from_spans(schedule: str, stages: int, micro: int, steps: int) -> list[dict[str, Any]]:
    """The trace rows a unit-time run would write (one VW)."""
    spans = simulate_unit(schedule, stages, micro, steps if schedule == "nf1b" else 1, steps)
    rows = []
    for q, stage in enumerate(spans):
        ends = sorted(end for _, end, t in stage if t.kind != TaskKind.FORWARD
                      and (schedule == "nf1b" or t.micro == micro))
        by_p: dict[int, dict[str, Any]] = {}
        for start, end, task in stage:
            r = by_p.setdefault(task.p, {"vw": 0, "stage": q, "p": task.p, "micro_fwd": [], "micro_bwd": []})
            if task.kind == TaskKind.FORWARD_BACKWARD:
                r["micro_fwd"].append([task.micro, start, start + 1])
                r["micro_bwd"].append([0, start + 1, end])
            elif task.kind == TaskKind.FORWARD:
                r["micro_fwd"].append([task.micro, start, end])
            else:
                r["micro_bwd"].append([task.micro, start, end])
        for r in by_p.values():
            r["fwd_start"], r["bwd_end"] = r["micro_fwd"][0][1], r["micro_bwd"][-1][2]
            r["local_version"] = sum(1 for t in ends if t <= r["fwd_start"])
            r["bwd_version"] = sum(1 for t in ends if t <= r["micro_bwd"][0][1])
            rows.append(r)
    return rows


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_resumed_schedule_starts_after_its_cut_and_refuses_what_came_before(schedule: str) -> None:
    s = MicroSchedule(schedule=schedule, stage=1, num_stages=3, nm=1, micro=2, steps=6, start=5)
    assert (s.next_forward, s.completed, s.done) == (5, 4, False)
    with pytest.raises(ScheduleError) as err:
        s.accept_forward(4, 2)
    assert err.value.reason == Rejection.DUPLICATE, "minibatch 4 ran before the cut"
    ran = 0
    while not s.done:
        for m in (1, 2):   # the previous stage's activations, as the window lets them come
            unit = (s.next_forward, m)
            if s.next_forward < s.next_backward + 1 and unit >= s.forward_unit and unit not in s._forward_ready:
                s.accept_forward(*unit)
        task = s.next_task()
        assert task is not None and task.p in (5, 6)
        s.complete(task)
        if task.kind == TaskKind.FORWARD:
            s.accept_backward(task.p, task.micro)
        ran += 1
    assert ran == 2 * 2 * 2 and s.next_task() is None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("micro", range(1, 9))
def test_flushed_schedules_run_their_order(schedule: str, stages: int, micro: int) -> None:
    schedule_rules.check_flushed(rows_from_spans(schedule, stages, micro, 3), schedule, stages, micro)


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("micro", range(1, 6))
def test_nf1b_keeps_its_rules(stages: int, micro: int) -> None:
    schedule_rules.check_nf1b(rows_from_spans("nf1b", stages, micro, 8), 8, micro)


def test_1f1b_keeps_fewer_micro_batches_in_flight_than_gpipe() -> None:
    """1f1b's point: stage 0 holds at most k micro-batches' activations, gpipe all M."""
    def most_open(schedule: str) -> int:
        open_ = best = 0
        for _, _, task in simulate_unit(schedule, 4, 8, 1, 2)[0]:
            open_ += 1 if task.kind == TaskKind.FORWARD else -1
            best = max(best, open_)
        return best
    assert most_open("gpipe") == 8 and most_open("1f1b") == 4


def test_flushed_checker_catches_a_swap_and_a_stale_version() -> None:
    rows = rows_from_spans("1f1b", 3, 4, 2)
    row = next(r for r in rows if r["stage"] == 0 and r["p"] == 2)
    (a, b) = row["micro_fwd"][2], row["micro_bwd"][0]  # F 2.3 and B 2.1 trade places
    a[1], a[2], b[1], b[2] = b[1], b[2], a[1], a[2]
    with pytest.raises(AssertionError, match="1f1b runs"):
        schedule_rules.check_flushed(rows, "1f1b", 3, 4)
    rows = rows_from_spans("gpipe", 2, 2, 2)
    rows[-1]["local_version"] = 0
    with pytest.raises(AssertionError, match="synchronous"):
        schedule_rules.check_flushed(rows, "gpipe", 2, 2)


def test_nf1b_checker_catches_stashed_weights_and_a_wide_window() -> None:
    rows = rows_from_spans("nf1b", 3, 2, 6)
    next(r for r in rows if r["p"] == 4)["bwd_version"] = 2
    with pytest.raises(AssertionError, match="current weights"):
        schedule_rules.check_nf1b(rows, 6, 2)
    with pytest.raises(AssertionError, match="L1 violated"):
        schedule_rules.check_nf1b(rows_from_spans("nf1b", 3, 2, 6), 1, 2)


def test_inputs_are_refused_by_reason() -> None:
    s = MicroSchedule(schedule="gpipe", stage=1, num_stages=2, nm=1, micro=2, steps=3)
    s.accept_forward(1, 1)
    cases = [
        (lambda: s.accept_forward(1, 1), Rejection.DUPLICATE),
        (lambda: s.accept_forward(1, 3), Rejection.UNKNOWN),
        (lambda: s.accept_forward(4, 1), Rejection.UNKNOWN),
        (lambda: s.accept_forward(2, 1), Rejection.WINDOW),
    ]
    for offer, reason in cases:
        with pytest.raises(ScheduleError) as err:
            offer()
        assert err.value.reason == reason
    first = MicroSchedule(schedule="nf1b", stage=0, num_stages=2, nm=2, micro=2, steps=3)
    with pytest.raises(ScheduleError) as err:
        first.accept_backward(1, 0)
    assert err.value.reason == Rejection.ORDER, "a gradient for a minibatch not forwarded here"
    with pytest.raises(ScheduleError) as err:
        first.accept_backward(1, 1)
    assert err.value.reason == Rejection.UNKNOWN, "nf1b's gradients are of whole minibatches"
    with pytest.raises(ScheduleError) as err:
        first.accept_forward(1, 1)
    assert err.value.reason == Rejection.NOT_ACCEPTED


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flushed_schedules_refuse_a_repeated_gradient_and_one_not_forwarded(schedule: str) -> None:
    """gpipe and 1f1b take gradients per micro-batch: one already here or already run is a
    duplicate, one for a micro-batch (or minibatch) not forwarded yet is out of order."""
    s = MicroSchedule(schedule=schedule, stage=0, num_stages=2, nm=1, micro=2, steps=3)

    def run(kind: TaskKind, p: int, m: int) -> None:
        task = s.next_task()
        assert task is not None and (task.kind, task.p, task.micro) == (kind, p, m), task
        s.complete(task)

    def refused(p: int, m: int) -> Rejection:
        with pytest.raises(ScheduleError) as err:
            s.accept_backward(p, m)
        return err.value.reason

    run(TaskKind.FORWARD, 1, 1)
    assert refused(1, 2) == Rejection.ORDER, "micro-batch 2 of minibatch 1 is not forwarded yet"
    s.accept_backward(1, 1)
    assert refused(1, 1) == Rejection.DUPLICATE, "waiting here already"
    run(TaskKind.FORWARD, 1, 2)  # stage 0 of 2 with 2 micro-batches: F1 F2 B1 B2 under both
    run(TaskKind.BACKWARD, 1, 1)
    assert refused(1, 1) == Rejection.DUPLICATE, "its backward has run"
    assert refused(2, 1) == Rejection.ORDER, "minibatch 2 is not forwarded yet"
    s.accept_backward(1, 2)
    run(TaskKind.BACKWARD, 1, 2)
    assert s.completed == 1


def test_a_minibatch_ends_with_its_last_backward() -> None:
    """ends_minibatch (when the stage applies its update): gpipe and 1f1b after the backward of
    the last micro-batch, nf1b after its one backward per minibatch (the last stage's fused one)."""
    for schedule in ("gpipe", "1f1b"):
        s = MicroSchedule(schedule=schedule, stage=0, num_stages=2, nm=1, micro=3, steps=2)
        assert [s.ends_minibatch(Task(TaskKind.BACKWARD, 1, micro=m)) for m in (1, 2, 3)] == [False, False, True]
        assert not any(s.ends_minibatch(Task(TaskKind.FORWARD, 1, micro=m)) for m in (1, 2, 3))
    nf1b = MicroSchedule(schedule="nf1b", stage=0, num_stages=2, nm=2, micro=3, steps=2)
    assert nf1b.ends_minibatch(Task(TaskKind.BACKWARD, 1, micro=0))
    assert not any(nf1b.ends_minibatch(Task(TaskKind.FORWARD, 1, micro=m)) for m in (1, 2, 3))
    last = MicroSchedule(schedule="nf1b", stage=1, num_stages=2, nm=2, micro=3, steps=2)
    assert last.ends_minibatch(Task(TaskKind.FORWARD_BACKWARD, 1, micro=3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "nf1b"])
def test_every_stage_ends_each_minibatch_once_at_its_last_task(schedule: str) -> None:
    """In a whole unit-time run, on every stage: exactly one task ends minibatch p, the last of
    p's tasks there (after it, p's update may be applied: nothing of p runs on older weights)."""
    nm = 2 if schedule == "nf1b" else 1  # gpipe and 1f1b: one minibatch in flight
    stages = simulate_unit(schedule, 3, 2, nm, 4)
    for q, spans in enumerate(stages):
        s = MicroSchedule(schedule=schedule, stage=q, num_stages=3, nm=nm, micro=2, steps=4)
        tasks = [task for _, _, task in spans]
        for p in range(1, 5):
            ending = [i for i, t in enumerate(tasks) if t.p == p and s.ends_minibatch(t)]
            assert ending == [max(i for i, t in enumerate(tasks) if t.p == p)], (schedule, q, p, tasks)
