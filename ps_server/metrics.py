"""Shard metrics (docs/metrics.md), read from the shard at scrape time, labelled with the shard's
index in the plan (known from Init, or after a restart from the checkpoint directory)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetpipe.metrics import REGISTRY


@dataclass(frozen=True, slots=True)
class ShardSnapshot:
    """The shard's counters at one instant (ShardServicer.metrics_snapshot)."""

    shard: int
    pushes_applied: int
    pushes_duplicate: int
    received_bytes: int
    sent_bytes: int
    pull_wait_seconds: float
    vw_clocks: list[int]      # per VW: min over this shard's keys
    c_global: int
    clock_distance: int


class ShardCollector(Collector):
    """Reads the shard's counters at scrape time through `snapshot` (None before Init)."""

    def __init__(self, snapshot: Callable[[], ShardSnapshot | None]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s is None:  # not initialised: which shard this is is not known yet
            return
        shard = str(s.shard)

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                   value: float) -> Metric:
            m = kind(name, doc, labels=["shard"])
            m.add_metric([shard], value)
            return m

        pushes = CounterMetricFamily("hetpipe_ps_pushes", "Pushes by outcome", labels=["shard", "outcome"])
        pushes.add_metric([shard, "applied"], s.pushes_applied)
        pushes.add_metric([shard, "duplicate"], s.pushes_duplicate)
        yield pushes
        yield family(CounterMetricFamily, "hetpipe_ps_received_bytes", "Push payload bytes received",
                     s.received_bytes)
        yield family(CounterMetricFamily, "hetpipe_ps_sent_bytes", "Pull payload bytes sent", s.sent_bytes)
        clocks = GaugeMetricFamily("hetpipe_ps_vw_clock", "Each VW's clock (min over this shard's keys)",
                                   labels=["shard", "vw"])
        for vw, clock in enumerate(s.vw_clocks):
            clocks.add_metric([shard, str(vw)], clock)
        yield clocks
        yield family(GaugeMetricFamily, "hetpipe_ps_global_clock", "c_global over this shard's keys", s.c_global)
        yield family(GaugeMetricFamily, "hetpipe_ps_clock_distance", "Fastest minus slowest VW clock",
                     s.clock_distance)
        yield family(CounterMetricFamily, "hetpipe_ps_pull_wait_seconds", "Seconds pulls waited for c_global",
                     s.pull_wait_seconds)


_bound: ShardCollector | None = None


def bind(snapshot: Callable[[], ShardSnapshot | None]) -> None:
    """Registers a collector of the shard's snapshots, replacing an earlier one's (one shard per process)."""
    global _bound
    if _bound is not None:
        REGISTRY.unregister(_bound)
    _bound = ShardCollector(snapshot)
    REGISTRY.register(_bound)


def unbind() -> None:
    """Removes the bound collector (in-process tests that are done with their shard)."""
    global _bound
    if _bound is not None:
        REGISTRY.unregister(_bound)
        _bound = None
