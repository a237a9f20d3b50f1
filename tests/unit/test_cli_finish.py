"""launch.ending.finish: a command ends with its exit code, its output flushed and its exit handlers
run (the shared-memory segments it owns removed), without Python's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = """
import atexit, sys
# Registered first, run last (after any handler of the imports that flushes): left in stdout's buffer.
atexit.register(lambda: print("handler ran", end="", flush=False))
from hetpipe import shm
from launch.ending import finish
segment = shm.Segment(4096)
print(segment.path)
sys.stdout.write("no newline yet")   # still in stdout's buffer when finish is called
finish(3)
"""


def test_finish_flushes_runs_the_exit_handlers_and_keeps_the_code() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # stdout to a pipe: buffered
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=50,
                          cwd=Path(__file__).resolve().parents[2], env=env)
    assert done.returncode == 3, done.stderr
    segment, rest = done.stdout.split("\n", 1)
    assert rest == "no newline yethandler ran", "the output, then what the exit handler printed"
    assert segment.startswith("/dev/shm/") and not Path(segment).exists(), "the segment it owned is removed"
