"""The GPU kit: the oracles and baselines on a real CUDA device (skipped without one).

Without a `cluster` section every stage runs on this machine's devices: with one GPU, all of a
VW's stages share cuda:0, which is the case HetPipe's one-GPU benchmarks run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetpipe import weight_files
from hetpipe.reference import initial_model, train_reference
from launch.local import run_local

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MOMENTUM = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def assert_equal_to_reference(out: Path, want: dict[str, torch.Tensor], w0: dict[str, torch.Tensor]) -> None:
    got = weight_files.read_weights(out)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value.cpu(), rtol=0, atol=1e-9, msg=f"{key} differs")
    assert max(float((want[k].cpu() - w0[k]).abs().max()) for k in want) > 1e-3, "training moved the weights"


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_o1_on_cuda_in_float64(make_job, tmp_path: Path, transport: str) -> None:
    """Two stages on one GPU: auto sends activations and gradients GPU to GPU by CUDA IPC."""
    job = make_job({"train": {"dtype": "float64", "optimizer": MOMENTUM, "steps": 20},
                    "parallel": {"stages_per_vw": 2, "nm": 1, "transport": transport}, "output": {"trace": False}})
    summary = run_local(job, quiet=True)
    assert (summary["cuda_ipc_bytes"] > 0) == (transport == "auto"), summary["cuda_ipc_bytes"]
    # The handles went over the next stage's link socket (its threads opened them), not a gRPC stream.
    assert (summary["link_socket_bundles"] > 0) == (transport == "auto"), summary["link_socket_bundles"]
    assert_equal_to_reference(tmp_path / "out", train_reference(job, device="cuda").state_dict(),
                              initial_model(job).state_dict())
    stages = [p for p in summary["processes"] if p["process"].startswith("stage")]
    name = torch.cuda.get_device_name(0)
    assert len(stages) == 2 and all(name in p["device"] and "cuda:0" in p["device"] for p in stages), stages
    assert all(p["device_peak_bytes"] > 0 for p in stages), "a stage on a GPU reports its peak GPU memory"


@pytest.mark.parametrize("transport", ["auto", "grpc"])
def test_o2_on_cuda_in_float64(make_job, tmp_path: Path, transport: str) -> None:
    """Two VWs of two stages on one GPU at D 0 equal summed synchronous data parallelism: every
    push leaves the GPU on a side stream into pinned memory, and every pull reaches it from there
    before the compute thread merges it (stage_worker/host_copies.py)."""
    job = make_job({"train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
                    "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 2,
                                 "transport": transport},
                    "output": {"trace": False}})
    summary = run_local(job, quiet=True)
    assert (summary["shm_bytes"] > 0) == (transport == "auto"), summary["shm_bytes"]
    assert (summary["link_socket_bundles"] > 0) == (transport == "auto"), summary["link_socket_bundles"]
    assert summary["max_clock_distance"] <= 1
    assert_equal_to_reference(tmp_path / "out", train_reference(job, device="cuda").state_dict(),
                              initial_model(job).state_dict())


@pytest.mark.parametrize(("schedule", "microbatches"), [("gpipe", 1), ("1f1b", 2)])
def test_torch_pipeline_on_one_gpu_equals_plain_training(make_job, tmp_path: Path, schedule: str,
                                                         microbatches: int) -> None:
    """Two ranks on one GPU: gloo with the stage boundaries staged through host memory."""
    job = make_job({"train": {"dtype": "float64", "optimizer": MOMENTUM, "steps": 20},
                    "parallel": {"stages_per_vw": 2, "nm": 1, "mode": "torch-pipeline", "schedule": schedule,
                                 "microbatches": microbatches},
                    "output": {"trace": False}})
    summary = run_local(job, quiet=True)
    assert summary["backend"] == ("gloo" if torch.cuda.device_count() == 1 else "nccl")
    assert_equal_to_reference(tmp_path / "out", train_reference(job, device="cuda").state_dict(),
                              initial_model(job).state_dict())


def test_bf16_on_cuda_learns(make_job) -> None:
    job = make_job({
        "model": {"args": {"hidden": [256, 256, 256]}},
        "data": {"batch_size": 32, "shuffle": True, "eval_fraction": 0.2},
        "train": {"precision": "bf16", "steps": 300, "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9}},
        "parallel": {"stages_per_vw": 2, "nm": 2},
        "eval": {"every": 100, "rows": 1024},
    })
    summary = run_local(job, quiet=True)
    assert summary["precision"] == "bf16"
    assert summary["eval_accuracy"] > 0.85, summary["eval_accuracy"]
