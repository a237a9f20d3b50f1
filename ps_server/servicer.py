"""gRPC handlers of the ParameterServer service: protobuf <-> Shard, with pulls that wait."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import torch

from hetpipe import devices, shm, wire
from hetpipe.errors import Rejected
from hetpipe.outputs import write_text_atomically
from hetpipe.rpc import handler
from hetpipe.service import exit_now
from hetpipe.v1 import ps_pb2, wire_pb2
from ps_server.durability import Durability, Snapshot
from ps_server.metrics import ShardSnapshot
from ps_server.pull_slots import Claim, PullSlots
from ps_server.headroom import push_sizes
from ps_server.shard import Shard, Sums
from ps_server.sync_rule import ShardError, SyncRule
from ps_server.trace import ShardTrace

R = TypeVar("R")
log = logging.getLogger(__name__)

_CODES = {
    ShardError.Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ShardError.Kind.NOT_OWNED: grpc.StatusCode.NOT_FOUND,
    ShardError.Kind.CLOCK: grpc.StatusCode.FAILED_PRECONDITION,
    ShardError.Kind.NOT_READY: grpc.StatusCode.FAILED_PRECONDITION,
    ShardError.Kind.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    ShardError.Kind.MODE: grpc.StatusCode.FAILED_PRECONDITION,
    ShardError.Kind.OVERFLOW: grpc.StatusCode.INVALID_ARGUMENT,
}


def _payload_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _rejected(exc: ShardError) -> Rejected:
    return Rejected(_CODES[exc.kind], str(exc))


def _sync_rule(tag: wire_pb2.InitTag) -> SyncRule:
    """The InitTag's sync fields, those of its mode only (an unknown mode is refused by check_init)."""
    mode = tag.sync or "wsp"
    D = tag.distance_bound if tag.HasField("distance_bound") else None   # refused by check_init but for wsp
    if mode == "quorum":
        return SyncRule(mode, quorum=tag.quorum, total_waves=tag.total_waves, D=D)
    if mode == "elastic":
        return SyncRule(mode, alpha=tag.alpha, period=tag.period, total_waves=tag.total_waves, D=D)
    return SyncRule(mode, exact=tag.exact, D=D)


