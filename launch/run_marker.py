"""A local `hetpipe run` that is alive, by its output.dir, from its first second: its coordinator's
address is published only once the run has planned and started it (seconds later), and until
then `hetpipe stop --job` would find nothing to stop. The mark lies outside output.dir, which a
refused run must leave as it was: one file per run, in a folder of this user's under the temp
folder, naming the run's pid. The run holds a shared flock on it for as long as it lives, as a
shared-memory segment's owner does (hetpipe/shm.py): the kernel drops it however the run ends,
so a mark nobody holds is a dead run's, whatever became of its pid."""

from __future__ import annotations

import fcntl
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

_MAKING = ".new"   # a mark being made: locked, then renamed to its name


@dataclass(frozen=True, slots=True)
class Run:
    pid: int
    created: float   # when it marked itself (its mark's mtime, seconds since the epoch)


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
    path, fd = None, -1
    try:
        user, runs = _folders()
        _make(user)
        if _ours(user):
            _make(runs)
        if _ours(user) and _ours(runs):
            _sweep(runs)
            path = runs / f"{_key(out_dir)}.{os.getpid()}"
            # Made under a name live_run skips, locked, then renamed: it never sees it unlocked.
            making = path.with_name(path.name + _MAKING)
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.write(fd, json.dumps({"pid": os.getpid()}).encode())
            os.rename(making, path)
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
        if fd >= 0:
            os.close(fd)


def live_run(out_dir: Path) -> Run | None:
    """The `hetpipe run` into out_dir that is alive now, if any; removes the marks of dead ones."""
    user, runs = _folders()
    key = _key(out_dir)
    try:
        if not (_ours(user) and _ours(runs)):
            return None
        paths = [p for p in runs.glob(f"{key}.*") if re.fullmatch(rf"{key}\.\d+", p.name)]   # not a mark being made
    except OSError:
        return None
    for path in paths:
        try:
            if (run := _alive(path)) is not None:
                return run
        except OSError:   # not a mark of ours (a folder by its name): no run
            continue
    return None


def _alive(path: Path) -> Run | None:
    """The run that holds the mark at path, or None: then the mark is removed (nobody holds it:
    its run ended without removing it, a kill -9)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None   # gone meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:   # its run holds it: alive
        try:
            return Run(int(json.loads(os.read(fd, 4096))["pid"]), os.fstat(fd).st_mtime)
        except (OSError, ValueError, KeyError, TypeError):
            return None
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
    return None


def _sweep(runs: Path) -> None:
    """Removes the marks of every dead run (of any output.dir): a kill -9'd run's would otherwise
    stay until a run into its own output.dir came."""
    for path in runs.iterdir():
        if re.fullmatch(r"[0-9a-f]{16}\.\d+", path.name):
            try:
                _alive(path)
            except OSError:   # one mark that cannot be read or locked keeps this run's own from being made
                continue
