"""A local `hetpipe run` that is alive, by its output.dir, from its first second: its coordinator's
address is published only once the run has planned and started it (seconds later), and until
then `hetpipe stop --job` would find nothing to stop. The mark lies outside output.dir, which a
refused run must leave as it was: one file per run, in a folder of this user's under the temp
folder, naming the run's pid and its process's start time (a pid reused by another process
after a kill -9 does not pass for the run)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from hetpipe.outputs import write_text_atomically


def _folder() -> Path:
    return Path(tempfile.gettempdir()) / f"hetpipe-{os.getuid()}" / "runs"


def _key(out_dir: Path) -> str:
    return hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:16]


def _ours(folder: Path) -> bool:
    """A folder this user made and no one else can write: another user's would let them name a
    pid for our `hetpipe stop` to wait on."""
    st = folder.lstat()
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


@contextmanager
def marked(out_dir: Path) -> Iterator[None]:
    """This process marked as a run into out_dir while the block runs (best effort: where the
    temp folder cannot take the mark, there is none, and `hetpipe stop` works as before)."""
    path = None
    try:
        folder = _folder()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if _ours(folder) and _ours(folder.parent):
            me = psutil.Process()
            path = folder / f"{_key(out_dir)}.{me.pid}"
            write_text_atomically(path, json.dumps({"pid": me.pid, "created": me.create_time()}))
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def live_run(out_dir: Path) -> int | None:
    """The pid of a `hetpipe run` into out_dir that is alive now, if any."""
    folder = _folder()
    try:
        if not (_ours(folder) and _ours(folder.parent)):
            return None
        paths = list(folder.glob(f"{_key(out_dir)}.*"))
    except OSError:
        return None
    for path in paths:
        try:
            mark = json.loads(path.read_text())
            run = psutil.Process(int(mark["pid"]))
            if run.create_time() == float(mark["created"]) and run.status() != psutil.STATUS_ZOMBIE:
                return int(mark["pid"])
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            pass
        path.unlink(missing_ok=True)   # its run ended without removing it (a kill -9)
    return None
