"""Stage-worker metrics (docs/metrics.md): counters and gauges read from the stage's Progress at
scrape time, histograms observed by the runtime (per forward) and by WSP (per push and pull)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetpipe.metrics import LATENCY_BUCKETS, REGISTRY
from stage_worker.assignment import Setup
from stage_worker.lifecycle import StageState
from stage_worker.progress import Progress

LABELS = ["vw", "stage"]

PUSH_SECONDS = Histogram(
    "hetpipe_stage_push_seconds", "Latency of one wave push to every shard owning this stage's keys",
    LABELS, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
PULL_SECONDS = Histogram(
    "hetpipe_stage_pull_seconds", "Latency of one pull from every shard, including the wait for c_global",
    LABELS, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
STALENESS = Histogram(
    "hetpipe_stage_staleness_minibatches",
    "Per forward: own minibatch updates missing from the weights used (p - 1 - local version)",
    LABELS, buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=REGISTRY,
)
GLOBAL_STALENESS = Histogram(
    "hetpipe_stage_global_staleness_waves",
    "Per forward: waves completed here minus the c_global the weights include",
    LABELS, buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 16, 32), registry=REGISTRY,
)
_HISTOGRAMS = (PUSH_SECONDS, PULL_SECONDS, STALENESS, GLOBAL_STALENESS)


class StageObservers:
    """One stage's histogram children: the label lookup is paid once per assignment."""

    def __init__(self, vw: int, stage: int) -> None:
        labels = (str(vw), str(stage))
        self.push = PUSH_SECONDS.labels(*labels)
        self.pull = PULL_SECONDS.labels(*labels)
        self._staleness = STALENESS.labels(*labels)
        self._global = GLOBAL_STALENESS.labels(*labels)

    def forward(self, p: int, local_version: int, clock: int, min_clock: int) -> None:
        self._staleness.observe(p - 1 - local_version)
        self._global.observe(clock - min_clock)


def observers(vw: int, stage: int) -> StageObservers:
    """Histogram children for a newly assigned stage. A process serves one stage; an earlier
    runtime's series (in-process test servers assign several one after another) are dropped."""
    for h in _HISTOGRAMS:
        h.clear()
    return StageObservers(vw, stage)


class StageCollector(Collector):
    """Reads the stage's Progress at scrape time through `snapshot` (None before an assignment)."""

    def __init__(self, snapshot: Callable[[], Progress]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # registering must not call collect(): assign() holds the runtime's lock then

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s.state == StageState.IDLE:  # not assigned yet: no vw or stage to label anything with
            return
        names, values = LABELS, [str(s.vw), str(s.stage)]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        def by(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, label: str,
               parts: dict[str, float]) -> Metric:
            m = kind(name, doc, labels=[*names, label])
            for part, value in parts.items():
                m.add_metric([*values, part], value)
            return m

        yield counter("hetpipe_stage_samples", "Samples whose backward finished at this stage", s.samples)
        yield by(CounterMetricFamily, "hetpipe_stage_compute_seconds", "Seconds spent running tasks, by phase",
                 "phase", {"forward": s.forward_seconds, "backward": s.backward_seconds})
        yield counter("hetpipe_stage_idle_seconds", "Seconds with no runnable task (bubble)", s.idle_seconds)
        yield gauge("hetpipe_stage_queue_depth", "Inputs received and waiting to run", s.queue_depth)
        yield gauge("hetpipe_stage_in_flight_minibatches", "Minibatches forwarded here, backward pending",
                    s.in_flight)
        yield by(CounterMetricFamily, "hetpipe_stage_sent_bytes",
                 "Tensor bytes sent: activations (forward) and gradients (backward)",
                 "phase", {"forward": s.sent_forward_bytes, "backward": s.sent_backward_bytes})
        yield by(CounterMetricFamily, "hetpipe_stage_link_socket_bundles",
                 "Bundles sent over the peer's link socket rather than a gRPC stream (hetpipe/link_socket.py)",
                 "phase", {"forward": s.socket_forward_bundles, "backward": s.socket_backward_bundles})
        yield counter("hetpipe_stage_shm_bytes",
                      "Tensor bytes sent, pushed or pulled through shared memory (parallel.transport)", s.shm_bytes)
        yield counter("hetpipe_stage_pull_wait_seconds", "Seconds forwards were blocked on the clock bound (G2)",
                      s.wait_seconds)
        yield counter("hetpipe_stage_pull_wait_idle_seconds",
                      "The part of the pull wait with no other task to run", s.wait_idle_seconds)
        yield gauge("hetpipe_stage_local_clock", "Waves completed at this stage", s.clock)
        yield gauge("hetpipe_stage_min_clock", "c_global the local weights include", s.min_clock)
        if not math.isnan(s.recent_loss):
            yield gauge("hetpipe_stage_loss", "Mean loss over the last 10 minibatches", s.recent_loss)
        yield by(GaugeMetricFamily, "hetpipe_device_memory_bytes",
                 "Device memory of this stage (emulated or CPU: the plan's accounting)", "kind",
                 {"used": s.memory_used_bytes, "capacity": s.memory_capacity_bytes})
        info = GaugeMetricFamily("hetpipe_stage_info", "What this stage runs on (always 1)",
                                 labels=[*names, "gpu", "device", "emulated"])
        gpu = s.gpu_type or ("cuda" if s.device.startswith("cuda") else "cpu")
        info.add_metric([*values, gpu, s.device, "true" if s.emulated else "false"], 1)
        yield info


def device_memory(setup: Setup) -> tuple[float, float]:
    """(used, capacity): measured on a real CUDA device, else the plan's estimate and capacity."""
    if setup.device.kind == "cuda" and not setup.emulated:
        device = torch.device(setup.device.name)
        return float(torch.cuda.memory_allocated(device)), float(setup.device.memory_bytes)
    return float(setup.memory_bytes), float(setup.capacity_bytes)


_bound: StageCollector | None = None


def bind(snapshot: Callable[[], Progress]) -> None:
    """Registers a collector of the stage's Progress once it is assigned, replacing an earlier
    one's (a process serves one stage; in-process test servers assign several one after another)."""
    global _bound
    if _bound is not None:
        REGISTRY.unregister(_bound)
    _bound = StageCollector(snapshot)
    REGISTRY.register(_bound)
