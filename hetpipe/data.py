"""The DESIGN §8 data order and the readers stage 0 (inputs) and the last stage (targets) take
minibatches from; evaluation's rows and the shapes of a minibatch. The datasets themselves:
hetpipe/datasets.py; their check against the model: hetpipe/data_check.py."""

from __future__ import annotations

import atexit
import functools
import multiprocessing.context
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hetpipe.config import ConfigError, JobConfig
from hetpipe.datasets import Batch, from_factory, training_rows, whole_set
from hetpipe.draws import CHECK_DRAW, TRAIN_DRAW, drawing, draws_at_random, seeded


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


def _collate(items: Any) -> Batch:
    if isinstance(items, Batch):  # ArrayDataset read the whole minibatch at once
        return items
    x, y = torch.utils.data.default_collate(items)
    return Batch(x, y)


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
        with seeded(self.seed, keys[0][0]):
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
    data.workers worker processes and pinned memory for a CUDA device). read_ahead() reads the
    next one before next() asks for it."""

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
        drawn = _Drawn(dataset, job.train.seed if draws_at_random(job) else None)
        self._loader = DataLoader(drawn, batch_sampler=order, collate_fn=_collate, num_workers=workers,
                                  pin_memory=pin, multiprocessing_context=_Spawn() if workers else None,
                                  persistent_workers=False, generator=base_seed)
        started = set(threading.enumerate())
        self._it: Iterator[Batch] | None = iter(self._loader)
        # The feeder threads of its workers' index queues: each holds its queue's lock, a
        # semaphore, until it ends (after the iterator is gone), so close waits for them.
        self._feeders = [t for t in threading.enumerate() if t not in started and t.name == "QueueFeederThread"]
        self._closing = threading.Lock()
        # (minibatch, since when: time.monotonic) a read has waited for the dataset
        self.reading: tuple[int, float] | None = None
        self._p, self._end = start, steps   # the next minibatch read, and the last
        self._ahead: tuple[torch.Tensor, torch.Tensor] | BaseException | None = None
        _open.add(self)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        if isinstance(ahead, BaseException):
            raise ahead
        return ahead if ahead is not None else self._read()

    @property
    def unread(self) -> bool:
        """Whether read_ahead() would read a minibatch: one is left, and none is read ahead."""
        return self._ahead is None and self._p <= self._end

    def read_ahead(self) -> None:
        """Reads the next minibatch now, where one is left, for next() to return at once: a stage
        reads while it would wait for a neighbour anyway, where its forward would read on the
        pipeline's critical path (stage 0's re-injection of p + Nm waited 0.4-0.5 ms for it on two
        cores, docs/benchmarks.md). A read that fails raises at that next()."""
        if not self.unread:
            return
        try:
            self._ahead = self._read()
        except Exception as exc:   # noqa: BLE001 - the minibatch's own next() raises it
            # Kept without its traceback, whose frames hold the loader's iterator (and this
            # reader, a cycle): close() must be able to end the data.workers processes.
            self._ahead = exc.with_traceback(None)

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        it = self._it
        if it is None:
            raise RuntimeError("minibatches read after close")
        self.reading = (self._p, time.monotonic())
        self._p += 1
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
        return _kept_shapes(job, key, training_rows(job, whole if whole is not None else whole_set(job)))
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
