"""A stage's lifecycle: every state and every allowed edge in one table (the servicer translates
the states to the protobuf enum)."""

from __future__ import annotations

import enum


class StageState(enum.Enum):
    IDLE = "idle"            # waiting for an assignment
    LOADING = "loading"      # assigned: building its layers, reading its data
    READY = "ready"          # loaded: waiting for Start (weights may still be replaced)
    RUNNING = "running"
    DONE = "done"            # every training task run, every push acknowledged
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        """Training has ended, one way or the other."""
        return self in (StageState.DONE, StageState.FAILED)

    @property
    def assigned(self) -> bool:
        """Whether the stage holds an assignment (layers, schedule, weights)."""
        return self is not StageState.IDLE

    def allows(self, new: StageState) -> bool:
        return new in TRANSITIONS[self]


TRANSITIONS: dict[StageState, frozenset[StageState]] = {
    StageState.IDLE: frozenset({StageState.LOADING}),
    StageState.LOADING: frozenset({StageState.READY, StageState.FAILED}),
    StageState.READY: frozenset({StageState.RUNNING, StageState.FAILED}),
    StageState.RUNNING: frozenset({StageState.DONE, StageState.FAILED}),
    # Done training, the stage still serves the final evaluation: that can fail too.
    StageState.DONE: frozenset({StageState.FAILED}),
    StageState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check(old: StageState, new: StageState) -> None:
    if not old.allows(new):
        raise IllegalTransition(f"a stage cannot go from {old.name} to {new.name}")
