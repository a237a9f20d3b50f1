"""The baselines (DESIGN §7): Horovod-style allreduce data parallelism (`parallel.mode: ddp`) and
one torch.distributed.pipelining pipeline (`parallel.mode: torch-pipeline`), on the same job file.

- ddp with N ranks and learning rate N*lr equals HetPipe with N VWs, Nm=1, D=0, k=1 and lr:
  allreduce averages the gradients while the shards sum the VWs' updates (float64, 1e-9).
- The pipeline with one micro-batch equals plain single-process training (float64, 1e-9).
- ddp leaves out the devices that cannot hold the model, and refuses when none can.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml

from baselines.ddp import select_devices
from hetpipe.errors import JobFailed
from launch.local import run_local
from launch import cli
from hetpipe import weight_files
from hetpipe.config import parse_job, with_overrides
from hetpipe.network import Network
from hetpipe.reference import initial_model, train_reference

pytestmark = pytest.mark.timeout(180)

SUMMARY_FIELDS = {"steps", "samples_per_second", "wall_seconds", "final_loss", "virtual_workers",
                  "stages_per_vw", "nm", "D", "emulated", "wait_seconds", "plan", "mode", "precision", "dtype",
                  "batch_size", "model", "emulate"}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], w0: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), "the weights hold every key of the model's state_dict"
    for key in want:
        assert got[key].dtype == torch.float64
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    moved = max(float((want[k] - w0[k]).abs().max()) for k in want)
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"


def load_model(out: Path) -> dict[str, torch.Tensor]:
    return weight_files.read_weights(out)


def test_ddp_with_n_times_lr_equals_hetpipe_k1(make_job, tmp_path: Path) -> None:
    n, lr, steps = 2, 0.05, 20
    hetpipe = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": lr}, "steps": steps},
        "parallel": {"virtual_workers": n, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1},
        "output": {"dir": "hetpipe", "trace": False},
    }, name="hetpipe.yaml")
    ddp = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": n * lr}, "steps": steps},
        "parallel": {"virtual_workers": n, "stages_per_vw": 1, "nm": 1, "D": 0, "mode": "ddp"},
        "output": {"dir": "ddp", "trace": False},
    }, name="ddp.yaml")
    summary = run_local(ddp, quiet=True)
    run_local(hetpipe, quiet=True)
    w0 = initial_model(hetpipe).state_dict()
    assert_same(load_model(tmp_path / "ddp"), load_model(tmp_path / "hetpipe"), w0)
    assert_same(load_model(tmp_path / "ddp"), train_reference(hetpipe).state_dict(), w0)
    assert SUMMARY_FIELDS <= set(summary)
    assert summary["mode"] == "ddp" and summary["virtual_workers"] == n and summary["stages_per_vw"] == 1
    assert (summary["nm"], summary["D"], summary["emulated"]) == (1, 0, False)
    assert [p["rank"] for p in summary["plan"]] == list(range(n))
    assert summary["steps"] == steps and summary["samples_per_second"] > 0


DROPOUT_NET = """
from torch import nn


def net():
    return nn.Sequential(nn.Linear(64, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 10))
"""


def test_ddp_draws_dropout_as_hetpipe_vws_do(make_job, tmp_path: Path) -> None:
    """Rank r's masks are VW r's: ddp at N*lr equals HetPipe N x 1 with dropout too. Unseeded,
    every rank drew the same masks (torch's default seed in each process) and the runs differed."""
    (tmp_path / "dropout_net.py").write_text(DROPOUT_NET)
    n, lr = 2, 0.05

    def job(mode: str, rate: float) -> Any:
        return make_job({
            "model": {"name": None, "args": None, "factory": "dropout_net:net"},
            "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": rate}, "steps": 12},
            "parallel": {"virtual_workers": n, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1, "mode": mode},
            "output": {"dir": mode, "trace": False},
        }, name=f"{mode}.yaml")

    hetpipe = job("hetpipe", lr)
    run_local(job("ddp", n * lr), quiet=True)
    run_local(hetpipe, quiet=True)
    assert_same(load_model(tmp_path / "ddp"), load_model(tmp_path / "hetpipe"), initial_model(hetpipe).state_dict())


