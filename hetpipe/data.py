"""Datasets and the DESIGN §8 data order: the built-ins (digits, synthetic, npz), the user's
factories (a map-style torch Dataset of (input, target)), the held-out split, the readers
stage 0 (inputs) and the last stage (targets) take minibatches from. Their check against the
model, before any process starts: hetpipe/data_check.py."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import multiprocessing.context
import os
import random
import sys
import threading
import time
import traceback
import weakref
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from hetpipe.config import ConfigError, JobConfig
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

    def __getitems__(self, rows: Sequence[int]) -> _Batch:
        index = np.asarray(rows, dtype=np.int64)
        return _Batch(torch.from_numpy(np.ascontiguousarray(self.x[index])),
                      torch.from_numpy(np.ascontiguousarray(self.y[index])))


@dataclass(frozen=True, slots=True)
class _Batch:
    x: torch.Tensor
    y: torch.Tensor

    def pin_memory(self) -> _Batch:
        """What DataLoader(pin_memory=True) calls on a batch of its own type: both tensors in
        page-locked memory, so their copies to the GPU can be non_blocking."""
        return _Batch(self.x.pin_memory(), self.y.pin_memory())


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
    return _training_rows(job, whole_set(job))


def _training_rows(job: JobConfig, whole: Dataset[Any]) -> Dataset[Any]:
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
        perm = _permutation(seed, int(epoch), rows)
        sel = epochs == epoch
        out[sel] = perm[idx[sel]]
    return out


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, rows: int) -> np.ndarray:
    """An epoch's order, drawn once: a minibatch of an ImageNet-sized dataset that drew it anew
    took 25 ms, and a stage computing its order up front took minutes."""
    perm = np.random.default_rng([seed, epoch]).permutation(rows)
    perm.flags.writeable = False
    return perm


def _collate(items: Any) -> _Batch:
    if isinstance(items, _Batch):  # ArrayDataset read the whole minibatch at once
        return items
    x, y = torch.utils.data.default_collate(items)
    return _Batch(x, y)


def cast(job: JobConfig, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs in the training dtype (integer inputs, such as tokens, stay integers); targets as
    the loss takes them. ConfigError for labels cross_entropy cannot use."""
    dtype = getattr(torch, job.train.dtype)
    if x.is_floating_point():
        x = x.to(dtype)
    if job.train.loss == "mse":
        return x, y.to(dtype)
    if y.is_floating_point() or y.dtype == torch.bool:
        raise ConfigError(f"train.loss: cross_entropy needs integer class labels as targets, got {y.dtype}; "
                          "use mse for float targets")
    return x, y.long()


# A draw names what is read: training minibatch (TRAIN_DRAW, vw, p), evaluation minibatch
# (EVAL_DRAW, i), (CHECK_DRAW,) the item a factory's dataset is checked by, or (BUILD_DRAW,) the factory's
# call itself; or what a stage's forward draws, dropout's masks (FORWARD_DRAW, vw, stage, p[, micro]).
TRAIN_DRAW, EVAL_DRAW, CHECK_DRAW, BUILD_DRAW, FORWARD_DRAW = 0, 1, 2, 3, 4


def entropy(seed: int, draw: Sequence[int]) -> int:
    """The seed of one draw: a hash of train.seed and the draw, independent of every other's."""
    return int(np.random.SeedSequence([seed & (2**63 - 1), *draw]).generate_state(2, np.uint64)[0])


def _draws_at_random(job: JobConfig) -> bool:
    """Whether the job's data comes from a factory (the user's code, which may draw at random: an
    augmentation); the built-in datasets are arrays, read as they are."""
    return job.data.factory is not None or job.data.eval_factory is not None


@contextlib.contextmanager
def _seeded(seed: int, draw: tuple[int, ...]) -> Iterator[None]:
    """torch's (CPU), numpy's and Python's global generators seeded for this draw, then put back.
    Not torch.manual_seed, which reseeds the GPUs' generators too, and put nothing back there: a
    stage's dropout on a GPU would restart from the draw's seed every minibatch. Under the lock
    that layers' seeded initialisation holds (models.GLOBAL_STATE): two stages of one process."""
    from hetpipe.models import GLOBAL_STATE

    seeded = entropy(seed, draw)
    with GLOBAL_STATE:
        state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.default_generator.manual_seed(seeded)
        np.random.seed(seeded % 2**32)
        random.seed(seeded)
        try:
            yield
        finally:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])


def drawing(job: JobConfig, draw: tuple[int, ...] | None) -> contextlib.AbstractContextManager[None]:
    """_seeded for this draw where the job's data may draw at random, else nothing."""
    return _seeded(job.train.seed, draw) if draw is not None and _draws_at_random(job) else contextlib.nullcontext()


