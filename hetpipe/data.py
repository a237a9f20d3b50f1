"""Datasets and the DESIGN §8 data order: the built-ins (digits, synthetic, npz), the user's
factories (a map-style torch Dataset of (input, target)), the held-out split, the readers
stage 0 (inputs) and the last stage (targets) take minibatches from, and the check of the data
against the model that runs before any process starts."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import random
import threading
import traceback
import weakref
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from hetpipe.config import ConfigError, JobConfig
from hetpipe.validate import Section

NUMBERS = "biuf"  # numpy kinds a tensor can be made of and a loss can take
# torch.nn.functional.cross_entropy skips targets of this value (its ignore_index): not a class.
IGNORED_LABEL = -100
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


def _from_factory(job: JobConfig, spec: str, key: str) -> Dataset[Any]:
    from hetpipe.models import resolve

    make = resolve(spec, key, job.base_dir)
    try:
        dataset = make(**dict(job.data.args))
    except TypeError as exc:
        raise ConfigError(f"data.args: {spec}: {exc}") from None
    except (Exception, SystemExit) as exc:   # a factory that exits (an argparse in it) ends nothing but itself
        raise ConfigError(f"{key}: {spec}(**data.args) failed: {type(exc).__name__}: {exc}") from None
    if isinstance(dataset, Mapping) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{key}: {spec} returned a {type(dataset).__name__}, expected a map-style "
                          f"torch.utils.data.Dataset (with __getitem__ and __len__) of (input, target)")
    try:
        rows = len(dataset)
    except Exception as exc:
        raise ConfigError(f"{key}: len() of {spec}'s dataset failed: {type(exc).__name__}: {exc}") from None
    if rows == 0:
        raise ConfigError(f"{key}: {spec} returned an empty dataset")
    try:
        with _drawing(job, (CHECK_DRAW,)):   # an augmentation's draws move no one's generator
            item = dataset[0]
    except Exception as exc:
        raise ConfigError(f"{key}: reading item 0 of {spec}'s dataset failed: {type(exc).__name__}: {exc}") from None
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


def _whole(job: JobConfig) -> Dataset[Any]:
    if job.data.factory is not None:
        return _from_factory(job, job.data.factory, "data.factory")
    loaders = {"digits": _digits, "synthetic": lambda: _synthetic(job), "npz": lambda: _npz(job)}
    return loaders[str(job.data.name)]()  # type: ignore[no-any-return]


def _split(job: JobConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows) for data.eval_fraction: a seeded choice of rows."""
    held = max(1, int(round(n * job.data.eval_fraction)))
    if held >= n:
        raise ConfigError(f"data.eval_fraction: {job.data.eval_fraction} of {n} rows leaves none to train on")
    order = np.random.default_rng([job.train.seed, 0x5EED]).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def training_set(job: JobConfig) -> Dataset[Any]:
    """The rows training reads (the dataset less any eval_fraction held out)."""
    whole = _whole(job)
    if job.data.eval_fraction > 0:
        return Subset(whole, _split(job, len(whole))[0].tolist())  # type: ignore[arg-type]
    return whole


def held_out_set(job: JobConfig) -> Dataset[Any] | None:
    """The held-out rows evaluation reads: data.eval_factory's, or the eval_fraction split."""
    if job.data.eval_factory is not None:
        return _from_factory(job, job.data.eval_factory, "data.eval_factory")
    if job.data.eval_fraction > 0:
        whole = _whole(job)
        return Subset(whole, _split(job, len(whole))[1].tolist())  # type: ignore[arg-type]
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
# (EVAL_DRAW, i), or (CHECK_DRAW,) the item a factory's dataset is checked by.
TRAIN_DRAW, EVAL_DRAW, CHECK_DRAW = 0, 1, 2


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

    entropy = int(np.random.SeedSequence([seed & (2**63 - 1), *draw]).generate_state(2, np.uint64)[0])
    with GLOBAL_STATE:
        state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.default_generator.manual_seed(entropy)
        np.random.seed(entropy % 2**32)
        random.seed(entropy)
        try:
            yield
        finally:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])


