"""O2: N VWs, Nm=1, D=0, plain SGD equal synchronous data parallelism with summed updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.local import run_local
from hetpipe.reference import initial_model, train_reference

pytestmark = pytest.mark.timeout(150)


# n=3 also writes the weights split in files of at most 10 kB (a larger tensor gets a file of its
# own): the transformers convention, model-0000i-of-0000N.safetensors and an index.
# Pushes, pulls and the stages' tensors through shared memory (shm) or gRPC frames (grpc).
@pytest.mark.parametrize(("n", "max_shard_bytes", "transport"), [(2, None, "shm"), (2, None, "grpc"), (3, 10_000, "shm")])
def test_wsp_d0_equals_summed_sync_dp(make_job, tmp_path: Path, n: int, max_shard_bytes: int | None,
                                      transport: str) -> None:
    job = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
        "parallel": {"virtual_workers": n, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 2,
                     "transport": transport},
        "output": {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {},
    })
    summary = run_local(job, quiet=True)
    out = tmp_path / "out"
    if max_shard_bytes is None:
        assert not (out / "model.safetensors.index.json").exists()
        got = load_file(out / "model.safetensors")
    else:
        assert not (out / "model.safetensors").exists()
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                             for i in range(1, len(files) + 1)]
        got = {}
        for name in files:
            part = load_file(out / name)
            assert all(weight_map[key] == name for key in part), f"{name} holds what the index says"
            many = len(part) > 1
            assert not many or sum(t.numel() * t.element_size() for t in part.values()) <= max_shard_bytes
            got.update(part)
    want = train_reference(job).state_dict()
    w0 = initial_model(job).state_dict()
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    assert max(float((want[k] - w0[k]).abs().max()) for k in want) > 1e-3
    assert summary["virtual_workers"] == n and summary["ps_shards"] == 2
    assert summary["max_clock_distance"] <= 1  # G4 with D=0
    assert (summary["shm_bytes"] > 0) == (transport == "shm"), summary["shm_bytes"]



def test_sgd_weight_decay_is_each_vws_own_so_the_summed_updates_decay_n_times(make_job, tmp_path: Path) -> None:
    """Each VW's step is -lr * (g_v + wd * w) and the shards sum them: the reference decayed w once
    per step, where the run decays it once per VW (apart by 1e-3 within three steps)."""
    job = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.05, "weight_decay": 0.1}, "steps": 10},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1},
        "output": {"trace": False},
    })
    run_local(job, quiet=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = train_reference(job).state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")

def test_the_final_evaluation_scores_the_model_written_out(make_job, tmp_path: Path) -> None:
    """O2 on 3 stages whose middle one holds only a ReLU (no parameters, no shard keys), with a
    final evaluation: it ends (the parameter-free stage has nothing to merge), and its loss is the
    loss of the weights written out, on the held-out minibatches it reads."""
    from baselines.common import evaluate
    from coordinator.planner import make_plan

    job = make_job({
        "model": {"args": {"hidden": [32]}},   # Linear | ReLU | Linear
        "data": {"eval_fraction": 0.2}, "eval": {"every": 0, "rows": 64},
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 12},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 3, "nm": 1, "D": 0},
    })
    plan = make_plan(job)
    assert [(s.layer_begin, s.layer_end) for s in plan.stages if s.vw == 0] == [(0, 1), (1, 2), (2, 3)]
    summary = run_local(job, quiet=True)
    model = initial_model(job)
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    want = train_reference(job).state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    # The baselines' evaluation of a whole model reads the same held-out minibatches.
    assert summary["eval_loss"] == pytest.approx(evaluate(job, model, torch.device("cpu"))["eval_loss"], rel=1e-12, abs=0)


def test_a_run_at_d0_and_nm1_repeats_bit_for_bit_whatever_the_order_pushes_arrive_in(
        make_job, inject_faults, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """float32 and momentum, three VWs: each run has another VW slow, so the pushes of a wave come
    to the shard in other orders; the shard adds a wave in VW order (ps_server/wave_hold.py), so
    the weights are the same, bit for bit."""
    weights = []
    for slow in (0, 2):
        inject_faults(slow_vw=slow, slow_factor=4.0, task_delay=(0.0, 0.004))
        job = make_job({
            "train": {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 25},
            "parallel": {"virtual_workers": 3, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1},
            "output": {"dir": f"out{slow}", "trace": False},
        }, name=f"job{slow}.yaml")
        run_local(job, quiet=True)
        weights.append(load_file(tmp_path / f"out{slow}" / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), f"{key} differs between the runs"
