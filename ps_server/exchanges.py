"""Elastic averaging's record at a shard (parallel.sync elastic, EA-Pipe): how many exchanges
each VW has made of each key, and the delta its latest one got; pure, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from hetpipe.buffers import raw_bytes
from ps_server.sync_rule import is_retry


class Exchanges:
    """Per key, the exchanges each VW has made, and the delta its latest one got: a retry of that
    one (its answer lost) is answered with the same delta and changes nothing."""

    def __init__(self) -> None:
        self.count: dict[str, list[int]] = {}                      # key -> exchanges per VW
        self.last_delta: dict[str, list[torch.Tensor | None]] = {}  # key -> each VW's latest delta
        self.applied = 0

    def add_key(self, key: str, virtual_workers: int) -> None:
        self.count[key] = [0] * virtual_workers
        self.last_delta[key] = [None] * virtual_workers

    def retry(self, vw: int, clock: int, keys: Sequence[str]) -> list[tuple[str, torch.Tensor]] | None:
        """The deltas of vw's exchange `clock` of these keys, copied, where it was its latest (a
        retry); None where it is the next. ShardError for any other clock: one that goes
        backwards or skips ahead."""
        if not is_retry({self.count[k][vw] for k in keys}, clock, f"exchange of vw {vw} for clock {clock}",
                        "its exchanges for these keys are"):
            return None
        stored = [(k, self.last_delta[k][vw]) for k in keys]
        return [(k, d.clone()) for k, d in stored if d is not None]

    def record(self, vw: int, clock: int, deltas: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vw's exchange `clock` applied, with these deltas (kept, not copied)."""
        for key, delta in deltas:
            self.count[key][vw] = clock + 1
            self.last_delta[key][vw] = delta
        self.applied += 1

    def feed(self, h: Any) -> None:
        """Adds the record to a digest (hashlib's update)."""
        for key in sorted(self.count):
            h.update(f"{key}:{self.count[key]}".encode())
            for delta in self.last_delta[key]:
                h.update(b"-" if delta is None else raw_bytes(delta))

    def snapshot(self) -> dict[str, Any]:
        """Plain tensors and ints, under the names a shard's checkpoint has always used."""
        return {
            "exchanged": {k: torch.tensor(c, dtype=torch.int64) for k, c in self.count.items()},
            "last_delta": {k: [None if d is None else d.clone() for d in ds] for k, ds in self.last_delta.items()},
            "exchanges_applied": self.applied,
        }

    @classmethod
    def restored(cls, snap: Mapping[str, object]) -> Exchanges:
        """From a shard's snapshot (one without elastic averaging's names: none made)."""
        count, last_delta = snap.get("exchanged") or {}, snap.get("last_delta") or {}
        assert isinstance(count, dict) and isinstance(last_delta, dict)
        book = cls()
        book.count = {k: [int(c) for c in t.tolist()] for k, t in count.items()}
        book.last_delta = {k: [None if d is None else d.clone() for d in ds] for k, ds in last_delta.items()}
        book.applied = int(snap.get("exchanges_applied", 0))  # type: ignore[call-overload]
        return book