def _drawing(job: JobConfig, draw: tuple[int, ...] | None) -> contextlib.AbstractContextManager[None]:
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
                                  pin_memory=pin, multiprocessing_context="spawn" if workers else None,
                                  persistent_workers=False, generator=base_seed)
        started = set(threading.enumerate())
        self._it: Iterator[_Batch] | None = iter(self._loader)
        # The feeder threads of its workers' index queues: each holds its queue's lock, a
        # semaphore, until it ends (after the iterator is gone), so close waits for them.
        self._feeders = [t for t in threading.enumerate() if t not in started and t.name == "QueueFeederThread"]
        self._closing = threading.Lock()
        _open.add(self)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        it = self._it
        if it is None:
            raise RuntimeError("minibatches read after close")
        try:
            batch = next(it)
        except Exception as exc:
            # A worker's error comes back through frames that hold it, and the iterator, in a
            # reference cycle. Collected as a cycle, the iterator's queues go before its __del__
            # can tell the workers to stop, and close would wait seconds on each: break it here.
            traceback.clear_frames(exc.__traceback__)
            raise
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


def eval_rows_note(rows: int, held_out: int, batch_size: int, *, given: bool = True) -> str | None:
    """A warning when an evaluation reads other than eval.rows held-out rows (eval_batches), else
    None. given: eval.rows was set (the default asks for up to that many, in whole minibatches)."""
    read = max(1, min(rows, held_out) // batch_size) * batch_size
    if held_out < batch_size:
        return (f"eval.rows {rows}: the held-out set has {held_out} rows, fewer than one minibatch of {batch_size}: "
                f"each evaluation reads {read}, some rows twice")
    if read == rows or not given:
        return None
    why = f"the held-out set has {held_out} rows" if held_out < rows else "whole minibatches"
    return f"eval.rows {rows}: each evaluation reads {read} held-out rows ({why}, of data.batch_size {batch_size})"


def first_item(job: JobConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One minibatch-shaped (x, y) pair of the training data, from its first row: what the
    planner and the driver need of the data (shapes and dtypes), without reading the rest."""
    dataset = training_set(job)
    with _drawing(job, (CHECK_DRAW,)):
        item = dataset[0]
    batch = _collate([item] * job.data.batch_size)
    return cast(job, batch.x, batch.y)


def read_rows(job: JobConfig, dataset: Dataset[Any], rows: Sequence[int],
              draw: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """These rows of dataset as one minibatch (x, y), cast as training takes them. draw: the
    minibatch's name, which seeds a factory's random draws for it (_Drawn): every reader of
    evaluation minibatch i passes (EVAL_DRAW, i)."""
    with _drawing(job, draw):
        items = _items(dataset, rows)
    batch = _collate(items)
    return cast(job, batch.x, batch.y)


# The checks read arrays in slices of about this many bytes: one pass, a small temporary.
CHECK_SLICE_BYTES = 16 << 20


def check(job: JobConfig, output_shape: Callable[[tuple[tuple[int, ...], torch.dtype]], Sequence[int]]) -> list[str]:
    """ConfigError, one line naming the file (or factory), the array and the element, for data that
    training would fail on once every process has started, or silently spoil: NaN or Inf in x or in
    float targets, labels outside the classes of the model's output (its last dimension), targets
    of another size than the output, an x the model does not take. output_shape: the model's
    output shape for a minibatch's (shape, dtype) of x, from a shape-only pass.

    Arrays held in memory (npz, digits, synthetic) are checked whole, in one pass over what is
    loaded anyway; any other dataset, which may stream from disk, by its first item. Returns
    warnings: what the job will do other than it says (eval.rows it cannot read)."""
    default = f"data.factory: {job.data.factory}" if job.data.factory else f"data.name: {job.data.name}"
    whole = _whole(job)
    held_out = 0
    if job.data.eval_fraction > 0:  # a held-out share that leaves no rows to train on
        held_out = len(_split(job, len(whole))[1])  # type: ignore[arg-type]
    train_rows = len(whole) - held_out  # type: ignore[arg-type]
    sets: list[tuple[str, Dataset[Any]]] = [(default, whole)]
    if job.data.eval_factory is not None:
        sets.append((f"data.eval_factory: {job.data.eval_factory}",
                     _from_factory(job, job.data.eval_factory, "data.eval_factory")))
        held_out = len(sets[-1][1])  # type: ignore[arg-type]
    for source, dataset in sets:
        if isinstance(dataset, ArrayDataset) and dataset.source:
            source = dataset.source
        with _drawing(job, (CHECK_DRAW,)):
            x, y = _rows(dataset)   # the item _from_factory checked
        for name, array in (("x", x), ("y", y)):
            if array.dtype.kind not in NUMBERS:
                raise ConfigError(f"{source}: {name} holds {array.dtype} values, expected numbers")
        try:
            first, _ = cast(job, torch.from_numpy(np.ascontiguousarray(x[:1])),
                            torch.from_numpy(np.ascontiguousarray(y[:1])))
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        batch = (job.data.batch_size, *x.shape[1:])
        try:
            output = tuple(output_shape((batch, first.dtype)))
        except ConfigError:   # the model's own fault, named by the check
            raise
        except Exception as exc:  # the model's own forward, on the meta device
            reason = str(exc).splitlines()[0] if str(exc) else ""
            # A layer that reads values fails there, not on the data: say where the pass ran.
            meta = (" (the planner runs the model on the meta device, shapes without values: a layer that reads "
                    "values, with .item() or a branch on the data, cannot run there)") if "meta" in reason else ""
            raise ConfigError(f"{source}: the model does not take x of shape {list(batch)} ({first.dtype}): "
                              f"{type(exc).__name__}: {reason}{meta}") from None
        _check_rows(job, source, x, y, output)
    small = [] if train_rows >= job.data.batch_size else [
        f"data: the training set has {train_rows} rows, fewer than one minibatch of data.batch_size "
        f"{job.data.batch_size}: each minibatch reads some rows more than once"]
    return small + eval_warnings(job, held_out)


def eval_warnings(job: JobConfig, held_out: int | None = None) -> list[str]:
    """What the job's evaluations will read other than it says (eval_rows_note); held_out: the
    held-out set's rows where known, else read here."""
    if job.eval is None:
        return []
    if held_out is None:
        held = held_out_set(job)
        held_out = len(held) if held is not None else 0  # type: ignore[arg-type]
    note = eval_rows_note(job.eval.rows_read, held_out, job.data.batch_size, given=job.eval.rows is not None)
    return [note] if held_out and note else []


def _check_rows(job: JobConfig, source: str, x: np.ndarray, y: np.ndarray, output: tuple[int, ...]) -> None:
    if x.dtype.kind == "f" and (at := _first(x, lambda s: ~np.isfinite(s))) is not None:
        raise ConfigError(f"{source}: {_element('x', at)} is {x[at]}")
    classification = job.train.loss == "cross_entropy"
    # The shape, not only the count: mse on an output of (B, 1) against y of (B,) broadcasts to
    # (B, B) and trains on a wrong loss without a word.
    row = tuple(output[1:-1] if classification else output[1:])
    if tuple(y.shape[1:]) != row:
        raise ConfigError(f"{source}: rows of y of shape {list(y.shape[1:])}, the model's output {list(output)} "
                          f"needs rows of shape {list(row)} for {job.train.loss}"
                          + (f" (reshape each row of y to {list(row)})" if math.prod(y.shape[1:]) == math.prod(row) else ""))
    if not classification:
        if y.dtype.kind == "f" and (at := _first(y, lambda s: ~np.isfinite(s))) is not None:
            raise ConfigError(f"{source}: {_element('y', at)} is {y[at]}")
        return
    classes = output[-1]
    at = _first(y, lambda s: ((s < 0) & (s != IGNORED_LABEL)) | (s >= classes))
    if at is not None:
        raise ConfigError(f"{source}: {_element('y', at)} is {y[at]}, not a class of the model's output "
                          f"(0 to {classes - 1})")


def _rows(dataset: Dataset[Any]) -> tuple[np.ndarray, np.ndarray]:
    """What to check, with a row dimension: an ArrayDataset's whole arrays when they are in
    memory, else the first item (memory-mapped arrays and other datasets read from disk)."""
    if isinstance(dataset, ArrayDataset) and not isinstance(dataset.x, np.memmap) \
            and not isinstance(dataset.y, np.memmap):
        return np.asarray(dataset.x), np.asarray(dataset.y)
    x, y = dataset[0]
    return _array(x)[None], _array(y)[None]


def _array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.dtype == torch.bfloat16 else value).numpy()
    return np.asarray(value)


def _first(array: np.ndarray, bad: Callable[[np.ndarray], np.ndarray]) -> tuple[int, ...] | None:
    """The index of the first element of array for which bad is true, or None."""
    step = max(1, CHECK_SLICE_BYTES // max(1, array[:1].nbytes))
    for start in range(0, len(array), step):
        mask = bad(array[start:start + step])
        if mask.any():
            index = np.unravel_index(int(np.argmax(mask)), mask.shape)
            return (start + int(index[0]), *(int(i) for i in index[1:]))
    return None


def _element(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, index))}]"