def test_ddp_three_ranks_equal_summed_sync_dp(make_job, tmp_path: Path) -> None:
    """N=3 against the summed-update reference, which O2 (test_oracle_o2) proves equal to HetPipe;
    each step at its scheduled learning rate in both."""
    n, lr = 3, 0.05
    job = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": n * lr}, "steps": 15,
                  "lr_schedule": {"warmup_steps": 3, "decay": "cosine"}},
        "parallel": {"virtual_workers": n, "stages_per_vw": 1, "mode": "ddp"},
        "output": {"trace": False},
    })
    summary = run_local(job, quiet=True)
    reference = with_overrides(job, train={"optimizer": dataclasses.replace(job.train.optimizer, lr=lr)})
    assert_same(load_model(tmp_path / "out"), train_reference(reference).state_dict(), initial_model(job).state_dict())
    assert summary["virtual_workers"] == n


TRAINING = {
    "sgd-momentum": {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
    "adam": {"optimizer": {"name": "adam", "lr": 0.01}},
    "adamw-warmup-linear": {"optimizer": {"name": "adamw", "lr": 0.01},
                            "lr_schedule": {"warmup_steps": 4, "decay": "linear"}},
    # The base job's gradient norms are 0.2-0.4: some minibatches clipped, some not.
    "sgd-momentum-clipped": {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "max_grad_norm": 0.3},
}


# 1F1B with one micro-batch is torch's Schedule1F1B only for one stage (it needs a micro-batch per
# stage, see test_1f1b_needs_a_microbatch_per_stage); with k micro-batches of equal size the mean
# losses and 1/k-scaled gradients still make the minibatch's update, so it is checked the same way.
@pytest.mark.parametrize(("schedule", "k", "microbatches", "optimizer"), [
    ("gpipe", 2, 1, "sgd-momentum"),
    ("1f1b", 1, 1, "adam"),
    ("1f1b", 2, 2, "adam"),
    ("gpipe", 2, 2, "adamw-warmup-linear"),
    ("1f1b", 3, 4, "sgd-momentum-clipped"),   # one norm over the pipeline's ranks, as train_reference clips
])
def test_pipeline_equals_plain_training(make_job, tmp_path: Path, schedule: str, k: int, microbatches: int,
                                        optimizer: str) -> None:
    job = make_job({
        "train": {"dtype": "float64", "steps": 20, **TRAINING[optimizer]},
        "parallel": {"virtual_workers": 1, "stages_per_vw": k, "nm": 1, "mode": "torch-pipeline",
                     "schedule": schedule, "microbatches": microbatches},
        "output": {"trace": False},
    })
    summary = run_local(job, quiet=True)
    assert_same(load_model(tmp_path / "out"), train_reference(job).state_dict(), initial_model(job).state_dict())
    assert SUMMARY_FIELDS <= set(summary)
    assert summary["mode"] == "torch-pipeline" and summary["schedule"] == schedule
    assert (summary["virtual_workers"], summary["stages_per_vw"], summary["microbatches"]) == (1, k, microbatches)
    cuts = [p["layers"] for p in summary["plan"]]
    assert cuts[0][0] == 0 and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:])) and len(cuts) == k


TIED = '''
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def mlp(in_features, hidden, num_classes):
    return nn.Sequential(nn.Linear(in_features, hidden[0]), Tied(hidden[0]), nn.Linear(hidden[0], num_classes))
'''


