"""Hang detection (pure: the caller's clock, no gRPC): which processes stopped answering, and
whether the job stopped making progress while every process still answers."""

from __future__ import annotations

from collections.abc import Hashable


class StallWatch:
    """Fed after each poll; after timeout_s names who has not answered since, or says that the job
    made no progress although everyone answered all along (a stage stuck inside its own work)."""

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self._silent: dict[str, float] = {}   # who -> when it first left a poll unanswered
        self._progress: Hashable = None
        self._since = now                     # the last progress, or the last poll someone missed

    def answered(self, who: str) -> None:
        self._silent.pop(who, None)

    def unanswered(self, who: str, now: float) -> None:
        self._silent.setdefault(who, now)
        # Time without an answer is not time a stage was seen stuck: that rule must not race this one.
        self._since = now

    def paused(self, now: float) -> None:
        """No verdict on progress up to now: a process refused the connection (dead, or restarting),
        or the job waited on purpose (a checkpoint being taken, every stage waiting at it)."""
        self._since = now

    def not_responding(self, now: float) -> list[tuple[str, float]]:
        """(who, seconds) for each process silent for timeout_s or longer, longest first."""
        late = [(who, now - since) for who, since in self._silent.items() if now - since >= self.timeout_s]
        return sorted(late, key=lambda item: -item[1])

    def progress(self, fingerprint: Hashable, now: float) -> None:
        """fingerprint: anything that changes whenever the job moves on (counters, clocks)."""
        if fingerprint != self._progress:
            self._progress, self._since = fingerprint, now

    def stalled_for(self, now: float) -> float | None:
        """Seconds without progress once they reach timeout_s with everyone answering; else None."""
        if self._silent:
            return None
        waited = now - self._since
        return waited if waited >= self.timeout_s else None
