"""A GPU stage's copies to and from host memory, on side streams and through pinned memory.

The compute stream goes on meanwhile, and nothing blocks the compute thread. On an H100 a pageable
`.cpu()` of one stage's bf16 push (59M elements) took 87 ms where a copy into pinned memory took
2, and a pull's 236 MB reached the GPU from pageable memory in 14 ms, from pinned in 4.4.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from hetpipe import cuda_ipc, wire

log = logging.getLogger(__name__)
# torch.frombuffer warns that a read-only mapping (a shard's pull slot, PinnedSlots) is not writable:
# the copies to the GPU only read it. Filtered once here: catch_warnings is not thread-safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)

_STREAMS: dict[tuple[torch.device, str], Any] = {}
_STREAMS_LOCK = threading.Lock()


def side_stream(device: torch.device, use: str) -> Any:
    """The device's side stream for one use ("link", "push", "pull"): copies of different uses
    do not queue behind each other, and copies to and from the host run on separate engines."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get((device, use))
        if stream is None:
            stream = _STREAMS[device, use] = torch.cuda.Stream(device)
        return stream


def marker(tensors: Sequence[torch.Tensor]) -> Any:
    """An event after the work queued so far on the current stream of the tensors' GPU, for a
    copy on another thread to wait for (that thread's current stream is not this one's); None
    for tensors on the CPU."""
    devices = {t.device for t in tensors if t.is_cuda}
    if not devices:
        return None
    (device,) = devices   # a stage computes on one device
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def to_host(tensors: Sequence[torch.Tensor], use: str, *, after: Any = None,
            cast: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> tuple[list[torch.Tensor], Any]:
    """The tensors, cast, in pinned host memory, and an event they are ready at (None where none
    is on a GPU: then they are returned as they are, cast). The copies run on the device's `use`
    side stream once `after` (an event, see marker) has happened, else once the work queued on
    the current stream now has."""
    devices = {t.device for t in tensors if t.is_cuda}
    if not devices:
        return [cast(t) for t in tensors], None
    (device,) = devices
    stream = side_stream(device, use)
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(device))
    host: list[torch.Tensor] = []
    with cuda_ipc.on_stream(stream):   # on any thread: a link's, the pusher
        for t in tensors:
            if t.is_cuda:
                wire = cast(t)
                pinned = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=True)
                pinned.copy_(wire, non_blocking=True)
                t.record_stream(stream)   # its memory is not reused before the copy has read it
                t = pinned
            else:
                t = cast(t)
            host.append(t)
        ready = torch.cuda.Event()
        ready.record(stream)
    return host, ready


def to_device(tensors: Sequence[torch.Tensor], device: torch.device, use: str) -> list[torch.Tensor]:
    """Host tensors on device, copied on its `use` side stream and waited for; each may then be
    used on the device's compute stream (its default stream) and freed from there. Pinned tensors
    copy without a bounce through a staging buffer."""
    stream = side_stream(device, use)
    with cuda_ipc.on_stream(stream):
        out = [t.to(device, non_blocking=True) for t in tensors]
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return _for_compute(out, device)


