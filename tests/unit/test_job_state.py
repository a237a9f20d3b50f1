"""The coordinator's job state machine allows exactly the listed edges."""

from __future__ import annotations

import itertools

import pytest

from coordinator import state as st

ALL = [st.NONE, st.PENDING, st.PLANNED, st.RUNNING, st.COMPLETED, st.FAILED, st.STOPPED]


def _reach(target: int) -> st.JobStateMachine:
    """A machine driven to target along legal edges."""
    path = {st.NONE: [], st.PENDING: [st.PENDING], st.PLANNED: [st.PENDING, st.PLANNED],
            st.RUNNING: [st.PENDING, st.PLANNED, st.RUNNING],
            st.COMPLETED: [st.PENDING, st.PLANNED, st.RUNNING, st.COMPLETED],
            st.FAILED: [st.PENDING, st.FAILED], st.STOPPED: [st.PENDING, st.STOPPED]}[target]
    m = st.JobStateMachine()
    for s in path:
        m.to(s)
    return m


@pytest.mark.parametrize(("a", "b"), list(itertools.product(ALL, ALL)))
def test_every_edge_is_allowed_exactly_when_listed(a: int, b: int) -> None:
    m = _reach(a)
    if b in st.TRANSITIONS[a]:
        m.to(b, "why")
        assert m.state == b and m.reason == "why"
    else:
        with pytest.raises(st.IllegalTransition, match=st.State.Name(b)):
            m.to(b)
        assert m.state == a


def test_terminal_states_end_a_job_and_a_new_one_can_start() -> None:
    for end in (st.COMPLETED, st.FAILED, st.STOPPED):
        m = _reach(end)
        assert m.terminal and m.wait_terminal(0)
        m.to(st.PENDING)
        assert not m.terminal
    assert [s for _, s, _ in _reach(st.COMPLETED).history] == [st.PENDING, st.PLANNED, st.RUNNING, st.COMPLETED]
