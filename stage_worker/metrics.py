"""Stage-worker metrics (DESIGN §6), read from the runtime's state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hetpipe.metrics import REGISTRY

if TYPE_CHECKING:
    from stage_worker.runtime import StageRuntime


class StageCollector(Collector):
    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rt = self.runtime
        s = rt.status()
        labels = {"vw": str(s.vw), "stage": str(s.stage)}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        batch = rt.job.data.batch_size
        yield counter("hetpipe_stage_samples", "Samples whose backward finished at this stage", s.backwards_done * batch)
        yield counter("hetpipe_stage_compute_seconds", "Seconds spent running tasks", s.compute_seconds)
        yield counter("hetpipe_stage_idle_seconds", "Seconds with no runnable task (bubble)", s.idle_seconds)
        yield counter("hetpipe_stage_pull_wait_seconds", "Seconds forwards waited for a pull", s.wait_seconds)
        yield gauge("hetpipe_stage_in_flight_minibatches", "Minibatches forwarded here, backward pending", s.in_flight)
        yield gauge("hetpipe_stage_local_clock", "Waves completed at this stage", s.clock)
        yield gauge("hetpipe_stage_min_clock", "c_global the local weights include", s.min_clock)
        yield gauge("hetpipe_stage_local_version", "Own minibatch updates in the local weights", s.local_version)
        if rt.last:
            yield gauge("hetpipe_stage_loss", "Mean loss over the last 10 minibatches", s.recent_loss)


_bound: StageCollector | None = None


def bind(runtime: StageRuntime) -> None:
    """Registers the runtime's collector once it is assigned, replacing an earlier runtime's (a
    process serves one stage; in-process test servers create several runtimes one after another)."""
    global _bound
    if _bound is not None:
        REGISTRY.unregister(_bound)
    _bound = StageCollector(runtime)
    REGISTRY.register(_bound)
