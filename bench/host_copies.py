"""What a GPU stage's pushes and pulls cost on the way through host memory, side by side: copies
between a GPU and pageable, pinned or shared memory (stage_worker/host_copies.py takes the pinned
path), and what the shard's push log costs for the same bytes (a page-cache write, then its fsync).

    python bench/host_copies.py                  # one stage's half of the 117.8M GPT (59M elements)
    python bench/host_copies.py --elements 4e6   # a smaller push (runs on the CPU too: host rows only)

Every figure is the median of --repeats timed copies after one untimed; ratios are to the pinned
copy in the same direction, measured in the same run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

REFERENCE = {"d2h": "into pinned memory", "h2d": "from pinned memory", "host": "memcpy"}


def timed(work: Callable[[], object], repeats: int, cuda: bool) -> float:
    """Median seconds of work(), each waited for (the GPU's queue too)."""
    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    work()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpu_rows(n: int, repeats: int) -> list[tuple[str, float, int, str]]:
    """(what, seconds, bytes, the row it is compared with) for each copy to and from the GPU."""
    g32 = torch.randn(n, device="cuda")
    g16 = g32.to(torch.bfloat16)
    page16, pin16 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    page32, pin32 = torch.empty(n), torch.empty(n, pin_memory=True)
    page32.fill_(1.0)   # touched: its pages exist, as a reused receive buffer's do
    page16.fill_(1.0)
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        f.truncate(n * 4)
        mapping = mmap.mmap(f.fileno(), n * 4)
    shared = torch.frombuffer(mapping, dtype=torch.float32, count=n)
    rows = [
        ("to host, bf16: .cpu() (new pageable memory)", timed(lambda: g16.cpu(), repeats, True), n * 2, "d2h"),
        ("to host, bf16: into touched pageable memory", timed(lambda: page16.copy_(g16), repeats, True), n * 2, "d2h"),
        ("to host, bf16: into pinned memory", timed(lambda: pin16.copy_(g16, non_blocking=True), repeats, True),
         n * 2, "d2h"),
        ("to the GPU, fp32: from touched pageable memory", timed(lambda: g32.copy_(page32), repeats, True), n * 4, "h2d"),
        ("to the GPU, fp32: from a /dev/shm mapping", timed(lambda: g32.copy_(shared), repeats, True), n * 4, "h2d"),
        ("to the GPU, fp32: from pinned memory", timed(lambda: g32.copy_(pin32, non_blocking=True), repeats, True),
         n * 4, "h2d"),
    ]
    # A GPU stage's pull through shared memory today: the shard's slot copied into pinned memory
    # (wire.receive), then to the GPU; both parts, and the whole.
    rows += [
        ("a pull's slot copied into pinned memory (host)", timed(lambda: pin32.copy_(shared), repeats, False),
         n * 4, "h2d"),
        ("to the GPU, fp32: slot -> pinned -> GPU (the path now)",
         timed(lambda: g32.copy_(pin32.copy_(shared), non_blocking=True), repeats, True), n * 4, "h2d"),
    ]
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    status = int(cudart.cudaHostRegister(shared.data_ptr(), n * 4, 0))   # page-locks the mapping in place
    if status == 0:
        registered = time.perf_counter() - start
        rows.append((f"to the GPU, fp32: from that mapping, registered ({registered * 1e3:.0f} ms to register)",
                     timed(lambda: g32.copy_(shared, non_blocking=True), repeats, True), n * 4, "h2d"))
        cudart.cudaHostUnregister(shared.data_ptr())
    else:
        print(f"# cudaHostRegister of the read-write mapping: cudaError {status}", flush=True)
    rows += _read_only_rows(g32, n, repeats)
    return rows   # the mapping goes with the tensor that views it


def _read_only_rows(g32: torch.Tensor, n: int, repeats: int) -> list[tuple[str, float, int, str]]:
    """The same copy from a read-only mapping of the segment, as a stage maps the shard's pull slots
    (shm.Reader): registered with cudaHostRegisterReadOnly (8) | Portable (1), where the driver
    takes it (cudaDevAttrHostRegisterReadOnlySupported), so that a pull could reach the GPU by DMA
    straight from the shard's slot."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        f.truncate(n * 4)
        with open(f.name, "rb") as ro:
            mapping = mmap.mmap(ro.fileno(), n * 4, prot=mmap.PROT_READ)
    import numpy as np

    address = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch warns that the buffer is not writable: it only reads it
        shared = torch.frombuffer(mapping, dtype=torch.float32, count=n)
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    status = int(cudart.cudaHostRegister(address, n * 4, 8 | 1))
    if status != 0:
        print(f"# cudaHostRegister of a read-only mapping (ReadOnly | Portable): cudaError {status}; "
              f"ReadOnly supported: {_read_only_supported()}", flush=True)
        return []
    registered = time.perf_counter() - start
    try:
        return [(f"to the GPU, fp32: from a read-only mapping, registered ({registered * 1e3:.0f} ms)",
                 timed(lambda: g32.copy_(shared, non_blocking=True), repeats, True), n * 4, "h2d")]
    finally:
        cudart.cudaHostUnregister(address)


def _read_only_supported() -> str:
    """cudaDevAttrHostRegisterReadOnlySupported (113) of device 0, where this torch tells it."""
    try:
        from cuda.bindings import runtime   # type: ignore[import-not-found]

        return str(runtime.cudaDeviceGetAttribute(runtime.cudaDeviceAttr(113), 0)[1])
    except Exception as exc:   # no cuda-python here: the status above says enough
        return f"unknown ({type(exc).__name__})"


def host_rows(n: int, repeats: int, folder: str) -> list[tuple[str, float, int, str]]:
    """The host's own copy, and the push log's write and fsync of a bf16 push of n elements."""
    src, dst = torch.ones(n * 2, dtype=torch.uint8), torch.zeros(n * 2, dtype=torch.uint8)   # raw bytes
    data = memoryview(src.numpy())
    path = os.path.join(folder, "host_copies.entry")

    def write(sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, 0)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    try:
        rows = [("host memcpy (the reference)", timed(lambda: dst.copy_(src), repeats, False), n * 2, "host"),
                ("log entry written (page cache)", timed(lambda: write(False), repeats, False), n * 2,
                 "host"),
                ("log entry written, then fsynced", timed(lambda: write(True), repeats, False), n * 2,
                 "host")]
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=float, default=59e6, help="elements a push holds (default 59e6)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the log entry is written (default: $TMPDIR)")
    args = ap.parse_args()
    n = int(args.elements)
    cuda = torch.cuda.is_available()
    print(f"# {torch.cuda.get_device_name(0) if cuda else 'no CUDA device: host rows only'}, torch {torch.__version__}, "
          f"{n:,} elements, {torch.get_num_threads()} intra-op threads, log entries written in {args.dir}", flush=True)
    rows = (gpu_rows(n, args.repeats) if cuda else []) + host_rows(n, args.repeats, args.dir)
    # Each row's time over its reference's, in this run: the pinned copy in its direction, the
    # host's memcpy for the log.
    reference = {kind: next(s for what, s, _, k in rows if k == kind and REFERENCE[kind] in what)
                 for kind in {k for *_, k in rows}}
    print(f"{'copy':<70}{'ms':>9}{'GB/s':>8}{'x ref':>8}")
    for what, seconds, nbytes, kind in rows:
        print(f"{what:<70}{seconds * 1e3:>9.2f}{nbytes / seconds / 1e9:>8.2f}{seconds / reference[kind]:>8.1f}")


if __name__ == "__main__":
    main()
