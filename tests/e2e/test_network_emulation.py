"""Emulated links (DESIGN §5) in real runs: activations, gradients, pushes and pull replies arrive
no sooner than the emulated network allows, and the plan derives each hold from the link's
bandwidth and latency and the (emulated) model's bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launch.local import run_local
from coordinator.planner import make_plan
from hetpipe.config import ConfigError
from hetpipe.network import Network
from hetpipe.models import structure
from trace_rules import by_stage, load_trace

pytestmark = pytest.mark.timeout(300)

# Slow enough that each transfer takes tens of milliseconds: far above loopback's own cost.
NETWORK = {"intra_node_gbs": 0.0001, "inter_node_gbs": 0.00005, "latency_s": 0.002}


def cluster(vws: int, **emulate: Any) -> dict[str, Any]:
    return {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": vws}]},
                      {"name": "n1", "gpus": [{"type": "titan-v", "count": vws}]}],
            "emulate": {"forward_seconds": 0.005, "backward_seconds": 0.01, "network": NETWORK, **emulate}}


def test_activations_and_gradients_wait_for_the_emulated_link(make_job, tmp_path: Path) -> None:
    job = make_job({"cluster": cluster(1), "train": {"steps": 12},
                    "parallel": {"stages_per_vw": 2, "nm": 2, "policy": "ED"}})
    plan = make_plan(job)
    s0, s1 = plan.vw_stages(0)
    assert s0.node != s1.node, "the two stages should sit on different nodes"
    activation = job.data.batch_size * job.model.args["hidden"][s0.layer_end // 2 - 1] * 4
    link = Network(**NETWORK).link("n0", "n1")
    assert s0.next_send_seconds == pytest.approx(link.seconds(activation))
    assert s1.prev_send_seconds == pytest.approx(link.seconds(activation))
    assert (s0.prev_send_seconds, s1.next_send_seconds, s0.push_seconds) == (0.0, 0.0, 0.0)  # no such transfers
    assert s0.next_send_seconds > 0.04

    summary = run_local(job, quiet=True)
    assert summary["steps"] == 12
    stages = by_stage(load_trace(tmp_path / "out" / "trace"))
    first = {r["p"]: r for r in stages[(0, 0)]}
    last = {r["p"]: r for r in stages[(0, 1)]}
    for p in range(1, 13):
        assert last[p]["fwd_start"] - first[p]["fwd_end"] >= s0.next_send_seconds, f"activation of {p} came early"
        assert first[p]["bwd_start"] - last[p]["bwd_end"] >= s1.prev_send_seconds, f"gradient of {p} came early"


def test_pushes_and_pull_replies_cross_the_emulated_links(make_job, tmp_path: Path) -> None:
    job = make_job({"cluster": cluster(2), "train": {"steps": 8},
                    "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "D": 0, "ps_shards": 2,
                                 "policy": "ED"}})
    plan = make_plan(job)
    model = structure(job.model, job.base_dir)
    size = {name: p.numel() * 4 for name, p in model.named_parameters()}
    net = Network(**NETWORK)
    for sp in plan.stages:
        # Shard i runs on node i; the stage's traffic to both shards shares its interface.
        expected = 0.0
        for shard in (0, 1):
            nbytes = sum(n for name, n in size.items()
                         if sp.layer_begin <= int(name.split(".")[0]) < sp.layer_end and plan.key_shard[name] == shard)
            if nbytes:
                expected += net.link(sp.node, f"n{shard}").seconds(nbytes)
        assert (sp.push_seconds, sp.pull_seconds) == (pytest.approx(expected), pytest.approx(expected))
        assert expected > 0.05

    summary = run_local(job, quiet=True)
    assert summary["steps"] == 8
    for sp in plan.stages:
        path = tmp_path / "out" / "trace" / "sync" / f"vw{sp.vw}_stage{sp.stage}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        pushes = [r for r in rows if r["event"] == "push"]
        pulls = [r for r in rows if r["event"] == "pull"]
        assert len(pushes) == 4 and pulls
        for r in pushes:
            assert r["end"] - r["start"] >= sp.push_seconds, f"{sp}: push of wave {r['wave']} too fast"
        for r in pulls:
            assert r["replied"] - r["sent"] >= sp.pull_seconds, f"{sp}: pull reply too fast"


def test_emulated_model_args_time_and_size_the_full_model(make_job) -> None:
    """A small stand-in computes; tasks, memory and transfers are those of the full-size model."""
    small = make_job({"cluster": {**cluster(1), "emulate": {"time_scale": 1.0, "network": NETWORK}},
                      "parallel": {"stages_per_vw": 2, "nm": 2}})
    full_args = {"hidden": [512, 512, 512]}
    full = make_job({"cluster": {**cluster(1), "emulate": {"time_scale": 1.0, "network": NETWORK,
                                                          "model_args": full_args}},
                     "parallel": {"stages_per_vw": 2, "nm": 2}})
    assert full.emulated_model_args["hidden"] == [512, 512, 512] and full.model.args["hidden"] == [32, 32, 32]
    a, b = make_plan(small).vw_stages(0), make_plan(full).vw_stages(0)
    for s, f in zip(a, b):
        assert f.forward_seconds > 10 * s.forward_seconds and f.memory_bytes > 10 * s.memory_bytes
    assert b[0].next_send_seconds > 10 * a[0].next_send_seconds > 0
    bad = make_job({"cluster": {**cluster(1), "emulate": {"model_args": {"hidden": [32, 32]}}},
                    "parallel": {"stages_per_vw": 2, "nm": 2}})
    with pytest.raises(ConfigError, match="cluster.emulate.model_args: .* may differ only in sizes"):
        make_plan(bad)
