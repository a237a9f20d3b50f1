"""Wave Synchronous Parallel for one stage: push each wave's summed update (G1), pull by G2,
merge by G3. The rules are hetpipe/wsp.py's; this is the thin driver that talks to the shards."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from hetpipe import rpc, security, shm, wire
from hetpipe.buffers import raw_bytes
from hetpipe.v1 import ps_pb2, wire_pb2
from hetpipe.wsp import (NARROWED_PUSH, g2_decision, merge_pulled, required_min_clock, shard_bound,
                         total_waves, unpulled, wave_of, waves_included)
from stage_worker import host_copies
from stage_worker.sync import SyncCallbacks, SyncConfig, Weights, in_parallel
from stage_worker.sync_record import SyncRecord

log = logging.getLogger(__name__)

PUSH_GIVE_UP_S = 120.0   # long enough for a shard to be restarted from its checkpoint
PULL_GIVE_UP_S = 600.0   # a pull may wait this long for the slowest VW
PULL_CALL_S = 30.0       # one pull call's deadline; retried until PULL_GIVE_UP_S
R = TypeVar("R")
# A bf16 job pushes its float32 wave sums in bfloat16: half the bytes on every copy, log write and
# scan of a push. The rounding is lost, as in ddp's bf16 allreduce (its bf16 compress hook); the
# stage's own weights keep every update whole, and the shard adds the rounded sum to its float32
# w_global. Pulls stay float32: w_global is the master copy.
PUSH_DTYPES: dict[str, torch.dtype | None] = {"": None, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class _Pulled:
    values: dict[int, torch.Tensor]   # parameter index -> the value received
    # Replies whose bytes are still in their shard's pull slot, with their parameters' indices:
    # copied from there straight into the weights (the slot stays until this VW pulls again).
    slots: list[tuple[wire.Stream, list[int]]]
    own_clock: list[int]
    c_global: int
    min_clock: int
    sent: float      # wall-clock times, for the sync trace
    answered: float  # the last shard's reply in (before it is received: copied, onto a GPU)
    replied: float


class WspSync:
    """The stage's side of WSP. The compute thread calls every public method; the pusher and
    puller threads only talk gRPC and hand pull results over through `_pending`."""

    def __init__(self, config: SyncConfig, callbacks: SyncCallbacks, params: Sequence[torch.Tensor]) -> None:
        if config.push_dtype not in PUSH_DTYPES:
            raise ValueError(f"push_dtype {config.push_dtype!r}: one of {sorted(PUSH_DTYPES)}")
        self._push_dtype = PUSH_DTYPES[config.push_dtype]
        self.cfg, self.cb = config, callbacks
        self.keys = list(config.keys)
        self.shard_of = dict(zip(self.keys, config.key_shards))
        self._channels = [rpc.channel(addr) for addr in config.addresses]
        self._stubs = [rpc.Stub(ch, "ParameterServer") for ch in self._channels]
        # A shard on this host: pushes through a ring of ours, pull replies through one of its own.
        shared = config.shared_memory or (False,) * len(config.addresses)
        self._rings = [shm.Ring(slots=1) if on else None for on in shared]  # one push at a time per shard
        self._reader = shm.Reader()
        self._params = [p.detach() for p in params]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._on_gpu = self._device.type == "cuda"   # pulls land in pinned memory and move to the GPU
        # ... or reach it by DMA straight from the shard's slot, where the driver pins it
        self._pins = host_copies.PinnedSlots(self._reader, self._device) if self._on_gpu else None
        self.total_waves = total_waves(config.steps, config.nm)
        self._acc: dict[int, list[torch.Tensor]] = {}   # own wave -> summed updates not yet in w_global
        self._spares: list[list[torch.Tensor]] = []     # updates' buffers no longer read (spare_update)
        self._clock = 0
        self._have = 0             # c_global the local weights are known to include
        self._lock = threading.Lock()
        self._pending: _Pulled | None = None
        self._pulling: int | None = None   # min_clock of the pull in flight
        self._wait_started: float | None = None
        self._wait_seconds = 0.0
        # The blocking wait under way, for the sync trace: (p, min_clock it needs, wall-clock start).
        self._wait_traced: tuple[int, int, float] | None = None
        self._acked_waves = 0
        self._failure: str | None = None   # why a push or pull gave up
        self._closed = threading.Event()
        # Wave, its sum, the event after the kernels that made it (a GPU stage's), when queued.
        self._pushes: queue.Queue[tuple[int, list[torch.Tensor], Any, float] | None] = queue.Queue()
        self.record = SyncRecord(config.trace_dir, config.trace_name, self.keys, params, ledger=config.ledger)
        self._rng = random.Random(hash((config.seed, config.vw, config.trace_name, "push")))
        self._pusher = self._start("pusher", self._push_loop)
        # One thread for every pull, fed a min_clock at a time, as the pusher is fed waves: a
        # thread started per pull made thousands in a run, each start waited for by the compute
        # thread (Thread.start returns once the new thread runs).
        self._pulls: queue.Queue[int | None] = queue.Queue()
        self._start("puller", self._pull_loop)

    def initialise(self, virtual_workers: int, values: Sequence[torch.Tensor]) -> None:
        """Gives this stage's shards their keys' initial values (VW 0's stages do, while loading)."""
        for shard, idx in self._by_shard().items():
            tag = wire_pb2.InitTag(virtual_workers=virtual_workers, shard=shard, sync=self.cfg.sync,
                                   quorum=self.cfg.quorum, alpha=self.cfg.alpha, period=self.cfg.period,
                                   total_waves=self.total_waves, **shard_bound(self.cfg.sync, self.cfg.D))
            tensors = [(self.keys[i], values[i].detach().cpu()) for i in idx]
            stub = self._stubs[shard]
            # The seed credential: a stage's own token may push and pull, not (re)initialise a shard.
            seed = security.role_metadata(security.SEED, f"vw{self.cfg.vw}")
            self._retrying(f"init of {len(idx)} keys", shard, PUSH_GIVE_UP_S,
                           lambda: stub.Init(wire.encode(tensors, init=tag), timeout=rpc.DATA_DEADLINE_S,
                                             metadata=seed))

    def pull_now(self, weights: Weights, min_clock: int) -> None:
        """Merges w_global at c_global >= min_clock before it returns (the final evaluation's
        weights: every VW's last push included). RuntimeError if the shards cannot answer."""
        if not self.keys:  # parameter-free layers: nothing to merge (and no shard to ask)
            return
        while self._have < min_clock:
            self._request(min_clock)
            while True:
                with self._lock:
                    if self._pending is not None:
                        break
                if self._failure is not None or self._closed.is_set():
                    raise RuntimeError(self._failure or "closed while waiting for w_global")
                time.sleep(0.005)
            self.apply_pending(weights)

    # ---- called by the compute thread -------------------------------------------------------

    def forward_allowed(self, p: int) -> bool:
        if not self.keys:
            return True
        decision = g2_decision(p, self.cfg.nm, self.cfg.D, self.cfg.steps, self._have)
        if not decision.allowed:
            with self._lock:
                if self._wait_started is None:
                    self._wait_started = time.monotonic()
                    self._wait_traced = (p, decision.pull or 0, time.time())
        if decision.pull is not None:
            self._request(decision.pull)
        return decision.allowed

    def _request(self, min_clock: int) -> None:
        """Starts a pull for min_clock unless one is under way or waiting to be merged."""
        with self._lock:
            if self._pulling is None and self._pending is None:
                self._pulling = min_clock
                self._pulls.put(min_clock)

    @property
    def waiting(self) -> bool:
        return self._wait_started is not None

    def after_update(self, p: int, update: list[torch.Tensor]) -> None:
        wave = wave_of(p, self.cfg.nm)
        acc = self._acc.get(wave)
        if acc is None:
            self._acc[wave] = update  # ours (Sync.after_update): no copy
        else:
            if acc:
                torch._foreach_add_(acc, update)
            self._recycle(update)

    def spare_update(self) -> list[torch.Tensor] | None:
        return self._spares.pop() if self._spares else None

    def _recycle(self, update: list[torch.Tensor]) -> None:
        """update's buffers for a later step's update; two sets at most."""
        if len(self._spares) < 2:
            self._spares.append(update)

    def on_wave_end(self, wave: int) -> None:
        self._clock = wave + 1
        if self.keys:
            # The wave's sum is final: the pusher reads it while merges (G3) may read it too,
            # and nothing writes it again, so it needs no copy.
            update = self._acc[wave]
            self._pushes.put((wave, update, host_copies.marker(update), time.time()))

    def apply_pending(self, weights: Weights) -> None:
        with self._lock:
            pulled, self._pending = self._pending, None
        if pulled is None:
            return
        if pulled.slots:
            weights.overwrite(lambda params: self._merge_into(params, pulled))
        else:
            values = [pulled.values[i].to(weights.device) for i in range(len(self.keys))]
            weights.set_weights(merge_pulled(values, pulled.own_clock, self._acc))
        self._have = max(self._have, pulled.c_global)
        self.record.write({"event": "pull", "min_clock": pulled.min_clock, "c_global": pulled.c_global,
                          "sent": pulled.sent, "answered": pulled.answered, "replied": pulled.replied,
                          "merged": time.time()})
        included = waves_included(pulled.own_clock)
        for wave in [w for w in self._acc if w < included]:
            done = self._acc.pop(wave)
            if wave < self._acked_waves:   # its pusher is done with it too (a pull may overtake the ack)
                self._recycle(done)
        need = required_min_clock(self.cb.next_forward(), self.cfg.nm, self.cfg.D, self.cfg.steps)
        with self._lock:
            self._pulling = None
            if self._wait_started is not None and need <= self._have:
                self._wait_seconds += time.monotonic() - self._wait_started
                self._wait_started = None
                waited, self._wait_traced = self._wait_traced, None
            else:
                waited = None
        if waited is not None:  # a forward was blocked on G2 from start until this merge let it go
            self.record.write({"event": "pull_wait", "p": waited[0], "min_clock": waited[1], "start": waited[2],
                              "end": time.time(), "c_global": self._have})

    def _merge_into(self, params: list[torch.Tensor], pulled: _Pulled) -> None:
        """G3 in place: w_global as pulled, copied into the weights (from the pull slots, one copy
        where receiving and then setting took two), plus the own waves it lacks."""
        for stream, idx in pulled.slots:
            try:
                wire.fill(stream, [raw_bytes(params[i]) for i in idx])
            except wire.WireError as exc:   # the shard keeps a slot until this VW pulls again: a broken promise
                raise RuntimeError(f"pull reply for min_clock {pulled.min_clock} changed while it was merged, the "
                                   f"weights are no longer whole: {exc}") from None
        for i, value in pulled.values.items():
            params[i].copy_(value)
        for i, param in enumerate(params):
            for update in unpulled(i, pulled.own_clock, self._acc):
                param.add_(update)

    @property
    def min_clock(self) -> int:
        return self._have

    @property
    def clock(self) -> int:
        return self._clock

    @property
    def shm_bytes(self) -> int:
        return sum(r.bytes_written for r in self._rings if r is not None) + self._reader.bytes_read

    @property
    def wait_seconds(self) -> float:
        with self._lock:
            ongoing = time.monotonic() - self._wait_started if self._wait_started is not None else 0.0
            return self._wait_seconds + ongoing

    def finished(self) -> bool:
        return not self.keys or self._acked_waves == self.total_waves

    @property
    def acked_waves(self) -> int:
        # A stage without keys (its layers have no trained parameters) pushes nothing: each wave
        # it completes is as good as acknowledged, or a checkpoint's cut would wait for it forever.
        return self._acked_waves if self.keys else self._clock

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (nothing is in flight at a cut): the clocks, the own waves not
        yet seen in a pull (G3 adds them to the next one), and the ledger (output.ledger; else None)."""
        return {"clock": self._clock, "have": self._have, "acked_waves": self._acked_waves,
                "acc": {str(w): [t.cpu() for t in ts] for w, ts in self._acc.items()},
                "ledger": self.record.state()}

    def restore(self, state: dict[str, Any], device: str) -> None:
        self._clock, self._have = int(state["clock"]), int(state["have"])
        self._acked_waves = int(state["acked_waves"])
        self._acc = {int(w): [t.to(device) for t in ts] for w, ts in state["acc"].items()}
        self.record.restore(state["ledger"])

    def interrupt(self) -> None:
        self._closed.set()   # what close() begins with: pull_now and the retries give up

    def close(self) -> None:
        self._closed.set()
        self._pushes.put(None)
        self._pulls.put(None)   # a pull under way ends with the channels, below: not joined
        # The channels before the join: they end a push the shard holds back (G4, for a slower
        # VW), which the pusher would wait on past the join and the launcher's grace.
        for ch in self._channels:
            ch.close()
        self._pusher.join(timeout=5)
        for ring in self._rings:
            if ring is not None:
                ring.close()
        if self._pins is not None:
            self._pins.close()
        self.record.close()

    # ---- background threads -------------------------------------------------------------------

    def _by_shard(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, key in enumerate(self.keys):
            out.setdefault(self.shard_of[key], []).append(i)
        return out

    def _retrying(self, what: str, shard: int, give_up_s: float, call: Callable[[], R]) -> R:
        """call() with rpc.retrying's rule while the shard is down or slow; RuntimeError naming
        the shard and what was asked once it gives up."""
        try:
            return rpc.retrying(call, give_up_s=give_up_s, closing=self._closed,
                                on_retry=lambda exc: log.warning("%s to shard %d: %s; retrying", what, shard,
                                                                 exc.code().name))
        except grpc.RpcError as exc:
            raise RuntimeError(f"{what} to ps shard {shard} at {self.cfg.addresses[shard]} failed: "
                               f"{exc.code().name}: {exc.details()}") from None

    def _start(self, name: str, work: Callable[..., None], *args: Any) -> threading.Thread:
        """A daemon thread that runs work(*args) and fails the stage with whatever it raises, so
        that none ends silently while the compute thread waits for it."""
        thread = threading.Thread(target=self._guarded, args=(name, work, *args), name=name, daemon=True)
        thread.start()
        return thread

    def _guarded(self, name: str, work: Callable[..., None], *args: Any) -> None:
        try:
            work(*args)
        except Exception as exc:
            if self._closed.is_set():  # a call cut short by closing is not a failure
                return
            if isinstance(exc, (RuntimeError, wire.WireError)):
                message = str(exc)  # a shard call that failed: _retrying's or the wire's message names it
            else:
                log.exception("%s thread failed", name)
                message = f"{name}: {type(exc).__name__}: {exc}"
            self._failure = message
            self.cb.on_failure(message)

    def _push_loop(self) -> None:
        groups = self._by_shard()
        while (item := self._pushes.get()) is not None:
            wave, update, made, queued = item
            started, start_wall = time.perf_counter(), time.time()
            sent = self._on_wire(update, made)
            batches = {shard: [(self.keys[i], sent[i]) for i in idx] for shard, idx in groups.items()}
            if self.cfg.push_hold_s > 0 and self._closed.wait(self.cfg.push_hold_s):
                return
            self.record.in_flight(sent)
            reached = in_parallel(lambda item: self._push(item[0], wave, item[1]), list(batches.items()))
            self.cb.observe_push(time.perf_counter() - started)
            self.record.write({"event": "push", "wave": wave, "queued": queued, "start": start_wall, "end": time.time()})
            self.record.acknowledged(sent)   # what the shards got
            self._acked_waves = wave + 1
            if self.cfg.sync == "quorum" and reached and min(reached) > self._have:
                # No G4 bounds a slow VW under a quorum of fewer than all: the fast ones close rounds
                # that G2 would not pull for until its own clock got there, while its wave sums piled
                # up (each the stage's size) and it trained on ever older weights. Pulled at once.
                self._request(min(reached))
            self.cb.wake()

    def _on_wire(self, update: list[torch.Tensor], made: Any) -> list[torch.Tensor]:
        """The wave's sum as pushed, on the host: rounded on its device first (a GPU's copy to the
        host moves the narrower bytes), and from a GPU into pinned memory on a side stream once
        the kernels that made it (`made`) are done, without waiting for the compute stream."""
        host, ready = host_copies.to_host(update, "push", after=made, cast=self._narrowed)
        if ready is not None:
            ready.synchronize()
        return host

    def _narrowed(self, u: torch.Tensor) -> torch.Tensor:
        """u in the push dtype where NARROWED_PUSH allows it (a bf16 job's float32 sums), else u."""
        if self._push_dtype is not None and NARROWED_PUSH.get(u.dtype) == self._push_dtype:
            return u.to(self._push_dtype)
        return u

    def _push(self, shard: int, wave: int, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """G1: one wave's update to one shard, retried until acknowledged; the shard's c_global then."""
        tag = wire_pb2.PushTag(vw=self.cfg.vw, clock=wave)
        stub, ring = self._stubs[shard], self._rings[shard]

        def call() -> ps_pb2.PushReply:
            reply: ps_pb2.PushReply = rpc.send_bundle(stub, "Push", wire.encode(tensors, push=tag, ring=ring),
                                                      timeout=rpc.DATA_DEADLINE_S)
            return reply

        reply = self._retrying(f"push of wave {wave}", shard, PUSH_GIVE_UP_S, call)
        if self.cfg.repeat_push and self._rng.random() < self.cfg.repeat_push:
            # Fault injection: the retry a lost acknowledgement would cause must be a no-op.
            reply = self._retrying(f"repeated push of wave {wave}", shard, PUSH_GIVE_UP_S, call)
            if not reply.duplicate:
                raise RuntimeError(f"ps shard {shard} applied a repeated push of wave {wave} twice")
        return int(reply.c_global)

    def _pull_loop(self) -> None:
        while (min_clock := self._pulls.get()) is not None:
            self._pull(min_clock)

    def _pull(self, min_clock: int) -> None:
        started, sent = time.perf_counter(), time.time()
        answered: list[float] = []   # each shard's reply in, for the trace

        def pull_one(shard: int, idx: list[int]) -> wire.Bundle | wire.Stream:
            request = ps_pb2.PullRequest(vw=self.cfg.vw, keys=[self.keys[i] for i in idx], min_clock=min_clock,
                                         shm=self._rings[shard] is not None)
            stub = self._stubs[shard]

            def call() -> wire.Bundle | wire.Stream:
                try:
                    if request.shm:   # the reply read to its end here: merging it waits on no call
                        frames = list(stub.Pull(request, timeout=PULL_CALL_S))
                        answered.append(time.time())
                        return self._held(wire.read(frames, self._reader), idx)
                    bundle = wire.decode(stub.Pull(request, timeout=PULL_CALL_S), reader=self._reader,
                                         pinned=self._on_gpu)
                    answered.append(time.time())
                    return bundle
                except wire.WireError as exc:
                    if not request.shm or exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    # The shard reused the slot while we copied it out (it answers pulls in turn
                    # from a small ring): ask again, this time in gRPC frames.
                    log.warning("pull reply from shard %d: %s; pulling again over gRPC", shard, exc)
                    request.shm = False
                    bundle = wire.decode(stub.Pull(request, timeout=PULL_CALL_S), pinned=self._on_gpu)
                    answered.append(time.time())
                    return bundle

            return self._retrying(f"pull for min_clock {min_clock}", shard, PULL_GIVE_UP_S, call)

        groups = list(self._by_shard().items())
        replies = in_parallel(lambda item: pull_one(*item), groups)
        c_global = min(r.header.pull.c_global for r in replies)
        index = {key: i for i, key in enumerate(self.keys)}
        values: dict[int, torch.Tensor] = {}
        slots: list[tuple[wire.Stream, list[int]]] = []
        own: dict[str, int] = {}
        for reply in replies:
            names = [m.name for m in reply.header.tensors]
            own.update(zip(names, (int(c) for c in reply.header.pull.own_clock)))
            if isinstance(reply, wire.Stream):
                slots.append((reply, [index[name] for name in names]))
            else:
                values.update((index[key], value) for key, value in reply.tensors)
        if values and self._on_gpu:   # here, not on the compute thread (apply_pending)
            values = dict(zip(values, host_copies.to_device(list(values.values()), self._device, "pull")))
        if self.cfg.pull_hold_s > 0 and self._closed.wait(self.cfg.pull_hold_s):  # the reply crosses the network
            return
        self.cb.observe_pull(time.perf_counter() - started)
        with self._lock:
            self._pending = _Pulled(values, slots, [own[k] for k in self.keys], int(c_global), min_clock, sent,
                                    max(answered, default=sent), time.time())
        self.cb.wake()

    def _held(self, stream: wire.Stream, idx: list[int]) -> wire.Bundle | wire.Stream:
        """A pull reply in the shard's slot, left there for apply_pending to copy into the weights,
        where they can take its bytes as they are (on the CPU, same dtypes and shapes, in the
        order asked); received now otherwise."""
        params = [self._params[i] for i in idx]
        fits = [m.name for m in stream.header.tensors] == [self.keys[i] for i in idx] and all(
            p.device.type == "cpu" and p.is_contiguous() and (p.dtype, list(p.shape)) == (dtype, shape)
            for p, (dtype, shape, _) in zip(params, stream.specs))
        if fits and stream.gpu is None and len(params) == len(stream.specs):
            return stream
        if self._pins is not None and stream.shared_memory:   # on the GPU already: the merge's to_device passes it
            return wire.Bundle(stream.header, list(zip(stream.names, self._pins.receive(stream))))
        return wire.receive(stream, pinned=self._on_gpu)
