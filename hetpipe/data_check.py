"""The check of a job's data against its model, before any process starts: data that training
would fail on once every process has started, or silently spoil, is a ConfigError naming the
file (or factory), the array and the element."""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hetpipe import data, datasets, draws
from hetpipe.config import ConfigError, JobConfig
from hetpipe.errors import first_line, meta_hint
from hetpipe.optim import IGNORED_LABEL

# The checks read arrays in slices of about this many bytes: one pass, a small temporary.
CHECK_SLICE_BYTES = 16 << 20


def check(job: JobConfig, output_shape: Callable[[tuple[tuple[int, ...], torch.dtype]], Sequence[int]],
          ids: int | None = None) -> list[str]:
    """ConfigError, one line naming the file (or factory), the array and the element, for data that
    training would fail on once every process has started, or silently spoil: NaN or Inf in x or in
    float targets, labels outside the classes of the model's output (its last dimension), targets
    of another size than the output, an x the model does not take, token ids outside the model's
    first layer's `ids` (where it is an nn.Embedding). output_shape: the model's output shape for
    a minibatch's (shape, dtype) of x, from a shape-only pass.

    Arrays held in memory (npz, digits, synthetic) are checked whole, in one pass over what is
    loaded anyway; any other dataset, which may stream from disk, by its first item. Returns
    warnings: what the job will do other than it says (eval.rows it cannot read)."""
    default = f"data.factory: {job.data.factory}" if job.data.factory else f"data.name: {job.data.name}"
    whole = datasets.whole_set(job)
    held_out = 0
    if job.data.eval_fraction > 0:  # a held-out share that leaves no rows to train on
        held_out = len(datasets.split_rows(job, len(whole))[1])  # type: ignore[arg-type]
    train_rows = len(whole) - held_out  # type: ignore[arg-type]
    if job.data.workers and job.parallel.mode == "hetpipe":   # the baselines read without DataLoader workers
        _check_picklable(job, default, whole)
    sets: list[tuple[str, Dataset[Any]]] = [(default, whole)]
    if job.data.eval_factory is not None:
        sets.append((f"data.eval_factory: {job.data.eval_factory}",
                     datasets.from_factory(job, job.data.eval_factory, "data.eval_factory")))
        held_out = len(sets[-1][1])  # type: ignore[arg-type]
    for source, dataset in sets:
        if isinstance(dataset, datasets.ArrayDataset) and dataset.source:
            source = dataset.source
        with draws.drawing(job, (draws.CHECK_DRAW,)):
            x, y = _rows(dataset)   # a factory's first item: loading it checked it
        for name, array in (("x", x), ("y", y)):
            if array.dtype.kind not in datasets.NUMBERS:
                raise ConfigError(f"{source}: {name} holds {array.dtype} values, expected numbers")
        try:
            first, _ = data.cast(job, torch.from_numpy(np.ascontiguousarray(x[:1])),
                                 torch.from_numpy(np.ascontiguousarray(y[:1])))
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        batch = (job.data.batch_size, *x.shape[1:])
        try:
            output = tuple(output_shape((batch, first.dtype)))
        except ConfigError:   # the model's own fault, named by the check
            raise
        except Exception as exc:  # its first layer's forward, on the meta device
            raise ConfigError(f"{source}: the model does not take x of shape {list(batch)} ({first.dtype}): "
                              f"{type(exc).__name__}: {first_line(exc)}{meta_hint(exc)}") from None
        _check_rows(job, source, x, y, output, ids)
    data.batch_shapes(job, whole)   # kept: the plan and the driver need them, and need not build the set again
    if job.data.eval_factory is not None:
        data.eval_batch_shapes(job, sets[-1][1])   # the driver checks them at the plan's cuts
    small = [] if train_rows >= job.data.batch_size else [
        f"data: the training set has {train_rows} rows, fewer than one minibatch of data.batch_size "
        f"{job.data.batch_size}: each minibatch reads some rows more than once"]
    return small + _eval_warnings(job, held_out)


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return memoryview(b).nbytes   # protocol 5 writes an array's bytes as a PickleBuffer


class _Probe(pickle.Pickler):
    """Pickles to nothing, to learn whether an object can be: a tensor always can, and torch's
    own reduction would copy its bytes into memory first."""

    def reducer_override(self, obj: Any) -> Any:
        return (int, ()) if isinstance(obj, torch.Tensor) else NotImplemented


