"""A shard's trace (DESIGN §6, §8): one JSON line per push applied and per pull answered."""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO

from hetpipe import outputs

FLUSH_EVERY_S = 1.0   # a shard killed with -9 loses at most this much of its trace


def trace_path(trace_dir: str | Path, shard: int) -> Path:
    """trace/ps/shard{j}.jsonl: beside the stages' files, not among them (their readers glob *.jsonl)."""
    return Path(trace_dir) / "ps" / f"shard{shard}.jsonl"


def _ends_a_line(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


class ShardTrace:
    """Appends to a buffered file, flushed at most every FLUSH_EVERY_S; a no-op until open() (a
    shard learns its index from Init) and without a trace directory. The servicer calls it under
    the lock it already holds, so it takes none of its own."""

    def __init__(self, trace_dir: str) -> None:
        self.trace_dir = trace_dir
        self.shard: int | None = None
        self._file: IO[str] | None = None
        self._flushed = 0.0

    def open(self, shard: int, *, append: bool) -> None:
        """append: a restarted shard goes on with the file its first life wrote."""
        if not self.trace_dir or self._file is not None:
            return
        path = trace_path(self.trace_dir, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.shard = shard
        self._file = open(path, "a" if append else "w", buffering=1 << 16)
        if append and self._file.tell() and not _ends_a_line(path):
            # The first life was killed mid-line (a full buffer goes out whole, lines or not): its
            # part-line ends here, or this life's first row would join it, and both be unreadable.
            self._file.write("\n")
        self._flushed = time.monotonic()

    def record(self, event: str, vw: int, clock: int, start: float, end: float,
               **fields: float | int | bool) -> None:
        if self._file is None:
            return
        self._file.write(outputs.json_line({"shard": self.shard, "event": event, "vw": vw, "clock": clock,
                                            "start": start, "end": end, **fields}))
        now = time.monotonic()
        if now - self._flushed >= FLUSH_EVERY_S:
            self._file.flush()
            self._flushed = now

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
