"""Datasets (npz, synthetic, scikit-learn's bundled digits) and the DESIGN §8 data order."""

from __future__ import annotations

import importlib.util
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hetpipe.config import ConfigError, JobConfig
from hetpipe.zoo import takes_tokens


@dataclass(frozen=True, slots=True)
class Dataset:
    x: torch.Tensor
    y: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    @property
    def classification(self) -> bool:
        return not self.y.is_floating_point()


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """UCI handwritten digits (1797 x 8x8), the file scikit-learn's wheel ships: no download.

    Read straight from the wheel: importing sklearn itself costs seconds in every process.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.name: digits needs scikit-learn installed (it ships the data file)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def _synthetic(job: JobConfig) -> tuple[np.ndarray, np.ndarray]:
    args, margs = job.data.args, job.model.args
    rows = int(args.get("rows", 1024))
    rng = np.random.default_rng(int(args.get("seed", job.train.seed)))
    if takes_tokens(job.model.name):
        # A fixed random Markov chain over the vocabulary: learnable next-token structure.
        vocab, context = int(margs.get("vocab", 64)), int(margs.get("context", 16))
        nxt = rng.integers(0, vocab, size=(vocab, 2))
        seq = np.empty((rows, context + 1), dtype=np.int64)
        seq[:, 0] = rng.integers(0, vocab, size=rows)
        for t in range(context):
            seq[:, t + 1] = nxt[seq[:, t], rng.integers(0, 2, size=rows)]
        return seq[:, :-1], seq[:, 1:]
    if "in_shape" in margs:
        features = int(np.prod(margs["in_shape"]))
    else:
        features = int(margs.get("in_features", args.get("features", 64)))
    classes = int(margs.get("num_classes", 10))
    x = rng.standard_normal((rows, features))
    # The labels depend on the first 1024 features: an image-sized input would otherwise need a
    # teacher matrix of features x classes (1.2 GB for 224x224x3 and 1000 classes).
    used = min(features, 1024)
    teacher = rng.standard_normal((used, classes))
    scores = x[:, :used] @ teacher
    if job.train.loss == "mse":
        return x, scores
    return x, scores.argmax(axis=1).astype(np.int64)


def _npz(job: JobConfig) -> tuple[np.ndarray, np.ndarray]:
    assert job.data.path is not None
    path = job.resolve(job.data.path)
    try:
        # allow_pickle=False: a data file must not be able to run code.
        with np.load(path, allow_pickle=False) as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise ConfigError(f"data.path: {path} lacks array(s) {sorted(missing)}; it has {f.files}")
            x, y = f["x"], f["y"]
    except FileNotFoundError:
        raise ConfigError(f"data.path: {path} does not exist") from None
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"data.path: {path} is not a readable npz of plain arrays ({exc})") from None
    if x.ndim == 0 or y.ndim == 0:
        raise ConfigError(f"data.path: x and y must have a row dimension, got shapes {x.shape} and {y.shape}")
    if len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"data.path: x has {len(x)} rows and y has {len(y)}; expected equal and > 0")
    return x, y


def load_dataset(job: JobConfig) -> Dataset:
    """Loads the job's dataset with x in the training dtype (token ids stay int64)."""
    loaders = {"digits": lambda: _digits(), "synthetic": lambda: _synthetic(job), "npz": lambda: _npz(job)}
    x_np, y_np = loaders[job.data.name]()
    dtype = getattr(torch, job.train.dtype)
    x = torch.from_numpy(np.ascontiguousarray(x_np))
    x = x.long() if takes_tokens(job.model.name) else x.to(dtype)
    y = torch.from_numpy(np.ascontiguousarray(y_np))
    y = y.to(dtype) if (job.train.loss == "mse" or y.is_floating_point()) else y.long()
    if job.train.loss == "cross_entropy" and y.is_floating_point():
        raise ConfigError("train.loss: cross_entropy needs integer labels in y; use mse for float targets")
    return Dataset(x, y)


def minibatch_rows(
    p: int, vw: int, *, virtual_workers: int, batch_size: int, rows: int, shuffle: bool, seed: int
) -> np.ndarray:
    """Row indices of minibatch p (from 1) of VW vw (from 0), per DESIGN §8.

    Global batch j = (p-1)*N + v takes rows j*B .. (j+1)*B-1 modulo n. With shuffle, each pass
    over the data (epoch) reads the rows through its own seeded permutation.
    """
    if p < 1 or not 0 <= vw < virtual_workers:
        raise ValueError(f"minibatch {p} of vw {vw} is outside the job")
    j = (p - 1) * virtual_workers + vw
    flat = np.arange(j * batch_size, (j + 1) * batch_size, dtype=np.int64)
    idx = flat % rows
    if not shuffle:
        return idx
    epochs = flat // rows
    out = np.empty_like(idx)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(rows)
        sel = epochs == epoch
        out[sel] = perm[idx[sel]]
    return out


def minibatch(data: Dataset, p: int, vw: int, job: JobConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The (x, y) of minibatch p of VW vw."""
    rows = minibatch_rows(
        p, vw, virtual_workers=job.parallel.virtual_workers, batch_size=job.data.batch_size,
        rows=data.rows, shuffle=job.data.shuffle, seed=job.train.seed,
    )
    index = torch.from_numpy(rows)
    return data.x[index], data.y[index]
