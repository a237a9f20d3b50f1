"""Receive buffers for large tensors: anonymous mappings, kept and handed out again once no tensor
holds them, so a received tensor lands in memory whose pages are already there.

Without them a receiver's tensor of a few MiB is fresh memory whenever the allocator has let it
go: glibc maps buffers above 32 MiB anew every time, and a thread's own arena (its heaps capped
at 64 MiB) lets smaller ones go when other sizes pass through it. Faulting 16 MiB in costs
about twice the copy into it (a 16 MiB copy out of shared memory: 2.4 ms into reused memory,
7.8 ms into fresh).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections import OrderedDict

import torch

HUGE_PAGE = 2 << 20
_ANONYMOUS_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as they go on the wire and into digests (little-endian, C order),
    without a copy where it is a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def _fresh(size: int) -> mmap.mmap:
    mapping = mmap.mmap(-1, size, flags=_ANONYMOUS_PRIVATE)
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):  # 512 times fewer faults where the kernel has huge pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


class Pool:
    """Mappings by size, at most keep_bytes of them kept. A mapping is free when nothing but the
    pool refers to it: a tensor made on it with torch.frombuffer holds it (through its storage's
    buffer export) for as long as any view of that storage lives."""

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._kept: OrderedDict[int, mmap.mmap] = OrderedDict()   # address -> mapping, least recently taken first
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        """A mapping of at least nbytes (whole huge pages from 2 MiB), free for the caller's tensor."""
        unit = HUGE_PAGE if nbytes >= HUGE_PAGE else mmap.PAGESIZE
        size = -(-max(nbytes, 1) // unit) * unit
        with self._lock:
            for key in list(self._kept):
                if len(self._kept[key]) == size and self._free(key):
                    self._kept.move_to_end(key)
                    return self._kept[key]
            self._evict_idle(self._bytes + size - self.keep_bytes)
            mapping = _fresh(size)
            if self._bytes + size <= self.keep_bytes:
                self._kept[_address(mapping)] = mapping
                self._bytes += size
            return mapping

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """The mappings under these tensors are not kept: a refused bundle (a hostile header that
        declares 256 MiB, then sends 100 bytes) leaves the pool as it found it. Each mapping goes
        when its tensor does."""
        with self._lock:
            for tensor in tensors:
                mapping = self._kept.pop(tensor.data_ptr(), None)
                if mapping is not None:
                    self._bytes -= len(mapping)

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def _evict_idle(self, excess: int) -> None:
        for key in list(self._kept):
            if excess <= 0:
                return
            if self._free(key):
                mapping = self._kept.pop(key)
                self._bytes -= len(mapping)
                excess -= len(mapping)
                mapping.close()

    def _free(self, key: int) -> bool:
        # Held by the pool's dict and this call's argument alone: no tensor's storage exports it.
        return sys.getrefcount(self._kept[key]) <= _IDLE_REFS


def _address(mapping: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapping)   # an export of the mapping, released with view
    address = ctypes.addressof(view)
    del view
    return address


def _idle_refs() -> int:
    """sys.getrefcount of a mapping held by a dict alone, passed straight from it."""
    kept = {0: mmap.mmap(-1, mmap.PAGESIZE)}
    refs = sys.getrefcount(kept[0])
    kept[0].close()
    return refs


_IDLE_REFS = _idle_refs()
RECEIVE = Pool()
