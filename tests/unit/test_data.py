"""Datasets and the DESIGN §8 data order (hetpipe/data.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.config import ConfigError, JobConfig, parse_job
from hetpipe.data import load_dataset, minibatch, minibatch_rows


def rows(p: int, vw: int, *, n_vw: int, b: int, n: int, shuffle: bool = False, seed: int = 0) -> list[int]:
    out = minibatch_rows(p, vw, virtual_workers=n_vw, batch_size=b, rows=n, shuffle=shuffle, seed=seed)
    assert out.dtype == np.int64 and out.shape == (b,)
    return out.tolist()


# ---- order without shuffle -------------------------------------------------------------------


def test_one_vw_reads_consecutive_batches() -> None:
    assert rows(1, 0, n_vw=1, b=4, n=100) == [0, 1, 2, 3]
    assert rows(2, 0, n_vw=1, b=4, n=100) == [4, 5, 6, 7]
    assert rows(25, 0, n_vw=1, b=4, n=100) == [96, 97, 98, 99]
    assert rows(26, 0, n_vw=1, b=4, n=100) == [0, 1, 2, 3], "the next epoch starts over"


def test_vws_interleave_global_batches_and_wrap() -> None:
    # N=2, B=3, n=10: j = (p-1)*2 + v takes rows 3j .. 3j+2 mod 10.
    assert rows(1, 0, n_vw=2, b=3, n=10) == [0, 1, 2]      # j=0
    assert rows(1, 1, n_vw=2, b=3, n=10) == [3, 4, 5]      # j=1
    assert rows(2, 0, n_vw=2, b=3, n=10) == [6, 7, 8]      # j=2
    assert rows(2, 1, n_vw=2, b=3, n=10) == [9, 0, 1]      # j=3 wraps inside the batch
    assert rows(3, 0, n_vw=2, b=3, n=10) == [2, 3, 4]      # j=4: rows 12..14 mod 10
    assert rows(3, 1, n_vw=3, b=3, n=10) == [1, 2, 3]      # N=3: j=7, rows 21..23 mod 10


def test_batch_larger_than_dataset_wraps_repeatedly() -> None:
    assert rows(1, 0, n_vw=1, b=7, n=3) == [0, 1, 2, 0, 1, 2, 0]
    assert rows(2, 0, n_vw=1, b=7, n=3) == [1, 2, 0, 1, 2, 0, 1]


@settings(max_examples=200, deadline=None)
@given(n_vw=st.integers(1, 4), b=st.integers(1, 9), n=st.integers(1, 40), p=st.integers(1, 30), data=st.data())
def test_order_formula(n_vw: int, b: int, n: int, p: int, data: st.DataObject) -> None:
    vw = data.draw(st.integers(0, n_vw - 1))
    j = (p - 1) * n_vw + vw
    assert rows(p, vw, n_vw=n_vw, b=b, n=n) == [r % n for r in range(j * b, (j + 1) * b)]


@pytest.mark.parametrize(("p", "vw", "n_vw"), [(0, 0, 1), (-1, 0, 2), (1, 2, 2), (1, -1, 2)])
def test_minibatch_outside_the_job(p: int, vw: int, n_vw: int) -> None:
    with pytest.raises(ValueError, match=f"minibatch {p} of vw {vw}"):
        minibatch_rows(p, vw, virtual_workers=n_vw, batch_size=4, rows=10, shuffle=False, seed=0)


# ---- shuffle ---------------------------------------------------------------------------------


def global_stream(n_vw: int, b: int, n: int, steps: int, seed: int, shuffle: bool = True) -> list[int]:
    """Every VW's minibatches in global batch order j = 0, 1, ..."""
    out: list[int] = []
    for p in range(1, steps + 1):
        for vw in range(n_vw):
            out += rows(p, vw, n_vw=n_vw, b=b, n=n, shuffle=shuffle, seed=seed)
    return out


