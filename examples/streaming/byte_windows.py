"""Data that streams from disk: next-byte prediction over a file of bytes, read through a numpy
memmap, so each process touches only the pages of the windows it reads (no stage loads the file).

The file is Python's own standard library source, concatenated (real text, no download). It is
written once, atomically, by whichever process needs it first: beside this module, or where that
folder cannot be written (a container that mounts the module read-only), in the temporary folder,
named by its size (stdlib-4mb.npy).
"""

from __future__ import annotations

import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent


def _corpus(file: str, megabytes: int) -> Path:
    # The size in the name: a file once written is never rewritten (a process may be reading it), so
    # another `megabytes` must be another file, not the first one's corpus under the same name.
    name = f"{Path(file).stem}-{megabytes}mb{Path(file).suffix}"
    for folder in (HERE, Path(tempfile.gettempdir())):
        try:
            return _written(folder / name, megabytes)
        except PermissionError:   # a read-only folder: the next
            continue
    raise PermissionError(f"{file}: neither {HERE} nor {tempfile.gettempdir()} can be written")


def _written(path: Path, megabytes: int) -> Path:
    if path.exists():
        return path
    budget = megabytes << 20
    parts = []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(source.read_bytes())
        budget -= len(parts[-1])
        if budget <= 0:
            break
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    np.save(tmp, np.frombuffer(b"".join(parts), dtype=np.uint8))
    os.replace(f"{tmp}.npy", path)  # np.save added the suffix
    return path


class ByteWindows(Dataset):
    """Item i: (bytes [s, s+context), bytes [s+1, s+context+1)) for s = start + i*context."""

    def __init__(self, path: Path, context: int, start: int, end: int) -> None:
        self.path, self.context, self.start = path, context, start
        self.count = (end - start - 1) // context
        self._tokens: np.ndarray | None = None  # opened lazily: in the process that reads

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.load(self.path, mmap_mode="r")
        s = self.start + i * self.context
        window = torch.from_numpy(self._tokens[s:s + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]


def _split(file: str, context: int, megabytes: int, held_out: bool) -> ByteWindows:
    path = _corpus(file, megabytes)
    n = len(np.load(path, mmap_mode="r"))
    cut = int(n * 0.9)  # the last tenth of the file is held out
    return ByteWindows(path, context, cut, n) if held_out else ByteWindows(path, context, 0, cut)


def train(*, file: str = "stdlib.npy", context: int = 64, megabytes: int = 4) -> ByteWindows:
    return _split(file, context, megabytes, held_out=False)


def held_out(*, file: str = "stdlib.npy", context: int = 64, megabytes: int = 4) -> ByteWindows:
    return _split(file, context, megabytes, held_out=True)