def _items(dataset: Dataset[Any], rows: Sequence[int]) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None)
    return getitems(list(rows)) if getitems is not None else [dataset[r] for r in rows]  # type: ignore[no-any-return]


class _Drawn(Dataset[Any]):
    """A dataset read a minibatch at a time by (draw, row) keys (_Order's); with a seed (a
    factory's dataset), under generators seeded for that minibatch (its draw: the job's seed, the
    VW and p). Stage 0 reads a minibatch's inputs and the last stage its targets, each on its own,
    and a random augmentation (a crop, mixup, a mask) must draw the same at both, or inputs would
    train against another draw's targets; it does, whatever else used the generators in between
    (a dropout), on any data.workers, and again on --resume. Without one (arrays), no seeding."""

    def __init__(self, dataset: Dataset[Any], seed: int | None) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, keys: list[tuple[tuple[int, ...], int]]) -> list[Any]:
        rows = [row for _, row in keys]
        if self.seed is None:
            return _items(self.dataset, rows)
        with _seeded(self.seed, keys[0][0]):
            return _items(self.dataset, rows)


class _Order:
    """The rows of minibatches `numbers` of VW vw, each worked out as the loader reaches it, as
    (draw, row) keys of _Drawn."""

    def __init__(self, job: JobConfig, vw: int, rows: int, numbers: range) -> None:
        self.job, self.vw, self.rows, self.numbers = job, vw, rows, numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def __iter__(self) -> Iterator[list[tuple[tuple[int, ...], int]]]:
        job = self.job
        for p in self.numbers:
            draw = (TRAIN_DRAW, self.vw, p)
            yield [(draw, row) for row in minibatch_rows(
                p, self.vw, virtual_workers=job.parallel.virtual_workers, batch_size=job.data.batch_size,
                rows=self.rows, shuffle=job.data.shuffle, seed=job.train.seed).tolist()]


class _Worker(multiprocessing.context.SpawnProcess):
    """A data.workers process that, once its loop has returned, runs the exit handlers (the
    dataset's own: a temporary folder's cleanup, say) and ends in os._exit, as our own processes
    do: an interpreter's teardown of torch takes 0.5 s, seconds under load, and a stage's close
    waits for it inside the launcher's grace of 3 s. A loop that fails ends as before, with its
    exit code."""

    def run(self) -> None:
        super().run()
        atexit._run_exitfuncs()   # what sys.exit would run first; the teardown after it is skipped
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(0)


class _Spawn(multiprocessing.context.SpawnContext):
    Process = _Worker


class Minibatches:
    """The minibatches of one VW in order p = 1, 2, ..., read through a DataLoader (with
    data.workers worker processes and pinned memory for a CUDA device)."""

    def __init__(self, job: JobConfig, dataset: Dataset[Any], vw: int, *, steps: int, pin: bool = False,
                 start: int = 1) -> None:
        # start: the first minibatch read (a job resumed from a checkpoint goes on from there)
        self.job = job
        self._pin = pin
        rows = len(dataset)  # type: ignore[arg-type]
        order = _Order(job, vw, rows, range(start, steps + 1))
        workers = job.data.workers
        # Workers are started, not forked: a process serving gRPC must not fork.
        # A generator of its own: without one, each iterator draws its workers' base seed from
        # torch's global generator, under a layer's seeded initialisation on another thread.
        base_seed = torch.Generator().manual_seed(hash((job.train.seed, vw)) & (2**63 - 1))
        drawn = _Drawn(dataset, job.train.seed if _draws_at_random(job) else None)
        self._loader = DataLoader(drawn, batch_sampler=order, collate_fn=_collate, num_workers=workers,
                                  pin_memory=pin, multiprocessing_context=_Spawn() if workers else None,
                                  persistent_workers=False, generator=base_seed)
        started = set(threading.enumerate())
        self._it: Iterator[_Batch] | None = iter(self._loader)
        # The feeder threads of its workers' index queues: each holds its queue's lock, a
        # semaphore, until it ends (after the iterator is gone), so close waits for them.
        self._feeders = [t for t in threading.enumerate() if t not in started and t.name == "QueueFeederThread"]
        self._closing = threading.Lock()
        self.reading: float | None = None   # since when (time.monotonic) next() waits for the dataset
        _open.add(self)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        it = self._it
        if it is None:
            raise RuntimeError("minibatches read after close")
        self.reading = time.monotonic()
        try:
            batch = next(it)
        except Exception as exc:
            # A worker's error comes back through frames that hold it, and the iterator, in a
            # reference cycle. Collected as a cycle, the iterator's queues go before its __del__
            # can tell the workers to stop, and close would wait seconds on each: break it here.
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            self.reading = None
        x, y = cast(self.job, batch.x, batch.y)
        if self._pin:   # a cast made new tensors: pinned again, or their copies to the GPU would block
            x, y = (t if t.is_pinned() else t.pin_memory() for t in (x, y))
        return x, y

    def close(self) -> None:
        """Joins data.workers' processes and frees their semaphores (sem.mp-* in /dev/shm) before
        returning: the stage worker ends in os._exit, which runs no finalizer, and would leave both
        to outlive the run (and multiprocessing's resource tracker to warn of leaked semaphores)."""
        # Dropping the only reference runs the iterator's __del__, which joins its workers, and
        # frees its queues, whose semaphores are unlinked as they go. Under the lock: callers on
        # other threads (a stop, then exit_now) return only once that is done.
        with self._closing:
            self._it = None
            for feeder in self._feeders:
                feeder.join(timeout=5)
            self._feeders = []
        _open.discard(self)


