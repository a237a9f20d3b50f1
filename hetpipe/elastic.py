"""Pure elastic-averaging rules (parallel.sync elastic, EA-Pipe): when a stage exchanges its replica
with the shards' master, and what one exchange changes. No gRPC, no threads."""

from __future__ import annotations

import math

import torch

from hetpipe.parallelism import ELASTIC_ALPHA as DEFAULT_ALPHA, ELASTIC_PERIOD as DEFAULT_PERIOD, MAX_ELASTIC_ALPHA as MAX_ALPHA

__all__ = ["DEFAULT_ALPHA", "DEFAULT_PERIOD", "MAX_ALPHA", "elastic_delta", "exchange_after", "total_exchanges",
           "waves_covered"]


def total_exchanges(total_waves: int, period: int) -> int:
    """Exchanges of one VW in a run: one after every `period` waves, and one after the last wave."""
    return math.ceil(total_waves / period)


def exchange_after(wave: int, period: int, total_waves: int) -> int | None:
    """The exchange a stage makes once it has finished `wave` (from 0), or None: exchange e follows
    wave (e + 1) * period - 1, and the last one the run's last wave."""
    if (wave + 1) % period == 0 or wave + 1 == total_waves:
        return wave // period
    return None


def waves_covered(exchanges: int, period: int, total_waves: int) -> int:
    """A VW's waves that its first `exchanges` exchanges followed: the clock a shard reports for it."""
    return min(exchanges * period, total_waves)


def elastic_delta(replica: torch.Tensor, master: torch.Tensor, alpha: float) -> torch.Tensor:
    """delta = alpha * (x_i - x~): the master adds it, the replica subtracts it, so x_i + x~ is
    unchanged and x_i - x~ is scaled by 1 - 2*alpha."""
    return (replica - master).mul_(alpha)
