"""The shards' health, asked on a thread of its own for as long as a job runs.

The driver's own loop cannot ask while it waits: on a shard's answer to a checkpoint, a --resume's
values or the final weights, or on the stages while they load (and give the shards w0). A shard
frozen then would hold the job for a whole data deadline (two minutes) and fail it with
DEADLINE_EXCEEDED, instead of being named within train.stall_timeout_s."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from hetpipe import rpc
from coordinator.stall import StallWatch

log = logging.getLogger(__name__)
SHARD_PROBE_S = 1.0  # how often a job's shards are asked whether they answer


def shard_name(index: int) -> str:
    return f"ps shard {index}"


class ShardWatch:
    """Feeds watch (shared with the driver's loop, under lock) with each shard's health check,
    every interval seconds; on_silent(index, seconds) for a shard silent for the watch's timeout.
    It returns True where the shard is being restarted (a fresh timeout), False where the job
    fails: the thread then stops asking."""

    def __init__(self, health: Sequence[Any], watch: StallWatch, lock: threading.Lock,
                 on_silent: Callable[[int, float], bool], *, interval: float = SHARD_PROBE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._health = list(health)   # grpc_health HealthStubs, one per shard
        self._index = {shard_name(i): i for i in range(len(self._health))}   # the watch's names, the shards'
        self._watch, self._lock = watch, lock
        self._on_silent = on_silent
        self._interval = interval
        self._clock = clock
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-watch", daemon=True)

    def start(self) -> None:
        if self._health:
            self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(rpc.STATUS_DEADLINE_S + 1.0)

    def _run(self) -> None:
        while not self._closed.wait(self._interval):
            try:
                if not self.probe():
                    return
            except Exception:   # a bug here must not end the watch quietly: the job would hang again
                log.exception("the shard watch failed; asking again in %gs", self._interval)

    def probe(self) -> bool:
        """Asks every shard once and acts on the silent ones; False once one fails the job."""
        for i, health in enumerate(self._health):
            if self._closed.is_set():
                return True
            try:
                health.Check(health_pb2.HealthCheckRequest(), timeout=rpc.STATUS_DEADLINE_S)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            except ValueError:   # its channel was closed: the job is over
                return False
            now = self._clock()
            with self._lock:
                if code == grpc.StatusCode.OK:
                    self._watch.answered(shard_name(i))
                elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._watch.unanswered(shard_name(i), now)
                else:   # UNAVAILABLE: dead or restarting, which the launcher or the heartbeats report
                    self._watch.answered(shard_name(i))   # an earlier missed check no longer counts
                    self._watch.paused(now)
                silent = [(who, s) for who, s in self._watch.not_responding(now) if who in self._index]
            for who, seconds in silent:
                if not self._on_silent(self._index[who], seconds):
                    return False
                with self._lock:
                    self._watch.answered(who)   # the restarted shard gets a fresh timeout
        return True
