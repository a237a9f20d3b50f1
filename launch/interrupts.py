"""Ctrl-C while hetpipe imports what a command needs (torch takes a second): held until the
imports are done, then a KeyboardInterrupt as anywhere else."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Imports that Ctrl-C waits for: it interrupts (KeyboardInterrupt) once they are done. Raised
    inside an import, it leaves extension modules half-imported, and a package that retries (numpy
    under torch) then fails with an ImportError and a traceback instead."""
    if threading.current_thread() is not threading.main_thread():   # only the main thread gets signals
        yield
        return
    pressed: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pressed.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt
