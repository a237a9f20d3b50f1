"""The per-minibatch trace of one stage (DESIGN §6, §8): one JSON line per minibatch."""

from __future__ import annotations

from typing import IO, Any

from hetpipe import outputs


class MinibatchTrace:
    """Collects a minibatch's forward fields until its backward ends, then writes the line.
    The compute thread alone writes to it."""

    def __init__(self, path: str, vw: int, stage: int) -> None:
        self.vw, self.stage = vw, stage
        self._file: IO[str] | None = open(path, "w") if path else None
        self._open: dict[int, dict[str, Any]] = {}

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def forward(self, p: int, **fields: float | int) -> None:
        if self._file is not None:
            self._open[p] = dict(fields)

    def micro(self, p: int, phase: str, m: int, start: float, end: float, **fields: float | int) -> None:
        """A micro-batch's forward or backward (phase "fwd" or "bwd"; m 0: all of p): p's row spans
        them all, lists each as [m, start, end] under micro_fwd or micro_bwd, and keeps the
        other fields of the first."""
        if self._file is None:
            return
        row = self._open.setdefault(p, {})
        row.setdefault(f"{phase}_start", start)
        row[f"{phase}_end"] = end
        row.setdefault(f"micro_{phase}", []).append([m, start, end])  # type: ignore[union-attr]
        for key, value in fields.items():
            row.setdefault(key, value)

    def backward(self, p: int, wave: int, **fields: float | int) -> None:
        """The backward of p ended (its line is written when p is committed)."""
        if self._file is not None:
            self._open[p] = {"vw": self.vw, "stage": self.stage, "p": p, "wave": wave, **self._open.get(p, {}),
                             **fields}

    def commit(self, p: int, **fields: float | int | bool) -> None:
        """p's step was applied (or, fp16, skipped): writes its line, forward fields first."""
        if self._file is None:
            return
        self._file.write(outputs.json_line({**self._open.pop(p), **fields}))   # a NaN loss: null
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
