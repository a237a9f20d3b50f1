"""What `hetpipe plan` and `hetpipe run` refuse before any process starts (issue 14, "accepted
nonsense" and "messy failures"): data with NaN or Inf or labels the model has no class for, a
model.init that does not fit the model, an output.dir that cannot be written. Each is one line
naming the file and the array or key, exit 2, no traceback. And what a run leaves behind when it
fails after starting, or when its loss diverges."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from conftest import BASE_JOB, deep_update
from hetpipe import models, threads
from hetpipe.config import parse_job
from launch import cli

pytestmark = pytest.mark.timeout(120)
HETPIPE = [sys.executable, "-m", "launch.cli"]
ROWS, FEATURES, CLASSES = 64, 64, 10  # BASE_JOB's mlp: 64 inputs, 10 classes


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=100)


def _job(tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / "job.yaml"
    raw = deep_update(BASE_JOB, {"train": {"steps": 5}, "output": {"dir": str(tmp_path / "out"), "trace": False},
                                 **overrides})
    path.write_text(yaml.safe_dump(raw))
    return path


def _npz(tmp_path: Path, spoil: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x, y = spoil(rng.standard_normal((ROWS, FEATURES)), rng.integers(0, CLASSES, ROWS))
    np.savez(tmp_path / "data.npz", x=x, y=y)
    return {"data": {"name": "npz", "path": "data.npz"}}


def _set(array: np.ndarray, index: tuple[int, ...], value: float) -> np.ndarray:
    array = array.astype(np.float64)
    array[index] = value
    return array


def _init(tmp_path: Path, name: str, spoil: Callable[[dict[str, torch.Tensor]], None]) -> dict[str, Any]:
    """model.init: the model's own initial weights, spoiled."""
    state = {k: v.clone() for k, v in models.build(parse_job(BASE_JOB)).state_dict().items()}
    spoil(state)
    if name.endswith(".safetensors"):
        save_file(state, str(tmp_path / name))
    else:
        torch.save(state, tmp_path / name)
    return {"model": {"init": name}}


def _under_a_file(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "results").write_text("a regular file where a folder is wanted\n")
    return {"output": {"dir": str(tmp_path / "results" / "run1")}}


def _unwritable(tmp_path: Path) -> dict[str, Any]:
    if os.geteuid() == 0:  # root writes in any folder whatever its mode, but not in /proc
        return {"output": {"dir": "/proc/hetpipe-test/out"}}
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return {"output": {"dir": str(locked / "out")}}


def _garbage(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "data.npz").write_bytes(b"PK\x03\x04 not really a zip file")
    return {"data": {"name": "npz", "path": "data.npz"}}


def _nan(state: dict[str, torch.Tensor]) -> None:
    state["2.weight"][3, 1] = math.nan


def _inf(state: dict[str, torch.Tensor]) -> None:
    state["0.bias"][7] = math.inf


def _drop(state: dict[str, torch.Tensor]) -> None:
    del state["4.bias"]


def _reshape(state: dict[str, torch.Tensor]) -> None:
    state["0.weight"] = torch.zeros(5, 5)


def _two_outputs(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "twoout.py").write_text(
        "from torch import nn\n\n"
        "class TwoOut(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        h = super().forward(x)\n"
        "        return h, h\n\n"
        "def net(**args):\n"
        "    return nn.Sequential(TwoOut(64, 32), nn.Linear(32, 10))\n")
    return {"model": {"name": None, "factory": "twoout:net"}}


def _unchained(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "unchained.py").write_text(
        "from torch import nn\n\n"
        "def net(**args):\n"
        "    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(10, 10))\n")
    return {"model": {"name": None, "factory": "unchained:net"}}