class ShardServicer:
    def __init__(self, shard: Shard, durability: Durability | None, *, max_pull_wait_s: float = 600.0,
                 trace_dir: str = "") -> None:
        self.shard = shard
        self.durability = durability
        self.max_pull_wait_s = max_pull_wait_s
        self.restored_pushes = 0
        self._cv = threading.Condition()
        # Keys whose accepted pushes are being added to w_global outside the lock (Shard.accept,
        # then add): nothing reads or adds to them meanwhile. quiet() waits for none at all.
        self._adding: set[str] = set()
        # Keys whose values pulls are copying into their slots outside the lock: nothing changes
        # them meanwhile (a push's add, an exchange, an Init, an Evict). A count per key.
        self._reading: Counter[str] = Counter()
        self._quieting = 0   # threads in quiet(): no new add or slot write starts until they are done
        self.pull_wait_seconds = 0.0
        self.received_bytes = 0  # push payloads
        self.sent_bytes = 0      # pull payloads
        self.index: int | None = None  # this shard's place in the plan, from Init (the `shard` label)
        self.trace = ShardTrace(trace_dir)  # written under self._cv, which every push and pull holds anyway
        self.reader = shm.Reader()  # pushes from stages on this host
        self.pull_slots = PullSlots()  # pull replies to stages on this host
        self._unsaved = False  # an Init or Evict is in memory but its checkpoint failed
        # Writes the checkpoints that pushes capture, in turn, after their pushes are answered; one
        # at a time: a push captures none while the last is still to be written (each holds a copy
        # of every value, and a slow disk would queue them without end).
        self._checkpoint_writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._checkpoint_pending = False

    def _index_path(self) -> Path | None:
        return None if self.durability is None else self.durability.dir / "shard_index"

    def restore(self) -> None:
        if self.durability is not None:
            with self._cv:
                self.restored_pushes = self.durability.restore(self.shard)
                path = self._index_path()
                if path is not None and path.exists():  # a restart: Init came before it
                    self.index = int(path.read_text())
                    self.trace.open(self.index, append=True)

    def flush_trace(self) -> None:
        with self._cv:
            self.trace.flush()

    def checkpoints_written(self) -> None:
        """Returns once every checkpoint captured so far is written (or failed, with a warning)."""
        self._checkpoint_writer.submit(lambda: None).result()

    def checkpoint(self) -> None:
        """The last checkpoint, at shutdown: it covers the whole log, whose files are deleted."""
        if self.durability is not None:
            self.checkpoints_written()
            with self._cv:
                self.quiet()
                self.durability.checkpoint(self.shard)
                self.durability.close()

    def discard(self) -> None:
        """Deletes the shard's durable state (checkpoint, log, index): its job is over. No push
        logs or captures a checkpoint after it (one still running fails on the missing log)."""
        with self._cv:
            durability, index = self.durability, self._index_path()
            self.durability = None
        if durability is not None and index is not None:
            self.checkpoints_written()
            durability.discard()
            index.unlink(missing_ok=True)

    def _checkpoint_change(self, fresh: bool) -> None:
        """Init and Evict are acknowledged once a checkpoint holds them. Their retries change
        nothing, so a change whose checkpoint failed is checkpointed by the retry."""
        if self.durability is not None and (fresh or self._unsaved):
            self._unsaved = True
            self.durability.checkpoint(self.shard)
            self._unsaved = False

    def quiet(self) -> None:
        """Returns once no push's sums are being added and no pull's slot written outside the lock,
        for a reader of every key (a snapshot, a digest) or a change of all of them. The caller
        holds self._cv; no new add or write starts until it lets go, and those under way need no
        lock to finish."""
        self._quieting += 1
        try:
            self._cv.wait_for(lambda: not self._adding and not self._reading)
        finally:
            self._quieting -= 1
            if not self._quieting:
                self._cv.notify_all()   # pushes held back by it

    def _check_init(self, stream: wire.Stream) -> None:
        if stream.header.WhichOneof("header") != "init":
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "Init: first frame lacks the init tag")
        try:
            self.shard.check_init(stream.header.init.virtual_workers, _sync_rule(stream.header.init))
        except ShardError as exc:
            raise _rejected(exc) from None

    def _check_update(self, stream: wire.Stream, kind: str) -> None:
        """Everything a push or an exchange is refused for that its header shows, before its
        tensors arrive."""
        if stream.header.WhichOneof("header") != kind:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{kind.capitalize()}: first frame lacks the {kind} tag")
        metas = [(name, dtype, tuple(shape)) for name, (dtype, shape, _) in zip(stream.names, stream.specs)]
        check = self.shard.check_push if kind == "push" else self.shard.check_exchange
        # Without the lock, so that a push is logged while another is applied: the check reads
        # what only Init and Evict change, a lookup at a time, and the apply checks again under it.
        try:
            check(getattr(stream.header, kind).vw, metas)
        except ShardError as exc:
            raise _rejected(exc) from None

    @handler
    def Init(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> wire_pb2.Ack:
        bundle = wire.decode(request_iterator, check=self._check_init)
        index = int(bundle.header.init.shard)
        with self._cv:
            if self.index is not None and index != self.index:   # each stage of VW 0 inits its own keys
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"Init as ps shard {index}: this shard is "
                                                               f"already initialised as ps shard {self.index}")
            self.quiet()
            try:
                fresh = self.shard.init(bundle.header.init.virtual_workers, bundle.tensors,
                                        list(bundle.header.init.clocks), _sync_rule(bundle.header.init))
            except ShardError as exc:
                raise _rejected(exc) from None
            self._checkpoint_change(fresh)
            self.index = index
            self.trace.open(self.index, append=False)
            path = self._index_path()
            if path is not None:
                write_text_atomically(path, f"{self.index}\n", durable=True)  # read by every restart
        return wire_pb2.Ack(message="initialised" if fresh else "already initialised")

    def _update(self, kind: str, request_iterator: Iterator[bytes],
                apply: Callable[..., tuple[bool, R, Sums | None]], wait_s: float = 0.0) -> R:
        """A push or an exchange: decoded and checked, then apply(tag, tensors, journal, sizes) under
        the lock, which answers (whether it was new, the reply, and a push's sums still to add:
        added outside the lock, so that pushes and pulls of other keys go on); checkpointed when
        due, traced. sizes: a push's magnitudes (headroom.push_sizes), None for an exchange. wait_s:
        how long a push that G4 holds back may wait for the slower VWs (Shard.held_back)."""
        received = time.time()
        stream = wire.read(request_iterator, self.reader)
        self._check_update(stream, kind)
        tag = getattr(stream.header, kind)
        durability = self.durability
        # Logged before it is applied: an acknowledged update survives a kill -9, and one whose log
        # write failed is not applied (so its retry is no "duplicate"). Under WSP a push is logged
        # before the lock, so that concurrent pushes write their logs at once: sums commute, so
        # the order of entries does not matter; it is fsynced after the lock (Durability). It is
        # logged as it arrives, and applied from its entry, which nothing holds on to after the
        # apply (its file may become a spare, written over). Quorum rounds keep their pushes, and
        # they and elastic exchanges log in order, once validated, under the lock, on disk.
        logged: int | None = None
        journal: Callable[[], None] | None = None
        if durability is not None and kind == "push" and self.shard.rule.mode == "wsp":
            logged, tensors = durability.log_stream(tag.vw, tag.clock, stream)
            # Its place in the order of applies, which restore replays, once the shard has checked
            # it, right before the apply: a refused push gets none, and replay asks G4 again only
            # of entries without one (Shard.accept's applied_before).
            journal = functools.partial(durability.place, logged)
        else:
            tensors = wire.receive(stream).tensors
        stamps = {"arrived": time.time()}   # for the trace: its bytes all in (and logged, where logged here)
        if durability is not None and logged is None:
            write = durability.journal_push if kind == "push" else durability.journal_exchange
            journal = lambda: write(tag.vw, tag.clock, tensors)  # noqa: E731
        applied = False
        try:
            # The scan for NaN and for the overflow bound reads the push alone: here, before the
            # lock, so that concurrent pushes (every VW's, every stage's) are scanned at once.
            sizes = push_sizes(tag.vw, tag.clock, tensors) if kind == "push" else None
            stamps["scanned"] = time.time()
        except ShardError as exc:
            if logged is not None and durability is not None:
                durability.settle(logged, applied=False)
            raise _rejected(exc) from None
        keys = set(stream.names)
        sums: Sums | None = None
        with self._cv:
            if kind == "push":
                # G4 lets it in once the slower VWs push (a stage's G2 wait makes that the rule only
                # after a restart stepped c_global back); past the pulls' wait, shard.push refuses it.
                # First: c_global only grows while this process lives, so the wait below stays enough.
                self._cv.wait_for(lambda: not self.shard.held_back(tag.vw, tag.clock, keys), timeout=wait_s)
            # After the adds of these keys already under way: a key's sums go in one at a time, in
            # the order of their places in the log, which restore replays. And after the pulls
            # copying these keys out: their slots take the values as they were answered.
            self._cv.wait_for(lambda: not self._quieting and self._adding.isdisjoint(keys)
                              and self._reading.keys().isdisjoint(keys))
            start = time.time()
            try:
                applied, reply, sums = apply(tag, tensors, journal, sizes)
                if sums is not None and not sums.adds:
                    sums = None   # nothing left to add: a quorum round keeps the push
            except ShardError as exc:
                raise _rejected(exc) from None
            finally:
                if logged is not None and durability is not None and sums is None:
                    durability.settle(logged, applied=applied)
            held = time.time()
            captured = None
            if sums is None:
                captured = self._done(kind, tag.vw, tag.clock, applied, (start, held), received, tensors, **stamps)
            else:
                self._adding |= sums.keys
        if sums is not None:
            # The adds, a pass over these keys' values, outside the lock (py-spy of a 2x2 GPT: a push
            # waited longer for the lock than it held it, mostly behind the adds of other keys).
            try:
                self.shard.add(sums)
            except BaseException:
                # Its clocks count it and its sums are half in: no state to serve from. Its entry,
                # placed and not settled, stays in the log, and a restart replays it, once.
                log.critical("ps shard %s: adding the push of vw %d for clock %d failed; exiting so that a "
                             "restart replays it from the log", self.index, tag.vw, tag.clock, exc_info=True)
                exit_now(70)
                raise
            with self._cv:
                self._adding -= sums.keys
                if logged is not None and durability is not None:
                    durability.settle(logged, applied=True)   # its entry is read no more
                captured = self._done(kind, tag.vw, tag.clock, applied, (start, held), received, tensors,
                                      added=time.time(), **stamps)
        try:
            if logged is not None and durability is not None and not stream.shared_memory:
                # On disk before the acknowledgement, the pulls it released already on their way; a
                # duplicate waits for its original's entry, which may still be on the way to disk.
                # A push through shared memory comes from this machine: its entry, whole in the page
                # cache, survives a kill -9 of the shard, and a restart of the machine, which would
                # lose it, ends the pusher too. So it is acknowledged without waiting for the disk,
                # which for a large model limited the clock rate (236 MB a clock on an H100's host).
                durability.sync(logged if applied else None)
        finally:
            if captured is not None and durability is not None:
                # Outside the lock, and after this push is answered: a checkpoint holds every key
                # (236 MB a shard for the 117.8M GPT, every tenth clock), and the push is safe without
                # it, in the log, whose entries stay until a checkpoint that covers them is written.
                # Whatever the sync did: the next capture waits for this one's write.
                self._checkpoint_writer.submit(self._write_checkpoint, durability, captured)
        return reply

    def _done(self, kind: str, vw: int, clock: int, applied: bool, held: tuple[float, float], received: float,
              tensors: list[tuple[str, torch.Tensor]], **added: float) -> Snapshot | None:
        """An update's end, under the lock: a checkpoint captured if one is due (returned, for the
        checkpoint thread), the trace's line (start..end: its time under the lock; `added`: when a
        push's sums were in, after it; before it `arrived`, its bytes all in and logged, and
        `scanned`, a push's NaN and overflow scan done), and the pulls waiting on it woken."""
        captured = None
        if (applied and self.durability is not None and not self._checkpoint_pending
                and self.durability.capture_due(self.shard)):
            self.quiet()
            captured = self.durability.capture(self.shard)
            self._checkpoint_pending = captured is not None
        self._cv.notify_all()  # pulls wait on pushes, the final pulls on every VW's last exchange
        payload = _payload_bytes(tensors)
        self.received_bytes += payload
        self.trace.record(kind, vw, clock, *held, received=received, duplicate=not applied,
                          checkpoint=captured is not None, bytes=payload, **added)
        return captured

    def _write_checkpoint(self, durability: Durability, snapshot: Snapshot) -> None:
        try:
            durability.write(snapshot)
        except Exception as exc:   # the log still holds every entry: the next checkpoint covers them
            log.warning("checkpoint covering log entry %s not written: %s", snapshot.covered, exc,
                        exc_info=not isinstance(exc, OSError))
        finally:
            with self._cv:
                self._checkpoint_pending = False

    @handler
    def Push(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushReply:
        def push(tag: wire_pb2.PushTag, deltas: list[tuple[str, torch.Tensor]], journal: Callable[[], None] | None,
                 sizes: dict[str, float] | None) -> tuple[bool, ps_pb2.PushReply, Sums | None]:
            sums = self.shard.accept(tag.vw, tag.clock, deltas, journal=journal, sizes=sizes)
            return sums is not None, ps_pb2.PushReply(duplicate=sums is None, c_global=self.shard.c_global()), sums

        return self._update("push", request_iterator, push, self._wait_budget(context))

    @handler
    def PushFrame(self, request: bytes, context: grpc.ServicerContext) -> ps_pb2.PushReply:
        return self.Push(iter([request]), context)  # type: ignore[no-any-return]

    @handler
    def Exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """sync elastic: a VW's replica values in, delta = alpha * (replica - master) out (and into the master)."""
        def exchange(tag: wire_pb2.ExchangeTag, replica: list[tuple[str, torch.Tensor]],
                     journal: Callable[[], None] | None, _: None) -> tuple[bool, Iterator[bytes], None]:
            result = self.shard.exchange(tag.vw, tag.clock, replica, journal=journal)
            self.sent_bytes += _payload_bytes(result.deltas)
            reply = wire_pb2.ExchangeTag(vw=tag.vw, clock=tag.clock, duplicate=not result.applied)
            return result.applied, wire.encode(result.deltas, exchange=reply), None

        return self._update("exchange", request_iterator, exchange)

    @handler
    def Evict(self, request: ps_pb2.EvictRequest, context: grpc.ServicerContext) -> wire_pb2.Ack:
        with self._cv:
            self.quiet()   # a quorum round may close, adding to the values
            try:
                fresh = self.shard.evict(request.vw)
            except ShardError as exc:
                raise _rejected(exc) from None
            except BaseException:
                # Marked evicted, with its released waves taken from the hold and half added: no
                # state to serve from, nor one a retry ("evicted already") would checkpoint. The
                # restart replays the log without the eviction, and the coordinator's retry evicts.
                log.critical("ps shard %s: evicting vw %d failed; exiting so that a restart replays the log",
                             self.index, request.vw, exc_info=True)
                exit_now(70)
                raise
            self.pull_slots.release(request.vw)  # it pulls no more: no slot stays pinned for it
            self._checkpoint_change(fresh)  # a restarted shard must not wait for it again
            self._cv.notify_all()  # pulls waiting on its clock may now be answered
        return wire_pb2.Ack(message=f"vw {request.vw} evicted" if fresh else f"vw {request.vw} was evicted already")

    def _wait_budget(self, context: grpc.ServicerContext) -> float:
        """How long a call may wait for the slower VWs: max_pull_wait_s, and a little less than the
        caller's deadline, so that it gets this shard's answer (naming c_global) instead of racing
        its own bare "Deadline Exceeded"."""
        remaining = context.time_remaining()
        if remaining is not None:
            remaining -= min(1.0, 0.2 * remaining)
        return self.max_pull_wait_s if remaining is None else max(0.0, min(remaining, self.max_pull_wait_s))

    @handler
    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        keys = list(request.keys)
        budget = self._wait_budget(context)
        deadline = time.monotonic() + budget
        started, requested = time.monotonic(), time.time()
        claim: Claim | None = None
        with self._cv:
            try:
                self.shard.check_pull(request.vw, keys)
                while self.shard.c_global(keys) < request.min_clock:
                    left = deadline - time.monotonic()
                    if left <= 0 or not context.is_active():
                        raise Rejected(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"pull of vw {request.vw}: c_global is {self.shard.c_global(keys)}, "
                            f"min_clock {request.min_clock} not reached within {budget:.1f}s "
                            f"(vw clocks {self.shard.vw_clocks(keys)})",
                        )
                    self._cv.wait(min(left, 0.5))
                # Keys whose pushes are being added hold no whole generation yet: wait for those
                # adds (a pass over the keys each, without the lock; pushes of other keys go on).
                # Through shared memory, wait too for a pull writing this generation: it is shared.
                self._cv.wait_for(lambda: not self._quieting and self._adding.isdisjoint(keys) and not (
                    request.shm and self.pull_slots.writing(keys, self.shard.generation)))
                answering = time.time()
                # Through shared memory the values are written into a slot straight from the live
                # tensors, with the lock let go and the keys marked as read (a pass over the values
                # each; pushes and pulls of other keys go on), instead of cloned here and copied
                # again; the VWs that pull the same generation after it share that slot.
                result = self.shard.pull(request.vw, keys, copy=not request.shm)
                tag = wire_pb2.PullTag(c_global=result.c_global, own_clock=result.own_clock,
                                       vw_clocks=result.vw_clocks)
                reply: Iterable[bytes] = ()
                nbytes = _payload_bytes(result.values)
                if request.shm:
                    claim = self.pull_slots.claim(request.vw, keys, self.shard.generation, nbytes)
                    if claim.writes:
                        self._reading.update(keys)
                    else:   # in a slot already, or /dev/shm full: gRPC frames, copied here
                        reply = list(wire.encode(result.values, pull=tag, ring=claim))
                        claim = None
                else:
                    reply = wire.encode(result.values, pull=tag)
            except ShardError as exc:
                raise _rejected(exc) from None
            answered = time.time()
            self.pull_wait_seconds += time.monotonic() - started
            self.sent_bytes += nbytes
            if claim is None:
                self.trace.record("pull", request.vw, request.min_clock, answering, answered, requested=requested,
                                  c_global=result.c_global)
        if claim is not None:
            reply = self._write_slot(claim, keys, result.values, tag)
            with self._cv:
                self.trace.record("pull", request.vw, request.min_clock, answering, answered,
                                  requested=requested, c_global=result.c_global, written=time.time())
        return iter(reply)

    def _write_slot(self, claim: Claim, keys: list[str], values: list[tuple[str, torch.Tensor]],
                    tag: wire_pb2.PullTag) -> list[bytes]:
        """A pull's reply written into its claimed slot, without the lock: its keys are marked as
        read until then, and unmarked whatever happens (else their pushes would wait for good)."""
        written = False
        try:
            reply = list(wire.encode(values, pull=tag, ring=claim))
            written = True
        finally:
            with self._cv:
                try:
                    if not claim.done() and written:
                        # Its slot went while it was written: in frames, the keys still marked.
                        reply = list(wire.encode(values, pull=tag))
                finally:
                    self._reading -= Counter(keys)   # and drops the keys no pull reads any more
                    self._cv.notify_all()   # pushes of these keys, and pulls of this generation
        return reply

    @handler
    def Status(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> ps_pb2.ShardStatus:
        return self.status()

    def metrics_snapshot(self) -> ShardSnapshot | None:
        """What the metrics collector reads at scrape time: status() without the digest."""
        with self._cv:
            if self.index is None:
                return None
            s = self.shard
            clocks = s.vw_clocks() if s.ready else []
            return ShardSnapshot(
                shard=self.index, pushes_applied=s.pushes_applied, pushes_duplicate=s.pushes_duplicate,
                received_bytes=self.received_bytes, sent_bytes=self.sent_bytes,
                pull_wait_seconds=self.pull_wait_seconds, vw_clocks=clocks,
                c_global=s.c_global() if s.ready else 0, clock_distance=s.clock_distance() if s.ready else 0,
            )

    def status(self) -> ps_pb2.ShardStatus:
        with self._cv:
            self.quiet()   # the digest reads every key's values; every field is read after it
            s = self.shard
            status = ps_pb2.ShardStatus(
                virtual_workers=s.virtual_workers, keys=len(s.values),
                pushes_applied=s.pushes_applied, pushes_duplicate=s.pushes_duplicate,
                max_clock_distance=s.max_clock_distance, restored_pushes=self.restored_pushes,
                peak_rss_bytes=devices.peak_rss_bytes(), evicted=sorted(s.evicted),
                sync=s.rule.mode, exchanges_applied=s.exchanges.applied,
            )
            if s.ready:
                status.c_global = s.c_global()
                status.clock_distance = s.clock_distance()
                status.values_digest = s.digest()
                for vw in range(s.virtual_workers):
                    per_key = s.key_clocks(vw)
                    status.clocks.add(vw=vw, min_clock=min(per_key), max_clock=max(per_key))
            return status
