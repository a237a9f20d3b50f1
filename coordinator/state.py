"""The job lifecycle as an explicit state machine: every state and every allowed edge."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hetpipe.v1 import coordinator_pb2

State = coordinator_pb2.JobStatus.State

NONE = State.NONE
PENDING = State.PENDING
PLANNED = State.PLANNED
RUNNING = State.RUNNING
COMPLETED = State.COMPLETED
FAILED = State.FAILED
STOPPED = State.STOPPED

TRANSITIONS: dict[State, frozenset[State]] = {
    NONE: frozenset({PENDING}),
    PENDING: frozenset({PLANNED, FAILED, STOPPED}),   # planning
    PLANNED: frozenset({RUNNING, FAILED, STOPPED}),   # waiting for workers, assigning
    RUNNING: frozenset({COMPLETED, FAILED, STOPPED}),
    COMPLETED: frozenset({PENDING}),                  # a finished coordinator takes a new job
    FAILED: frozenset({PENDING}),
    STOPPED: frozenset({PENDING}),
}
TERMINAL = frozenset({COMPLETED, FAILED, STOPPED})


class IllegalTransition(RuntimeError):
    pass


@dataclass
class JobStateMachine:
    """Thread-safe holder of the job state; refuses edges that TRANSITIONS does not list."""

    state: State = NONE
    reason: str = ""
    history: list[tuple[float, State, str]] = field(default_factory=list)
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def to(self, new: State, reason: str = "") -> None:
        with self._lock:
            if new not in TRANSITIONS[self.state]:
                raise IllegalTransition(f"job cannot go from {State.Name(self.state)} to {State.Name(new)}")
            self.state, self.reason = new, reason
            self.history.append((time.time(), new, reason))
            self._lock.notify_all()

    def try_to(self, new: State, reason: str = "") -> bool:
        """Like to(), but False instead of raising (a stop racing with completion)."""
        try:
            self.to(new, reason)
            return True
        except IllegalTransition:
            return False

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def wait_terminal(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.state in TERMINAL, timeout)
