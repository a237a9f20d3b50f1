"""Same-host fast path between GPU stages: a bundle's bytes go GPU to GPU by CUDA IPC.

A sender owns a Ring of slots in its GPU memory per peer. Each slot is shared once through torch's
CUDA IPC (`_share_cuda_`), and has a header segment in /dev/shm (hetpipe/shm.py) that holds the
slot's seqlock version. When a bundle is sent, it is copied into a free slot on a side stream,
after the kernels that made it. The compute stream goes on meanwhile. The call carries only the
tensor metas, the slot's handle and its version.

The receiver maps a slot once and keeps it while the sender's handle stays the same. It copies the
bytes onto its own device on a stream of its own, waits for that copy, and checks the version
again. A stale or overwritten slot is refused, as with host shared memory. The sender frees a slot
once the call that named it is acknowledged, and by then the receiver's copy is done.

torch.multiprocessing shares CUDA tensors the same way, but through pickle. Here the handle's
fields travel as protobuf, nothing is unpickled, and every field is checked before it is used.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from hetpipe import shm
from hetpipe.shm import HandleError
from hetpipe.v1 import wire_pb2

# torch's shared reference counter, a POSIX shm name made by at::NewProcessWideShmHandle.
_COUNTER = re.compile(rb"/torch_\d{1,10}_\d{1,20}_\d{1,20}")
_HANDLE_BYTES = 66        # torch's version byte, its kind, then the 64-byte cudaIpcMemHandle_t
_PLAIN = b"c"             # the kind of a plain (not expandable-segment) allocation
_COUNTERS = 10_000        # int64 counters in one torch counter file (CUDA_IPC_REF_COUNTER_FILE_SIZE)
_SLOT_UNIT = 2 << 20      # slots are whole 2 MiB blocks (shm.capacity)
Spec = tuple[torch.dtype, Sequence[int], int]   # dtype, shape, bytes (wire.Spec)


# torch's reference-counter files (/dev/shm/torch_<pid>_...) of the slots this process shared:
# torch removes them at interpreter exit, which a service's os._exit skips (unlink_counters).
_COUNTER_FILES: set[str] = set()
_COUNTER_FILES_LOCK = threading.Lock()


def unlink_counters() -> None:
    """Removes the counter files of every slot this process shared; for a process about to exit."""
    with _COUNTER_FILES_LOCK:
        names = list(_COUNTER_FILES)
        _COUNTER_FILES.clear()
    for name in names:
        (shm.SHM_DIR / name).unlink(missing_ok=True)


class _Slot:
    """A GPU buffer shared by CUDA IPC once, and the /dev/shm header that versions its content."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        (_, handle, size, offset, counter, counter_offset, _, _) = self.buffer.untyped_storage()._share_cuda_()
        with _COUNTER_FILES_LOCK:   # made by the share, whether or not the handle is one a receiver takes
            _COUNTER_FILES.add(counter.decode(errors="replace").lstrip("/"))
        self.ref = wire_pb2.CudaRef(handle=handle, storage_bytes=size, storage_offset=offset,
                                    ref_counter_handle=counter, ref_counter_offset=counter_offset)
        check_ref(self.ref, capacity)   # what the receiver takes (not an expandable segment's handle)
        self.header = shm.Segment(0)
        self.writing = False   # begun, not yet ended: the header's version is odd

    def close(self) -> None:
        self.header.close()
        # torch keeps the allocation alive while a receiver still maps it (its shared counter).
        del self.buffer


@contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Work queued in the block goes on stream, with stream's device current. torch.cuda.stream
    alone, on a thread whose current device is another (a gRPC handler's, a link's: device 0),
    also reads and sets that device's stream, which makes a CUDA context there: about 0.5 GiB on
    GPU 0 for every stage that computes on another GPU."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


@dataclass(frozen=True, slots=True)
class Staged:
    """A bundle being copied into slot `index`: written once `ready` has happened."""

    index: int
    nbytes: int
    ready: Any   # torch.cuda.Event


