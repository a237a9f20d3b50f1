"""One entry of a shard's push log on disk: a safetensors file of an update's tensors, whose
metadata names its kind, VW, clock and its place in the order the shard applied its updates.
The format alone: when entries are written, placed, synced and replayed is ps_server/durability.py's."""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hetpipe import wire
from hetpipe.buffers import raw_bytes
from hetpipe.weight_files import header
from ps_server.shard import Shard

log = logging.getLogger(__name__)
# An entry's place in the order the shard applied its updates, the first field of its metadata so
# that it sits at a fixed offset of the file: set_place() writes it there right before a push logged
# before the lock is applied. 0: not placed (yet).
PLACE = "applied"
_PLACE_DIGITS = 12
_PLACE_AT = 8 + len(b'{"__metadata__":{"applied":"')   # safetensors: 8 bytes of length, then the JSON


def metadata(kind: str, vw: int, clock: int, place: int) -> dict[str, str]:
    """An entry's metadata, its place first (where set_place() writes it)."""
    return {PLACE: _placed(place), "kind": kind, "vw": str(vw), "clock": str(clock)}


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry's header, read back; its tensors are read when it is applied (restore sorts
    every entry before it applies one)."""
    path: Path
    kind: str
    vw: int
    clock: int
    place: int   # in the order the updates were applied (given once the shard had checked it); 0: never applied

    def apply(self, shard: Shard) -> int:
        """1 if it changed shard, 0 for a duplicate or an entry unreadable on the disk; ShardError
        where the shard refuses it."""
        tensors = read_tensors(self.path)
        if tensors is None:
            return 0
        if self.kind == "exchange":  # an elastic exchange: replayed in order, it gives the same deltas
            return int(shard.exchange(self.vw, self.clock, tensors).applied)
        return int(shard.push(self.vw, self.clock, tensors, applied_before=self.place > 0))


def _unreadable(path: Path, exc: Exception) -> None:
    # Damaged on the disk: nothing of ours leaves a numbered entry unfinished.
    log.warning("push log entry %s unreadable, not replayed: %s", path.name, exc)


def read(path: Path) -> Entry | None:
    """The entry's header; None (with a warning) where the file is damaged."""
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        return Entry(path, meta["kind"], int(meta["vw"]), int(meta["clock"]), int(meta.get(PLACE, 0)))
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as exc:   # TypeError: no metadata
        _unreadable(path, exc)
        return None


def read_tensors(path: Path) -> list[tuple[str, torch.Tensor]] | None:
    try:
        with safe_open(path, framework="pt") as f:
            return [(key, f.get_tensor(key)) for key in f.keys()]
    except (OSError, SafetensorError) as exc:
        _unreadable(path, exc)
        return None


def set_place(path: Path, place: int, *, durable: bool = False) -> None:
    """Writes an entry's place into its header; durable: fsynced too."""
    fd = os.open(path, os.O_WRONLY)
    try:
        _pwrite_all(fd, _placed(place).encode(), _PLACE_AT)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, chunk: bytes | memoryview, position: int) -> int:
    """Writes chunk at position; returns the position after it."""
    while chunk:   # one write moves at most about 2 GiB
        written = os.pwrite(fd, chunk, position)
        chunk, position = chunk[written:], position + written
    return position


def _placed(place: int) -> str:
    """An entry's place as its header holds it: fixed width, so it can be written in place."""
    return f"{place:0{_PLACE_DIGITS}d}"


def _header(specs: list[tuple[str, torch.dtype, list[int], int]], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """weight_files.header(), with the entry's place where set_place() writes it."""
    head, offsets = header(specs, metadata)
    if PLACE in metadata and head[_PLACE_AT:_PLACE_AT + _PLACE_DIGITS] != metadata[PLACE].encode():
        raise RuntimeError(f"push log: the entry's place is not at byte {_PLACE_AT} of its header")
    return head, offsets


def write(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """A safetensors file of tensors at path, written over what path holds (no new file where it
    exists)."""
    views = [raw_bytes(tensor) for _, tensor in tensors]
    head, _ = _header([(name, t.dtype, list(t.shape), v.nbytes) for (name, t), v in zip(tensors, views)], metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        position = 0
        for chunk in (head, *views):
            position = _pwrite_all(fd, chunk, position)
        os.ftruncate(fd, position)   # a spare may have been longer
    finally:
        os.close(fd)


def write_stream(path: Path, stream: wire.Stream, metadata: dict[str, str]) -> list[tuple[str, torch.Tensor]]:
    """write() from a stream's pieces as they arrive; returns the tensors, on a private
    mapping of the file (its pages are the page cache's until written, which nothing does)."""
    specs = [(name, dtype, shape, nbytes) for name, (dtype, shape, nbytes) in zip(stream.names, stream.specs)]
    head, offsets = _header(specs, metadata)
    total = len(head) + sum(nbytes for *_, nbytes in specs)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _pwrite_all(fd, head, 0)
        for index, offset, piece in stream.pieces:   # checks the byte count, and a shared-memory handle at the end
            _pwrite_all(fd, piece, len(head) + offsets[index] + offset)
        os.ftruncate(fd, total)   # a spare may have been longer
        mapping = mmap.mmap(fd, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return [(name, _on(mapping, dtype, shape, len(head) + offset, nbytes))
            for (name, dtype, shape, nbytes), offset in zip(specs, offsets)]


def _on(mapping: mmap.mmap, dtype: torch.dtype, shape: list[int], offset: int, nbytes: int) -> torch.Tensor:
    if nbytes == 0:   # frombuffer refuses a count of 0
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)
