"""Coordinator metrics (docs/metrics.md), read from the registry and the job at scrape time.
Registered by coordinator.__main__.build, so both `python -m coordinator` and the coordinator
embedded in `hetpipe run` export them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hetpipe.metrics import REGISTRY
from hetpipe.v1 import coordinator_pb2

if TYPE_CHECKING:
    from coordinator.job import JobRunner
    from coordinator.registry import Registry

State = coordinator_pb2.JobStatus.State
Role = coordinator_pb2.WorkerInfo.Role
STATES = [name for name in State.keys() if name != "STATE_UNSPECIFIED"]
ROLES = {Role.STAGE_WORKER: "stage_worker", Role.PS_SHARD: "ps_shard"}


class CoordinatorCollector(Collector):
    def __init__(self, registry: Registry, runner: JobRunner) -> None:
        self.registry = registry
        self.runner = runner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        current = State.Name(self.runner.machine.state)
        state = GaugeMetricFamily("hetpipe_job_state", "1 for the job's current state, 0 for the others",
                                  labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if name == current else 0.0)
        yield state

        counts = {(role, alive): 0 for role in ROLES.values() for alive in ("true", "false")}
        for w, _, is_alive in self.registry.workers():
            role = ROLES.get(w.info.role)
            if role is not None:
                counts[(role, "true" if is_alive else "false")] += 1
        workers = GaugeMetricFamily("hetpipe_workers", "Registered workers by role and liveness",
                                    labels=["role", "alive"])
        for (role_label, alive), n in counts.items():
            workers.add_metric([role_label, alive], n)
        yield workers

        progress = self.runner.progress
        rate = GaugeMetricFamily("hetpipe_job_samples_per_second",
                                 "The job's throughput (samples whose last stage finished, per second)")
        loss = GaugeMetricFamily("hetpipe_job_loss", "The job's loss: mean over the last stages' recent minibatches")
        if progress is not None:
            rate.add_metric([], progress.samples_per_second)
            if not math.isnan(progress.loss):
                loss.add_metric([], progress.loss)
        yield rate
        yield loss


_bound: CoordinatorCollector | None = None


def bind(registry: Registry, runner: JobRunner) -> None:
    """Registers the coordinator's collector, replacing an earlier coordinator's (tests build
    several in one process, one after another)."""
    global _bound
    if _bound is not None:
        REGISTRY.unregister(_bound)
    _bound = CoordinatorCollector(registry, runner)
    REGISTRY.register(_bound)