@settings(max_examples=150, deadline=None)
@given(n_vw=st.integers(1, 3), b=st.integers(1, 8), n=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
def test_shuffle_is_a_permutation_per_epoch(n_vw: int, b: int, n: int, seed: int) -> None:
    steps = -(-3 * n // (n_vw * b))  # at least three epochs
    stream = global_stream(n_vw, b, n, steps, seed)
    for e in range(3):
        epoch = stream[e * n:(e + 1) * n]
        assert sorted(epoch) == list(range(n)), f"epoch {e} reads every row exactly once"
    assert stream == global_stream(n_vw, b, n, steps, seed), "deterministic per seed"


def test_shuffle_with_batches_dividing_the_dataset() -> None:
    # n a multiple of B: each epoch is a whole number of minibatches covering each row once.
    n, b = 48, 8
    per_epoch = n // b
    batches = [rows(p, 0, n_vw=1, b=b, n=n, shuffle=True, seed=5) for p in range(1, 3 * per_epoch + 1)]
    epochs = [sum(batches[e * per_epoch:(e + 1) * per_epoch], []) for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != list(range(n)), "shuffled, not the plain order"
    assert epochs[0] != epochs[1], "each epoch has its own permutation"


def test_shuffle_depends_on_seed_and_off_means_plain_order() -> None:
    a = global_stream(2, 4, 32, 8, seed=0)
    assert a != global_stream(2, 4, 32, 8, seed=1)
    assert global_stream(2, 4, 32, 8, seed=0, shuffle=False) == list(range(32)) * 2


# ---- loaders ---------------------------------------------------------------------------------


def npz_job(tmp_path: Path, path: str = "data.npz", **train: Any) -> JobConfig:
    raw = {"model": {"name": "mlp"}, "data": {"name": "npz", "path": path, "batch_size": 4}, "train": train}
    return parse_job(raw, base_dir=str(tmp_path))


def test_npz_loads_in_training_dtype(tmp_path: Path) -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    y = np.arange(10) % 3
    np.savez(tmp_path / "data.npz", x=x, y=y)
    ds = load_dataset(npz_job(tmp_path, dtype="float64"))
    assert ds.x.dtype == torch.float64 and ds.y.dtype == torch.int64
    assert torch.equal(ds.x, torch.from_numpy(x).double()) and torch.equal(ds.y, torch.from_numpy(y))
    assert ds.rows == 10 and ds.classification
    bx, by = minibatch(ds, 3, 0, npz_job(tmp_path))
    assert torch.equal(by, torch.tensor([8, 9, 0, 1]) % 3), "rows 8..11 mod 10"
    assert torch.equal(bx[0], ds.x[8])


def test_npz_float_targets_for_mse(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.ones((4, 2)), y=np.linspace(0, 1, 4))
    ds = load_dataset(npz_job(tmp_path, loss="mse"))
    assert ds.y.dtype == torch.float32 and not ds.classification
    with pytest.raises(ConfigError, match="cross_entropy needs integer labels"):
        load_dataset(npz_job(tmp_path, loss="cross_entropy"))


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.path: .*nowhere\.npz does not exist"):
        load_dataset(npz_job(tmp_path, "nowhere.npz"))


def test_npz_missing_array(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 2)), labels=np.zeros(4))
    with pytest.raises(ConfigError) as err:
        load_dataset(npz_job(tmp_path))
    assert "data.path" in str(err.value) and "['y']" in str(err.value) and "labels" in str(err.value)


@pytest.mark.parametrize(("nx", "ny"), [(5, 4), (0, 0)])
def test_npz_length_mismatch_or_empty(tmp_path: Path, nx: int, ny: int) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((nx, 2)), y=np.zeros(ny, dtype=np.int64))
    with pytest.raises(ConfigError, match=f"x has {nx} rows and y has {ny}; expected equal and > 0"):
        load_dataset(npz_job(tmp_path))


@pytest.mark.parametrize("content", [b"hello, not an npz", None])
def test_npz_refuses_pickles_and_garbage(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "data.npz"
    if content is None:
        np.savez(path, x=np.array([{"code": 1}], dtype=object), y=np.zeros(1))
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match="not a readable npz of plain arrays"):
        load_dataset(npz_job(tmp_path))


@pytest.mark.parametrize("case", ["truncated", "directory", "scalar"])
def test_npz_other_bad_files_are_config_errors(tmp_path: Path, case: str) -> None:
    path = tmp_path / "data.npz"
    if case == "truncated":
        np.savez(path, x=np.zeros((8, 2)), y=np.zeros(8))
        path.write_bytes(path.read_bytes()[:100])
    elif case == "directory":
        path.mkdir()
    else:
        np.savez(path, x=np.float64(1.0), y=np.zeros(3))
    with pytest.raises(ConfigError, match="data.path"):
        load_dataset(npz_job(tmp_path))


def test_digits_equal_scikit_learn() -> None:
    from sklearn.datasets import load_digits

    ref = load_digits()
    job = parse_job({"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"dtype": "float64"}})
    ds = load_dataset(job)
    assert ds.x.shape == (1797, 64) and ds.y.shape == (1797,)
    assert ds.x.dtype == torch.float64 and ds.y.dtype == torch.int64
    assert torch.equal(ds.x, torch.from_numpy(ref.data / 16.0))
    assert torch.equal(ds.y, torch.from_numpy(ref.target.astype(np.int64)))
    assert float(ds.x.max()) == 1.0 and float(ds.x.min()) == 0.0


def test_synthetic_is_seeded_and_shaped() -> None:
    raw: dict[str, Any] = {"model": {"name": "mlp", "args": {"in_features": 5, "num_classes": 3}},
                           "data": {"name": "synthetic", "args": {"rows": 50}}, "train": {"seed": 3}}
    a, b = load_dataset(parse_job(raw)), load_dataset(parse_job(raw))
    assert a.x.shape == (50, 5) and a.y.shape == (50,)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert int(a.y.max()) < 3 and len(set(a.y.tolist())) > 1
    raw["train"]["seed"] = 4
    assert not torch.equal(load_dataset(parse_job(raw)).x, a.x)
