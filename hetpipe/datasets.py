"""The datasets a job reads: the built-ins (digits, synthetic, npz), the user's factories (a
map-style torch Dataset of (input, target)), and the held-out split. The order they are read in
and the readers: hetpipe/data.py; their check against the model: hetpipe/data_check.py."""

from __future__ import annotations

import importlib.util
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from hetpipe.config import ConfigError, JobConfig
from hetpipe.draws import BUILD_DRAW, CHECK_DRAW, drawing
from hetpipe.errors import user_frame
from hetpipe.validate import Section

NUMBERS = "biuf"  # numpy kinds a tensor can be made of and a loss can take
MAX_SYNTHETIC = 1 << 27  # rows, features, classes, vocab, context of data.name synthetic: within memory


class ArrayDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Rows of two arrays (in memory or memory-mapped); a minibatch is one fancy index. source:
    what the job calls it, for errors ("data.path: /data/train.npz")."""

    def __init__(self, x: np.ndarray, y: np.ndarray, source: str = "") -> None:
        self.x, self.y, self.source = x, y, source

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(np.asarray(self.x[i])), torch.as_tensor(np.asarray(self.y[i]))

    def __getitems__(self, rows: Sequence[int]) -> Batch:
        index = np.asarray(rows, dtype=np.int64)
        return Batch(torch.from_numpy(np.ascontiguousarray(self.x[index])),
                      torch.from_numpy(np.ascontiguousarray(self.y[index])))


@dataclass(frozen=True, slots=True)
class Batch:
    """A minibatch's inputs and targets, read at once."""

    x: torch.Tensor
    y: torch.Tensor

    def pin_memory(self) -> Batch:
        """What DataLoader(pin_memory=True) calls on a batch of its own type: both tensors in
        page-locked memory, so their copies to the GPU can be non_blocking."""
        return Batch(self.x.pin_memory(), self.y.pin_memory())


def _digits() -> ArrayDataset:
    """UCI handwritten digits (1797 x 8x8), the file scikit-learn's wheel ships: no download.

    Read straight from the wheel: importing sklearn itself costs seconds in every process.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.name: digits needs scikit-learn installed (it ships the data file)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    return ArrayDataset(table[:, :-1] / 16.0, table[:, -1].astype(np.int64), "data.name: digits")


def _synthetic(job: JobConfig) -> ArrayDataset:
    """Seeded random inputs with learnable labels. The shapes come from data.args (features,
    classes; or vocab, context for token models), else from a zoo model's args."""
    args, margs = job.data.args, job.model.args
    given = Section(args, "data.args")

    def size(key: str, default: Any) -> int:  # a data.args size, else the model's (which checks its own)
        return given.integer(key, int(default), minimum=1, maximum=MAX_SYNTHETIC) if key in args else int(default)

    rows = size("rows", 1024)
    rng = np.random.default_rng(given.integer("seed", job.train.seed))
    if "vocab" in args or (job.model.name == "gpt" and "features" not in args):
        # A fixed random Markov chain over the vocabulary: learnable next-token structure.
        vocab, context = size("vocab", margs.get("vocab", 64)), size("context", margs.get("context", 16))
        nxt = rng.integers(0, vocab, size=(vocab, 2))
        seq = np.empty((rows, context + 1), dtype=np.int64)
        seq[:, 0] = rng.integers(0, vocab, size=rows)
        for t in range(context):
            seq[:, t + 1] = nxt[seq[:, t], rng.integers(0, 2, size=rows)]
        return ArrayDataset(seq[:, :-1], seq[:, 1:], "data.name: synthetic")
    features = size("features", np.prod(margs["in_shape"]) if "in_shape" in margs else margs.get("in_features", 64))
    classes = size("classes", margs.get("num_classes", 10))
    x = rng.standard_normal((rows, features))
    # The labels depend on the first 1024 features: an image-sized input would otherwise need a
    # teacher matrix of features x classes (1.2 GB for 224x224x3 and 1000 classes).
    used = min(features, 1024)
    scores = x[:, :used] @ rng.standard_normal((used, classes))
    return ArrayDataset(x, scores if job.train.loss == "mse" else scores.argmax(axis=1).astype(np.int64),
                        "data.name: synthetic")


