"""The `hetpipe` console script: launch.cli's main behind its imports, which take a second
(torch); Ctrl-C during them ends the command as it does later, in one line with exit 130."""

from __future__ import annotations

import signal
from types import FrameType


def main() -> int:
    # Ctrl-C is held until the imports are done: a KeyboardInterrupt raised inside one leaves
    # extension modules half-imported, and a package that retries (numpy under torch) then fails
    # with an ImportError and a traceback instead.
    pressed: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pressed.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        from launch.cli import interrupted, main as cli_main
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        return interrupted()
    return cli_main()
