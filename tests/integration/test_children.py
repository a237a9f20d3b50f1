"""hetpipe/children.py: workers forked from multiprocessing's fork server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import forkserver
from pathlib import Path

import psutil
import pytest

from hetpipe import children

pytestmark = pytest.mark.timeout(60)


def test_a_worker_is_running_while_it_runs_though_its_fork_server_was_killed(tmp_path: Path) -> None:
    """multiprocessing reads each child's exit code from the fork server, and says 255 for every
    child once the server is gone: the launcher took every live worker for dead (a shard
    "restarted" beside itself, a stage "exited with code 255")."""
    worker = children.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], tmp_path / "log")
    try:
        server = forkserver._forkserver._forkserver_pid   # type: ignore[attr-defined]
        assert server is not None and worker.poll() is None
        os.kill(server, signal.SIGKILL)
        while psutil.Process(server).status() != psutil.STATUS_ZOMBIE:   # left unreaped: ensure_running reaps it
            time.sleep(0.01)
        time.sleep(0.2)
        assert worker.poll() is None, "a live worker taken for dead"
    finally:
        os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while worker.poll() is None:   # reaped by init now, its fork server gone: the code is 255
        assert time.monotonic() < deadline, "a dead worker taken for live"
        time.sleep(0.05)
    assert worker.returncode == children.FORK_SERVER_GONE

    again = children.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], tmp_path / "log2")
    try:
        assert again.poll() is None, "the next worker comes from a fork server started again"
    finally:
        os.kill(again.pid, signal.SIGKILL)


def test_workers_whose_fork_server_died_are_stopped_each_with_its_grace(tmp_path: Path) -> None:
    """join() returns at once once the fork server is gone: wait() raised TimeoutExpired at once
    for a live worker, so stop() SIGKILLed the first without its grace and raised, leaving the
    others neither waited for nor killed (`hetpipe worker` ended in a traceback)."""
    workers = [children.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], tmp_path / f"log{i}")
               for i in range(2)]
    try:
        server = forkserver._forkserver._forkserver_pid   # type: ignore[attr-defined]
        os.kill(server, signal.SIGKILL)
        while psutil.Process(server).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            workers[0].wait(0.5)
        assert time.monotonic() - start >= 0.5, "wait() gave up before its timeout"
        children.stop([children.Child(f"worker {i}", w, tmp_path / f"log{i}") for i, w in enumerate(workers)], grace=10.0)
        assert all(w.poll() is not None for w in workers), "a worker outlived stop()"
    finally:
        for w in workers:
            if w.poll() is None:
                os.kill(w.pid, signal.SIGKILL)


def test_a_pid_another_process_took_after_our_worker_ended_is_not_signalled() -> None:
    """Our worker, its fork server gone (multiprocessing says 255 for it), has exited and its pid
    is another process's by now (the pid space is 32768 here, and a suite starts thousands): the
    pid alone took that process for our live worker, and stopping the launcher sent it SIGTERM."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        class Ours:   # what multiprocessing holds for our worker once its fork server is gone
            pid, exitcode = stranger.pid, children.FORK_SERVER_GONE

        worker = children.Forked(Ours())
        assert worker.poll() is None, "the process it started, still running"
        ours = worker._process_found
        assert ours is not None
        pid, started = ours._ident   # as psutil knows a process: its pid and its start in ticks since boot
        ours._ident = (pid, started - 1.0)   # ours started a second before the pid's present holder
        assert worker.poll() == children.FORK_SERVER_GONE
        worker.terminate()
        time.sleep(0.2)
        assert stranger.poll() is None, "the pid's new holder was signalled"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_stopped_worker_ends_by_its_sigterm_not_by_the_sigkill_after_the_grace(tmp_path: Path) -> None:
    """A SIGSTOPped worker takes SIGTERM only once continued: stop() continues it, so it ends at
    once, as a live one does (its own clean-up: shared memory), not 10 s later by SIGKILL."""
    worker = children.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], tmp_path / "log")
    os.kill(worker.pid, signal.SIGSTOP)
    children.stop([children.Child("worker", worker, tmp_path / "log")], grace=10.0)
    # Its exit code tells which ended it: -SIGKILL had it waited out the grace still stopped.
    assert worker.returncode == -signal.SIGTERM, worker.returncode
