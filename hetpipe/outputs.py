"""What a run leaves in output.dir (DESIGN §8): the final weights as safetensors, written piece by
piece as they arrive (no process holds the model), summary.json and eval.jsonl."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from hetpipe import wire
from hetpipe.errors import JobFailed
from hetpipe.validate import ConfigError

# safetensors' names for the dtypes the wire carries.
DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".hetpipe.lock"  # held by the run writing into the folder; holds its pid
STALE = (SINGLE_FILE, INDEX_FILE, "model.pt", SUMMARY_FILE, "eval.jsonl")


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


def write_atomically(path: str | Path, write: Callable[[Path], object], *, durable: bool = False) -> None:
    """write(tmp) then rename it onto path, so that a kill during the write leaves the old file or
    none, never half of one; durable: also on disk before this returns (the file's fsync, then its
    folder's, which holds the rename), to outlive a power cut. A write that fails leaves no
    temporary file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        if durable:
            fsync(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if durable:
        fsync(path.parent)


def write_text_atomically(path: str | Path, text: str, *, durable: bool = False) -> None:
    """path's text, all or nothing (write_atomically)."""
    write_atomically(path, lambda tmp: tmp.write_text(text), durable=durable)


def fsync(path: str | Path) -> None:
    """Puts a file's bytes on disk; of a folder, its entries (a file created, renamed or removed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(obj: Any, path: str | Path, *, durable: bool = False) -> None:
    """torch.save(obj) to path, atomically (write_atomically)."""
    write_atomically(path, lambda tmp: torch.save(obj, tmp), durable=durable)


CHECKPOINTS = "checkpoints"  # train.checkpoint_every: the cuts a run can --resume from


def cut_dir(checkpoint_dir: str | Path, wave: int) -> Path:
    """The folder of the checkpoint after `wave` waves: each stage's state, each shard's values."""
    return Path(checkpoint_dir) / f"cut{wave:06d}"


def stage_state_path(checkpoint_dir: str | Path, wave: int, vw: int, stage: int) -> Path:
    return cut_dir(checkpoint_dir, wave) / f"vw{vw}_stage{stage}.pt"


def save_stage_state(checkpoint_dir: str | Path, wave: int, vw: int, stage: int, state: Any) -> Path:
    """A stage's part of the cut after `wave`, on disk when this returns (its file, and the cut's
    folder where this host made it): the driver deletes the older cuts once every part is saved."""
    path = stage_state_path(checkpoint_dir, wave, vw, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically(state, path, durable=True)
    fsync(path.parent.parent)
    return path


def check_dir(out_dir: Path) -> None:
    """ConfigError unless out_dir is a folder this process can write in, or can be made one: found
    before any process starts, not when the first of them writes there."""
    existing = out_dir
    while not existing.exists() and not existing.is_symlink():  # a missing path under a file: not there
        existing = existing.parent
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "not a folder"
        raise ConfigError(f"output.dir: {out_dir}: {existing} is {what}")
    try:  # a probe rather than os.access, which says yes to root on a read-only or virtual file system
        fd, probe = tempfile.mkstemp(prefix=".hetpipe-probe-", dir=existing)
    except OSError as exc:
        raise ConfigError(f"output.dir: {out_dir}: cannot write in {existing}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


@contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Holds out_dir (made if missing) for one run: a second run into it is refused, naming the
    first's pid, instead of clearing the results of a run still writing them. The kernel's lock
    (flock) goes with its process, even a killed one: no stale lock to remove by hand."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    while True:
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise ConfigError(f"output.dir {out_dir} is in use by another hetpipe run (pid {holder}): wait for it "
                              "to end, or give this job another output.dir") from None
        try:  # still the file at path: its holder did not remove it while we opened it
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: no one takes a file that is about to go
        lock.close()


def start_fresh(out_dir: Path, *, keep_checkpoints: bool) -> None:
    """Readies out_dir for a new job: made if missing, without an earlier job's shard state (ps/,
    which a shard would restore) or results, and without its checkpoints unless kept (--resume
    goes on from them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "ps", ignore_errors=True)
    if not keep_checkpoints:  # nor may a later --resume take an earlier job's checkpoint
        shutil.rmtree(out_dir / CHECKPOINTS, ignore_errors=True)
    clear(out_dir)


def clear(out_dir: Path) -> None:
    """Removes an earlier run's results, so that a failed run never leaves them beside its own."""
    for name in (*STALE, *(p.name for p in out_dir.glob("model-*-of-*.safetensors"))):
        (out_dir / name).unlink(missing_ok=True)


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
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for e in group:
                header[e.key] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                                 "data_offsets": [offset, offset + e.nbytes]}
                offset += e.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
            start = 8 + len(text)
            fd = os.open(self._tmp(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, len(text).to_bytes(8, "little") + text, 0)
            os.ftruncate(fd, start + offset)
            self._fds.append(fd)
            base = 0
            for e in group:
                self._where[e.key] = (i, start + base, e.nbytes)
                self._written[e.key] = 0
                base += e.nbytes

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
            write_text_atomically(self.out_dir / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        return paths


def read_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a run wrote, whichever way they were split (for tests and tools)."""
    from safetensors.torch import load_file

    index = out_dir / INDEX_FILE
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [SINGLE_FILE]
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(load_file(str(out_dir / name)))
    return out


def _strict(value: Any) -> Any:
    """NaN and infinities are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def write_summary(out_dir: Path, fields: Mapping[str, Any]) -> dict[str, Any]:
    summary = _strict(dict(fields))
    write_text_atomically(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary  # type: ignore[no-any-return]


def read_summary(out_dir: Path) -> dict[str, Any] | None:
    """The last run's summary.json, or None where there is none or it is not a JSON object (a
    file from elsewhere, or one an older version wrote in place and a kill cut short)."""
    try:
        summary = json.loads((out_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def append_evals(out_dir: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    with open(out_dir / "eval.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(_strict(dict(row)), allow_nan=False) + "\n")


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
    tensors in the job's dtype, except under float32, where they stay as the model made them
    (models.build_layers: a bf16 buffer stays bf16)."""
    return {k: Entry(k, dtype if t.is_floating_point() and dtype != torch.float32 else t.dtype, tuple(t.shape))
            for k, t in model.state_dict(keep_vars=True).items()}


def stream_into(writer: WeightsWriter, call: Callable[[], Any], who: str) -> None:
    """Writes the tensor stream call() answers (a gRPC call) into writer, piece by piece."""
    try:
        stream = wire.read(call())
        names = stream.names
        for name, (dtype, shape, _) in zip(names, stream.specs):
            expected = writer.entries.get(name)
            if expected is None or (expected.dtype, expected.shape) != (dtype, tuple(shape)):
                want = f"{expected.dtype} {list(expected.shape)}" if expected else "no such key"
                raise JobFailed(f"{who}: sent weights {name!r} as {dtype} {list(shape)}, expected {want}")
        for index, offset, piece in stream.pieces:
            writer.write(names[index], offset, piece)
    except grpc.RpcError as exc:
        raise JobFailed(f"{who}: reading weights failed: {exc.code().name}: {exc.details()}") from None
