"""O1: one VW over gRPC with Nm=1 equals plain single-process training (float64, 1e-9)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.local import run_local
from hetpipe.reference import train_reference
from hetpipe.zoo import build_model

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS = {
    "sgd-momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "adam": {"name": "adam", "lr": 0.01},
}


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_pipeline_matches_single_process(make_job, tmp_path: Path, k: int, optimizer: str) -> None:
    # A model.init that differs from the seeded init proves init is honoured.
    init = build_model("mlp", {"in_features": 64, "hidden": [32, 32, 32], "num_classes": 10}, seed=123,
                       dtype=torch.float64)
    torch.save(init.state_dict(), tmp_path / "init.pt")
    job = make_job({
        "model": {"init": "init.pt"},
        "train": {"dtype": "float64", "optimizer": OPTIMIZERS[optimizer], "steps": 30},
        "parallel": {"stages_per_vw": k, "nm": 1},
        "output": {"trace": False},
    })
    summary = run_local(job, quiet=True)
    got = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    want = train_reference(job).state_dict()
    assert list(got) == list(want), "model.pt keys must follow layer order"
    assert len(summary["plan"]) == k
    for key in want:
        assert got[key].dtype == torch.float64
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    moved = max(float((want[key] - init.state_dict()[key]).abs().max()) for key in want)
    assert moved > 1e-3, "training must actually move the weights for the comparison to mean anything"
