"""Emulated links (hetpipe/network.py), their job-file keys, and the simulator's per-stage sync costs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pytest import approx

from coordinator.planner.simulator import SimStage, simulate
from hetpipe.config import ConfigError, parse_job
from hetpipe.network import LinkModel, Network, ring_allreduce_seconds, shard_node

JOB: dict[str, Any] = {
    "cluster": {"nodes": [{"name": "a", "gpus": [{"type": "titan-v", "count": 2}]}],
                "emulate": {"time_scale": 10.0}},
    "model": {"name": "mlp", "args": {"in_features": 64, "hidden": [8], "num_classes": 10}},
    "data": {"name": "digits", "batch_size": 8},
    "train": {"steps": 3},
    "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 1},
}


def test_link_time_is_latency_plus_bytes_over_bandwidth_both_scaled() -> None:
    net = Network(intra_node_gbs=8.0, inter_node_gbs=2.0, latency_s=1e-5)
    inside, between = net.link("a", "a"), net.link("a", "b")
    assert inside.seconds(8 * 10**9) == approx(1.0 + 1e-5)
    assert between.seconds(8 * 10**9) == approx(4.0 + 1e-5)
    # time_scale stretches a link exactly as it stretches the emulated compute.
    slow = net.link("a", "b", time_scale=100.0)
    assert slow.seconds(8 * 10**9) == approx(100 * between.seconds(8 * 10**9))
    assert net.seconds(0, type("G", (), {"node": "a"})(), type("G", (), {"node": "b"})()) == 0.0


def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_bytes() -> None:
    link = LinkModel(latency_s=0.001, bytes_per_second=1e9)
    assert ring_allreduce_seconds(10**9, 1, link) == 0.0  # nothing to reduce with
    assert ring_allreduce_seconds(10**9, 2, link) == approx(2 * 0.001 + 1.0)
    assert ring_allreduce_seconds(10**9, 4, link) == approx(6 * 0.001 + 6 * 0.25)
    # The bandwidth term tends to twice the model's bytes: the ring's well-known bound.
    assert ring_allreduce_seconds(10**9, 1000, LinkModel(0.0, 1e9)) == approx(2.0, rel=1e-2)


def test_shards_are_spread_over_the_nodes_in_order() -> None:
    assert [shard_node(s, ["n0", "n1", "n2"]) for s in range(5)] == ["n0", "n1", "n2", "n0", "n1"]


def test_network_keys_default_to_the_papers_cluster_and_round_trip() -> None:
    assert parse_job(JOB).cluster.emulate.network is None  # type: ignore[union-attr]
    raw = copy.deepcopy(JOB)
    raw["cluster"]["emulate"]["network"] = {}
    assert parse_job(raw).cluster.emulate.network == Network()  # type: ignore[union-attr]
    raw["cluster"]["emulate"]["network"] = {"inter_node_gbs": 1.25, "latency_s": 0.0}
    job = parse_job(raw)
    assert job.cluster.emulate.network == Network(inter_node_gbs=1.25, latency_s=0.0)  # type: ignore[union-attr]
    assert type(job).from_json(job.to_json()) == job


@pytest.mark.parametrize("network, message", [
    ({"inter_node_gbs": 0}, "cluster.emulate.network.inter_node_gbs: expected a finite number >= 1e-06, got 0"),
    ({"latency_s": -1}, "cluster.emulate.network.latency_s: expected a finite number >= 0.0 and <= 3600.0, got -1"),
    ({"latency_s": 1e308}, "cluster.emulate.network.latency_s: expected a finite number >= 0.0 and <= 3600.0, got 1e+308"),
    ({"bandwidth": 1}, "cluster.emulate.network.bandwidth: unknown key; known keys are intra_node_gbs"),
    ([1, 2], "cluster.emulate.network: expected a mapping, got [1, 2]"),
])
def test_bad_network_keys_are_named(network: Any, message: str) -> None:
    raw = copy.deepcopy(JOB)
    raw["cluster"]["emulate"]["network"] = network
    with pytest.raises(ConfigError) as err:
        parse_job(raw)
    assert message in str(err.value)


def test_simulator_charges_each_stage_its_own_push_and_pull() -> None:
    """Two VWs, D=0, nm=1, one stage: every wave waits for the slower stage's push + pull."""
    steps = 20
    plain = simulate([[SimStage(0.1, 0.1)], [SimStage(0.1, 0.1)]], nm=1, D=0, steps=steps)
    costly = simulate([[SimStage(0.1, 0.1)], [SimStage(0.1, 0.1, push_seconds=0.05, pull_seconds=0.02)]],
                      nm=1, D=0, steps=steps)
    assert costly.makespan_seconds > plain.makespan_seconds + (steps - 2) * 0.05
    # A per-stage value overrides the global one; None falls back to it.
    a = simulate([[SimStage(0.1, 0.1, push_seconds=0.05)], [SimStage(0.1, 0.1, push_seconds=0.05)]],
                 nm=1, D=0, steps=steps, push_seconds=9.0)
    b = simulate([[SimStage(0.1, 0.1)], [SimStage(0.1, 0.1)]], nm=1, D=0, steps=steps, push_seconds=0.05)
    assert a.makespan_seconds == approx(b.makespan_seconds)
    with pytest.raises(ValueError, match=r"vws\[1\]\[0\].pull_seconds"):
        simulate([[SimStage(0.1, 0.1)], [SimStage(0.1, 0.1, pull_seconds=-1.0)]], nm=1, D=0, steps=2)
