"""Wave Synchronous Parallel for one stage: push each wave's summed update, pull by G2, merge by G3."""

from __future__ import annotations

import json
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypeVar, cast

import grpc
import torch

from hetpipe import rpc, wire
from hetpipe.v1 import ps_pb2, ps_pb2_grpc, wire_pb2
from hetpipe.wsp import required_min_clock
from stage_worker.stage import StageCompute

if TYPE_CHECKING:
    from stage_worker.runtime import StageRuntime

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
PUSH_GIVE_UP_S = 120.0   # long enough for a shard to be restarted from its checkpoint
PULL_GIVE_UP_S = 600.0   # a pull may wait this long for the slowest VW
PULL_CALL_S = 30.0       # one pull call's deadline; retried until PULL_GIVE_UP_S
T = TypeVar("T")
R = TypeVar("R")


def _in_parallel(call: Callable[[T], R], items: list[T]) -> list[R]:
    """call(item) for every item at once, results in order; raises the first error. Pushes and
    pulls go to every shard at once: one round trip, not one per shard. Daemon threads, not an
    executor: a pull the shards hold back must never delay the process's exit."""
    if len(items) == 1:
        return [call(items[0])]
    results: list[R | None] = [None] * len(items)
    errors: list[BaseException] = []

    def run(i: int, item: T) -> None:
        try:
            results[i] = call(item)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, item), daemon=True) for i, item in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return cast(list[R], results)


@dataclass(frozen=True, slots=True)
class _Pulled:
    values: dict[str, torch.Tensor]
    own_clock: dict[str, int]
    c_global: int
    min_clock: int
    sent: float      # wall-clock times, for the sync trace
    replied: float


