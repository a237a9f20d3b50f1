"""ShardWatch: the shards' health asked on a thread of its own, each silent shard acted on once
per stall timeout, and nothing counted against a shard that is dead or restarting."""

from __future__ import annotations

import threading

import grpc
import pytest

from coordinator.shard_watch import ShardWatch
from coordinator.stall import StallWatch


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _Health:
    """A shard's health stub that answers with the next scripted code (OK: it answers)."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)

    def Check(self, request: object, timeout: float) -> None:
        code = self.codes.pop(0) if self.codes else grpc.StatusCode.OK
        if code == "closed":
            raise ValueError("Cannot invoke RPC on closed channel!")
        if code != grpc.StatusCode.OK:
            raise _Failed(code)


SILENT = grpc.StatusCode.DEADLINE_EXCEEDED


def _watch(health: list[_Health], restart: bool, timeout: float = 3.0):
    clock = [0.0]
    named: list[tuple[int, float]] = []

    def on_silent(index: int, seconds: float) -> bool:
        named.append((index, seconds))
        return restart

    watch = StallWatch(timeout, 0.0)
    return ShardWatch(health, watch, threading.Lock(), on_silent, clock=lambda: clock[0]), clock, named, watch


def test_a_silent_shard_is_named_once_its_silence_reaches_the_timeout() -> None:
    shard_watch, clock, named, _ = _watch([_Health(), _Health(SILENT, SILENT, SILENT, SILENT)], restart=False)
    for t in (0.0, 1.0, 2.0):
        clock[0] = t
        assert shard_watch.probe()
    assert named == []
    clock[0] = 3.0
    assert not shard_watch.probe(), "the job fails: the watch stops asking"
    assert named == [(1, 3.0)]


def test_an_answer_clears_the_silence() -> None:
    shard_watch, clock, named, _ = _watch([_Health(SILENT, SILENT, grpc.StatusCode.OK, SILENT, SILENT)], restart=False)
    for t in range(5):
        clock[0] = float(t)
        assert shard_watch.probe()
    assert named == [], "silent at 0-1 and again from 3: never 3 s in a row"


def test_a_restarted_shard_gets_a_fresh_timeout() -> None:
    shard_watch, clock, named, _ = _watch([_Health(*[SILENT] * 10)], restart=True)
    for t in range(8):
        clock[0] = float(t)
        assert shard_watch.probe()
    assert named == [(0, 3.0), (0, 3.0)], "named at 3 (silent since 0), then at 7 (since 4)"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED])
def test_a_shard_that_refuses_is_not_silent(code: grpc.StatusCode) -> None:
    """Dead or restarting (the launcher or the heartbeats report it): no verdict of silence, and
    no verdict on progress meanwhile either."""
    shard_watch, clock, named, watch = _watch([_Health(*[code] * 10)], restart=False)
    watch.progress("moved", 0.0)
    for t in range(8):
        clock[0] = float(t)
        assert shard_watch.probe()
    assert named == []
    assert watch.stalled_for(8.0) is None, "the time the shard refused is not time the job was seen stuck"


def test_a_closed_channel_ends_the_watch_without_a_verdict() -> None:
    shard_watch, _, named, _ = _watch([_Health("closed")], restart=False)  # type: ignore[arg-type]
    assert not shard_watch.probe()
    assert named == []


def test_the_thread_finds_a_silent_shard_and_close_stops_it() -> None:
    named = threading.Event()
    health = _Health(*[SILENT] * 1000)
    shard_watch = ShardWatch([health], StallWatch(0.05, 0.0), threading.Lock(),
                             lambda index, seconds: named.set() or True, interval=0.01)
    shard_watch.start()
    try:
        assert named.wait(10.0), "the thread never named the silent shard"
    finally:
        shard_watch.close()
    asked = len(health.codes)
    threading.Event().wait(0.1)
    assert len(health.codes) == asked, "still asking after close"


def test_a_shard_slow_once_then_restarting_is_not_named_silent() -> None:
    """One missed check, then refusals (it died and is being restarted: the launcher or compose
    brings it back, and its heartbeats are the rule): the missed check no longer counts, so the
    restart's time was taken for silence and the shard named "not responding"."""
    shard_watch, clock, named, _ = _watch([_Health(SILENT, *[grpc.StatusCode.UNAVAILABLE] * 10)], restart=False)
    for t in range(8):
        clock[0] = float(t)
        assert shard_watch.probe(), f"named silent at t={t}: {named}"
    assert named == []
