"""coordinator/state.py: the job state machine allows exactly the edges of the lifecycle."""

from __future__ import annotations

import itertools

import pytest

from coordinator.state import IllegalTransition, JobState, JobStateMachine

S = JobState
# The lifecycle, written out here from DESIGN §2 and the first-hour rules (a stop works in every
# state that has not ended, NONE included), independently of the table under test.
ALLOWED = {
    (S.NONE, S.PENDING), (S.NONE, S.STOPPED),
    (S.PENDING, S.PLANNED), (S.PENDING, S.FAILED), (S.PENDING, S.STOPPED),
    (S.PLANNED, S.RUNNING), (S.PLANNED, S.FAILED), (S.PLANNED, S.STOPPED),
    (S.RUNNING, S.COMPLETED), (S.RUNNING, S.FAILED), (S.RUNNING, S.STOPPED),
    (S.COMPLETED, S.PENDING), (S.FAILED, S.PENDING), (S.STOPPED, S.PENDING),
}
PATHS = {S.NONE: [], S.PENDING: [S.PENDING], S.PLANNED: [S.PENDING, S.PLANNED],
         S.RUNNING: [S.PENDING, S.PLANNED, S.RUNNING], S.COMPLETED: [S.PENDING, S.PLANNED, S.RUNNING, S.COMPLETED],
         S.FAILED: [S.PENDING, S.FAILED], S.STOPPED: [S.PENDING, S.STOPPED]}


def _reach(target: JobState) -> JobStateMachine:
    m = JobStateMachine()
    for s in PATHS[target]:
        m.to(s)
    return m


@pytest.mark.parametrize(("a", "b"), list(itertools.product(JobState, JobState)))
def test_every_edge_is_allowed_exactly_when_the_lifecycle_has_it(a: JobState, b: JobState) -> None:
    m = _reach(a)
    if (a, b) in ALLOWED:
        m.to(b, "why")
        assert m.state == b and m.reason == "why"
    else:
        with pytest.raises(IllegalTransition, match=f"from {a.name} to {b.name}"):
            m.to(b)
        assert m.state == a
        assert not m.try_to(b) and m.state == a


def test_terminal_states_end_a_job_and_a_new_one_can_start() -> None:
    assert {s for s in JobState if s.is_terminal} == {S.COMPLETED, S.FAILED, S.STOPPED}
    for end in (S.COMPLETED, S.FAILED, S.STOPPED):
        m = _reach(end)
        assert m.terminal and m.wait_terminal(0)
        m.to(S.PENDING)
        assert not m.terminal and not m.wait_terminal(0)
    assert [s for _, s, _ in _reach(S.COMPLETED).history] == [S.PENDING, S.PLANNED, S.RUNNING, S.COMPLETED]
