"""The trained weights as safetensors files (DESIGN §8), written piece by piece as they arrive
(no process holds the model), and read back; a stage's part of a checkpoint cut (torch.save)."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from hetpipe import wire
from hetpipe.errors import JobFailed
from hetpipe.outputs import (INDEX_FILE, SINGLE_FILE, fsync, read_weight_map, stage_state_path, write_atomically,
                             write_text_atomically)

log = logging.getLogger(__name__)

# safetensors' names for the dtypes the wire carries, and the shards' push log holds.
DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def layout(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """The tensors of each file, in order: a new file whenever the next tensor would take this
    one past max_shard_bytes (a tensor larger than that alone in a file)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return files


def file_names(count: int) -> list[str]:
    """model.safetensors alone, or the Hugging Face convention model-00001-of-0000N.safetensors."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header(tensors: Sequence[tuple[str, torch.dtype, Sequence[int], int]],
           metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """The safetensors header of these (name, dtype, shape, bytes), in the format's own layout: 8
    bytes of its length, then JSON padded to 8 bytes (the data starts aligned); and each tensor's
    offset after it. ValueError for a name given twice or a dtype the format is not given here."""
    fields: dict[str, Any] = {"__metadata__": metadata}
    offsets, offset = [], 0
    for name, dtype, shape, nbytes in tensors:
        if name in fields:
            raise ValueError(f"safetensors header: tensor {name!r} appears twice")
        if dtype not in DTYPES:
            raise ValueError(f"safetensors header: tensor {name!r} has dtype {dtype}, which is not written")
        fields[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


def save_atomically(obj: Any, path: str | Path, *, durable: bool = False) -> None:
    """torch.save(obj) to path, atomically (write_atomically). OSError where the write fails:
    torch's writer reports a full disk, a file too large or a folder gone as a RuntimeError, which
    a server would answer as its own bug (INTERNAL) where the same call may succeed later."""
    def save(tmp: Any) -> None:
        try:
            torch.save(obj, tmp)
        except RuntimeError as exc:
            raise OSError(errno.EIO, f"writing {Path(path).name} failed: {exc}") from exc

    write_atomically(path, save, durable=durable)


def save_stage_state(checkpoint_dir: str | Path, wave: int, vw: int, stage: int, state: Any) -> Path:
    """A stage's part of the cut after `wave`, on disk when this returns (its file, and the cut's
    folder where this host made it): the driver deletes the older cuts once every part is saved."""
    path = stage_state_path(checkpoint_dir, wave, vw, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically(state, path, durable=True)
    fsync(path.parent.parent)
    return path


class WeightsWriter:
    """Writes the model's tensors into safetensors files whose headers are known up front: the
    bytes of each tensor go straight to their place as they arrive, in any order, one piece at
    a time. close() checks that every byte came and publishes the files (and the index)."""

    def __init__(self, out_dir: Path, entries: Sequence[Entry], max_shard_bytes: int) -> None:
        self.out_dir = out_dir
        self.entries = {e.key: e for e in entries}
        groups = layout(entries, max_shard_bytes)
        self.names = file_names(len(groups))
        self._where: dict[str, tuple[int, int, int]] = {}   # key -> (file, data offset in file, bytes)
        self._written: dict[str, int] = {}
        self._fds: list[int] = []
        try:
            self._open(groups)
        except BaseException:  # no descriptor or .partial file left behind
            self.abort()
            raise

    def _open(self, groups: list[list[Entry]]) -> None:
        for i, group in enumerate(groups):
            head, offsets = header([(e.key, e.dtype, e.shape, e.nbytes) for e in group], {"format": "pt"})
            fd = os.open(self._tmp(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, head, 0)
            os.ftruncate(fd, len(head) + sum(e.nbytes for e in group))
            self._fds.append(fd)
            for e, offset in zip(group, offsets):
                self._where[e.key] = (i, len(head) + offset, e.nbytes)
                self._written[e.key] = 0

    def _tmp(self, i: int) -> Path:
        return self.out_dir / f".{self.names[i]}.partial"

    def write(self, key: str, offset: int, piece: memoryview | bytes) -> None:
        file, start, nbytes = self._where[key]
        if offset + len(piece) > nbytes:
            raise ValueError(f"{key}: bytes {offset}..{offset + len(piece)} past its {nbytes}")
        os.pwrite(self._fds[file], piece, start + offset)
        self._written[key] += len(piece)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:  # a stream failed: no file descriptor or partial file is left behind
            self.abort()

    def abort(self) -> None:
        """Gives up: closes the files and removes them."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        for i in range(len(self.names)):
            self._tmp(i).unlink(missing_ok=True)

    def close(self) -> list[Path]:
        missing = [k for k, (_, _, n) in self._where.items() if self._written[k] != n]
        if missing:
            self.abort()
            raise ValueError(f"the weights of {missing[:5]} did not all arrive")
        fds, self._fds = self._fds, []
        for fd in fds:
            os.fsync(fd)
            os.close(fd)
        paths = []
        for i, name in enumerate(self.names):
            os.replace(self._tmp(i), self.out_dir / name)
            paths.append(self.out_dir / name)
        fsync(self.out_dir)   # the renames, as the files' bytes above
        if len(self.names) > 1:
            index = {"metadata": {"total_size": sum(n for _, _, n in self._where.values())},
                     "weight_map": {k: self.names[f] for k, (f, _, _) in self._where.items()}}
            write_text_atomically(self.out_dir / INDEX_FILE, json.dumps(index, indent=2) + "\n", durable=True)
        return paths


