"""Large byte copies between buffers (shared memory, tensors, gRPC's frames) without the GIL, and
split over the process's intra-op threads where there are several."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_GIL_FREE_FROM = 1 << 16   # bytes: below, a slice assignment is cheaper than numpy's call
_SPLIT_FROM = 8 << 20      # bytes: below, one thread's memcpy beats handing parts out
_COPY_POOL: ThreadPoolExecutor | None = None
_COPY_POOL_LOCK = threading.Lock()


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src, without the GIL for large copies: a memoryview slice assignment holds it for
    the whole memcpy (3-4 ms per 12 MB here), stalling every other thread of a busy server, where
    numpy releases it. A copy of _SPLIT_FROM bytes or more is split over this process's
    intra-op threads (torch.get_num_threads: a shard beside GPU stages has several)."""
    n = len(src)
    if n < _GIL_FREE_FROM:
        dst[:] = src
        return
    parts = _copy_threads() if n >= _SPLIT_FROM else 1
    if parts == 1:
        _memcpy(dst, src)
        return
    step = -(-n // parts)
    pool = _copy_pool(parts)
    done = [pool.submit(_memcpy, dst[i:i + step], src[i:i + step]) for i in range(step, n, step)]
    _memcpy(dst[:step], src[:step])   # this thread takes the first part
    for future in done:
        future.result()


def _memcpy(dst: memoryview, src: memoryview) -> None:
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def _copy_threads() -> int:
    import torch   # imported by every process that moves tensors; not by the CLI, which imports shm

    return max(1, torch.get_num_threads())


def _copy_pool(parts: int) -> ThreadPoolExecutor:
    """Threads for copy_bytes' other parts (parts - 1 of them), made once."""
    global _COPY_POOL
    with _COPY_POOL_LOCK:
        if _COPY_POOL is None:
            _COPY_POOL = ThreadPoolExecutor(parts - 1, thread_name_prefix="copy")
        return _COPY_POOL
