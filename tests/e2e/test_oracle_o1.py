"""O1: one VW over gRPC with Nm=1 equals plain single-process training (float64, 1e-9), with the
stages' tensors in shared memory (parallel.transport shm) and in gRPC frames (grpc)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.local import run_local
from hetpipe import weight_files
from hetpipe.config import parse_job
from hetpipe.models import build
from hetpipe.reference import train_reference

pytestmark = pytest.mark.timeout(120)

TRAINING = {
    "sgd-momentum": {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
    "adam": {"optimizer": {"name": "adam", "lr": 0.01}},
    # Each stage steps minibatch p at its own learning rate, as the reference does.
    "adamw-warmup-cosine": {"optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
                            "lr_schedule": {"warmup_steps": 5, "decay": "cosine", "min_lr": 0.001}},
}


@pytest.mark.parametrize(("k", "optimizer", "transport"), [
    (2, "sgd-momentum", "shm"), (2, "sgd-momentum", "grpc"), (2, "adam", "shm"), (3, "sgd-momentum", "grpc"),
    (3, "adam", "shm"), (4, "sgd-momentum", "shm"), (4, "adam", "grpc"), (3, "adamw-warmup-cosine", "shm"),
])
def test_pipeline_matches_single_process(make_job, tmp_path: Path, k: int, optimizer: str, transport: str) -> None:
    # A model.init that differs from the seeded init proves init is honoured.
    init = build(parse_job({"model": {"name": "mlp", "args": {"in_features": 64, "hidden": [32, 32, 32]}},
                            "train": {"seed": 123, "dtype": "float64"}}))
    torch.save(init.state_dict(), tmp_path / "init.pt")  # a plain state_dict: read key by key
    job = make_job({
        "model": {"init": "init.pt"},
        "train": {"dtype": "float64", "steps": 30, **TRAINING[optimizer]},
        "parallel": {"stages_per_vw": k, "nm": 1, "transport": transport},
        "output": {"trace": False},
    })
    summary = run_local(job, quiet=True)
    got = weight_files.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    assert sorted(got) == sorted(want), "the safetensors hold every key of the model's state_dict"
    assert len(summary["plan"]) == k
    assert (summary["shm_bytes"] > 0) == (transport == "shm"), summary["shm_bytes"]
    # Through shared memory the bundles' handles go over the next stage's link socket, not gRPC.
    assert (summary["link_socket_bundles"] > 0) == (transport == "shm"), summary["link_socket_bundles"]
    for key in want:
        assert got[key].dtype == torch.float64
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    moved = max(float((want[key] - init.state_dict()[key]).abs().max()) for key in want)
    assert moved > 1e-3, "training must actually move the weights for the comparison to mean anything"
