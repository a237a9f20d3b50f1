"""Errors every layer shares: a request refused with a gRPC status, and how a job ends early."""

from __future__ import annotations

import signal

import grpc


class Rejected(Exception):
    """A request refused with a specific gRPC status; the servicer answers with it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class JobFailed(Exception):
    """The job cannot finish; the message names the process, the stage and the minibatch."""


class JobStopped(Exception):
    """Someone asked the job to stop."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled as Ctrl-C is; str() is the reason a stopped job gives."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted ({signal.Signals(signum).name})")
        self.signum = signum


def interrupt_reason(exc: KeyboardInterrupt) -> str:
    """Why an interrupted job stopped: the signal's name, Ctrl-C for a plain KeyboardInterrupt."""
    return str(exc) if isinstance(exc, Interrupted) else "interrupted (Ctrl-C)"


class StageLost(JobFailed):
    """A stage died, hung or failed: its virtual worker cannot go on (the job may, without it)."""

    def __init__(self, vw: int, message: str) -> None:
        super().__init__(message)
        self.vw = vw


def first_line(exc: BaseException) -> str:
    """An exception's message, for a one-line error: its first line ("" where it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def meta_hint(exc: BaseException) -> str:
    """Where the planner's shape-only pass (the meta device) failed: a layer that reads values
    fails there, not on the data or on the layer before it."""
    return (" (the planner runs the model on the meta device, shapes without values: a layer that reads values, "
            "with .item() or a branch on the data, cannot run there)") if "meta" in first_line(exc) else ""