@pytest.mark.parametrize(("mode", "k"), [("ddp", 1), ("torch-pipeline", 2)])
def test_a_weight_tied_within_a_layer_is_written_under_both_keys(make_job, tmp_path: Path, mode: str, k: int) -> None:
    """safetensors refuses to save two keys of one tensor: on the CPU, where .cpu() copies nothing,
    the run trained to its end and then failed writing its weights."""
    (tmp_path / "tied_mlp.py").write_text(TIED)
    job = make_job({
        "model": {"name": None, "factory": "tied_mlp:mlp"},
        "train": {"dtype": "float64", "steps": 10},
        "parallel": {"virtual_workers": 1, "stages_per_vw": k, "nm": 1, "mode": mode},
        "output": {"trace": False},
    })
    run_local(job, quiet=True)
    got = load_model(tmp_path / "out")
    assert torch.equal(got["1.a.weight"], got["1.b.weight"]), "one tensor, written twice alike"
    assert_same(got, train_reference(job).state_dict(), initial_model(job).state_dict())


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_ddp_computes_in_bf16_as_hetpipe_does(make_job, tmp_path: Path) -> None:
    """train.precision bf16: ddp's ranks compute under autocast as HetPipe's stages do, so that
    bench/gpu.py compares like with like; its weights stay float32."""
    n, lr = 2, 0.05

    def job(mode: str, precision: str, rate: float) -> Any:
        return make_job({
            "train": {"precision": precision, "optimizer": {"name": "sgd", "lr": rate}, "steps": 8},
            "parallel": {"virtual_workers": n, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1, "mode": mode},
            "output": {"dir": f"{mode}-{precision}", "trace": False},
        }, name=f"{mode}-{precision}.yaml")

    for spec in (job("ddp", "bf16", n * lr), job("ddp", "fp32", n * lr), job("hetpipe", "bf16", lr)):
        run_local(spec, quiet=True)
    ddp16, ddp32, het16 = (load_model(tmp_path / d) for d in ("ddp-bf16", "ddp-fp32", "hetpipe-bf16"))
    assert all(t.dtype == torch.float32 for t in ddp16.values())
    precision_effect = _largest_difference(ddp16, ddp32)
    assert 0 < precision_effect < 1e-2, "bf16 changes the arithmetic, not what is learnt"
    # Averaged gradients against summed updates: float32 rounding apart, far below bf16's effect.
    assert _largest_difference(ddp16, het16) < precision_effect / 10


def test_torch_pipeline_computes_in_bf16(make_job, tmp_path: Path) -> None:
    """Two stages under autocast, the boundary activations and gradients in bf16 (shape inference
    included), the weights float32."""
    def job(precision: str) -> Any:
        return make_job({
            "train": {"precision": precision, "steps": 8},
            "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "mode": "torch-pipeline", "schedule": "gpipe",
                         "microbatches": 2},
            "output": {"dir": precision, "trace": False},
        }, name=f"{precision}.yaml")

    for precision in ("bf16", "fp32"):
        run_local(job(precision), quiet=True)
    bf16, fp32 = load_model(tmp_path / "bf16"), load_model(tmp_path / "fp32")
    assert all(t.dtype == torch.float32 for t in bf16.values())
    assert 0 < _largest_difference(bf16, fp32) < 1e-2


def paper_cluster_job(types: list[str], out: str = "out") -> dict[str, Any]:
    return {
        "cluster": {"nodes": [{"name": f"n{i}", "gpus": [{"type": t, "count": 2}]} for i, t in enumerate(types)],
                    "emulate": {"time_scale": 1.0}},
        "model": {"name": "resnet152", "args": {"in_shape": [3, 224, 224]}},
        "data": {"name": "synthetic", "batch_size": 32, "args": {"rows": 32}},
        "train": {"steps": 1, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}},
        "parallel": {"virtual_workers": 1, "stages_per_vw": 1, "mode": "ddp"},
        "output": {"dir": out},
    }


