"""Stopping the helper processes of the transport and parameter-server benchmarks."""

from __future__ import annotations

from collections.abc import Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


def stop_children(conns: Iterable[Connection], message: Any, procs: Iterable[BaseProcess]) -> None:
    """Sends each child its stop message, then waits for it; one that hangs is killed."""
    for conn in conns:
        try:
            conn.send(message)
        except (BrokenPipeError, OSError):
            pass  # already gone
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