class Ring:
    """A sender's GPU slots for one peer. stage() takes a free slot, refs() names it once written,
    release() frees it once the peer has acknowledged the call. With every slot taken, stage()
    returns None and the caller sends through host memory instead: it never blocks the compute
    thread."""

    def __init__(self, device: torch.device, slots: int = 4) -> None:
        if slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {slots}")
        self.device = device
        self._slots: list[_Slot | None] = [None] * slots
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device)

    def stage(self, tensors: Sequence[torch.Tensor]) -> Staged | None:
        """Starts copying the tensors, in order, into a free slot, after the work queued on the
        current stream; None when no slot is free. HandleError or RuntimeError where no slot can
        be made (an allocator whose handles no receiver takes, no GPU memory left)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
        slot = self._slots[index]
        if slot is None or slot.capacity < nbytes:
            if slot is not None:
                self._stream.synchronize()   # nothing of ours still writes the old buffer
                slot.close()
                self._slots[index] = None
            try:
                slot = self._slots[index] = _Slot(self.device, shm.capacity(nbytes, _SLOT_UNIT))
            except BaseException:   # out of GPU memory, a handle no receiver takes: the caller falls back
                with self._lock:
                    self._free.append(index)
                raise
        slot.header.begin()   # odd until refs(): a receiver holding an older handle sees it moved on
        slot.writing = True
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with on_stream(self._stream):
            pos = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                slot.buffer[pos:pos + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
                t.record_stream(self._stream)   # its memory is not reused before the copy has read it
                pos += n
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return Staged(index, nbytes, ready)

    def refs(self, staged: Staged) -> tuple[wire_pb2.ShmRef, wire_pb2.CudaRef]:
        """Waits until the staged copy is done; the slot's header handle and its CUDA IPC handle."""
        staged.ready.synchronize()
        slot = self._slots[staged.index]
        assert slot is not None
        if slot.writing:   # the first call for this bundle; a retry names the same version
            slot.header.end()
            slot.writing = False
        return wire_pb2.ShmRef(name=slot.header.name, version=slot.header.version, nbytes=staged.nbytes), slot.ref

    def release(self, staged: Staged) -> None:
        with self._lock:
            self._free.append(staged.index)

    @property
    def idle(self) -> bool:
        """No slot holds a bundle on its way: staged and not yet released."""
        with self._lock:
            return len(self._free) == len(self._slots)

    def close(self) -> None:
        self._stream.synchronize()
        with self._lock:
            for slot in self._slots:
                if slot is not None:
                    slot.close()
            self._slots = [None] * len(self._slots)


def check_ref(ref: wire_pb2.CudaRef, nbytes: int) -> None:
    """INVALID_ARGUMENT unless the handle's fields are well formed and hold nbytes; nothing is opened.

    Only a plain allocation's handle is taken (torch's version byte, `c`, the 64-byte cudaIpcMemHandle_t):
    an expandable segment's handle names file descriptors to take out of the process its pid field
    names, which no peer should be able to make us do. The reference counter is an int64 in torch's
    80,000-byte counter file that the receiver decrements when it drops the slot: its offset is
    bounded here, or a peer could aim that write anywhere."""
    if len(ref.handle) != _HANDLE_BYTES or ref.handle[1:2] != _PLAIN:
        raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"CUDA IPC handle of {len(ref.handle)} bytes, not a plain allocation's "
                          f"({_HANDLE_BYTES} bytes, kind {_PLAIN!r})")
    if nbytes > ref.storage_bytes:
        raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"CUDA IPC handle claims {nbytes} bytes of a {ref.storage_bytes}-byte slot")
    if not _COUNTER.fullmatch(ref.ref_counter_handle):
        raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"CUDA IPC reference counter {ref.ref_counter_handle[:80]!r} is not torch's")
    if ref.ref_counter_offset >= _COUNTERS:
        raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"CUDA IPC reference counter offset {ref.ref_counter_offset}, at most {_COUNTERS - 1}")