def read_weights(out_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The weights a run wrote into out_dir, whichever way they were split (for tests and tools)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    index = out_dir / INDEX_FILE
    names = sorted(set(read_weight_map(index).values())) if index.exists() else [SINGLE_FILE]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(load_file(str(out_dir / name)))
    return out


def write_from(out_dir: Path, sources: Sequence[Path], max_shard_bytes: int) -> list[Path]:
    """The weights in safetensors files written by workers that each held part of the model (or
    all of it), laid out as a run's are; copied one tensor at a time."""
    from safetensors import safe_open

    torch_dtypes = {v: k for k, v in DTYPES.items()}
    entries: list[Entry] = []
    where: dict[str, Path] = {}
    for path in sources:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                view = f.get_slice(key)
                entries.append(Entry(key, torch_dtypes[view.get_dtype()], tuple(view.get_shape())))
                where[key] = path
    with WeightsWriter(out_dir, entries, max_shard_bytes) as writer:   # a failed copy leaves nothing behind
        for path in sources:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key).contiguous()
                    writer.write(key, 0, tensor.reshape(-1).view(torch.uint8).numpy().data)
        return writer.close()


def entries(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, Entry]:
    """Each state_dict key's safetensors entry, in the dtype the stages hold it in: floating
    tensors in the job's dtype, whatever dtype the factory gave them (models.build_layers)."""
    return {k: Entry(k, dtype if t.is_floating_point() else t.dtype, tuple(t.shape))
            for k, t in model.state_dict(keep_vars=True).items()}


class ReadFailed(JobFailed):
    """Reading weights from a process failed with this gRPC code."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


R = TypeVar("R")
SHARD_RETURN_S = 60.0   # how long a write waits for a shard that died to be back (restarted at its address)


def through_restarts(write: Callable[[], R], what: str, *, closing: threading.Event | None = None,
                     give_up_s: float = SHARD_RETURN_S) -> R:
    """write() again from the start while a read in it finds its process gone (UNAVAILABLE: a
    shard the launcher restarts from its checkpoint and push log, at the same address and with
    the same values), for up to give_up_s, or until closing is set (the job is being stopped);
    each try writes anew."""
    deadline = time.monotonic() + give_up_s
    while True:
        try:
            return write()
        except ReadFailed as exc:
            stop = closing is not None and closing.is_set()
            if exc.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline or stop:
                raise
            log.warning("%s: %s; reading again once it is back", what, exc)
            if closing is not None:
                closing.wait(1.0)
            else:
                time.sleep(1.0)


def stream_into(writer: WeightsWriter, call: Callable[[], Any], who: str,
                tied: dict[str, list[str]] | None = None) -> None:
    """Writes the tensor stream call() answers (a gRPC call) into writer, piece by piece; tied:
    the keys (models.tied_keys) that hold the same tensor as a streamed key, written alike."""
    try:
        stream = wire.read(call())
        names = stream.names
        for name, (dtype, shape, _) in zip(names, stream.specs):
            expected = writer.entries.get(name)
            if expected is None or (expected.dtype, expected.shape) != (dtype, tuple(shape)):
                want = f"{expected.dtype} {list(expected.shape)}" if expected else "no such key"
                raise JobFailed(f"{who}: sent weights {name!r} as {dtype} {list(shape)}, expected {want}")
        also = tied or {}
        for index, offset, piece in stream.pieces:
            for name in (names[index], *also.get(names[index], ())):
                writer.write(name, offset, piece)
    except grpc.RpcError as exc:
        raise ReadFailed(f"{who}: reading weights failed: {exc.code().name}: {exc.details()}", exc.code()) from None
