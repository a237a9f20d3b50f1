"""The `hetpipe` console script: launch.cli's main behind its imports (Ctrl-C during them ends
the command as it does later, in one line with exit 130), and its end (launch.ending)."""

from __future__ import annotations

import signal
from types import FrameType

_EARLY: list[int] = []   # Ctrl-C before the imports below are done


def _record(signum: int, frame: FrameType | None) -> None:
    _EARLY.append(signum)


# From the first line of ours that runs: the imports below bring in grpc (60 ms here, far longer on
# a loaded host), and a Ctrl-C among them ended in a traceback. An ignored SIGINT (a command started
# in the background) stays ignored.
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _record)

from launch.ending import finish  # noqa: E402
from launch.interrupts import interrupted, interrupts_held  # noqa: E402


def main() -> int:
    try:
        with interrupts_held():   # a Ctrl-C inside comes back to _record once it is done
            from launch.cli import main as cli_main
    except KeyboardInterrupt:
        return interrupted()
    if signal.getsignal(signal.SIGINT) is _record:
        signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C raises again from here on
    if _EARLY:
        return interrupted()
    finish(cli_main())
