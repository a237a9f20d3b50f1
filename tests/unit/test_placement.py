"""coordinator/planner/placement.py: which shard owns each parameter."""

from __future__ import annotations

import pytest
from torch import nn

from coordinator.planner.placement import home_shards, place_keys
from hetpipe.network import shard_node


def _model() -> nn.Sequential:
    # Parameters in layers 0, 2, 3 and 5; layers 1 and 4 have none.
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))


def test_default_deals_parameter_layers_round_robin_keeping_a_layer_together() -> None:
    owners = place_keys(_model(), [(0, 3), (3, 6)], shards=3, placement="default")
    assert owners == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1, "3.weight": 2, "3.bias": 2,
                      "5.weight": 0, "5.bias": 0}


def test_local_puts_each_stages_layers_on_its_home_shard() -> None:
    owners = place_keys(_model(), [(0, 3), (3, 6)], shards=2, placement="local", home=[1, 0])
    assert {k: v for k, v in owners.items()} == {"0.weight": 1, "0.bias": 1, "2.weight": 1, "2.bias": 1,
                                                 "3.weight": 0, "3.bias": 0, "5.weight": 0, "5.bias": 0}
    # Without homes, stage q's home is shard q (mod the shards).
    assert set(place_keys(_model(), [(0, 3), (3, 6)], shards=1, placement="local").values()) == {0}


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
def test_home_shard_runs_on_the_stages_node(shards: int) -> None:
    """With `local` placement a stage's keys live on the shard that runs on its node, wherever its
    node runs one: every stage once each node runs a shard, else those on the first `shards` nodes."""
    nodes = ["n0", "n1", "n2", "n3"]
    stage_nodes = ["n2", "n0", "n3", "n1"]
    home = home_shards(stage_nodes, nodes)
    assert home == [2, 0, 3, 1], "a stage's home is its node's index"
    ranges = [(0, 1), (1, 3), (3, 4), (4, 6)]  # one layer with parameters per stage
    owners = place_keys(_model(), ranges, shards, "local", home)
    shard_nodes = {shard_node(j, nodes) for j in range(shards)}
    local = [q for q in range(len(ranges)) if stage_nodes[q] in shard_nodes]
    assert len(local) == min(shards, len(nodes))  # the loop below checks as many stages
    for q in local:
        begin, end = ranges[q]
        keys = [k for k in owners if begin <= int(k.split(".", 1)[0]) < end]
        assert keys and {shard_node(owners[k], nodes) for k in keys} == {stage_nodes[q]}, (q, keys, owners)
    assert home_shards(["local", "local"], []) == [0, 1], "no cluster spec: stage q's home is q"

