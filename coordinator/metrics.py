"""Coordinator metrics (docs/metrics.md), read from a snapshot of the registry and the job at scrape
time. Registered by coordinator.__main__.build, so both `python -m coordinator` and the coordinator
embedded in `hetpipe run` export them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetpipe.metrics import REGISTRY
from hetpipe.v1 import coordinator_pb2

Role = coordinator_pb2.WorkerInfo.Role
ROLES: dict[int, str] = {Role.STAGE_WORKER: "stage_worker", Role.PS_SHARD: "ps_shard"}
STATES = ("NONE", "PENDING", "PLANNED", "RUNNING", "COMPLETED", "FAILED", "STOPPED")


@dataclass(frozen=True, slots=True)
class CoordinatorSnapshot:
    state: str                               # one of STATES
    workers: Sequence[tuple[int, bool]]      # (role, alive) of every registered worker
    samples_per_second: float | None         # None before the job runs
    loss: float | None
    virtual_workers: int = 0                 # the job's, once planned
    evicted: Sequence[int] = ()              # VWs that left the job


class CoordinatorCollector(Collector):
    def __init__(self, snapshot: Callable[[], CoordinatorSnapshot]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        state = GaugeMetricFamily("hetpipe_job_state", "1 for the job's current state, 0 for the others",
                                  labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if name == s.state else 0.0)
        yield state

        counts = {(role, alive): 0 for role in ROLES.values() for alive in ("true", "false")}
        for role_value, is_alive in s.workers:
            role = ROLES.get(role_value)
            if role is not None:
                counts[(role, "true" if is_alive else "false")] += 1
        workers = GaugeMetricFamily("hetpipe_workers", "Registered workers by role and liveness",
                                    labels=["role", "alive"])
        for (role_label, alive), n in counts.items():
            workers.add_metric([role_label, alive], n)
        yield workers

        rate = GaugeMetricFamily("hetpipe_job_samples_per_second",
                                 "The job's throughput (samples whose last stage finished, per second)")
        loss = GaugeMetricFamily("hetpipe_job_loss", "The job's loss: mean over the last stages' recent minibatches")
        if s.samples_per_second is not None:
            rate.add_metric([], s.samples_per_second)
        if s.loss is not None and not math.isnan(s.loss):
            loss.add_metric([], s.loss)
        yield rate
        yield loss

        evicted = GaugeMetricFamily("hetpipe_job_evicted", "1 for a virtual worker that left the job "
                                    "(parallel.on_vw_failure: continue), 0 for one still in it", labels=["vw"])
        for vw in range(s.virtual_workers):
            evicted.add_metric([str(vw)], 1.0 if vw in s.evicted else 0.0)
        yield evicted


_bound: CoordinatorCollector | None = None


def bind(snapshot: Callable[[], CoordinatorSnapshot]) -> None:
    """Registers the coordinator's collector, replacing an earlier coordinator's (tests build
    several in one process, one after another)."""
    global _bound
    if _bound is not None:
        REGISTRY.unregister(_bound)
    _bound = CoordinatorCollector(snapshot)
    REGISTRY.register(_bound)
