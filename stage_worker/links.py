"""Ordered, retrying senders from one stage to a neighbour stage."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from hetpipe import rpc, shm, wire
from hetpipe.v1 import wire_pb2


@dataclass(frozen=True, slots=True)
class Outgoing:
    tag: wire_pb2.MinibatchTag | wire_pb2.CommitTag   # a commit: fp16 verdicts alone, no tensors
    tensors: list[tuple[str, torch.Tensor]]
    ready: Any = None   # a torch.cuda.Event: the tensors' copies to the host are done once it is

    def encode(self, ring: shm.Ring | None) -> Iterator[bytes]:
        if isinstance(self.tag, wire_pb2.CommitTag):
            return wire.encode(self.tensors, commit=self.tag, ring=ring)
        return wire.encode(self.tensors, minibatch=self.tag, ring=ring)

    @property
    def what(self) -> str:
        if isinstance(self.tag, wire_pb2.CommitTag):
            return f"verdicts through minibatch {self.tag.verdicts.through}"
        return f"minibatch {self.tag.minibatch}"


_COPY_STREAMS: dict[torch.device, Any] = {}


def to_host(item: Outgoing) -> Outgoing:
    """item with its GPU tensors copied to pinned host memory on a side stream, started now and
    ready once item.ready is: the compute thread goes on with its next task meanwhile, and the
    copy waits only for the kernels that made the tensors (a plain .cpu() on the default stream
    would block the caller, and on the sender thread it would queue behind the next task)."""
    devices = {t.device for _, t in item.tensors if t.is_cuda}
    if not devices:
        return item
    (device,) = devices   # a stage computes on one device
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    host: list[tuple[str, torch.Tensor]] = []
    with torch.cuda.stream(stream):
        for name, t in item.tensors:
            if t.is_cuda:
                pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                pinned.copy_(t, non_blocking=True)
                t.record_stream(stream)   # its memory is not reused before the copy has read it
                t = pinned
            host.append((name, t))
        ready = torch.cuda.Event()
        ready.record(stream)
    return Outgoing(item.tag, host, ready)


class Link:
    """Sends bundles to one peer in submission order, on its own thread.

    A send that keeps failing for longer than give_up_s calls on_failure with a message naming
    the peer and the minibatch, so a dead neighbour fails the stage fast instead of hanging it.
    With hold_s (an emulated network), each bundle is held that long before it goes out; the one
    sender thread makes bundles queue behind each other as on a real link. With shared_memory
    (the peer shares this host), the bytes go through a ring of shared-memory slots and the call
    carries only their handle; the peer copies them out before it answers, so a slot is free
    again once the next call is acknowledged.
    """

    def __init__(
        self, *, address: str, method: str, peer: str, on_failure: Callable[[str], None],
        give_up_s: float = 10.0, hold_s: float = 0.0, shared_memory: bool = False,
    ) -> None:
        self.address, self.method, self.peer = address, method, peer
        self.ring = shm.Ring() if shared_memory else None
        self._hold_s = hold_s
        self._on_failure = on_failure
        self._give_up_s = give_up_s
        self._channel = rpc.channel(address)
        self._stub = rpc.Stub(self._channel, "Stage")
        self._queue: queue.Queue[Outgoing | None] = queue.Queue()
        self._closing = threading.Event()
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._run, name=f"link-{method}", daemon=True)
        self._thread.start()

    def send(self, item: Outgoing) -> None:
        self._queue.put(to_host(item))

    def close(self) -> None:
        self._closing.set()  # a send that is retrying gives up now: closing must not wait out give_up_s
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._channel.close()
        if self.ring is not None:
            self.ring.close()

    @property
    def shm_bytes(self) -> int:
        """Bytes sent through shared memory."""
        return 0 if self.ring is None else self.ring.bytes_written

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if item.ready is not None:
                item.ready.synchronize()
            if self._hold_s > 0 and self._closing.wait(self._hold_s):
                return
            if not self._deliver(item):
                return

    def _deliver(self, item: Outgoing) -> bool:
        what = "activation" if self.method == "Forward" else "gradient"
        try:
            rpc.retrying(lambda: rpc.send_bundle(self._stub, self.method, item.encode(self.ring),
                                                 timeout=rpc.DATA_DEADLINE_S),
                         give_up_s=self._give_up_s, closing=self._closing)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:  # else an earlier attempt landed
                if not self._closing.is_set():
                    self._on_failure(f"could not send the {what} of {item.what} to {self.peer} "
                                     f"at {self.address}: {exc.code().name}: {exc.details()}")
                return False
        self.bytes_sent += sum(t.numel() * t.element_size() for _, t in item.tensors)
        return True
