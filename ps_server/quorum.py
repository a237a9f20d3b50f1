"""One key's quorum rounds (parallel.sync quorum, eager-SGD's partial reduction): pure, no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from hetpipe.buffers import raw_bytes


def quorum_size(quorum: int, live: int) -> int:
    """On-time VWs that close a round: `quorum` (0: a majority, floor(live/2) + 1), at most the
    VWs still in the job, so that an eviction never leaves a round that cannot close."""
    return live // 2 + 1 if quorum == 0 else min(quorum, live)


@dataclass(slots=True)
class Round:
    """The contributions waiting in one open round of one key."""

    total: torch.Tensor | None = None                     # their sum
    on_time: set[int] = field(default_factory=set)        # VWs whose own wave r is here: r's quorum
    waves: dict[int, int] = field(default_factory=dict)   # vw -> how many of its waves are here


class KeyRounds:
    """Round r of a key holds the waves r that arrived on time, and every late wave (c < rounds
    closed) folded into the open round when it arrived. Round r closes, once rounds 0..r-1 have,
    when `quorum_size` live VWs' own waves r are in it: its sum is added to w_global once.
    A VW's waves enter rounds in order (round = max(c, rounds closed) never decreases), so the
    waves applied are a prefix of the waves pushed: `applied[vw]` says how long."""

    def __init__(self, virtual_workers: int) -> None:
        self.closed = 0
        self.open: dict[int, Round] = {}
        self.applied = [0] * virtual_workers

    def takes_copy(self, wave: int) -> bool:
        """Whether add() of this wave starts its round's total (a copy of the delta)."""
        pending = self.open.get(max(wave, self.closed))
        return pending is None or pending.total is None

    def add(self, vw: int, wave: int, delta: torch.Tensor, first: torch.Tensor | None = None) -> int:
        """Puts VW vw's wave into its round; returns the round. first: the delta's copy, made
        beforehand (takes_copy), for a round that has no total yet."""
        r = max(wave, self.closed)
        pending = self.open.setdefault(r, Round())
        if pending.total is None:
            pending.total = first if first is not None else delta.clone()
        else:
            pending.total.add_(delta)
        if r == wave:
            pending.on_time.add(vw)
        pending.waves[vw] = pending.waves.get(vw, 0) + 1
        return r

    def _apply(self, r: int, value: torch.Tensor) -> None:
        pending = self.open.pop(r)
        if pending.total is not None:
            value.add_(pending.total)
        for vw, n in pending.waves.items():
            self.applied[vw] += n

    def close_ready(self, value: torch.Tensor, quorum: int, live: Collection[int]) -> int:
        """Closes the next rounds while each has its quorum, adding them to value; returns how many."""
        voters, before = set(live), self.closed
        need = quorum_size(quorum, len(voters))
        while (pending := self.open.get(self.closed)) is not None and len(pending.on_time & voters) >= need:
            self._apply(self.closed, value)
            self.closed += 1
        return self.closed - before

    def flush(self, value: torch.Tensor, total_waves: int) -> None:
        """Every live VW has pushed its last wave: every open round is applied, in order."""
        for r in sorted(self.open):
            self._apply(r, value)
        self.closed = max(self.closed, total_waves)

    # ---- durability: tensors and ints only (torch.load weights_only) -----------------------------

    def snapshot(self) -> dict[str, object]:
        rounds = sorted(self.open)
        return {
            "closed": self.closed,
            "applied": torch.tensor(self.applied, dtype=torch.int64),
            "rounds": torch.tensor(rounds, dtype=torch.int64),
            # Cloned: the checkpoint is written after the lock is let go, and a later push adds
            # into an open round's total in place (its log entry, past the checkpoint, replays).
            "totals": [None if (t := self.open[r].total) is None else t.clone() for r in rounds],
            "on_time": [torch.tensor(sorted(self.open[r].on_time), dtype=torch.int64) for r in rounds],
            "waves": [torch.tensor(sorted(self.open[r].waves.items()), dtype=torch.int64).reshape(-1, 2)
                      for r in rounds],
        }

    @classmethod
    def restored(cls, snap: Mapping[str, object]) -> KeyRounds:
        applied, rounds, totals = snap["applied"], snap["rounds"], snap["totals"]
        on_time, waves = snap["on_time"], snap["waves"]
        assert isinstance(applied, torch.Tensor) and isinstance(rounds, torch.Tensor)
        assert isinstance(totals, list) and isinstance(on_time, list) and isinstance(waves, list)
        book = cls(len(applied))
        book.closed = int(snap["closed"])  # type: ignore[call-overload]
        book.applied = [int(a) for a in applied.tolist()]
        for r, total, voters, counts in zip(rounds.tolist(), totals, on_time, waves):
            book.open[int(r)] = Round(None if total is None else total.clone(), {int(v) for v in voters.tolist()},
                                      {int(v): int(n) for v, n in counts.tolist()})
        return book

    def feed(self, h: "hashlib._Hash") -> None:
        """Adds to the shard's digest what it covers beyond w_global: which contributions wait where."""
        h.update(f"closed={self.closed} applied={self.applied}".encode())
        for r in sorted(self.open):
            pending = self.open[r]
            h.update(f"r{r}:{sorted(pending.on_time)}:{sorted(pending.waves.items())}".encode())
            if pending.total is not None:
                h.update(raw_bytes(pending.total))
