"""Ordered, retrying senders from one stage to a neighbour stage."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from hetpipe import cuda_ipc as ipc
from hetpipe import link_socket, rpc, shm, socket_duplex, wire
from hetpipe.duplex import Duplex
from hetpipe.v1 import wire_pb2
from stage_worker import host_copies

log = logging.getLogger(__name__)

# One-frame bundles on the held stream before the oldest is answered: the next goes out while the
# peer copies the last one in. 1 MiB through shared memory, a burst: 1.96 GiB/s with two, 0.86 with
# one at a time (docs/benchmarks.md, twenty-fourth pass); more did not help.
WINDOW = 2
# A bundle over this goes through shared memory in chunks of it, each handed on as it is written,
# so that the peer copies one out while the next is written: over the peer's link socket a chunk
# costs a few µs of control. shm / gloo, alternating (docs/benchmarks.md, thirty-fourth pass):
# whole up to 16 MiB in 8 MiB chunks 0.76-0.87 at 4 MiB, 0.78-0.85 at 16; in 2 MiB chunks
# 0.95-1.18 and 1.31-1.45 (4 MiB chunks did better at 64 MiB, worse below).
CHUNK_BYTES = 2 << 20
# ...and in at most this many chunks (larger ones past 64 MiB): a receiver keeps 256 mappings, for
# both its links' three slots.
MAX_CHUNKS = 32


_SETTLE = object()   # in a link's queue: a bundle send() put out itself awaits its answer


@dataclass(frozen=True, slots=True)
class Outgoing:
    tag: wire_pb2.MinibatchTag | wire_pb2.CommitTag   # a commit: fp16 verdicts alone, no tensors
    tensors: list[tuple[str, torch.Tensor]]
    ready: Any = None   # a torch.cuda.Event: the tensors' copies to the host are done once it is
    staged: ipc.Staged | None = None   # the tensors are being copied into this CUDA IPC slot

    def encode(self, ring: shm.Ring | None, gpu: ipc.Ring | None = None) -> wire.Frames:
        if isinstance(self.tag, wire_pb2.CommitTag):
            return wire.encode(self.tensors, commit=self.tag, ring=ring)
        if self.staged is not None and gpu is not None:
            return wire.encode(self.tensors, minibatch=self.tag, cuda=gpu.refs(self.staged))
        return wire.encode(self.tensors, minibatch=self.tag, ring=ring)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    @property
    def what(self) -> str:
        if isinstance(self.tag, wire_pb2.CommitTag):
            return f"verdicts through minibatch {self.tag.verdicts.through}"
        if self.tag.eval:   # its minibatch counts that evaluation's batches, not training's
            return f"evaluation {self.tag.eval}'s batch {self.tag.minibatch}"
        return f"minibatch {self.tag.minibatch}"


# How a receiver refuses a handle it cannot use (hetpipe/cuda_ipc.py's HandleError, and shm.py's
# for the slot's header segment): these codes, with a message that names the handle.
_REFUSED_HANDLE = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
_HANDLE_WORDS = ("CUDA IPC", "shared-memory")


def handle_refused(exc: grpc.RpcError) -> bool:
    """The peer could not use a CUDA IPC handle of ours, as against refusing the bundle itself
    (out of its window, say), which the same codes answer and host memory would not mend."""
    details = exc.details() or ""
    return exc.code() in _REFUSED_HANDLE and any(word in details for word in _HANDLE_WORDS)


def to_host(item: Outgoing) -> Outgoing:
    """item with its GPU tensors copied to pinned host memory on a side stream, started now and
    ready once item.ready is: the compute thread goes on with its next task meanwhile, and the
    copy waits only for the kernels that made the tensors (a plain .cpu() on the default stream
    would block the caller, and on the sender thread it would queue behind the next task)."""
    tensors, ready = host_copies.to_host([t for _, t in item.tensors], "link")
    if ready is None:
        return item
    return Outgoing(item.tag, [(name, t) for (name, _), t in zip(item.tensors, tensors)], ready)


class Link:
    """Sends bundles to one peer in submission order, on its own thread.

    A send that keeps failing for longer than give_up_s calls on_failure with a message naming
    the peer and the minibatch, so a dead neighbour fails the stage fast instead of hanging it.
    With hold_s (an emulated network), each bundle is held that long before it goes out; the one
    sender thread makes bundles queue behind each other as on a real link. With shared_memory
    (the peer shares this host), the bytes go through a ring of shared-memory slots and the call
    carries only their handle; the peer copies them out before it answers. With cuda_ipc as well
    (both compute on GPUs), GPU tensors go through a ring of GPU slots instead
    (hetpipe/cuda_ipc.py), never through the host. Up to WINDOW one-frame bundles are on their way
    at once; a bundle in several frames goes by a call of its own, after them. A failure sends
    every one unanswered again, in order, by the retrying path (the peer answers one it has
    already with ALREADY_EXISTS).
    """

    def __init__(
        self, *, address: str, method: str, peer: str, on_failure: Callable[[str], None],
        give_up_s: float = 10.0, hold_s: float = 0.0, shared_memory: bool = False, cuda_ipc: bool = False,
    ) -> None:
        self.address, self.method, self.peer = address, method, peer
        self._what = "activation" if method == "Forward" else "gradient"
        # A bundle is written once the one WINDOW before it is answered (the peer answers once it
        # has copied a bundle out), so WINDOW slots would do; one more measured a little faster.
        # After a failure a resend may take a slot that a dead call's read still uses: the peer's
        # version check refuses that read, on a call nobody waits for any more.
        self.ring = (shm.Ring(slots=WINDOW + 1, chunk_bytes=CHUNK_BYTES, whole_up_to=CHUNK_BYTES, max_chunks=MAX_CHUNKS)
                     if shared_memory else None)
        self._cuda_ipc = shared_memory and cuda_ipc
        self.gpu_ring: ipc.Ring | None = None   # made for the first GPU bundle
        self._gpu_lock = threading.Lock()        # _stage (the compute thread) against _release (this link's)
        self.cuda_ipc_bytes = 0   # delivered GPU to GPU
        self._hold_s = hold_s
        self._on_failure = on_failure
        self._give_up_s = give_up_s
        self._channel = rpc.channel(address)
        self._stub = rpc.Stub(self._channel, "Stage")
        # One-frame bundles: over the peer's link socket where it shares this host, else a held stream.
        self._duplex: Duplex | socket_duplex.SocketDuplex = Duplex(getattr(self._stub, f"{method}Link"), rpc.DATA_DEADLINE_S)
        if shared_memory:
            self._duplex = socket_duplex.SocketDuplex(self._locate, method, rpc.DATA_DEADLINE_S, fallback=self._duplex,
                                                    on_fallback=self._whole_bundles)
        self._queue: queue.Queue[Outgoing | object | None] = queue.Queue()
        self._in_flight: deque[tuple[Outgoing, Any]] = deque()   # put on the held stream or socket, unanswered
        self._current: Outgoing | None = None   # the bundle being sent or answered: a failure names it
        # Held by whichever thread puts a bundle out or reads an answer: the link's thread, or a
        # sender putting a bundle out itself (send()).
        self._io = threading.Lock()
        self._unsent = 0   # bundles queued for the link's thread that it has not put out yet
        self._closing = threading.Event()
        self.bytes_sent = 0
        self._sent = threading.Condition()   # flush() waits on it
        self._queued = self._finished = 0    # bundles given to send(), and done with (answered or failed)
        self._flush_at = 0                   # flush() waits for this many to be done with (0: none waits)
        self._ended = False                  # the link's thread has ended: failed, or closed
        self._thread = threading.Thread(target=self._run, name=f"link-{method}", daemon=True)
        self._thread.start()

    def _whole_bundles(self) -> None:
        """Over a gRPC stream a chunk costs a message, and a bundle of several a call of its own:
        bundles up to shm.WHOLE_UP_TO go whole again, one frame on the held stream."""
        if self.ring is not None:
            self.ring.chunking(shm.CHUNK_BYTES, shm.WHOLE_UP_TO)

    def _locate(self) -> Any:
        return self._stub.LinkSocket(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)

    def send(self, item: Outgoing) -> None:
        """Sends item after every bundle sent before it: on the caller's thread where it is one
        frame and the link is quiet (_put_out), else on the link's."""
        prepared = self.prepare(item)   # may raise: then nothing is queued, nor counted for flush
        if self._put_out(prepared):
            return
        with self._sent:
            self._queued += 1
            self._unsent += 1
        self._queue.put(prepared)

    def _put_out(self, item: Outgoing) -> bool:
        """item put out now, on this thread, where it is one frame and the link is quiet: the
        hand-off to the link's thread, its wake-up, cost a pipeline hop 0.1 ms more on two cores
        (docs/benchmarks.md, forty-first pass). The link's thread reads the answer. False: it is
        for the link's thread (larger, waiting for its host copy or an emulated network, others
        queued or unanswered, the link's thread busy reading an answer, or no connection open)."""
        if (item.ready is not None or self._hold_s > 0 or self._closing.is_set()
                or item.nbytes > rpc.CHUNK_BYTES):   # up to rpc.CHUNK_BYTES, one frame on every path
            return False
        if not self._duplex.connected:   # the link's thread connects (up to CONTROL_DEADLINE_S), not this one
            return False
        if not self._io.acquire(blocking=False):
            return False
        try:
            with self._sent:
                if self._ended or self._in_flight or self._unsent:
                    return False
                self._queued += 1
            self._current = item
            self._send(item)   # one frame: a failure shows at its answer
        finally:
            self._io.release()
        self._queue.put(_SETTLE)   # the link's thread reads the answer
        return True

    def flush(self, timeout: float) -> bool:
        """Waits until every bundle sent so far is answered; False if the link ended (failed or
        closed) first, or timeout passed. One caller at a time."""
        with self._sent:
            self._flush_at = target = self._queued
            try:
                return self._sent.wait_for(lambda: self._finished >= target or self._ended, timeout) and (
                    self._finished >= target and not self._ended)
            finally:
                self._flush_at = 0

    def prepare(self, item: Outgoing) -> Outgoing:
        """item on its way off the compute stream: being copied into a CUDA IPC slot, or its GPU
        tensors into pinned host memory (to_host); ready to deliver once item.ready has happened."""
        staged = self._stage(item)
        return dataclasses.replace(item, staged=staged) if staged is not None else to_host(item)

    def _stage(self, item: Outgoing) -> ipc.Staged | None:
        """Starts copying a GPU bundle into a CUDA IPC slot; None: it goes through the host."""
        if not item.tensors or isinstance(item.tag, wire_pb2.CommitTag):
            return None
        devices = {t.device for _, t in item.tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return None
        with self._gpu_lock:
            if not self._cuda_ipc:
                return None
            if self.gpu_ring is None:
                self.gpu_ring = ipc.Ring(next(iter(devices)))
            try:
                return self.gpu_ring.stage([t for _, t in item.tensors])   # None while every slot is in flight
            except (ipc.HandleError, RuntimeError) as exc:
                log.warning("no CUDA IPC slot for %s (%s); sending through host memory", self.peer, exc)
                self._cuda_ipc = False
                self._drop_gpu_ring()
                return None

    def close(self) -> None:
        """Ends the link at once: what is unanswered is not sent again (a stage closes its links
        once the job no longer needs them; flush() first to wait for the answers)."""
        self._closing.set()  # a send that is retrying gives up now: closing must not wait out give_up_s
        self._queue.put(None)
        self._duplex.close()   # first: wakes a thread waiting for an answer, which then sends nothing again
        # Then the channel: it cancels a bundle's own call under way (one of several frames, over
        # gRPC), whose answer the thread would otherwise wait for past the join.
        self._channel.close()
        self._thread.join(timeout=5)
        if self.ring is not None:
            self.ring.close()
        if self.gpu_ring is not None:
            self.gpu_ring.close()

    @property
    def shm_bytes(self) -> int:
        """Bytes sent through shared memory, host or GPU."""
        return (0 if self.ring is None else self.ring.bytes_written) + self.cuda_ipc_bytes

    @property
    def socket_bundles(self) -> int:
        """Bundles answered over the peer's link socket."""
        return self._duplex.answered if isinstance(self._duplex, socket_duplex.SocketDuplex) else 0

    @property
    def backlog(self) -> int:
        """Bundles given to send() and not yet done with: queued, in flight, or being sent again."""
        with self._sent:
            return self._queued - self._finished

    def _run(self) -> None:
        try:
            while True:
                with self._io:
                    if self._in_flight and (len(self._in_flight) >= WINDOW or self._queue.empty() or self._duplex.due):
                        if not self._settle():
                            return
                        continue
                if (item := self._queue.get()) is _SETTLE:   # one put out by send() itself: answered above
                    continue
                if item is None or self._closing.is_set():   # the channel is closed
                    with self._io:
                        while self._in_flight:   # what is on its way is answered (or given up) first
                            if not self._settle():
                                return
                    return
                assert isinstance(item, Outgoing)
                self._current = item
                if item.ready is not None:
                    item.ready.synchronize()
                if self._hold_s > 0 and self._closing.wait(self._hold_s):
                    return
                with self._io:
                    sent = self._send(item)
                    with self._sent:
                        self._unsent -= 1
                if not sent:
                    return
        except Exception as exc:  # a bug or a device error must fail the stage, not end the link quietly
            log.exception("link to %s failed", self.peer)
            if not self._closing.is_set():
                current = self._current.what if self._current else "?"
                self._on_failure(f"could not send the {self._what} of {current} to {self.peer}: "
                                 f"{type(exc).__name__}: {exc}")
        finally:
            with self._sent:
                self._ended = True
                self._sent.notify_all()

    def _send(self, item: Outgoing) -> bool:
        """item on the held stream if it is one frame, else by its own call once those before it
        are answered. False: the link failed."""
        self._duplex.open()   # a peer without a link socket, found out now, gets this bundle whole too
        frames = item.encode(self.ring, self.gpu_ring)
        first = frames.peek()
        if frames.single:
            self._in_flight.append((item, self._duplex.put(first)))
            return True
        waited = bool(self._in_flight)
        while self._in_flight:
            if not self._settle():
                return False
        # Encoded again after a wait: resends of those before it (after a failure) take the ring's
        # next slots, and may have come round to the one its first chunk was written into.
        return self._done_with(self._deliver(item, None if waited else frames))

    def _settle(self) -> bool:
        """The oldest bundle in flight answered. After a failure that a resend may mend, every one
        in flight is sent again in order, each until it is answered. False: the link failed."""
        item, opened = self._in_flight[0]
        self._current = item
        try:
            self._duplex.take(opened)
        except grpc.RpcError as exc:
            again = [unanswered for unanswered, _ in self._in_flight]   # the stream is gone, and their answers
            self._in_flight.clear()
            if self._closing.is_set():   # nothing goes out again: the ring's slots are going too
                for unanswered in again:
                    self._release(unanswered)
                    self._done_with(False)
                return False
            if exc.code() not in rpc.RETRYABLE and not (item.staged is not None and handle_refused(exc)):
                self._release(item)
                if not self._done_with(self._answered(item, exc)):
                    return False
                again.pop(0)
            # Stops at the first that fails.
            return all(self._done_with(self._deliver(unanswered)) for unanswered in again)
        self._in_flight.popleft()
        self._release(item)
        self._count(item)
        return self._done_with(True)

    def _done_with(self, delivered: bool) -> bool:
        """A bundle of send()'s is done with, delivered or not (then the link has failed)."""
        with self._sent:
            self._finished += 1
            if self._flush_at and self._finished >= self._flush_at:   # a wake-up per flush, not per bundle
                self._sent.notify_all()
        return delivered

    def _deliver(self, item: Outgoing, frames: Iterator[bytes] | None = None) -> bool:
        """item sent, retried until it is answered or give_up_s has passed; frames: its first
        attempt's, encoded already. False: the link failed."""
        first = [] if frames is None else [frames]
        self._current = item

        def attempt() -> Any:
            if self._closing.is_set():   # retrying() makes one attempt whatever: not into a closed ring
                raise link_socket.SocketError(grpc.StatusCode.CANCELLED, "the link is closing")
            encoded = first.pop() if first else item.encode(self.ring, self.gpu_ring)
            return rpc.send_bundle(self._stub, self.method, encoded, self._duplex, timeout=rpc.DATA_DEADLINE_S)

        try:
            rpc.retrying(attempt, give_up_s=self._give_up_s, closing=self._closing)
        except grpc.RpcError as exc:
            if item.staged is not None and handle_refused(exc):
                # The peer cannot map our GPU memory (no peer access, another driver's rules): this
                # link goes through host memory from now on, and so does this bundle.
                log.warning("%s refused a CUDA IPC handle (%s: %s); sending through host memory",
                            self.peer, exc.code().name, exc.details())
                with self._gpu_lock:
                    self._cuda_ipc = False   # the ring's slots go once the bundles staged in them are done with
                host = to_host(Outgoing(item.tag, item.tensors))
                if host.ready is not None:
                    host.ready.synchronize()
                return self._deliver(host)
            return self._answered(item, exc)
        finally:
            self._release(item)   # acknowledged, refused or given up: the peer is done with its slot
        self._count(item)
        return True

    def _answered(self, item: Outgoing, exc: grpc.RpcError) -> bool:
        """An answer that no resend changes: ALREADY_EXISTS (an earlier attempt landed) is a
        delivery; any other fails the link."""
        if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
            self._count(item)
            return True
        if not self._closing.is_set():
            self._on_failure(f"could not send the {self._what} of {item.what} to {self.peer} "
                             f"at {self.address}: {exc.code().name}: {exc.details()}")
        return False

    def _release(self, item: Outgoing) -> None:
        if item.staged is None:
            return
        with self._gpu_lock:
            if self.gpu_ring is not None:
                self.gpu_ring.release(item.staged)
                if not self._cuda_ipc:
                    self._drop_gpu_ring()

    def _drop_gpu_ring(self) -> None:
        """With CUDA IPC off for this link, its GPU ring closed once no slot holds a bundle on its
        way (caller holds _gpu_lock): the slots' headers leave /dev/shm, and torch frees each
        slot's memory once no receiver maps it (one never mapped stays until exit: torch's shared
        counter, design.md)."""
        if self.gpu_ring is not None and self.gpu_ring.idle:
            ring, self.gpu_ring = self.gpu_ring, None
            ring.close()

    def _count(self, item: Outgoing) -> None:
        nbytes = item.nbytes
        self.bytes_sent += nbytes
        if item.staged is not None:
            self.cuda_ipc_bytes += nbytes
