"""Emulated network links (DESIGN §5): what moving bytes between two nodes costs. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _OnNode(Protocol):
    @property
    def node(self) -> str: ...


@dataclass(frozen=True, slots=True)
class LinkModel:
    """One emulated link: a transfer of n bytes takes latency_s + n / bytes_per_second."""

    latency_s: float
    bytes_per_second: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_second


@dataclass(frozen=True, slots=True)
class Network:
    """The paper's cluster by default (hetpipe.txt §8.1): PCIe 3 x16 inside a node, scaled down
    as the paper does, and 56 Gb/s InfiniBand between nodes."""

    intra_node_gbs: float = 15.75 * 0.5
    inter_node_gbs: float = 7.0 * 0.8
    latency_s: float = 20e-6

    def link(self, a_node: str, b_node: str, time_scale: float = 1.0) -> LinkModel:
        """The link from a_node to b_node, its times stretched by time_scale like the emulated compute."""
        gbs = self.intra_node_gbs if a_node == b_node else self.inter_node_gbs
        return LinkModel(self.latency_s * time_scale, gbs * 1e9 / time_scale)

    def seconds(self, nbytes: int, a: _OnNode, b: _OnNode) -> float:
        """Time to move nbytes from a to b: PCIe within a node, InfiniBand between nodes."""
        if nbytes <= 0:
            return 0.0
        return self.link(a.node, b.node).seconds(nbytes)


def shard_node(shard: int, nodes: list[str]) -> str:
    """The node parameter-server shard `shard` runs on: shards are spread over the nodes in order,
    as the paper runs one PS per node (so `placement: local` keeps stage q's keys on its node)."""
    return nodes[shard % len(nodes)]


def ring_allreduce_seconds(nbytes: int, ranks: int, link: LinkModel) -> float:
    """A ring allreduce of nbytes over `ranks` peers whose slowest hop is `link`: 2(n-1) steps,
    each moving nbytes/n (Horovod's and NCCL's ring)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.latency_s + steps * (nbytes / ranks) / link.bytes_per_second
