"""Placement (DESIGN §4): which parameter-server shard owns each parameter."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hetpipe.models import trainable


def place_keys(model: nn.Sequential, ranges: Sequence[tuple[int, int]], shards: int, placement: str,
               home: Sequence[int] | None = None) -> dict[str, int]:
    """Owning shard of every trained parameter. `default`: layers with parameters round-robin over the
    shards; `local`: stage q's layers on shard home[q] (mod S), the shard on stage q's node, so
    that with ED, where stage q of every VW sits on the same node, pushes stay inside nodes."""
    keys = [name for name, _ in trainable(model)]   # a frozen parameter stays with its stages
    layer_of = {key: int(key.split(".", 1)[0]) for key in keys}
    if placement == "local":
        home = list(home) if home is not None else list(range(len(ranges)))
        return {key: home[next(q for q, (b, e) in enumerate(ranges) if b <= layer_of[key] < e)] % shards
                for key in keys}
    layers = sorted(set(layer_of.values()))
    return {key: layers.index(layer_of[key]) % shards for key in keys}


def home_shards(stage_nodes: Sequence[str], nodes: Sequence[str]) -> list[int]:
    """Per stage: its node's index, for `local` placement: shard s runs on node s (mod nodes,
    hetpipe.network.shard_node), as the paper runs one PS per node. Without a cluster spec, q."""
    return [list(nodes).index(node) if node in nodes else q for q, node in enumerate(stage_nodes)]