# case: (what to write under tmp_path, returning the job's overrides; the error, with {tmp} for
# tmp_path and {out} for the job's output.dir)
CASES: dict[str, tuple[Callable[[Path], dict[str, Any]], str]] = {
    "NaN in x": (lambda t: _npz(t, lambda x, y: (_set(x, (3, 5), math.nan), y)),
                 "data.path: {tmp}/data.npz: x[3, 5] is nan"),
    "Inf in float targets": (
        lambda t: {**_npz(t, lambda x, y: (x, _set(np.zeros((ROWS, CLASSES)), (7, 2), -math.inf))),
                   "train": {"loss": "mse"}},
        "data.path: {tmp}/data.npz: y[7, 2] is -inf"),
    "a label beyond the classes": (lambda t: _npz(t, lambda x, y: (x, np.where(np.arange(ROWS) == 9, CLASSES, y))),
                                   "data.path: {tmp}/data.npz: y[9] is 10, not a class of the model's output (0 to 9)"),
    "a negative label": (lambda t: _npz(t, lambda x, y: (x, np.where(np.arange(ROWS) == 2, -1, y))),
                         "data.path: {tmp}/data.npz: y[2] is -1, not a class of the model's output (0 to 9)"),
    "string labels": (lambda t: _npz(t, lambda x, y: (x, np.array(["cat", "dog"] * (ROWS // 2)))),
                      "data.path: {tmp}/data.npz: y holds <U3 values, expected numbers"),
    "targets of another size": (lambda t: {**_npz(t, lambda x, y: (x, np.zeros((ROWS, 3)))), "train": {"loss": "mse"}},
                                "data.path: {tmp}/data.npz: rows of y of shape [3], the model's output "
                                "[16, 10] needs rows of shape [10] for mse"),
    # As many values per row, in another shape: mse would broadcast, training on a wrong loss.
    "targets of another shape": (
        lambda t: {**_npz(t, lambda x, y: (x, np.zeros((ROWS, 2, 5)))), "train": {"loss": "mse"}},
        "data.path: {tmp}/data.npz: rows of y of shape [2, 5], the model's output [16, 10] needs rows of shape "
        "[10] for mse (reshape each row of y to [10])"),
    "x the model does not take": (lambda t: _npz(t, lambda x, y: (x[:, :32], y)),
                                  "data.path: {tmp}/data.npz: the model does not take x of shape [16, 32]"),
    # The shape-only pass multiplies any dtypes; the kernels a stage runs refuse them.
    "uint8 pixels into a Linear": (
        lambda t: _npz(t, lambda x, y: ((x * 40 + 128).clip(0, 255).astype(np.uint8), y)),
        "data.path: {tmp}/data.npz: the model does not take x of shape [16, 64] (torch.uint8): RuntimeError: "
        "addmm of float32 and uint8 operands: its kernels take one dtype"),
    # The model's fault, not the data's: named as such, with the layer.
    "layers that do not chain": (_unchained, "model: layer 2 (Linear) does not take the output of layer 1 (ReLU), "
                                             "float32 [16, 32]: RuntimeError: "),
    "a layer that returns two tensors": (_two_outputs, "model: layer 0 (TwoOut) returns a tuple, not a tensor: each "
                                                       "layer of the nn.Sequential must return one tensor"),
    "no data file": (lambda t: {"data": {"name": "npz", "path": "nowhere.npz"}},
                     "data.path: {tmp}/nowhere.npz does not exist"),
    "a data file that is not an npz": (_garbage, "data.path: {tmp}/data.npz is not a readable npz of plain arrays"),
    "NaN in model.init": (lambda t: _init(t, "w0.safetensors", _nan),
                          "model.init: {tmp}/w0.safetensors: 2.weight holds NaN or Inf"),
    "Inf in a state_dict": (lambda t: _init(t, "w0.pt", _inf), "model.init: {tmp}/w0.pt: 0.bias holds NaN or Inf"),
    "model.init without a key": (lambda t: _init(t, "w0.safetensors", _drop),
                                 "model.init: {tmp}/w0.safetensors lacks ['4.bias']"),
    "model.init of another shape": (lambda t: _init(t, "w0.pt", _reshape),
                                    "model.init: {tmp}/w0.pt: 0.weight has shape [5, 5], the model [32, 64]"),
    "output.dir under a file": (_under_a_file, "output.dir: {tmp}/results/run1: {tmp}/results is a file"),
    "output.dir not writable": (_unwritable, "output.dir: {out}: cannot write in "),
}


def _refused(tmp_path: Path, case: str, code: int, stderr: str, overrides: dict[str, Any]) -> None:
    assert code == 2, stderr
    out = overrides.get("output", {}).get("dir", tmp_path / "out")
    assert stderr.startswith("hetpipe: error: " + CASES[case][1].format(tmp=tmp_path, out=out)), stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert not (tmp_path / "out" / "logs").exists(), "no process was started"


def _args(command: str, job: Path) -> list[str]:
    return [command, *(["-q"] if command == "run" else []), str(job)]


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_in_one_line_before_any_process_starts(tmp_path: Path, case: str, command: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # The command line's main in this process: 30 interpreters importing torch took 90 s of the
    # suite. The test below runs it as a user does, as its own process.
    overrides = CASES[case][0](tmp_path)
    job = _job(tmp_path, **overrides)
    monkeypatch.chdir(tmp_path)
    code = cli.main(_args(command, job))
    _refused(tmp_path, case, code, capsys.readouterr().err, overrides)


@pytest.mark.parametrize("mode", ["ddp", "torch-pipeline"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_baseline_refuses_what_hetpipe_refuses(tmp_path: Path, case: str, mode: str, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The same checks before a baseline's ranks start: unchecked, NaN in x trained ddp to a
    final_loss of null and exit 0, and a label beyond the classes ended in a traceback."""
    overrides = CASES[case][0](tmp_path)
    job = _job(tmp_path, **deep_update(overrides, {"parallel": {"mode": mode}}))
    monkeypatch.chdir(tmp_path)
    code = cli.main(_args("run", job))
    _refused(tmp_path, case, code, capsys.readouterr().err, overrides)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_hetpipe_refuses_in_one_line_with_exit_2(tmp_path: Path, command: str) -> None:
    overrides = CASES["NaN in x"][0](tmp_path)
    done = _cli(*_args(command, _job(tmp_path, **overrides)), cwd=tmp_path)
    assert done.stdout == ""
    _refused(tmp_path, "NaN in x", done.returncode, done.stderr, overrides)


@pytest.mark.parametrize("env, value", [("HETPIPE_THREADS", "abc"), ("HETPIPE_PS_THREADS", "0")])
def test_a_bad_thread_count_is_refused_before_anything_changes(tmp_path: Path, env: str, value: str,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.json").write_text("{}")   # an earlier run's result, to be left as it is
    monkeypatch.setenv(env, value)
    code = cli.main(["run", "-q", str(_job(tmp_path))])
    assert (code, capsys.readouterr().err) == (
        2, f"hetpipe: error: {env}={value!r}: expected a whole number of threads, at least 1\n")
    assert (tmp_path / "out" / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("flag", ["--resume", "--fresh"])
def test_checkpoint_flags_are_refused_for_a_coordinator_elsewhere(tmp_path: Path, flag: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens at port 1: a run that went on to the coordinator would exit 69, not 2.
    code = cli.main(["run", "-q", flag, "--coordinator", "127.0.0.1:1", str(_job(tmp_path))])
    err = capsys.readouterr().err
    assert (code, err) == (2, f"hetpipe: error: {flag}: a job run on a coordinator elsewhere keeps no checkpoints "
                              "yet, to resume from or to delete\n")


def test_the_job_itself_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cases above spoil one thing each of a job that plans."""
    unspoiled = {**_npz(tmp_path, lambda x, y: (x, y)), **_init(tmp_path, "w0.pt", lambda state: None)}
    assert cli.main(["plan", str(_job(tmp_path, **unspoiled))]) == 0, capsys.readouterr().err


def test_a_run_that_fails_after_starting_leaves_no_earlier_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier run's results are gone once a new run into the same output.dir has started,
    even when it fails: nothing there can pass for the new run's. A run refused before it
    starts leaves them as they were."""
    out = tmp_path / "out"
    first = _cli("run", "-q", str(_job(tmp_path)), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (out / "summary.json").exists() and (out / "model.safetensors").exists()
    assert not (out / "coordinator.address").exists(), "its port is free: `hetpipe stop --job` must not reach another run"
    results = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # Refusals in this process: an interpreter each would spend 2-3 s importing torch.
    assert cli.main(["run", "-q", "--resume", str(_job(tmp_path))]) == 2
    assert "--resume: no complete checkpoint" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "-q", str(_job(tmp_path, security={"token_file": "no-such-token"}))]) == 2
    assert "security: token file" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == results, "a refused run changed them"
    # Item 0 reads (what the checks before the start read of a factory's data); row 1 does not.
    (tmp_path / "rows.py").write_text(
        "import torch\n\n"
        "class Rows(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 64\n\n"
        "    def __getitem__(self, i):\n"
        "        if i > 0:\n            raise OSError(f'row {i} is unreadable')\n"
        "        return torch.zeros(64), 0\n\n"
        "def train():\n    return Rows()\n")
    second = _cli("run", "-q", str(_job(tmp_path, data={"name": None, "factory": "rows:train"})), cwd=tmp_path)
    assert second.returncode == 1, second.stderr
    assert "hetpipe: job failed: stage 0 of vw 0: OSError: row 1 is unreadable" in second.stderr
    assert (out / "logs").is_dir(), "the processes had started"
    assert json.loads((out / "status.json").read_text())["state"] == "FAILED"
    assert not (out / "summary.json").exists() and not (out / "model.safetensors").exists()


@pytest.mark.parametrize(("precision", "steps", "message"), [
    ("fp32", 20, r"training diverged: the loss of vw 0 is nan at minibatch \d+ \(train.optimizer.lr is 1e\+30"),
    ("fp16", 60, r"stage 1 of vw 0: Diverged: training diverged: minibatch \d+ overflowed in fp16 at the smallest "
                 r"loss scale \(1\)"),
])
def test_a_run_whose_loss_diverges_fails_naming_where(tmp_path: Path, precision: str, steps: int, message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A loss gone NaN fails the job (fp32), as does an overflow at the smallest loss scale (fp16,
    whose first NaNs the loss scaling skips): not exit 0 with NaN weights and a null final_loss.
    The cause is reported, not the neighbour that then could not send to the failed stage."""
    job = _job(tmp_path, train={"steps": steps, "precision": precision, "optimizer": {"name": "sgd", "lr": 1e30}},
               parallel={"stages_per_vw": 2, "nm": 2})
    assert cli.main(["run", "-q", str(job)]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert re.search(r"; log \S+/out/logs/stage_worker_\d\.log\nhetpipe: it left no checkpoint to go on from "
                     r"\(train\.checkpoint_every is 0\)\n$", err), "the failed stage's log is named, then what is lost"
    assert json.loads((tmp_path / "out" / "status.json").read_text())["state"] == "FAILED"
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("mode", ["ddp", "torch-pipeline"])
def test_a_baseline_refuses_a_model_init_it_would_clear(tmp_path: Path, mode: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"an earlier run's")
    job = _job(tmp_path, parallel={"mode": mode}, model={"init": str(tmp_path / "out" / "model.safetensors")})
    assert cli.main(["run", "-q", str(job)]) == 2
    assert "model.init: " in capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"an earlier run's"


def test_a_run_that_fails_to_start_says_why_in_status_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A worker that exits before it serves (here a shard whose thread count cannot be read) fails
    the run with its log's tail; status.json, which `hetpipe status --job` reads afterwards, says
    the same. It said STOPPED, 'the launcher failed'."""
    # The launcher refuses such a count of the user's before anything starts: handed to the shard alone.
    monkeypatch.setattr(threads, "thread_split", lambda *counts: ("1", "many"))
    job = _job(tmp_path, parallel={"virtual_workers": 2, "stages_per_vw": 1})
    assert cli.main(["run", "-q", str(job)]) == 1
    assert "ps server 0 exited with code 1 before serving" in capsys.readouterr().err
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["state"] == "FAILED" and status["reason"].startswith("ps server 0 exited with code 1 before serving"), status


def test_a_diverged_run_names_the_first_minibatch_whose_loss_was_nan(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Not the minibatch the last poll saw: a NaN in one row of the data (past the first, which
    the checks before the start read) makes minibatch 3's loss NaN, and every loss after it."""
    (tmp_path / "rows.py").write_text(
        "import torch\n\n"
        "class Rows(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 640\n\n"
        "    def __getitem__(self, i):\n"
        "        x = torch.full((64,), 0.01 * (i % 7))\n"
        "        if i == 16 * 2 + 5:\n            x[3] = float('nan')\n"
        "        return x, i % 10\n\n"
        "def train():\n    return Rows()\n")
    job = _job(tmp_path, data={"name": None, "factory": "rows:train", "shuffle": False}, train={"steps": 30},
               parallel={"stages_per_vw": 1})
    assert cli.main(["run", "-q", str(job)]) == 1
    err = capsys.readouterr().err
    assert "training diverged: the loss of vw 0 is nan at minibatch 3 (train.optimizer.lr is 0.05;" in err, err


def test_a_run_does_not_delete_an_earlier_runs_checkpoints_unless_told_to(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Without --resume, a run into an output.dir with checkpoints is refused, changing nothing
    (a forgotten --resume must not cost the training they hold); --fresh starts over without them."""
    out = tmp_path / "out"
    two_vws = {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0}
    first = _cli("run", "-q", str(_job(tmp_path, train={"steps": 5, "checkpoint_every": 2}, parallel=two_vws)),
                 cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file())
    assert (out / "checkpoints" / "cut000004" / "manifest.json").exists()

    # The refusals in this process: an interpreter each would spend 2-3 s importing torch.
    assert cli.main(["run", "-q", str(_job(tmp_path, parallel=two_vws))]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hetpipe: error: output.dir {out} holds an earlier run's checkpoints (the latest after wave 4): "
        "--resume goes on from it, --fresh deletes them and starts over"]
    assert sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) == before
    with pytest.raises(SystemExit) as both:
        cli.main(["run", "-q", "--resume", "--fresh", str(_job(tmp_path, parallel=two_vws))])
    assert both.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

    fresh = _cli("run", "-q", "--fresh", str(_job(tmp_path, parallel=two_vws)), cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert not (out / "checkpoints").exists() and (out / "model.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs a cluster's real GPUs")
def test_a_cluster_of_real_gpus_is_not_run_on_the_cpu_under_their_names(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A cluster without emulate names real GPUs: planned anywhere (for a cluster elsewhere), but
    not run on a machine without CUDA, where its stages computed on the CPU labelled titan-v and
    'emulated: false'."""
    job = _job(tmp_path, cluster={"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 2}]}]},
               parallel={"stages_per_vw": 2, "nm": 2})
    assert cli.main(["plan", str(job)]) == 0
    capsys.readouterr()
    assert cli.main(["run", "-q", str(job)]) == 2
    assert capsys.readouterr().err == (
        "hetpipe: error: cluster: names real GPUs (titan-v; there is no cluster.emulate), and this machine has no "
        "CUDA device: add cluster.emulate: {} to emulate them on the CPU, or leave cluster out to train on this "
        "machine's own devices\n")
    assert not (tmp_path / "out").exists()


def test_a_run_leaves_no_earlier_runs_logs_or_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """logs/ and trace/ hold this run's alone: an earlier run's log of a process this one lacks,
    or its trace where this one writes none, would pass for this run's (`hetpipe trace`)."""
    out = tmp_path / "out"
    traced = _job(tmp_path, parallel={"virtual_workers": 2, "stages_per_vw": 2, "nm": 2},
                  output={"dir": str(out), "trace": True})
    assert cli.main(["run", "-q", str(traced)]) == 0, capsys.readouterr().err
    assert (out / "trace" / "ps").is_dir() and len(list((out / "logs").glob("stage_worker_*.log"))) == 4
    assert cli.main(["run", "-q", str(_job(tmp_path, parallel={"stages_per_vw": 1}))]) == 0, capsys.readouterr().err
    assert not (out / "trace").exists()
    assert sorted(p.name for p in (out / "logs").glob("*.log")) == ["stage_worker_0.log"]


def test_a_run_removes_only_what_runs_write_from_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """output.dir may be the user's own folder: a new run clears an earlier run's files there, by
    the names runs write, and leaves the user's own in logs/, trace/, checkpoints/ and ps/ alone.
    A model.init that is an earlier run's output there is refused before anything is cleared."""
    out = tmp_path / "out"
    job = _job(tmp_path, output={"dir": str(out), "trace": True})
    assert cli.main(["run", "-q", str(job)]) == 0, capsys.readouterr().err
    assert (out / "trace" / "vw0_stage0.jsonl").exists() and (out / "model.safetensors").exists()
    mine = {"notes.md": "notes", "logs/train.log": "mine", "trace/profile.json": "{}", "checkpoints/epoch10.pt": "w",
            "checkpoints/cut_best/w.pt": "w", "ps/readme.txt": "r", "trace/sync/mine.txt": "m"}
    for name, text in mine.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    model = (out / "model.safetensors").read_bytes()

    fine_tune = _job(tmp_path, output={"dir": str(out), "trace": False}, model={"init": str(out / "model.safetensors")})
    assert cli.main(["run", "-q", str(fine_tune)]) == 2
    assert capsys.readouterr().err == (
        f"hetpipe: error: model.init: {out / 'model.safetensors'} is an earlier run's output in output.dir {out}, "
        "which this run clears before it starts: copy it out of output.dir first, or choose another output.dir\n")
    assert (out / "model.safetensors").read_bytes() == model, "a refused run changes nothing"

    assert cli.main(["run", "-q", str(_job(tmp_path, output={"dir": str(out), "trace": False}))]) == 0
    assert {name: (out / name).read_text() for name in mine} == mine
    assert sorted(p.name for p in (out / "trace").iterdir()) == ["profile.json", "sync"]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["stage_worker_0.log", "stage_worker_1.log", "train.log"]
