"""Shard metrics (DESIGN §6), read from the shard at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hetpipe.metrics import REGISTRY

if TYPE_CHECKING:
    from ps_server.servicer import ShardServicer


class ShardCollector(Collector):
    def __init__(self, servicer: ShardServicer) -> None:
        self.servicer = servicer

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.servicer.status()
        pushes = CounterMetricFamily("hetpipe_ps_pushes", "Pushes by outcome", labels=["outcome"])
        pushes.add_metric(["applied"], s.pushes_applied)
        pushes.add_metric(["duplicate"], s.pushes_duplicate)
        yield pushes
        clocks = GaugeMetricFamily("hetpipe_ps_vw_clock", "Each VW's clock (min over this shard's keys)",
                                   labels=["vw"])
        for c in s.clocks:
            clocks.add_metric([str(c.vw)], c.min_clock)
        yield clocks
        yield GaugeMetricFamily("hetpipe_ps_global_clock", "c_global over this shard's keys", value=s.c_global)
        yield GaugeMetricFamily("hetpipe_ps_clock_distance", "Fastest minus slowest VW clock", value=s.clock_distance)
        yield CounterMetricFamily("hetpipe_ps_pull_wait_seconds", "Seconds pulls waited for c_global",
                                  value=self.servicer.pull_wait_seconds)


def bind(servicer: ShardServicer) -> None:
    REGISTRY.register(ShardCollector(servicer))