_open: weakref.WeakSet[Minibatches] = weakref.WeakSet()  # readers not yet closed


def close_all() -> None:
    """Closes every Minibatches this process still has open (exit_now, before os._exit)."""
    for reader in list(_open):
        reader.close()


def eval_batches(job: JobConfig, dataset: Dataset[Any], rows: int) -> list[list[int]]:
    """The held-out rows one evaluation reads, in minibatches of data.batch_size: the first
    `rows` rows (at least one minibatch's, and whole minibatches only, as the stages take)."""
    n = len(dataset)  # type: ignore[arg-type]
    b = job.data.batch_size
    count = max(1, min(rows, n) // b)
    return [[(i * b + r) % n for r in range(b)] for i in range(count)]


Shape = tuple[tuple[int, ...], torch.dtype]
_SHAPES: dict[str, tuple[Shape, Shape]] = {}
_SHAPES_KEPT = 16


def batch_shapes(job: JobConfig, whole: Dataset[Any] | None = None) -> tuple[Shape, Shape]:
    """The (shape, dtype) of a training minibatch's x and of its y, from the first row: what the
    planner and the driver need of the data. Kept per process for the job's data (until
    forget_batch_shapes), so that a launcher builds a factory's dataset once for its checks, its
    plan and its driver, not once for each; whole: that dataset as built now, read again."""
    key = repr((job.base_dir, job.data, job.model.name, job.model.args, job.train.seed, job.train.dtype,
                job.train.loss))
    if key not in _SHAPES or whole is not None:
        return _kept_shapes(job, key, _training_rows(job, whole if whole is not None else whole_set(job)))
    return _SHAPES[key]


def eval_batch_shapes(job: JobConfig, held_out: Dataset[Any] | None = None) -> tuple[Shape, Shape] | None:
    """batch_shapes of data.eval_factory's rows, which may differ from the training rows (None
    without one: eval_fraction holds out training rows); held_out: that dataset as built now."""
    if job.data.eval_factory is None or job.eval is None:
        return None
    key = repr(("eval", job.base_dir, job.data, job.train.seed, job.train.dtype, job.train.loss))
    if key not in _SHAPES or held_out is not None:
        return _kept_shapes(job, key, held_out if held_out is not None else
                            from_factory(job, job.data.eval_factory, "data.eval_factory"))
    return _SHAPES[key]


def _kept_shapes(job: JobConfig, key: str, dataset: Dataset[Any]) -> tuple[Shape, Shape]:
    with drawing(job, (CHECK_DRAW,)):
        item = dataset[0]
    batch = _collate([item] * job.data.batch_size)
    x, y = cast(job, batch.x, batch.y)
    if len(_SHAPES) >= _SHAPES_KEPT:
        _SHAPES.pop(next(iter(_SHAPES), ""), None)
    _SHAPES[key] = shapes = ((tuple(x.shape), x.dtype), (tuple(y.shape), y.dtype))
    return shapes


def forget_batch_shapes() -> None:
    """batch_shapes reads the data again: a long-lived coordinator's next job may find it changed."""
    _SHAPES.clear()


def read_rows(job: JobConfig, dataset: Dataset[Any], rows: Sequence[int],
              draw: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """These rows of dataset as one minibatch (x, y), cast as training takes them. draw: the
    minibatch's name, which seeds a factory's random draws for it (_Drawn): every reader of
    evaluation minibatch i passes (EVAL_DRAW, i)."""
    with drawing(job, draw):
        items = _items(dataset, rows)
    batch = _collate(items)
    return cast(job, batch.x, batch.y)
