"""Errors every layer shares: a request refused with a gRPC status, and how a job ends early."""

from __future__ import annotations

import difflib
import os
import re
import signal
import traceback
from collections.abc import Iterable
from pathlib import Path

import grpc


class Rejected(Exception):
    """A request refused with a specific gRPC status; the servicer answers with it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class JobFailed(Exception):
    """The job cannot finish; the message names the process, the stage and the minibatch."""


class JobStopped(Exception):
    """Someone asked the job to stop."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled as Ctrl-C is; str() is the reason a stopped job gives."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted ({signal.Signals(signum).name})")
        self.signum = signum


def interrupt_reason(exc: KeyboardInterrupt) -> str:
    """Why an interrupted job stopped: the signal's name, Ctrl-C for a plain KeyboardInterrupt."""
    return str(exc) if isinstance(exc, Interrupted) else "interrupted (Ctrl-C)"


class StageLost(JobFailed):
    """A stage died, hung or failed: its virtual worker cannot go on (the job may, without it)."""

    def __init__(self, vw: int, message: str) -> None:
        super().__init__(message)
        self.vw = vw


def first_line(exc: BaseException) -> str:
    """An exception's message, for a one-line error: its first line ("" where it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def meta_hint(exc: BaseException) -> str:
    """Where the planner's shape-only pass (the meta device) failed: a layer that reads values
    fails there, not on the data or on the layer before it."""
    return (" (the planner runs the model on the meta device, shapes without values: a layer that reads values, "
            "with .item() or a branch on the data, cannot run there: guard it with `if not x.is_meta:`)"
            ) if "meta" in first_line(exc) else ""


def user_frame(exc: BaseException, base_dir: str | None) -> str:
    """Where in the job folder's own code (a factory's module) exc was raised, as " (file.py:12
    in fn)": the last such frame of its traceback; "" where none is there."""
    where = _in_job_folder(((f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)),
                           base_dir)
    return f" ({where})" if where else ""


def _in_job_folder(frames: Iterable[tuple[str, int, str]], base_dir: str | None) -> str:
    """"file.py:12 in fn" of the last of frames (filename, line, function) in the job folder's own
    code: not a package installed under the folder, nor code compiled from a string; "" if none."""
    if not base_dir:
        return ""
    roots = {Path(os.path.abspath(base_dir)), Path(base_dir).resolve()}
    for filename, line, name in reversed(list(frames)):
        if filename.startswith("<") or re.search(r"[/\\](site|dist)-packages[/\\]", filename):
            continue
        for path in (Path(os.path.abspath(filename)), Path(filename).resolve()):
            root = next((r for r in roots if path.is_relative_to(r)), None)
            if root is not None:
                return f"{path.relative_to(root)}:{line} in {name}"
    return ""


_WORKER = re.compile(r"Caught \w+ in (DataLoader worker process \d+)\.\nOriginal Traceback \(most recent call last\):\n")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def worker_words(said: str, base_dir: str | None) -> str:
    """What a DataLoader worker's exception says, without its traceback: torch raises it again in
    the reading process with the worker's whole traceback as its message. Its own last line, with
    the last frame in the job folder's code, as user_frame gives it: "row 50 is unreadable
    (mydata.py:30 in __getitem__, in DataLoader worker process 0)". Anything else: said."""
    m = _WORKER.match(said)
    if m is None:
        return said
    lines = [line for line in said[m.end():].splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    words = last.split(": ", 1)[1] if re.match(r"[\w.]+: ", last) else last
    where = _in_job_folder(((f, int(line), name) for f, line, name in _FRAME.findall(said)), base_dir)
    return f"{words} ({where + ', ' if where else ''}in {m.group(1)})"


def closest(word: str, choices: Iterable[str]) -> str | None:
    """A close spelling of word among choices (difflib's default likeness), or None."""
    found = difflib.get_close_matches(word, list(choices), n=1)
    return found[0] if found else None


# What torch says when the data does not suit the model, and what it usually means; a line of
# the message (a DataLoader worker's error comes wrapped, its own line last).
_DATA_HINTS = (
    (re.compile(r"^(\w+: )?index out of range in self", re.M),
     "an index out of range, most often a token id past an nn.Embedding's num_embeddings: check the data's ids "
     "against the model's vocabulary"),
    (re.compile(r"^(\w+: )?Target -?\d+ is out of bounds", re.M),
     "a label outside the classes of the model's output (0 to its last dimension - 1)"),
    (re.compile(r"^(\w+: )?stack expects each tensor to be equal size", re.M),
     "the dataset's items differ in shape, and a minibatch stacks them: pad or cut each to one length"),
    (re.compile(r"device-side assert triggered"),
     "on a GPU most often an index out of range: a token id past an nn.Embedding's vocabulary or a label past the "
     "classes; the same job on the CPU names which"),
)


def data_hint(exc: BaseException) -> str:
    """What a torch error that bad data causes at run time usually means, else ""."""
    text = str(exc)
    return next((hint for pattern, hint in _DATA_HINTS if pattern.search(text)), "")
