"""A virtual worker's GPUs as the partitioner sees them: kinds (type, memory) on nodes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.catalog import gpu_type
from hetpipe.config import JobConfig
from hetpipe.devices import local_devices


@dataclass(frozen=True, slots=True)
class Gpu:
    id: str        # "n0/1": node name / index on the node
    node: str
    type: str      # catalog name, or "cpu"/"cuda"
    memory_bytes: int


class PlanError(ValueError):
    """No plan fits; the message names the stage, the device, and bytes needed vs available."""


Usage = tuple[tuple[int, ...], ...]          # per node (canonical order), GPUs used per kind


class Cluster:
    """A VW's GPUs as kinds (type, memory) on nodes; nodes sorted so that equal ones are adjacent."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        self.kinds = sorted({(g.type, g.memory_bytes) for g in gpus})
        kind_of = {kind: i for i, kind in enumerate(self.kinds)}
        by_node: dict[str, list[Gpu]] = {}
        for g in gpus:
            by_node.setdefault(g.node, []).append(g)

        def composition(node: str) -> tuple[int, ...]:
            counts = [0] * len(self.kinds)
            for g in by_node[node]:
                counts[kind_of[(g.type, g.memory_bytes)]] += 1
            return tuple(counts)

        self.nodes = sorted(by_node, key=lambda node: (composition(node), node))
        self.composition = [composition(node) for node in self.nodes]
        self.free = [sum(c) for c in self.composition]
        # members[j][d]: the GPUs of kind d on node j, by id.
        self.members = [[sorted((g for g in by_node[node] if kind_of[(g.type, g.memory_bytes)] == d),
                                key=lambda g: g.id) for d in range(len(self.kinds))] for node in self.nodes]
        # Ranges of interchangeable nodes.
        self.groups: list[tuple[int, int]] = []
        for j, comp in enumerate(self.composition):
            if self.groups and self.composition[self.groups[-1][0]] == comp:
                self.groups[-1] = (self.groups[-1][0], j + 1)
            else:
                self.groups.append((j, j + 1))
        self.kind_gpus = [sorted((g for g in gpus if kind_of[(g.type, g.memory_bytes)] == d), key=lambda g: g.id)
                          for d in range(len(self.kinds))]

    def canonical(self, usage: Usage, cur: int) -> tuple[Usage, int, list[int]]:
        """Sorts interchangeable nodes by usage (the current node first among equals).
        Returns the usage, the current node's new position, and perm (new position -> old)."""
        perm: list[int] = []
        for a, z in self.groups:
            perm.extend(sorted(range(a, z), key=lambda j: (usage[j], j != cur, j)))
        return tuple(usage[j] for j in perm), (perm.index(cur) if cur >= 0 else -1), perm


def cluster_gpus(job: JobConfig, count: int | None = None) -> list[Gpu]:
    """Every GPU of the job's cluster spec, in order. Without one, `count` GPUs (default: one per
    stage) on this machine's own devices, round robin: cuda:N if present, else the CPU."""
    if job.cluster is None:
        need = job.parallel.virtual_workers * job.parallel.stages_per_vw if count is None else count
        devices = local_devices()
        # The stages a device takes share its memory: each is planned against its share, or two
        # stages that each fit would together overrun it.
        sharing = [len(range(d, need, len(devices))) for d in range(len(devices))]
        return [Gpu(f"local/{i}", "local", devices[i % len(devices)].kind,
                    devices[i % len(devices)].memory_bytes // max(1, sharing[i % len(devices)]))
                for i in range(need)]  # "cpu" or "cuda": profiled as this machine's own device
    gpus = []
    for node in job.cluster.nodes:
        index = 0
        for group in node.gpus:
            for _ in range(group.count):
                gpus.append(Gpu(f"{node.name}/{index}", node.name, group.type, gpu_type(group.type).memory_bytes))
                index += 1
    return gpus


Signature = tuple[tuple[tuple[str, int], ...], ...]


def vw_signature(group: Sequence[Gpu]) -> tuple[Signature, list[Gpu]]:
    """A VW's GPUs up to renaming: per node the sorted (type, memory) list, nodes sorted. Two VWs
    with the same signature have the same best partition; the list maps position to GPU."""
    nodes: dict[str, list[Gpu]] = {}
    for g in group:
        nodes.setdefault(g.node, []).append(g)
    ordered = sorted((sorted(gs, key=lambda g: (g.type, g.memory_bytes, g.id)) for gs in nodes.values()),
                     key=lambda gs: [(g.type, g.memory_bytes) for g in gs])
    signature = tuple(tuple((g.type, g.memory_bytes) for g in gs) for gs in ordered)
    return signature, [g for gs in ordered for g in gs]
