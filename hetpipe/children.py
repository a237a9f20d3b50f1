"""Child processes of a launcher: start one with its own log, describe its exit, stop them all."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


def start(args: list[str], log_path: Path, *, env: Mapping[str, str] | None = None,
          append: bool = False) -> subprocess.Popen[bytes]:
    """Starts args with stdout and stderr in log_path, no stdin, and unbuffered Python output."""
    environment = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=environment)


@dataclass
class Child:
    """A started process and its log, named for messages (e.g. "stage worker 3", "rank 1 (...)")."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def exit_description(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "is running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop(children: Iterable[Child], grace: float = 3.0) -> None:
    """SIGTERM every live child, then SIGKILL what is still alive after grace seconds."""
    alive = [c for c in children if c.popen.poll() is None]
    for c in alive:
        c.popen.terminate()
    deadline = time.monotonic() + grace
    for c in alive:
        try:
            c.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.popen.kill()
            c.popen.wait()