def _for_compute(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """tensors, allocated on a side stream, marked for the compute thread's stream, which frees them."""
    compute = torch.cuda.default_stream(device)
    for t in tensors:
        t.record_stream(compute)
    return tensors


class PinnedSlots:
    """A GPU stage's pulls through shared memory, copied from the shard's slot straight to the GPU.

    The stage maps the shard's pull slots read-only (shm.Reader). Received into pinned memory, a
    pull costs a CPU copy of the whole reply before its copy to the GPU (236 MB a stage for the
    117.8M GPT); from a slot the driver has page-locked in place (cudaHostRegister, read-only) it
    reaches the GPU by DMA alone. A slot is pinned at its first pull (12 ms for 236 MB on an H100)
    and unpinned at the first pull after its reader has let go of its mapping (its segment gone or
    replaced): the shard reuses its slots wave after wave. Where the driver refuses (no read-only
    registration on this host), every pull takes the pinned path, and pinning is not tried again:
    a refusal for want of memory would most likely come again.

    The copies are waited for before the stream checks a chunk's version, which it does once the
    chunk's pieces are consumed: after the last piece of a reply in one chunk (a pull's, always),
    after each piece of one in several."""

    FLAGS = 0x08 | 0x01   # cudaHostRegisterReadOnly | cudaHostRegisterPortable

    def __init__(self, reader: Any, device: torch.device) -> None:
        self._reader, self._device = reader, device
        # id(mapping) -> (mapping, its address, a uint8 tensor over it): held, so unmapped only once unpinned
        self._pinned: dict[int, tuple[mmap.mmap, int, torch.Tensor]] = {}
        self._lock = threading.Lock()   # one pinned receive at a time: a mapping is unpinned only between them
        self._closed = False
        self.refused: str | None = None   # the driver's answer where it would not pin a slot
        self.pins = 0   # slots pinned so far (each costs its registration once)

    def receive(self, stream: wire.Stream, use: str = "pull") -> list[torch.Tensor]:
        """The stream's tensors on this stage's device, each ready to use on its compute stream."""
        pieces = iter(stream.pieces)
        first = next(pieces, None)
        chained = pieces if first is None else itertools.chain([first], pieces)
        with self._lock:
            self._unpin_gone()
            if first is not None and self._pinned_view(first[2]) is not None:
                return self._copy_pinned(stream, chained, use)
        # Not pinned: into pinned memory, then to the GPU, as any pull that does not fit; outside
        # the lock, so that the replies of several shards are copied at once.
        host = wire.receive(wire.Stream(stream.header, stream.specs, chained), pinned=True)
        return to_device([t for _, t in host.tensors], self._device, use)

    def _copy_pinned(self, stream: wire.Stream, pieces: Iterator[tuple[int, int, memoryview]],
                     use: str) -> list[torch.Tensor]:
        """receive() by DMA from the pinned slot (caller holds _lock)."""
        side = side_stream(self._device, use)
        with cuda_ipc.on_stream(side):
            out = [torch.empty(shape, dtype=dtype, device=self._device) for dtype, shape, _ in stream.specs]
            flat = [t.view(-1).view(torch.uint8) for t in out]
            left = sum(nbytes for *_, nbytes in stream.specs)
            for index, offset, piece in pieces:
                source = self._pinned_view(piece)
                if source is None:   # a later chunk in a segment the driver refused: through a copy
                    source = torch.frombuffer(bytearray(piece), dtype=torch.uint8)
                flat[index][offset:offset + len(piece)].copy_(source, non_blocking=True)
                left -= len(piece)
                # Before the next piece is asked for: the stream then checks the version of the
                # chunk this one ends, and a pull reply is one chunk (the shard writes it whole).
                if left == 0 or not stream.whole:
                    side.synchronize()
        return _for_compute(out, self._device)

    def _pinned_view(self, piece: memoryview) -> torch.Tensor | None:
        """The piece's bytes as a view of its pinned mapping, pinning the mapping if it is new;
        None where it cannot be (caller holds _lock)."""
        mapping = piece.obj
        found = self._pinned.get(id(mapping))
        if found is None or found[0] is not mapping:
            found = self._pin(mapping)
            if found is None:
                return None
        start = int(np.frombuffer(piece, dtype=np.uint8).ctypes.data) - found[1]
        return found[2][start:start + len(piece)]

    def _pin(self, mapping: object) -> tuple[mmap.mmap, int, torch.Tensor] | None:
        if self._closed or self.refused is not None or not isinstance(mapping, mmap.mmap):   # frames: no slot
            return None
        address = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
        status = _on_own_thread(self._device, lambda: torch.cuda.cudart().cudaHostRegister(address, len(mapping),
                                                                                           self.FLAGS))
        if status != 0:
            self.refused = f"cudaHostRegister of a read-only slot: cudaError {status}"
            log.warning("pull slots are not pinned (%s): pulls go through pinned memory", self.refused)
            return None
        found = self._pinned[id(mapping)] = (mapping, address, torch.frombuffer(mapping, dtype=torch.uint8))
        self.pins += 1
        return found

    def _unpin(self, key: int) -> None:
        _, address, _ = self._pinned.pop(key)
        status = _on_own_thread(self._device, lambda: torch.cuda.cudart().cudaHostUnregister(address))
        if status != 0:   # its pages stay locked until this process ends
            log.warning("cudaHostUnregister of a pull slot: cudaError %d", status)

    def _unpin_gone(self) -> None:
        """Unpins the mappings the reader has let go of (their segment gone or replaced), which it
        then unmaps once nothing else holds them (caller holds _lock)."""
        for key, (mapping, _, _) in list(self._pinned.items()):
            if not self._reader.holds(mapping):
                self._unpin(key)

    def close(self) -> None:
        """Unpins every slot; a pull still under way takes the pinned-memory path."""
        with self._lock:
            self._closed = True
            for key in list(self._pinned):
                self._unpin(key)


def _on_own_thread(device: torch.device, call: Callable[[], Any]) -> int:
    """A CUDA runtime call's status, asked on a thread of its own with device current. A failed
    call also sets the runtime's last error for the thread that made it, which torch's next check
    after a kernel launch there would raise as its own; and the default device, 0, would get a
    context of its own (about 0.5 GiB) where the stage is on another."""
    status = [-1]

    def run() -> None:
        with torch.cuda.device(device):
            status[0] = int(call())

    thread = threading.Thread(target=run, name="cuda-host-register", daemon=True)
    thread.start()
    thread.join()
    return status[0]