def test_ddp_leaves_out_gpus_that_cannot_hold_the_model() -> None:
    """The paper's case: ResNet-152 at batch 32 fits a TITAN V (12 GiB), not an RTX 2060 (6 GiB)."""
    devices = select_devices(parse_job(paper_cluster_job(["titan-v", "rtx-2060"])))
    assert [r.gpu for r in devices.ranks] == ["titan-v", "titan-v"]
    assert [r.node for r in devices.ranks] == ["n0", "n0"]
    assert all(r.step_seconds > 0 and r.label == "titan-v (emulated)" for r in devices.ranks)
    assert 6 * 2**30 < devices.model_bytes <= 12 * 2**30
    (line,) = devices.left_out
    assert line.startswith("rtx-2060 x2: the model needs ") and line.endswith(
        "GiB, the GPU has 6.00 GiB: left out, as the paper does"), line


def test_ddp_refuses_a_cluster_where_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(paper_cluster_job(["rtx-2060"])))
    assert cli.main(["run", "-q", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "parallel.mode ddp: no device can hold the whole resnet152 at batch 32" in err, err
    assert "rtx-2060 x2: the model needs" in err and "left out" in err
    assert not (tmp_path / "out" / "logs").exists(), "no worker may start"


def emulated_job(make_job, steps: int, step_s: float, **parallel: Any):
    return make_job({
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 1}]},
                              {"name": "n1", "gpus": [{"type": "rtx-2060", "count": 1}]}],
                    "emulate": {"time_scale": 1.0, "forward_seconds": step_s / 2, "backward_seconds": step_s / 2}},
        "data": {"eval_fraction": 0.2},
        "eval": {"rows": 64},
        "train": {"steps": steps},
        "parallel": {"mode": "ddp", "stages_per_vw": 1, **parallel},
        "output": {"trace": False},
    })


def test_ddp_on_an_emulated_cluster_is_paced_by_its_devices(make_job) -> None:
    steps, step_s = 10, 0.05
    summary = run_local(emulated_job(make_job, steps, step_s), quiet=True)
    assert summary["emulated"] is True and summary["virtual_workers"] == 2
    assert [(p["node"], p["gpu"]) for p in summary["plan"]] == [("n0", "titan-v (emulated)"),
                                                                 ("n1", "rtx-2060 (emulated)")]
    assert summary["wall_seconds"] >= steps * step_s * 0.95
    assert 0 <= summary["wait_seconds"] and 0 < summary["eval_accuracy"] <= 1 and summary["eval_rows"] == 64


