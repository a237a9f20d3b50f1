"""Shard durability: a checkpoint every M clocks plus a log of every push (and elastic exchange)
acknowledged since."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hetpipe.outputs import save_atomically, write_atomically
from ps_server.shard import Shard, ShardError

log = logging.getLogger(__name__)
LOG_SUFFIX = ".safetensors"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A checkpoint captured under the shard's lock, to be written outside it."""
    state: dict[str, Any]
    covered: int   # the log entries it holds: every one numbered up to this
    number: int    # captures before it, so that an older one never overwrites a newer one


def _seq_of(entry: Path) -> int:
    return int(entry.name.removesuffix(LOG_SUFFIX))


class Durability:
    """Writes each push to the log before it is acknowledged, so a kill -9 loses nothing acked.

    A checkpoint (every `every_clocks` of c_global, on Init and on SIGTERM) captures the whole
    shard and lets the log entries it covers be deleted. Restore = checkpoint + log replay;
    replaying a push the checkpoint already holds is a duplicate and a no-op by the clock rule.
    The checkpoint is loaded with torch.load(weights_only=True); log entries are safetensors files.

    Under WSP a push may be logged outside the shard's lock (its sum commutes with the others'):
    such an entry is unsettled until settle() says whether it was applied, and a checkpoint
    covers (and deletes) only the entries below the first unsettled one. Replayed, an entry whose
    push was never acknowledged is applied, and its retry is then a duplicate: still exactly once.

    Such an entry also reaches the disk after it is applied (sync(), before the acknowledgement):
    the fsync is then off the path from a push to the pulls waiting on it. A kill -9 loses
    nothing (the page cache outlives the process); a power cut may lose an entry a pull has seen,
    but never one acknowledged, and its push is retried, so the sum is whole again.
    """

    def __init__(self, directory: str, every_clocks: int = 1) -> None:
        self.dir = Path(directory)
        self.log_dir = self.dir / "log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.every_clocks = max(1, every_clocks)
        self._seq = 0
        self._checkpointed_clock = 0
        self._lock = threading.Lock()      # _seq, _unsettled and _unsynced, which pushes logging outside the shard lock share
        self._unsettled: set[int] = set()
        self._unsynced: set[int] = set()   # entries written but not yet on disk (log_push, before sync)
        self._captured = 0                 # checkpoints captured; the number of the last one written:
        self._written = 0
        self._write_lock = threading.Lock()

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pt"

    def entry_path(self, seq: int) -> Path:
        return self.log_dir / f"{seq:012d}{LOG_SUFFIX}"

    def entries(self) -> list[Path]:
        """The log's entries, oldest first."""
        return sorted(self.log_dir.glob(f"*{LOG_SUFFIX}"))

    def restore(self, shard: Shard) -> int:
        """Loads the checkpoint and replays the log into shard; returns pushes replayed."""
        covered = 0
        if self.checkpoint_path.exists():
            snap = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
            shard.restore(snap)
            covered = int(snap["log_seq"])
            self._checkpointed_clock = shard.c_global() if shard.ready else 0
        replayed = 0
        for entry in self.entries():
            seq = _seq_of(entry)
            self._seq = max(self._seq, seq)
            if seq <= covered:
                continue
            try:
                with safe_open(entry, framework="pt") as f:
                    meta = f.metadata()
                    tensors = [(key, f.get_tensor(key)) for key in f.keys()]
            except (OSError, SafetensorError) as exc:
                # Cut short by a power cut before sync(): its push was never acknowledged.
                log.warning("push log entry %s unreadable, not replayed: %s", entry.name, exc)
                continue
            vw, clock = int(meta["vw"]), int(meta["clock"])
            try:
                if meta["kind"] == "exchange":  # an elastic exchange: replayed in order, it gives the same deltas
                    if shard.exchange(vw, clock, tensors).applied:
                        replayed += 1
                elif shard.push(vw, clock, tensors):
                    replayed += 1
            except ShardError as exc:
                # Logged before it was checked (WSP, outside the lock), refused, and the process
                # died before the entry was removed: it was never acknowledged.
                log.warning("push log entry %s not replayed: %s", entry.name, exc)
        self._seq = max(self._seq, covered)
        return replayed

    def _entry(self, kind: str, vw: int, clock: int, tensors: list[tuple[str, torch.Tensor]], *,
               durable: bool = True) -> int:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._unsettled.add(seq)
            if not durable:
                self._unsynced.add(seq)
        metadata = {"kind": kind, "vw": str(vw), "clock": str(clock)}
        try:
            # safetensors: raw bytes and a small header, about 1.5x faster to write than torch.save's
            # zip of pickles (which was a third of a shard's time under two pushing VWs), and no
            # pickle to read back.
            write_atomically(self.entry_path(seq), lambda tmp: save_file(dict(tensors), tmp, metadata=metadata),
                             durable=durable)
        except BaseException:
            self.settle(seq, applied=False)
            raise
        return seq

    def log_push(self, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> int:
        """Logs a push before it is applied, not yet on disk; returns its entry's number for
        settle() and then, before the push is acknowledged, sync()."""
        return self._entry("push", vw, clock, deltas, durable=False)

    def sync(self, seq: int | None = None) -> None:
        """Puts entry seq on disk; None: every entry not yet there (a duplicate's acknowledgement
        must not overtake its original's). An entry a checkpoint removed is on disk in it. An
        fsync that fails raises and leaves the entry pending, so the push's retry tries again."""
        with self._lock:
            pending = sorted(self._unsynced) if seq is None else [seq] if seq in self._unsynced else []
        for entry in pending:
            try:
                fd = os.open(self.entry_path(entry), os.O_RDONLY)
            except FileNotFoundError:
                pass
            else:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            with self._lock:
                self._unsynced.discard(entry)

    def journal_push(self, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> None:
        """Logs a push that the caller, holding the shard's lock, applies right after (Shard.push's journal)."""
        self.settle(self.log_push(vw, clock, deltas), applied=True)

    def journal_exchange(self, vw: int, clock: int, replica: list[tuple[str, torch.Tensor]]) -> None:
        """Logs an elastic exchange, as journal_push."""
        self.settle(self._entry("exchange", vw, clock, replica), applied=True)

    def settle(self, seq: int, *, applied: bool) -> None:
        """Entry seq's update was applied, or not (refused, or a duplicate): then it is removed,
        so that no restore applies it."""
        if not applied:
            self.entry_path(seq).unlink(missing_ok=True)
        with self._lock:
            self._unsettled.discard(seq)
            if not applied:
                self._unsynced.discard(seq)

    def capture(self, shard: Shard) -> Snapshot | None:
        """The checkpoint of shard as it is now (the caller holds the shard's lock), for write()."""
        if not shard.ready:
            return None
        with self._lock:  # entries logged but not yet applied are not in the snapshot: keep them
            covered = min(self._unsettled) - 1 if self._unsettled else self._seq
            self._captured += 1
            number = self._captured
        self._checkpointed_clock = shard.c_global()
        return Snapshot({**shard.snapshot(), "log_seq": covered}, covered, number)

    def write(self, snapshot: Snapshot) -> None:
        """Puts a captured checkpoint on disk and deletes the log entries it covers; the shard's
        lock need not be held, so pushes go on meanwhile. One captured later wins."""
        with self._write_lock:
            if snapshot.number < self._written:
                return
            save_atomically(snapshot.state, self.checkpoint_path, durable=True)
            self._written = snapshot.number
            for entry in self.entries():
                if _seq_of(entry) <= snapshot.covered:
                    entry.unlink(missing_ok=True)

    def checkpoint(self, shard: Shard) -> None:
        """capture() and write() at once."""
        snapshot = self.capture(shard)
        if snapshot is not None:
            self.write(snapshot)

    def maybe_capture(self, shard: Shard) -> Snapshot | None:
        """A checkpoint to write() when c_global has advanced every_clocks past the last one."""
        if shard.c_global() - self._checkpointed_clock >= self.every_clocks:
            return self.capture(shard)
        return None
