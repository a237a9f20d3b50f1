"""Shard durability: a checkpoint every M clocks plus a log of every push (and elastic exchange)
acknowledged since."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from hetpipe.outputs import save_atomically
from ps_server.shard import Shard, ShardError

log = logging.getLogger(__name__)


class Durability:
    """Writes each push to the log before it is acknowledged, so a kill -9 loses nothing acked.

    A checkpoint (every `every_clocks` of c_global, on Init and on SIGTERM) captures the whole
    shard and lets the log entries it covers be deleted. Restore = checkpoint + log replay;
    replaying a push the checkpoint already holds is a duplicate and a no-op by the clock rule.
    Everything is loaded with torch.load(weights_only=True).

    Under WSP a push may be logged outside the shard's lock (its sum commutes with the others'):
    such an entry is unsettled until settle() says whether it was applied, and a checkpoint
    covers (and deletes) only the entries below the first unsettled one. Replayed, an entry whose
    push was never acknowledged is applied, and its retry is then a duplicate: still exactly once.
    """

    def __init__(self, directory: str, every_clocks: int = 1) -> None:
        self.dir = Path(directory)
        self.log_dir = self.dir / "log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.every_clocks = max(1, every_clocks)
        self._seq = 0
        self._checkpointed_clock = 0
        self._lock = threading.Lock()      # _seq and _unsettled, which pushes logging outside the shard lock share
        self._unsettled: set[int] = set()

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pt"

    def restore(self, shard: Shard) -> int:
        """Loads the checkpoint and replays the log into shard; returns pushes replayed."""
        covered = 0
        if self.checkpoint_path.exists():
            snap = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
            shard.restore(snap)
            covered = int(snap["log_seq"])
            self._checkpointed_clock = shard.c_global() if shard.ready else 0
        replayed = 0
        entries = sorted(self.log_dir.glob("*.pt"))
        for entry in entries:
            seq = int(entry.stem)
            self._seq = max(self._seq, seq)
            if seq <= covered:
                continue
            record = torch.load(entry, map_location="cpu", weights_only=True)
            try:
                if "replica" in record:  # an elastic exchange: replayed in order, it gives the same deltas
                    if shard.exchange(int(record["vw"]), int(record["clock"]), list(record["replica"].items())).applied:
                        replayed += 1
                elif shard.push(int(record["vw"]), int(record["clock"]), list(record["deltas"].items())):
                    replayed += 1
            except ShardError as exc:
                # Logged before it was checked (WSP, outside the lock), refused, and the process
                # died before the entry was removed: it was never acknowledged.
                log.warning("push log entry %s not replayed: %s", entry.name, exc)
        self._seq = max(self._seq, covered)
        return replayed

    def _entry(self, record: dict[str, object]) -> int:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._unsettled.add(seq)
        try:
            save_atomically(record, self.log_dir / f"{seq:012d}.pt", durable=True)
        except BaseException:
            self.settle(seq, applied=False)
            raise
        return seq

    def log_push(self, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> int:
        """Logs a push before it is applied; returns its entry's number for settle()."""
        return self._entry({"vw": vw, "clock": clock, "deltas": dict(deltas)})

    def journal_push(self, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> None:
        """Logs a push that the caller, holding the shard's lock, applies right after (Shard.push's journal)."""
        self.settle(self.log_push(vw, clock, deltas), applied=True)

    def journal_exchange(self, vw: int, clock: int, replica: list[tuple[str, torch.Tensor]]) -> None:
        """Logs an elastic exchange, as journal_push."""
        self.settle(self._entry({"vw": vw, "clock": clock, "replica": dict(replica)}), applied=True)

    def settle(self, seq: int, *, applied: bool) -> None:
        """Entry seq's update was applied, or not (refused, or a duplicate): then it is removed,
        so that no restore applies it."""
        if not applied:
            (self.log_dir / f"{seq:012d}.pt").unlink(missing_ok=True)
        with self._lock:
            self._unsettled.discard(seq)

    def checkpoint(self, shard: Shard) -> None:
        if not shard.ready:
            return
        with self._lock:  # entries logged but not yet applied are not in the snapshot: keep them
            covered = min(self._unsettled) - 1 if self._unsettled else self._seq
        save_atomically({**shard.snapshot(), "log_seq": covered}, self.checkpoint_path, durable=True)
        for entry in self.log_dir.glob("*.pt"):
            if int(entry.stem) <= covered:
                entry.unlink(missing_ok=True)
        self._checkpointed_clock = shard.c_global()

    def maybe_checkpoint(self, shard: Shard) -> bool:
        """Checkpoints when c_global has advanced every_clocks past the last checkpoint."""
        if shard.c_global() - self._checkpointed_clock >= self.every_clocks:
            self.checkpoint(shard)
            return True
        return False