class WspSync:
    """The stage's side of WSP. The compute thread calls every public method; the pusher and
    puller threads only talk gRPC and hand pull results over through `_pending`."""

    def __init__(self, runtime: StageRuntime) -> None:
        a, job = runtime.a, runtime.job
        self.rt = runtime
        self._observe = runtime.observe  # push/pull latency histograms
        self.vw, self.nm, self.D = a.vw, job.nm, job.parallel.D
        self.keys = list(runtime.compute.names)
        if len(a.key_shards) != len(self.keys) or any(s >= len(a.ps_addresses) for s in a.key_shards):
            raise rpc.Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"key_shards: {len(a.key_shards)} entries for {len(self.keys)} parameters over "
                f"{len(a.ps_addresses)} shards",
            )
        self.shard_of = dict(zip(self.keys, a.key_shards))
        self.addresses = list(a.ps_addresses)
        self._channels = [rpc.channel(addr) for addr in self.addresses]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(ch) for ch in self._channels]
        # An emulated network (DESIGN §5) holds each push, and each pull reply, this long.
        self._hold_push_s, self._hold_pull_s = a.push_seconds, a.pull_seconds
        self.steps = job.train.steps
        self.total_waves = math.ceil(self.steps / self.nm)
        self._acc: dict[int, list[torch.Tensor]] = {}
        self._clock = 0
        self._have = 0             # c_global the local weights are known to include
        self._lock = threading.Lock()
        self._pending: _Pulled | None = None
        self._pulling: int | None = None   # min_clock of the pull in flight
        self._wait_started: float | None = None
        self._wait_seconds = 0.0
        self._acked_waves = 0
        self._closed = threading.Event()
        self._pushes: queue.Queue[tuple[int, list[torch.Tensor], float] | None] = queue.Queue()
        # Sum of every acknowledged push, written next to the trace: what O3 checks the shards against.
        self._ledger = [torch.zeros_like(p, device="cpu") for p in runtime.compute.params]
        self._ledger_path = ""
        # The sync trace (trace/sync/vwV_stageQ.jsonl): when each push and pull was queued, sent,
        # answered and merged; what explains a wait that the minibatch trace only shows the end of.
        self._sync_trace: IO[str] | None = None
        self._trace_lock = threading.Lock()
        if a.trace_path:
            trace = Path(a.trace_path)
            self._ledger_path = str(trace.with_name(f"acked_vw{a.vw}_stage{a.stage}.pt"))
            (trace.parent / "sync").mkdir(exist_ok=True)
            self._sync_trace = open(trace.parent / "sync" / trace.name, "w")
        self._repeat_push = job.faults.repeat_push
        self._rng = random.Random(hash((job.train.seed, a.vw, a.stage, "push")))
        self._pusher = threading.Thread(target=self._push_loop, name="pusher", daemon=True)
        self._pusher.start()

    # ---- called by the compute thread -------------------------------------------------------

    def forward_allowed(self, p: int) -> bool:
        if not self.keys:
            return True
        need = required_min_clock(p, self.nm, self.D, self.steps)
        if need > self._have:
            with self._lock:
                if self._wait_started is None:
                    self._wait_started = time.monotonic()
            self._request(need)
            return False
        # Prefetch: the next wave's forwards will need more; asking now hides the round trip,
        # and a fresher w_global is always allowed (G2 is a lower bound).
        ahead = required_min_clock(min(p + self.nm, self.steps), self.nm, self.D, self.steps)
        if ahead > self._have:
            self._request(ahead)
        return True

    def _request(self, min_clock: int) -> None:
        """Starts a pull for min_clock unless one is under way or waiting to be merged."""
        with self._lock:
            if self._pulling is None and self._pending is None:
                self._pulling = min_clock
                threading.Thread(target=self._pull, args=(min_clock,), name="puller", daemon=True).start()

    @property
    def waiting(self) -> bool:
        return self._wait_started is not None

    def after_update(self, p: int, update: list[torch.Tensor]) -> None:
        wave = (p - 1) // self.nm
        acc = self._acc.get(wave)
        if acc is None:
            self._acc[wave] = [u.clone() for u in update]
        else:
            for total, u in zip(acc, update):
                total.add_(u)

    def on_wave_end(self, wave: int) -> None:
        self._clock = wave + 1
        if self.keys:
            self._pushes.put((wave, [t.clone() for t in self._acc[wave]], time.time()))

    def apply_pending(self, compute: StageCompute) -> None:
        with self._lock:
            pulled, self._pending = self._pending, None
        if pulled is None:
            return
        # G3: w_global plus the own waves it does not include yet; nothing lost, nothing twice.
        merged = []
        for i, key in enumerate(self.keys):
            value = pulled.values[key].to(compute.device)
            for wave, acc in self._acc.items():
                if wave >= pulled.own_clock[key]:
                    value = value + acc[i]
            merged.append(value)
        compute.set_weights(merged)
        self._have = max(self._have, pulled.c_global)
        self._write_sync({"event": "pull", "min_clock": pulled.min_clock, "c_global": pulled.c_global,
                          "sent": pulled.sent, "replied": pulled.replied, "merged": time.time()})
        included = min(pulled.own_clock.values())
        for wave in [w for w in self._acc if w < included]:
            del self._acc[wave]
        with self._lock:
            self._pulling = None
            if self._wait_started is not None and required_min_clock(self.rt.schedule.next_forward, self.nm, self.D, self.steps) <= self._have:
                self._wait_seconds += time.monotonic() - self._wait_started
                self._wait_started = None

    @property
    def min_clock(self) -> int:
        return self._have

    @property
    def clock(self) -> int:
        return self._clock

    @property
    def wait_seconds(self) -> float:
        with self._lock:
            ongoing = time.monotonic() - self._wait_started if self._wait_started is not None else 0.0
            return self._wait_seconds + ongoing

    def finished(self) -> bool:
        return not self.keys or self._acked_waves == self.total_waves

    def close(self) -> None:
        self._closed.set()
        self._pushes.put(None)
        self._pusher.join(timeout=5)
        for ch in self._channels:
            ch.close()
        with self._trace_lock:
            if self._sync_trace is not None:
                self._sync_trace.close()
                self._sync_trace = None

    def _write_sync(self, row: dict[str, float | int | str]) -> None:
        with self._trace_lock:
            if self._sync_trace is not None:
                self._sync_trace.write(json.dumps(row) + "\n")
                self._sync_trace.flush()

    # ---- background threads -------------------------------------------------------------------

    def _by_shard(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, key in enumerate(self.keys):
            out.setdefault(self.shard_of[key], []).append(i)
        return out

    def _retrying(self, what: str, shard: int, give_up_s: float, call: Callable[[], object]) -> object:
        """Runs call until it succeeds, retrying while the shard is down or slow, up to give_up_s."""
        deadline = time.monotonic() + give_up_s
        delay = 0.05
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in _RETRYABLE or time.monotonic() > deadline or self._closed.is_set():
                    raise RuntimeError(
                        f"{what} to ps shard {shard} at {self.addresses[shard]} failed: {code.name}: {exc.details()}"
                    ) from None
                log.warning("%s to shard %d: %s; retrying", what, shard, code.name)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)

    def _push_loop(self) -> None:
        groups = self._by_shard()
        while (item := self._pushes.get()) is not None:
            wave, update, queued = item
            started, start_wall = time.perf_counter(), time.time()
            batches = {shard: [(self.keys[i], update[i].cpu()) for i in idx] for shard, idx in groups.items()}
            if self._hold_push_s > 0 and self._closed.wait(self._hold_push_s):
                return
            try:
                _in_parallel(lambda item: self._push(item[0], wave, item[1]), list(batches.items()))
            except RuntimeError as exc:
                if not self._closed.is_set():  # a call cut short by closing is not a failure
                    self.rt.fail(str(exc))
                return
            self._observe.push.observe(time.perf_counter() - started)
            self._write_sync({"event": "push", "wave": wave, "queued": queued, "start": start_wall, "end": time.time()})
            for total, u in zip(self._ledger, update):
                total.add_(u.cpu())
            self._acked_waves = wave + 1
            if self._acked_waves == self.total_waves and self._ledger_path:
                torch.save(dict(zip(self.keys, self._ledger)), self._ledger_path)
            self.rt.wake()

    def _push(self, shard: int, wave: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """G1: one wave's update to one shard, retried until acknowledged."""
        tag = wire_pb2.PushTag(vw=self.vw, clock=wave)
        stub = self._stubs[shard]

        def call() -> ps_pb2.PushReply:
            reply: ps_pb2.PushReply = stub.Push(wire.encode(tensors, push=tag), timeout=rpc.DATA_DEADLINE_S)
            return reply

        self._retrying(f"push of wave {wave}", shard, PUSH_GIVE_UP_S, call)
        if self._repeat_push and self._rng.random() < self._repeat_push:
            # Fault injection: the retry a lost acknowledgement would cause must be a no-op.
            reply = self._retrying(f"repeated push of wave {wave}", shard, PUSH_GIVE_UP_S, call)
            assert isinstance(reply, ps_pb2.PushReply)
            if not reply.duplicate:
                raise RuntimeError(f"ps shard {shard} applied a repeated push of wave {wave} twice")

    def _pull(self, min_clock: int) -> None:
        values: dict[str, torch.Tensor] = {}
        own: dict[str, int] = {}
        started, sent = time.perf_counter(), time.time()

        def pull_one(shard: int, idx: list[int]) -> wire.Bundle:
            request = ps_pb2.PullRequest(vw=self.vw, keys=[self.keys[i] for i in idx], min_clock=min_clock)
            stub = self._stubs[shard]
            bundle = self._retrying(
                f"pull for min_clock {min_clock}", shard, PULL_GIVE_UP_S,
                lambda: wire.decode(stub.Pull(request, timeout=PULL_CALL_S)),
            )
            assert isinstance(bundle, wire.Bundle)
            return bundle

        try:
            groups = self._by_shard()
            bundles = dict(zip(groups, _in_parallel(lambda item: pull_one(*item), list(groups.items()))))
        except (RuntimeError, wire.WireError) as exc:
            if not self._closed.is_set():
                self.rt.fail(str(exc))
            return
        c_global = min(b.header.pull.c_global for b in bundles.values())
        for bundle in bundles.values():
            for (key, value), clock in zip(bundle.tensors, bundle.header.pull.own_clock):
                values[key], own[key] = value, int(clock)
        if self._hold_pull_s > 0 and self._closed.wait(self._hold_pull_s):  # the reply crosses the network
            return
        self._observe.pull.observe(time.perf_counter() - started)
        with self._lock:
            self._pending = _Pulled(values, own, int(c_global), min_clock, sent, time.time())
        self.rt.wake()
