"""A job's cluster section is bounded in all, not only per group: a few hundred bytes of groups of
262144 GPUs each made the planner build a Gpu per GPU (a 10 KB Submit: about 75 million, 12 GiB)."""

from __future__ import annotations

import json

import pytest

from hetpipe.config import ConfigError, JobConfig
from hetpipe.parallelism import MAX_STAGES, MAX_VIRTUAL_WORKERS


def job_json(groups: int) -> str:
    return json.dumps({
        "model": {"name": "mlp", "args": {"in_features": 64, "hidden": [32, 32, 32], "num_classes": 10}},
        "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": 4, "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.05}, "seed": 0},
        "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 1, "D": 0},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "h200", "count": MAX_VIRTUAL_WORKERS * MAX_STAGES}] * groups}],
                    "emulate": {"time_scale": 1.0}},
        "output": {"dir": "out"},
    })


def test_a_cluster_past_what_any_plan_uses_is_refused() -> None:
    JobConfig.from_json(job_json(1))
    with pytest.raises(ConfigError, match=r"cluster.nodes: expected at most 262144 GPUs in all.*524288 GPUs"):
        JobConfig.from_json(job_json(2))
