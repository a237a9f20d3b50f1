"""StallWatch: who stopped answering, and a job that stopped moving while everyone answers."""

from __future__ import annotations

from coordinator.stall import StallWatch


def test_silent_process_named_after_the_timeout_not_before() -> None:
    w = StallWatch(30.0, now=0.0)
    w.unanswered("ps shard 0", 10.0)
    w.unanswered("ps shard 0", 25.0)  # still silent: counted from the first miss
    assert w.not_responding(39.9) == []
    assert w.not_responding(40.0) == [("ps shard 0", 30.0)]


def test_an_answer_clears_the_silence() -> None:
    w = StallWatch(30.0, now=0.0)
    w.unanswered("stage 1 of vw 0", 0.0)
    w.answered("stage 1 of vw 0")
    w.unanswered("stage 1 of vw 0", 20.0)
    assert w.not_responding(45.0) == []
    assert w.not_responding(50.0) == [("stage 1 of vw 0", 30.0)]


def test_longest_silence_first() -> None:
    w = StallWatch(5.0, now=0.0)
    w.unanswered("a", 3.0)
    w.unanswered("b", 1.0)
    assert [who for who, _ in w.not_responding(10.0)] == ["b", "a"]


def test_no_progress_counted_from_the_last_change() -> None:
    w = StallWatch(30.0, now=0.0)
    w.progress((1, 2), 0.0)
    w.progress((1, 3), 20.0)
    w.progress((1, 3), 40.0)  # unchanged: not progress
    assert w.stalled_for(49.9) is None
    assert w.stalled_for(50.0) == 30.0


def test_no_stall_verdict_while_someone_is_silent() -> None:
    """A silent process is named by its own rule; the stall rule must not race it."""
    w = StallWatch(30.0, now=0.0)
    w.progress((0,), 0.0)
    w.unanswered("ps shard 0", 10.0)
    assert w.stalled_for(100.0) is None
    w.answered("ps shard 0")
    # The clock restarted at the miss: the shard's silence was not the job's own stall.
    assert w.stalled_for(39.9) is None
    assert w.stalled_for(40.0) == 30.0


def test_an_unreachable_process_restarts_the_stall_clock() -> None:
    """A restarting shard refuses connections for a while: no progress is expected meanwhile."""
    w = StallWatch(30.0, now=0.0)
    w.progress((0,), 0.0)
    w.paused(25.0)
    assert w.stalled_for(54.0) is None
    assert w.stalled_for(55.0) == 30.0
