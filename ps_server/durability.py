"""Shard durability: a checkpoint every M clocks plus a log of every push (and elastic exchange)
acknowledged since."""

from __future__ import annotations

from pathlib import Path

import torch

from hetpipe.outputs import save_atomically
from ps_server.shard import Shard


class Durability:
    """Writes each push to the log before it is acknowledged, so a kill -9 loses nothing acked.

    A checkpoint (every `every_clocks` of c_global, on Init and on SIGTERM) captures the whole
    shard and lets the log entries it covers be deleted. Restore = checkpoint + log replay;
    replaying a push the checkpoint already holds is a duplicate and a no-op by the clock rule.
    Everything is loaded with torch.load(weights_only=True).
    """

    def __init__(self, directory: str, every_clocks: int = 1) -> None:
        self.dir = Path(directory)
        self.log_dir = self.dir / "log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.every_clocks = max(1, every_clocks)
        self._seq = 0
        self._checkpointed_clock = 0

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
            if "replica" in record:  # an elastic exchange: replayed in order, it gives the same deltas
                if shard.exchange(int(record["vw"]), int(record["clock"]), list(record["replica"].items())).applied:
                    replayed += 1
            elif shard.push(int(record["vw"]), int(record["clock"]), list(record["deltas"].items())):
                replayed += 1
        self._seq = max(self._seq, covered)
        return replayed

    def log_push(self, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> None:
        self._seq += 1
        save_atomically({"vw": vw, "clock": clock, "deltas": dict(deltas)}, self.log_dir / f"{self._seq:012d}.pt",
                        durable=True)

    def log_exchange(self, vw: int, clock: int, replica: list[tuple[str, torch.Tensor]]) -> None:
        self._seq += 1
        save_atomically({"vw": vw, "clock": clock, "replica": dict(replica)}, self.log_dir / f"{self._seq:012d}.pt",
                        durable=True)

    def checkpoint(self, shard: Shard) -> None:
        if not shard.ready:
            return
        save_atomically({**shard.snapshot(), "log_seq": self._seq}, self.checkpoint_path, durable=True)
        for entry in self.log_dir.glob("*.pt"):
            if int(entry.stem) <= self._seq:
                entry.unlink(missing_ok=True)
        self._checkpointed_clock = shard.c_global()

    def maybe_checkpoint(self, shard: Shard) -> bool:
        """Checkpoints when c_global has advanced every_clocks past the last checkpoint."""
        if shard.c_global() - self._checkpointed_clock >= self.every_clocks:
            self.checkpoint(shard)
            return True
        return False