def _npz(job: JobConfig) -> ArrayDataset:
    assert job.data.path is not None
    path = job.resolve(job.data.path)
    try:
        # allow_pickle=False: a data file must not be able to run code.
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ConfigError(f"data.path: {path} holds one array (.npy); expected an npz with arrays x and y "
                              "(numpy.savez)")
        with loaded as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise ConfigError(f"data.path: {path} lacks array(s) {sorted(missing)}; it has {f.files}")
            x, y = f["x"], f["y"]
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"data.path: {path} does not exist") from None
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"data.path: {path} is not a readable npz of plain arrays ({exc})") from None
    if x.ndim == 0 or y.ndim == 0:
        raise ConfigError(f"data.path: x and y must have a row dimension, got shapes {x.shape} and {y.shape}")
    if len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"data.path: x has {len(x)} rows and y has {len(y)}; expected equal and > 0")
    for name, array in (("x", x), ("y", y)):
        if array.dtype.kind not in NUMBERS:  # strings would fail deep inside torch, in every stage
            raise ConfigError(f"data.path: {path}: {name} holds {array.dtype} values, expected numbers")
    return ArrayDataset(x, y, f"data.path: {path}")


_ITEM_VALUES = (torch.Tensor, np.ndarray, int, float, np.number)   # what default_collate stacks into one tensor


def from_factory(job: JobConfig, spec: str, key: str) -> Dataset[Any]:
    from hetpipe.models import call_factory, resolve

    make = resolve(spec, key, job.base_dir)
    # Every process that reads the data builds it: one that shuffles or splits its rows as it
    # is built must build the same rows in each, or inputs train against other rows' targets.
    with drawing(job, (BUILD_DRAW,)):
        dataset = call_factory(make, dict(job.data.args), key, spec, "data.args", job.base_dir)
    if isinstance(dataset, Mapping) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{key}: {spec} returned a {type(dataset).__name__}, expected a map-style "
                          f"torch.utils.data.Dataset (with __getitem__ and __len__) of (input, target)")
    try:
        rows = len(dataset)
    except Exception as exc:
        raise ConfigError(f"{key}: len() of {spec}'s dataset failed: {type(exc).__name__}: {exc}"
                          f"{user_frame(exc, job.base_dir)}") from None
    if rows == 0:
        raise ConfigError(f"{key}: {spec} returned an empty dataset")
    try:
        with drawing(job, (CHECK_DRAW,)):   # an augmentation's draws move no one's generator
            item = dataset[0]
    except Exception as exc:
        raise ConfigError(f"{key}: reading item 0 of {spec}'s dataset failed: {type(exc).__name__}: {exc}"
                          f"{user_frame(exc, job.base_dir)}") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"{key}: {spec}'s items are {type(item).__name__}s, expected (input, target) pairs")
    x, y = item
    if not isinstance(x, _ITEM_VALUES):   # a token id is one number
        # A tuple would be stacked into one tensor, or collated into a list the first layer
        # cannot take: the pipeline hands each layer one tensor.
        raise ConfigError(f"{key}: {spec}'s inputs are {type(x).__name__}s, expected one tensor (or numpy "
                          "array, or number) per item: each layer of the pipeline takes one tensor")
    if not isinstance(y, _ITEM_VALUES):
        raise ConfigError(f"{key}: {spec}'s targets are {type(y).__name__}s, expected a tensor, a numpy array or "
                          "a number per item")
    return dataset  # type: ignore[no-any-return]


def whole_set(job: JobConfig) -> Dataset[Any]:
    if job.data.factory is not None:
        return from_factory(job, job.data.factory, "data.factory")
    loaders = {"digits": _digits, "synthetic": lambda: _synthetic(job), "npz": lambda: _npz(job)}
    return loaders[str(job.data.name)]()  # type: ignore[no-any-return]


def split_rows(job: JobConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) for data.eval_fraction: a seeded choice of rows."""
    held = max(1, int(round(n * job.data.eval_fraction)))
    if held >= n:
        raise ConfigError(f"data.eval_fraction: {job.data.eval_fraction} of {n} rows leaves none to train on")
    order = np.random.default_rng([job.train.seed, 0x5EED]).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def training_set(job: JobConfig) -> Dataset[Any]:
    """The rows training reads (the dataset less any eval_fraction held out)."""
    return training_rows(job, whole_set(job))


def training_rows(job: JobConfig, whole: Dataset[Any]) -> Dataset[Any]:
    if job.data.eval_fraction > 0:
        return Subset(whole, split_rows(job, len(whole))[0].tolist())  # type: ignore[arg-type]
    return whole


def held_out_set(job: JobConfig) -> Dataset[Any] | None:
    """The held-out rows evaluation reads: data.eval_factory's, or the eval_fraction split."""
    if job.data.eval_factory is not None:
        return from_factory(job, job.data.eval_factory, "data.eval_factory")
    if job.data.eval_fraction > 0:
        whole = whole_set(job)
        return Subset(whole, split_rows(job, len(whole))[1].tolist())  # type: ignore[arg-type]
    return None
