"""O2: N VWs, Nm=1, D=0, plain SGD equal synchronous data parallelism with summed updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.local import run_local
from hetpipe import outputs
from hetpipe.reference import initial_model, train_reference

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("n", [2, 3])
def test_wsp_d0_equals_summed_sync_dp(make_job, tmp_path: Path, n: int) -> None:
    job = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
        "parallel": {"virtual_workers": n, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 2},
    })
    summary = run_local(job, quiet=True)
    got = outputs.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    w0 = initial_model(job).state_dict()
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    assert max(float((want[k] - w0[k]).abs().max()) for k in want) > 1e-3
    assert summary["virtual_workers"] == n and summary["ps_shards"] == 2
    assert summary["max_clock_distance"] <= 1  # G4 with D=0
