"""The datasets a job reads (hetpipe/datasets.py): the built-ins, npz, digits and synthetic, as
training reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import npz_job
from hetpipe.config import ConfigError, JobConfig, parse_job
from hetpipe.data import read_rows
from hetpipe.datasets import training_set
from hetpipe.reference import minibatch


def whole(job: JobConfig) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = training_set(job)
    return read_rows(job, dataset, range(len(dataset)))


def test_npz_loads_in_training_dtype(tmp_path: Path) -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    y = np.arange(10) % 3
    np.savez(tmp_path / "data.npz", x=x, y=y)
    job = npz_job(tmp_path, dtype="float64")
    xs, ys = whole(job)
    assert xs.dtype == torch.float64 and ys.dtype == torch.int64
    assert torch.equal(xs, torch.from_numpy(x).double()) and torch.equal(ys, torch.from_numpy(y))
    bx, by = minibatch(npz_job(tmp_path), training_set(job), 3, 0)
    assert torch.equal(by, torch.tensor([8, 9, 0, 1]) % 3), "rows 8..11 mod 10"
    assert torch.equal(bx[0], torch.from_numpy(x[8]))


def test_npz_float_targets_for_mse(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.ones((4, 2)), y=np.linspace(0, 1, 4))
    assert whole(npz_job(tmp_path, loss="mse"))[1].dtype == torch.float32
    with pytest.raises(ConfigError, match="cross_entropy needs integer class labels"):
        whole(npz_job(tmp_path, loss="cross_entropy"))


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.path: .*nowhere\.npz does not exist"):
        training_set(npz_job(tmp_path, "nowhere.npz"))


def test_npz_missing_array(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 2)), labels=np.zeros(4))
    with pytest.raises(ConfigError) as err:
        training_set(npz_job(tmp_path))
    assert "data.path" in str(err.value) and "['y']" in str(err.value) and "labels" in str(err.value)


@pytest.mark.parametrize(("nx", "ny"), [(5, 4), (0, 0)])
def test_npz_length_mismatch_or_empty(tmp_path: Path, nx: int, ny: int) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((nx, 2)), y=np.zeros(ny, dtype=np.int64))
    with pytest.raises(ConfigError, match=f"x has {nx} rows and y has {ny}; expected equal and > 0"):
        training_set(npz_job(tmp_path))


@pytest.mark.parametrize("content", [b"hello, not an npz", None])
def test_npz_refuses_pickles_and_garbage(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "data.npz"
    if content is None:
        np.savez(path, x=np.array([{"code": 1}], dtype=object), y=np.zeros(1))
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match="not a readable npz of plain arrays"):
        training_set(npz_job(tmp_path))


@pytest.mark.parametrize("case", ["truncated", "directory", "scalar", "npy"])
def test_npz_other_bad_files_are_config_errors(tmp_path: Path, case: str) -> None:
    path = tmp_path / "data.npz"
    if case == "npy":  # one array, which np.load returns as such (no npz to open as a context)
        with open(path, "wb") as f:
            np.save(f, np.zeros((8, 2)))
    elif case == "truncated":
        np.savez(path, x=np.zeros((8, 2)), y=np.zeros(8))
        path.write_bytes(path.read_bytes()[:100])
    elif case == "directory":
        path.mkdir()
    else:
        np.savez(path, x=np.float64(1.0), y=np.zeros(3))
    with pytest.raises(ConfigError, match="data.path"):
        training_set(npz_job(tmp_path))


def test_digits_equal_scikit_learn() -> None:
    from sklearn.datasets import load_digits

    ref = load_digits()
    job = parse_job({"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"dtype": "float64"}})
    x, y = whole(job)
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert x.dtype == torch.float64 and y.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(ref.data / 16.0))
    assert torch.equal(y, torch.from_numpy(ref.target.astype(np.int64)))


@pytest.mark.parametrize("value", [0, -3, "x", 1.5, True, 1 << 40])
def test_synthetic_sizes_are_checked(value: Any) -> None:
    raw = {"model": {"name": "mlp"}, "data": {"name": "synthetic", "args": {"rows": value}}}
    with pytest.raises(ConfigError, match=r"data\.args\.rows: expected an integer >= 1"):
        training_set(parse_job(raw))


def test_synthetic_is_seeded_and_shaped() -> None:
    raw: dict[str, Any] = {"model": {"name": "mlp", "args": {"in_features": 5, "num_classes": 3}},
                           "data": {"name": "synthetic", "args": {"rows": 50}}, "train": {"seed": 3}}
    (ax, ay), (bx, by) = whole(parse_job(raw)), whole(parse_job(raw))
    assert ax.shape == (50, 5) and ay.shape == (50,)
    assert torch.equal(ax, bx) and torch.equal(ay, by)
    assert int(ay.max()) < 3 and len(set(ay.tolist())) > 1
    raw["train"]["seed"] = 4
    assert not torch.equal(whole(parse_job(raw))[0], ax)
    # A user's model: the shapes come from data.args.
    factory = {"model": {"factory": "mymodels:net"}, "data": {"name": "synthetic",
                                                                "args": {"rows": 8, "features": 7, "classes": 4}}}
    x, y = whole(parse_job(factory))
    assert x.shape == (8, 7) and int(y.max()) < 4
