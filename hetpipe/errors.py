"""Errors every layer shares: a request refused with a gRPC status, and how a job ends early."""

from __future__ import annotations

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


class StageLost(JobFailed):
    """A stage died, hung or failed: its virtual worker cannot go on (the job may, without it)."""

    def __init__(self, vw: int, message: str) -> None:
        super().__init__(message)
        self.vw = vw
