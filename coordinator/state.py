"""The job lifecycle as an explicit state machine: every state, and every edge it allows, in one
place (the servicer translates the states to the protobuf enum)."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field


class JobState(enum.Enum):
    NONE = "none"            # no job submitted yet
    PENDING = "pending"      # planning
    PLANNED = "planned"      # waiting for workers, assigning them
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED)

    def allows(self, new: JobState) -> bool:
        return new in TRANSITIONS[self]


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # A stop before any job arrives is a stop all the same: what is submitted next starts afresh.
    JobState.NONE: frozenset({JobState.PENDING, JobState.STOPPED}),
    JobState.PENDING: frozenset({JobState.PLANNED, JobState.FAILED, JobState.STOPPED}),
    JobState.PLANNED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED}),
    # A coordinator whose job ended takes a new one.
    JobState.COMPLETED: frozenset({JobState.PENDING}),
    JobState.FAILED: frozenset({JobState.PENDING}),
    JobState.STOPPED: frozenset({JobState.PENDING}),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class JobStateMachine:
    """Thread-safe holder of the job state; refuses edges that TRANSITIONS does not list."""

    state: JobState = JobState.NONE
    reason: str = ""
    history: list[tuple[float, JobState, str]] = field(default_factory=list)
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def to(self, new: JobState, reason: str = "") -> None:
        with self._lock:
            if not self.state.allows(new):
                raise IllegalTransition(f"job cannot go from {self.state.name} to {new.name}")
            self.state, self.reason = new, reason
            self.history.append((time.time(), new, reason))
            self._lock.notify_all()

    def try_to(self, new: JobState, reason: str = "") -> bool:
        """Like to(), but False instead of raising (a stop racing with completion)."""
        try:
            self.to(new, reason)
            return True
        except IllegalTransition:
            return False

    @property
    def terminal(self) -> bool:
        return self.state.is_terminal

    def wait_terminal(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.state.is_terminal, timeout)
