"""launch/interrupts.py: a signal that comes while hetpipe imports waits for the imports, then
reaches the handler that was in place, as if it came just after."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from launch.interrupts import interrupts_held

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _handlers_back() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_ctrl_c_inside_waits_for_the_block_then_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the block went on")
    assert done == ["the block went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_handler_in_place_gets_the_first_signal_and_an_ignored_one_stays_ignored() -> None:
    got: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert got == [], "held while the block runs"
    assert got == [signal.SIGTERM]
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)   # ignored before: nothing afterwards either
    assert got == [signal.SIGTERM] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_run_keeps_the_signals_it_was_started_with_ignored() -> None:
    """`nohup hetpipe run` (SIGHUP ignored), a script's `hetpipe run &` (SIGINT ignored): a
    closed terminal or a Ctrl-C meant for the script must not stop the run; SIGTERM still does."""
    from launch.interrupts import run_interrupts

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with pytest.raises(KeyboardInterrupt) as stopped:
        with run_interrupts():
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
    assert "SIGTERM" in str(stopped.value), stopped.value