class Source:
    """A bundle's bytes in a peer's slot, checked and mapped: copy_out() takes them."""

    def __init__(self, opener: Opener, storage: Any, header: wire_pb2.ShmRef, mapped: Any) -> None:
        self._opener, self._storage, self._header, self._mapped = opener, storage, header, mapped
        self.nbytes = header.nbytes

    def copy_out(self, specs: Sequence[Spec]) -> list[torch.Tensor]:
        """The tensors on the receiver's device; FAILED_PRECONDITION if the slot moved on meanwhile."""
        device, stream = self._opener.device, self._opener.stream
        out: list[torch.Tensor] = []
        try:
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(self._storage, 0, (self.nbytes,), (1,))
            with on_stream(stream):
                pos = 0
                for dtype, shape, n in specs:
                    t = torch.empty(tuple(shape), dtype=dtype, device=device)
                    t.reshape(-1).view(torch.uint8).copy_(src[pos:pos + n], non_blocking=True)
                    out.append(t)
                    pos += n
            stream.synchronize()   # the copy is done before the call is answered and the slot reused
        except RuntimeError as exc:
            raise HandleError(grpc.StatusCode.FAILED_PRECONDITION, f"CUDA IPC slot cannot be read: {exc}") from None
        compute = torch.cuda.default_stream(device)
        for t in out:
            t.record_stream(compute)   # allocated on our stream, used on the compute thread's
        self._opener.reader.verify(self._header, self._mapped)   # FAILED_PRECONDITION if overwritten
        return out


class Opener:
    """A GPU receiver's mappings of its peers' slots, onto this process's device (CUDA reaches a
    peer device's memory from there).

    Each slot is mapped once and kept while its sender keeps it: torch's counter for one share is
    decremented when we drop the mapping, so mapping a share twice, or again after dropping it,
    would decrement it twice. A mapping is dropped once the slot's header has left /dev/shm (its
    sender closed or regrew it), and a handle naming that share again is refused. At most `limit`
    live mappings: a peer that makes more is refused (RESOURCE_EXHAUSTED).
    """

    def __init__(self, reader: shm.Reader, device: torch.device, limit: int = 64) -> None:
        self.reader = reader
        self.device = device if device.index is not None else torch.device("cuda", 0)
        self._maps: dict[tuple[bytes, int, bytes, int], tuple[str, Any]] = {}   # key -> (header name, storage)
        self._dropped: set[tuple[bytes, int, bytes, int]] = set()
        self._limit = limit
        self._lock = threading.Lock()
        self._stream: Any = None

    @property
    def stream(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            return self._stream

    def open(self, ref: wire_pb2.CudaRef, header: wire_pb2.ShmRef, nbytes: int, sender: str | None = None) -> Source:
        """The bundle's bytes, checked against both handles: INVALID_ARGUMENT (malformed) or
        FAILED_PRECONDITION (stale, a slot this process cannot map, or another sender's)."""
        check_ref(ref, nbytes)
        mapped = self.reader.header(header, nbytes, sender)[0]
        return Source(self, self._map(ref, header.name), header, mapped)

    def _map(self, ref: wire_pb2.CudaRef, header: str) -> Any:
        key = (ref.handle, ref.storage_offset, ref.ref_counter_handle, ref.ref_counter_offset)
        dropped: list[Any] = []
        try:
            # Under the lock: two calls naming one share (a retry beside its original) map it once.
            with self._lock:
                found = self._maps.get(key)
                if found is not None:
                    return found[1]
                if key in self._dropped:
                    raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                                      "stale CUDA IPC handle: its slot was closed by its sender")
                for k, (name, storage) in list(self._maps.items()):
                    if not (shm.SHM_DIR / name).exists():
                        dropped.append(self._maps.pop(k)[1])
                        self._dropped.add(k)   # a few per slot regrown: small for a whole run
                if len(self._maps) >= self._limit:
                    raise HandleError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"{len(self._maps)} CUDA IPC slots mapped already, at most {self._limit}")
                try:
                    torch.cuda._lazy_init()
                    # The share's own event is not waited on: it was recorded when the slot was
                    # made, and the sender waits for each bundle's copy before it names the slot.
                    storage = torch.UntypedStorage._new_shared_cuda(
                        self.device.index, ref.handle, ref.storage_bytes, ref.storage_offset, ref.ref_counter_handle,
                        ref.ref_counter_offset, b"", False)
                except RuntimeError as exc:   # an unknown handle, a peer that ended, no peer access
                    raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"CUDA IPC handle cannot be opened on {self.device}: {exc}") from None
                self._maps[key] = (header, storage)
                return storage
        finally:
            # Dropping a mapping waits on this thread's current stream: outside the lock.
            dropped.clear()
