"""The paper's cluster (4 nodes x 4 GPUs of Table 1 types): plans like Table 3, whimpy GPUs."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from coordinator.planner import PlanError
from hetpipe.network import Network
from hetpipe.models import structure
from hetpipe.config import ModelConfig
from coordinator.planner import Plan, make_plan
from hetpipe.config import parse_job

pytestmark = pytest.mark.timeout(240)
LETTER = {"titan-v": "V", "titan-rtx": "R", "rtx-2060": "G", "quadro-p4000": "Q"}
TABLE_3 = {
    "NP": [Counter("VVVV"), Counter("RRRR"), Counter("GGGG"), Counter("QQQQ")],
    "ED": [Counter("VRGQ")] * 4,
    "HD": [Counter("VVQQ"), Counter("VVQQ"), Counter("RRGG"), Counter("RRGG")],
}


def paper_job(model: str, policy: str, nm: int | str = "auto") -> dict[str, Any]:
    return {
        # The paper's network (PCIe in a node, 56 Gb/s InfiniBand between nodes). time_scale 20, as
        # an emulated run of these models would use: at 1, this CPU box's own loopback cost of
        # pushing VGG-19's 548 MB, not the paper's cluster, would decide Nm.
        "cluster": {"nodes": [{"name": f"n{i}", "gpus": [{"type": t, "count": 4}]}
                              for i, t in enumerate(LETTER)], "emulate": {"time_scale": 20.0, "network": {}}},
        # in_shape said, not left to the zoo's default: synthetic data takes its features from it.
        "model": {"name": model, "args": {"in_shape": [3, 224, 224]}},
        "data": {"name": "synthetic", "batch_size": 32, "args": {"rows": 32}},
        "train": {"optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}},
        "parallel": {"virtual_workers": 4, "stages_per_vw": 4, "policy": policy, "nm": nm, "ps_shards": 4},
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("profiles"))


def vw_types(plan: Plan) -> list[Counter[str]]:
    return [Counter(LETTER[s.gpu] for s in plan.vw_stages(v)) for v in range(plan.virtual_workers)]


@pytest.mark.parametrize("model", ["vgg19", "resnet152"])
@pytest.mark.parametrize("policy", ["NP", "ED", "HD"])
def test_plans_follow_table_3(model: str, policy: str, cache: str) -> None:
    plan = make_plan(parse_job(paper_job(model, policy)), cache_dir=cache)
    assert sorted(vw_types(plan), key=sorted) == sorted(TABLE_3[policy], key=sorted)
    for s in plan.stages:
        assert s.emulated and s.memory_bytes <= s.capacity_bytes, s
        assert s.forward_seconds > 0 and s.backward_seconds > 0
    for v in range(4):  # each VW covers every layer exactly once, in order
        cuts = [(s.layer_begin, s.layer_end) for s in plan.vw_stages(v)]
        assert cuts[0][0] == 0 and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert plan.predicted_samples_per_second > 0 and 1 <= plan.nm <= min(plan.max_m)


def test_resnet152_does_not_fit_one_rtx_2060_so_dp_alone_cannot_use_it(cache: str) -> None:
    plan = make_plan(parse_job(paper_job("resnet152", "ED")), cache_dir=cache)
    assert plan.dp_only == {"titan-v": True, "titan-rtx": True, "rtx-2060": False, "quadro-p4000": True}
    vgg = make_plan(parse_job(paper_job("vgg19", "ED")), cache_dir=cache)
    assert all(vgg.dp_only.values()), "VGG-19 fits every Table 1 GPU alone (the paper runs Horovod on all 16)"


def test_np_nm_is_bounded_by_the_smallest_memory_vw(cache: str) -> None:
    plan = make_plan(parse_job(paper_job("resnet152", "NP")), cache_dir=cache)
    by_types = {"".join(sorted(t.elements())): m for t, m in zip(vw_types(plan), plan.max_m)}
    assert by_types["GGGG"] == min(plan.max_m) < max(plan.max_m), by_types  # 4 x 6 GiB is the tightest
    assert plan.nm <= by_types["GGGG"]
    with pytest.raises(PlanError, match=r"rtx-2060.*needs .* has "):
        make_plan(parse_job(paper_job("resnet152", "NP", nm=by_types["GGGG"] + 1)), cache_dir=cache)


def test_hetpipe_plan_prints_the_table_and_the_whimpy_gpu(tmp_path: Path) -> None:
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(paper_job("resnet152", "ED")))
    out = subprocess.run([sys.executable, "-m", "launch.cli", "plan", str(job)], capture_output=True, text=True,
                         timeout=200)
    assert out.returncode == 0, out.stderr
    assert "policy ED, 4 virtual workers x 4 stages" in out.stdout and "s_global" in out.stdout
    assert "rtx-2060: the whole model does not fit on one GPU" in out.stdout
    assert out.stdout.count("(emulated)") == 16 and "predicted throughput" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "launch.cli", "plan", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_ed_local_keeps_each_stages_parameters_on_its_own_node(cache: str) -> None:
    """hetpipe.txt §8.1: with ED, stage q of every VW sits on one node, and `local` puts its layers
    on that node's parameter server, so pushes and pulls never cross the InfiniBand links."""
    nodes = [f"n{i}" for i in range(len(LETTER))]
    local = make_plan(parse_job({**paper_job("vgg19", "ED", nm=2), "parallel": {
        **paper_job("vgg19", "ED")["parallel"], "nm": 2, "placement": "local"}}), cache_dir=cache)
    default = make_plan(parse_job(paper_job("vgg19", "ED", nm=2)), cache_dir=cache)
    for q in range(4):
        assert len({s.node for s in local.stages if s.stage == q}) == 1, "ED: stage q on one node"
    for s in local.stages:
        owners = {shard for key, shard in local.key_shard.items() if s.layer_begin <= int(key.split(".")[0]) < s.layer_end}
        assert owners <= {nodes.index(s.node)}, (s, owners)
    # So each push crosses only its node's PCIe link, never InfiniBand.
    sizes = {name: p.numel() * 4 for name, p in structure(ModelConfig(name="vgg19"), ".").named_parameters()}
    pcie = Network().link("n0", "n0", time_scale=20.0)
    for s in local.stages:
        nbytes = sum(n for key, n in sizes.items() if s.layer_begin <= int(key.split(".")[0]) < s.layer_end)
        assert s.push_seconds == pytest.approx(pcie.seconds(nbytes) if nbytes else 0.0)
    assert sum(s.push_seconds for s in local.stages) < sum(s.push_seconds for s in default.stages)
