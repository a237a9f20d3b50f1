"""How the command line takes Ctrl-C, SIGTERM and SIGHUP: held while it imports what a command
needs (torch takes a second), turned into a run's orderly stop while it runs, and one line."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from hetpipe.errors import Interrupted

EXIT_INTERRUPTED = 130
INTERRUPTING = (signal.SIGTERM, signal.SIGHUP)  # handled as Ctrl-C by a run: exit 128 + the signal's number
HELD = (signal.SIGINT, *INTERRUPTING)

Handler = Callable[[int, FrameType | None], None]


def interrupted() -> int:
    """Ctrl-C outside a run (which stops its processes and says so itself): one line, exit 130."""
    print("hetpipe: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


@contextmanager
def _handling(signals: Sequence[signal.Signals], handler: Handler) -> Iterator[None]:
    """handler for these signals inside the block, and the ones before it back afterwards; on a
    thread other than the main one (which alone may set them) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Imports that an interrupt waits for. One raised inside an import leaves extension modules
    half-imported, and a package that retries (numpy under torch) then fails with an ImportError
    and a traceback instead. The first signal that came is raised again once the handlers in place
    before are back: Ctrl-C's KeyboardInterrupt, a run's Interrupted, SIGTERM's default end, or
    nothing where it was ignored."""
    came: list[int] = []
    with _handling(not_ignored(HELD), lambda signum, frame: came.append(signum)):
        yield
    if came:
        signal.raise_signal(came[0])


@contextmanager
def run_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP (a scheduler's cancel, a closed terminal) stop a run as Ctrl-C does:
    every process stopped, status.json written, the run's address and token removed. Repeats of
    any of them, Ctrl-C's too, are ignored while that runs (it takes seconds): a second Ctrl-C
    raised inside the clean-up left no status.json and the run's token behind."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        for s in HELD:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)

    # One this process was started with ignored stays ignored (nohup's SIGHUP, the SIGINT of a
    # script's background job): whoever started the run asked it to outlive those, and its
    # services, which inherit the launcher's ignored signals, then ignore them too.
    with _handling(not_ignored(HELD), interrupt):
        yield


def not_ignored(signals: Sequence[signal.Signals]) -> list[signal.Signals]:
    """Those of signals this process does not ignore. An ignored one is left so, whatever block
    runs: a child started meanwhile (children.start) is told its launcher ignores SIGINT only
    while getsignal says so."""
    return [s for s in signals if signal.getsignal(s) is not signal.SIG_IGN]
