"""Ctrl-C (and SIGTERM, SIGHUP) while hetpipe imports what a command needs (torch takes a second):
held until the imports are done, then delivered to whatever handles it there."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Imports that an interrupt waits for. One raised inside an import leaves extension modules
    half-imported, and a package that retries (numpy under torch) then fails with an ImportError
    and a traceback instead. The first signal that came is raised again once the handlers in place
    before are back: Ctrl-C's KeyboardInterrupt, a run's Interrupted, SIGTERM's default end, or
    nothing where it was ignored."""
    if threading.current_thread() is not threading.main_thread():   # only the main thread gets signals
        yield
        return
    came: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        came.append(signum)

    previous = {s: signal.signal(s, hold) for s in HELD}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if came:
        signal.raise_signal(came[0])
