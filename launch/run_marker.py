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
import re
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from hetpipe.outputs import write_text_atomically

# A process's start time as psutil gives it moves with the wall clock (an NTP step): two readings
# of one process agree to well within this, two processes that shared a pid cannot.
SAME_START_S = 1.0


@dataclass(frozen=True, slots=True)
class Run:
    pid: int
    created: float   # its process's start time (seconds since the epoch)


def _folders() -> tuple[Path, Path]:
    user = Path(tempfile.gettempdir()) / f"hetpipe-{os.getuid()}"
    return user, user / "runs"


def _key(out_dir: Path) -> str:
    return hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:16]


def _ours(folder: Path) -> bool:
    """A folder this user made and no one else can write: another user's would let them name a
    pid for our `hetpipe stop` to wait on."""
    st = folder.lstat()
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _make(folder: Path) -> None:
    """folder, made private (mkdir's mode is cut by the umask: 002 would leave it group-writable);
    one that exists is left as it is, and then is ours or is not used."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return
    os.chmod(folder, 0o700)


@contextmanager
def marked(out_dir: Path) -> Iterator[None]:
    """This process marked as a run into out_dir while the block runs (best effort: where the
    temp folder cannot take the mark, there is none, and `hetpipe stop` works as before)."""
    path = None
    try:
        user, runs = _folders()
        _make(user)
        if _ours(user):
            _make(runs)
        if _ours(user) and _ours(runs):
            me = psutil.Process()
            path = runs / f"{_key(out_dir)}.{me.pid}"
            write_text_atomically(path, json.dumps({"pid": me.pid, "created": me.create_time()}))
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def live_run(out_dir: Path) -> Run | None:
    """The `hetpipe run` into out_dir that is alive now, if any."""
    user, runs = _folders()
    key = _key(out_dir)
    try:
        if not (_ours(user) and _ours(runs)):
            return None
        paths = [p for p in runs.glob(f"{key}.*") if re.fullmatch(rf"{key}\.\d+", p.name)]   # not a mark being written
    except OSError:
        return None
    for path in paths:
        try:
            mark = json.loads(path.read_text())
            run = Run(int(mark["pid"]), float(mark["created"]))
            process = psutil.Process(run.pid)
            if abs(process.create_time() - run.created) < SAME_START_S and process.status() != psutil.STATUS_ZOMBIE:
                return run
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            pass
        path.unlink(missing_ok=True)   # its run ended without removing it (a kill -9)
    return None