def _check_picklable(job: JobConfig, source: str, dataset: Dataset[Any]) -> None:
    """The stages' data.workers start by spawn (a fork would copy gRPC's state), so each gets the
    training set pickled: one that cannot be failed every stage after the processes had started.
    Nothing is kept: _Discard drops what is written, and tensors are not serialized."""
    try:
        _Probe(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(dataset)
    except Exception as exc:
        raise ConfigError(f"data.workers: {job.data.workers}: {source}'s dataset cannot be pickled for its worker "
                          f"processes ({type(exc).__name__}: {exc}): keep lambdas, open files and locks out of it, "
                          "or set data.workers: 0") from None


def _eval_warnings(job: JobConfig, held_out: int) -> list[str]:
    """What the job's evaluations will read other than it says (eval_rows_note), of a held-out set
    of held_out rows."""
    if job.eval is None:
        return []
    note = eval_rows_note(job.eval.rows_read, held_out, job.data.batch_size, given=job.eval.rows is not None)
    return [note] if held_out and note else []


def _check_finite(job: JobConfig, source: str, name: str, array: np.ndarray) -> None:
    """Float values that are NaN or Inf, or will be once cast to train.dtype, refused."""
    if array.dtype.kind != "f":
        return
    limit = torch.finfo(getattr(torch, job.train.dtype)).max
    at = _first(array, lambda s: ~(np.abs(s) <= limit))   # NaN too
    if at is None:
        return
    past = f", past {job.train.dtype}'s largest finite value (train.dtype)" if np.isfinite(array[at]) else ""
    raise ConfigError(f"{source}: {_element(name, at)} is {array[at]}{past}")


def _check_rows(job: JobConfig, source: str, x: np.ndarray, y: np.ndarray, output: tuple[int, ...],
                ids: int | None = None) -> None:
    _check_finite(job, source, "x", x)
    if ids is not None and x.dtype.kind in "iu":
        # Else each stage 0 fails at the first minibatch holding one, with torch's "index out of range in self".
        at = _first(x, lambda s: (s < 0) | (s >= ids))
        if at is not None:
            raise ConfigError(f"{source}: {_element('x', at)} is {x[at]}, not an id the model's first layer, an "
                              f"nn.Embedding of {ids}, takes (0 to {ids - 1})")
    classification = job.train.loss == "cross_entropy"
    if classification and len(output) < 2:   # its last dimension would be the batch, taken for the classes
        raise ConfigError(f"{source}: the model's output {list(output)} has no class dimension; cross_entropy takes "
                          "scores of shape [batch, classes] (or [batch, ..., classes]): keep the classes' dimension, "
                          "or use mse for one number per row")
    # The shape, not only the count: mse on an output of (B, 1) against y of (B,) broadcasts to
    # (B, B) and trains on a wrong loss without a word.
    row = tuple(output[1:-1] if classification else output[1:])
    if tuple(y.shape[1:]) != row:
        raise ConfigError(f"{source}: rows of y of shape {list(y.shape[1:])}, the model's output {list(output)} "
                          f"needs rows of shape {list(row)} for {job.train.loss}"
                          + (" (cross_entropy takes the classes on the output's last dimension, where torch's "
                             "F.cross_entropy takes them on dim 1: end the model with a layer that moves them last, "
                             "x.movedim(1, -1))" if classification and len(output) > 2 and tuple(y.shape[1:]) == tuple(output[2:])
                             else f" (reshape each row of y to {list(row)})" if math.prod(y.shape[1:]) == math.prod(row)
                             else ""))
    if not classification:
        _check_finite(job, source, "y", y)
        return
    classes = output[-1]
    at = _first(y, lambda s: ((s < 0) & (s != IGNORED_LABEL)) | (s >= classes))
    if at is not None:
        raise ConfigError(f"{source}: {_element('y', at)} is {y[at]}, not a class of the model's output "
                          f"(0 to {classes - 1})")


def _rows(dataset: Dataset[Any]) -> tuple[np.ndarray, np.ndarray]:
    """What to check, with a row dimension: an ArrayDataset's whole arrays when they are in
    memory, else the first item (memory-mapped arrays and other datasets read from disk)."""
    if isinstance(dataset, datasets.ArrayDataset) and not isinstance(dataset.x, np.memmap) \
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


def eval_rows_note(rows: int, held_out: int, batch_size: int, *, given: bool = True) -> str | None:
    """A warning when an evaluation reads other than eval.rows held-out rows (eval_batches), else
    None. given: eval.rows was set (the default asks for up to that many, in whole minibatches)."""
    read = max(1, min(rows, held_out) // batch_size) * batch_size
    if held_out < batch_size:
        return (f"{f'eval.rows {rows}: ' if given else ''}the held-out set has {held_out} rows, fewer than one "
                f"minibatch of data.batch_size {batch_size}: each evaluation reads {read}, some rows twice")
    if read == rows or not given:
        return None
    why = f"the held-out set has {held_out} rows" if held_out < rows else "whole minibatches"
    return f"eval.rows {rows}: each evaluation reads {read} held-out rows ({why}, of data.batch_size {batch_size})"
