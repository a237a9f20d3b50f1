"""How a `hetpipe` command ends: its exit codes, its one-line errors, and its exit once its work
is done, without Python's teardown."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a reader that went away


def error(message: str) -> None:
    print(f"hetpipe: error: {message}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"hetpipe: warning: {message}", file=sys.stderr)


def finish(code: int) -> NoReturn:
    """Ends the command once its work is done: its exit handlers run (the shared-memory segments
    it owns, logging, multiprocessing's fork server), Python's teardown does not. With torch
    loaded, that teardown's garbage collection took 1-2 s after every `hetpipe run` had printed
    its results; every file the command wrote is closed by then."""
    _flush()
    atexit._run_exitfuncs()
    _flush()   # what a handler printed
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # the reader went away (cli.main has said so), or it is closed
            pass
