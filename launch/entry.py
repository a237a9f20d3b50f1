"""The `hetpipe` console script: launch.cli's main behind its imports (Ctrl-C during them ends
the command as it does later, in one line with exit 130), and its end (launch.ending)."""

from __future__ import annotations

from launch.ending import finish
from launch.interrupts import interrupted, interrupts_held


def main() -> int:
    try:
        with interrupts_held():
            from launch.cli import main as cli_main
    except KeyboardInterrupt:
        return interrupted()
    finish(cli_main())