def test_ddp_evaluates_every_eval_every_steps(make_job, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eval.every holds for ddp as for HetPipe: rank 0 appends an evaluation every `every` steps
    and the final one last, in eval.jsonl's format; the final one is the summary's. eval.rows it
    cannot read (70 in minibatches of 16) is a warning, as for HetPipe."""
    job = emulated_job(make_job, 10, 0.01)
    job = with_overrides(job, eval={"every": 4, "rows": 70})
    summary = run_local(job, quiet=True)
    assert ("hetpipe: warning: eval.rows 70: each evaluation reads 64 held-out rows (whole minibatches, of "
            "data.batch_size 16)") in capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert [(r["id"], r["minibatches"], r["final"]) for r in rows] == [(1, 4, False), (2, 8, False), (3, 10, True)]
    assert all(r["rows"] == 64 and 0 <= r["accuracy"] <= 1 for r in rows)
    assert rows[0]["seconds"] <= rows[1]["seconds"] and rows[-1]["accuracy"] == summary["eval_accuracy"]


def test_ddp_allreduce_crosses_the_emulated_network(make_job) -> None:
    steps, step_s = 8, 0.02
    job = emulated_job(make_job, steps, step_s)
    raw_net = {"inter_node_gbs": 0.0004, "intra_node_gbs": 1.0, "latency_s": 0.001}
    assert job.cluster is not None and job.cluster.emulate is not None
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, emulate=dataclasses.replace(
        job.cluster.emulate, network=Network(**raw_net))))
    devices = select_devices(job)
    grads = sum(p.numel() * 4 for p in initial_model(job).parameters())
    # Two ranks on two nodes: a ring over the inter-node link, 2 steps of half the gradients each.
    expected = 2 * 0.001 + 2 * (grads / 2) / (0.0004e9)
    assert devices.allreduce_seconds == pytest.approx(expected)
    assert expected > 0.04
    summary = run_local(job, quiet=True)
    assert summary["allreduce_seconds"] == pytest.approx(expected)
    assert summary["wall_seconds"] >= steps * (step_s + expected)
    assert summary["wait_seconds"] >= 2 * steps * expected  # both ranks sat in every allreduce


def test_ddp_names_the_failed_rank_and_stops_every_worker(make_job, tmp_path: Path) -> None:
    job = emulated_job(make_job, steps=400, step_s=0.05)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            run_local(job, quiet=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    progress = tmp_path / "out" / "baseline" / "rank1.progress"
    deadline = time.monotonic() + 120
    victim = None
    while victim is None and time.monotonic() < deadline and thread.is_alive():
        steps = progress.read_text().split()[0] if progress.exists() else "0"
        if int(steps) >= 2:
            victim = next((p for p in psutil.Process().children(recursive=True)
                           if " ".join(p.cmdline()).split()[-2:] == ["--rank", "1"]), None)
        time.sleep(0.05)
    assert victim is not None, "rank 1 never made progress"
    victim.kill()
    thread.join(60)
    assert not thread.is_alive(), "the launcher must stop once a rank dies"
    (exc,) = failure
    assert isinstance(exc, JobFailed)
    assert "rank 1 (rtx-2060 (emulated) on n1) was killed by SIGKILL" in str(exc), str(exc)


@pytest.mark.parametrize("flag", ["resume", "fresh"])
def test_a_baseline_refuses_resume_and_fresh_which_it_has_no_checkpoints_for(make_job, flag: str) -> None:
    from hetpipe.config import ConfigError

    job = make_job({"parallel": {"mode": "ddp", "virtual_workers": 2, "stages_per_vw": 1}})
    with pytest.raises(ConfigError, match=rf"--{flag}: parallel.mode ddp writes no checkpoints"):
        run_local(job, **{flag: True})


@pytest.mark.parametrize("stderr_kind", ["terminal", "log"])
def test_the_progress_rate_counts_from_the_ranks_first_steps(stderr_kind: str, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A second of start-up before 200 samples in 0.2 s: the bar said 250 samples/s (300 over 1.2 s,
    the start-up counted), where summary.json's rate over the training alone is about 1000. In a
    log the progress comes as lines, as `hetpipe run` writes it, with the last rank's loss."""
    from baselines.common import run_group

    monkeypatch.setattr(sys.stderr, "isatty", lambda: stderr_kind == "terminal")   # capsys's stream

    class Ranks:
        mode = "ddp"
        done = [0, 0]

        def __enter__(self) -> "Ranks":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def start(self) -> None:
            pass

        def wait(self, show: Any) -> None:
            show([0, 0])
            time.sleep(1.0)          # interpreters, torch, the rendezvous
            self.done = [1, 1]
            show(self.done)
            time.sleep(0.2)          # two steps
            self.done = [3, 3]
            show(self.done)

        def progress(self) -> list[int]:
            return self.done

        def loss(self) -> float | None:
            return 0.25 if self.done[0] else None

    run_group(Ranks(), total_steps=3, samples_per_step=100, quiet=False, emulated=False)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert ("\r" in err) == (stderr_kind == "terminal"), "a log gets lines, not a bar redrawn in place"
    if stderr_kind == "terminal":
        rate = float(re.findall(r"([\d.]+)sample/s", err)[-1])
    else:
        lines = err.splitlines()
        assert lines[0] == "ddp: 33% (100/300 samples), loss 0.2500", "no rate before a step has been timed"
        assert lines[-1].startswith("ddp: 100% (300/300 samples), ") and lines[-1].endswith(" samples/s, loss 0.2500")
        rate = float(re.findall(r"(\d+) samples/s", lines[-1])[0])
    assert 400 < rate < 1100, rate

