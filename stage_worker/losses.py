"""The last stage's losses as a poll reads them: the last ten, and the first that was NaN or Inf."""

from __future__ import annotations

from collections import deque

import torch


class Losses:
    """Kept as tensors where the losses are: adding one queues a few kernels and waits for none
    (on a GPU, reading a loss waits for the work before it: polls do that, off the compute
    thread). The first non-finite loss is kept apart, so that a poll names the minibatch where
    training diverged however many came after it. Not thread-safe: the runtime's lock guards it."""

    def __init__(self, keep: int = 10) -> None:
        self.recent: deque[tuple[int, torch.Tensor]] = deque(maxlen=keep)   # (p, loss)
        self.first_bad: tuple[torch.Tensor, torch.Tensor] | None = None   # (p, loss); p 0 while none

    def add(self, p: int, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.recent.append((p, loss))
        if self.first_bad is None:
            self.first_bad = (torch.zeros((), dtype=torch.int64, device=loss.device), torch.zeros_like(loss))
        at, value = self.first_bad
        now = ~torch.isfinite(loss) & (at == 0)
        self.first_bad = (torch.where(now, p, at), torch.where(now, loss, value))


def read(first_bad: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, float]:
    """Losses.first_bad as (p, its loss); (0, 0.0) while no loss was NaN or Inf."""
    if first_bad is None:
        return 0, 0.0
    at, value = first_bad
    return int(at), float(value)
