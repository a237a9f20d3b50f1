"""The cluster a job runs on, as its job file (or the coordinator's registry) describes it: nodes,
their GPU types and counts, and whether the GPUs are emulated on the CPU (at what time scale, over
what network, at what model size)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hetpipe.catalog import gpu_type
from hetpipe.network import Network
from hetpipe.validate import Section, fail


@dataclass(frozen=True, slots=True)
class GpuGroup:
    type: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class NodeConfig:
    name: str
    gpus: tuple[GpuGroup, ...]


@dataclass(frozen=True, slots=True)
class EmulateConfig:
    time_scale: float = 1.0
    # Fixed per-task times override the catalog, e.g. for pipeline benchmarks with equal stages.
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    # Emulated links between stages, to the shards and in the allreduce baseline; None = loopback as is.
    network: Network | None = None
    # Model args the emulated costs are taken at (times, memory, bytes moved), over model.args: a
    # small stand-in computes while every task and transfer is timed as the full-size model's.
    model_args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fixed_times(self) -> bool:
        return bool(self.forward_seconds or self.backward_seconds)

    def work(self) -> dict[str, Any]:
        """What the emulated tasks are timed as (summary.json's `emulate`), JSON as it is."""
        return {"time_scale": self.time_scale, "forward_seconds": self.forward_seconds,
                "backward_seconds": self.backward_seconds, "model_args": dict(self.model_args),
                "network": self.network is not None}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    nodes: tuple[NodeConfig, ...]
    emulate: EmulateConfig | None = None


def _parse_network(em: Section) -> Network | None:
    if em.get("network") is None:
        return None
    net = em.section("network")
    net.check_known(("intra_node_gbs", "inter_node_gbs", "latency_s"))
    paper = Network()
    return Network(
        intra_node_gbs=net.number("intra_node_gbs", paper.intra_node_gbs, minimum=1e-6),
        inter_node_gbs=net.number("inter_node_gbs", paper.inter_node_gbs, minimum=1e-6),
        latency_s=net.number("latency_s", paper.latency_s, maximum=3600.0),   # scaled, still finite
    )


def parse_cluster(raw: Any, max_gpus: int) -> ClusterConfig | None:
    """The job file's `cluster` section; max_gpus bounds its GPUs (and so a node's count of one type)."""
    if raw is None:
        return None
    sec = Section(raw, "cluster")
    sec.check_known(("nodes", "emulate"))
    nodes_raw = sec.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise fail("cluster.nodes", nodes_raw, "a non-empty list of nodes")
    nodes = []
    for i, node_raw in enumerate(nodes_raw):
        node = Section(node_raw, f"cluster.nodes[{i}]")
        node.check_known(("name", "gpus"))
        gpus_raw = node.get("gpus")
        if not isinstance(gpus_raw, list) or not gpus_raw:
            raise fail(f"cluster.nodes[{i}].gpus", gpus_raw, "a non-empty list of {type, count}")
        gpus = []
        for j, g_raw in enumerate(gpus_raw):
            g = Section(g_raw, f"cluster.nodes[{i}].gpus[{j}]")
            g.check_known(("type", "count"))
            kind = g.text("type")
            gpu_type(kind, g.path("type"))   # refused here, where the job file's line is known
            gpus.append(GpuGroup(type=kind, count=g.integer("count", GpuGroup("").count, minimum=1,
                                                                      maximum=max_gpus)))
        nodes.append(NodeConfig(name=node.text("name", f"n{i}"), gpus=tuple(gpus)))
    # A plan uses at most max_gpus (virtual workers x stages at their bounds); the planner makes
    # an object per GPU, so a cluster past that is refused here, not allocated there.
    total = sum(g.count for n in nodes for g in n.gpus)
    if total > max_gpus:
        raise fail("cluster.nodes", f"{total} GPUs", f"at most {max_gpus} GPUs in all (no plan uses more)")
    names = [n.name for n in nodes]
    again = next((i for i, name in enumerate(names) if name in names[:i]), None)
    if again is not None:
        raise fail(f"cluster.nodes[{again}].name", names[again], f"a name no other node has ({names})")
    emulate = None
    if sec.get("emulate") is not None:
        em, d = sec.section("emulate"), EmulateConfig()
        em.check_known(("time_scale", "forward_seconds", "backward_seconds", "network", "model_args"))
        emulate = EmulateConfig(
            time_scale=em.number("time_scale", d.time_scale, minimum=1e-9, maximum=1e9),
            forward_seconds=em.number("forward_seconds", d.forward_seconds, maximum=3600.0),
            backward_seconds=em.number("backward_seconds", d.backward_seconds, maximum=3600.0),
            network=_parse_network(em),
            model_args=em.mapping("model_args"),
        )
    return ClusterConfig(nodes=tuple(nodes), emulate=emulate)
