"""What a traced stage's sync writes beside its minibatch trace: the sync trace and O3's ledger."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import torch

from hetpipe import outputs, weight_files

log = logging.getLogger(__name__)


class SyncRecord:
    """The sync trace (trace/sync/vwV_stageQ.jsonl: when each push, pull or exchange was queued,
    sent, answered and merged; what explains a wait that the minibatch trace only shows the end
    of) and, with `ledger`, the ledger (trace/acked_vwV_stageQ.pt: the sum of every update the
    shards acknowledged, which O3 checks them against). The ledger is model-sized and saved at
    every push, so a job asks for it apart from the trace (output.ledger); untraced (trace_dir
    ""), every method does nothing."""

    def __init__(self, trace_dir: str, trace_name: str, keys: Sequence[str], params: Sequence[torch.Tensor], *,
                 ledger: bool = False) -> None:
        self.keys = list(keys)
        ledger = ledger and bool(trace_dir)
        self.ledger = [torch.zeros_like(p, device="cpu") for p in params] if ledger else []
        self._ledger_path = ""
        self._trace: IO[str] | None = None
        self._lock = threading.Lock()   # rows come from the compute thread and the pusher
        if trace_dir:
            trace = Path(trace_dir)
            if ledger:
                self._ledger_path = str(trace / f"acked_{Path(trace_name).stem}.pt")
            (trace / "sync").mkdir(parents=True, exist_ok=True)
            self._trace = open(trace / "sync" / trace_name, "w")

    @property
    def enabled(self) -> bool:
        return bool(self._ledger_path)

    def write(self, row: dict[str, float | int | str]) -> None:
        with self._lock:
            if self._trace is not None:
                self._trace.write(outputs.json_line(row))
                self._trace.flush()

    def in_flight(self, sent: Sequence[torch.Tensor]) -> None:
        """Saves the ledger with the update about to be sent. A stage killed mid-push leaves both,
        so O3 can check a VW that left the job: each of its keys holds the acknowledged sum, or
        that plus the update in flight (applied, its acknowledgement lost)."""
        self._save(sent)

    def acknowledged(self, sent: Sequence[torch.Tensor]) -> None:
        """Adds an acknowledged update to the ledger and saves it, with nothing in flight."""
        if not self.enabled:
            return
        for total, u in zip(self.ledger, sent):
            total.add_(u.cpu())
        self._save(None)

    def restore(self, ledger: list[torch.Tensor] | None) -> None:
        """Goes on from a checkpoint's ledger (state()'s). A cut taken without one (output.ledger
        off then) cannot say what was acknowledged before it: from such a cut no ledger is kept,
        rather than one that starts at zero and undercounts."""
        if not self.enabled:
            return
        if ledger is None or len(ledger) != len(self.ledger):
            log.warning("output.ledger: the checkpoint this run goes on from has no ledger (taken with "
                        "output.ledger off); this stage writes none")
            self.ledger, self._ledger_path = [], ""
            return
        self.ledger = [t.clone() for t in ledger]

    def state(self) -> list[torch.Tensor] | None:
        """The ledger for a checkpoint: None where this job keeps none."""
        return [t.clone() for t in self.ledger] if self.enabled else None

    def close(self) -> None:
        with self._lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    def _save(self, pending: Sequence[torch.Tensor] | None) -> None:
        if not self.enabled:
            return
        record = {"acked": dict(zip(self.keys, self.ledger)),
                  "pending": {} if pending is None else {k: u.cpu() for k, u in zip(self.keys, pending)}}
        weight_files.save_atomically(record, self._ledger_path)
