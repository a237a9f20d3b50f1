"""`hetpipe run` with data.workers: the DataLoader worker processes and their semaphores end with
the run, when it learns and when a row fails to read. The stage workers end in os._exit, which
runs no finalizer: before they closed their readers, the workers outlived the run by seconds
(reparented, so no process tree shows them) and multiprocessing's resource tracker warned of
leaked semaphores after the shell prompt had come back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import BASE_JOB, deep_update

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX semaphores live in /dev/shm")]
MARK = "HETPIPE_TEST_RUN_MARK"  # every process of the run inherits it, orphaned or not

BAD_ROWS = '''
import torch


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        if i >= 100:  # read by a DataLoader worker some minibatches in
            raise ValueError(f"row {i} is unreadable")
        return torch.zeros(64), 0


def train():
    return Rows()
'''


def _semaphores() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("sem.mp-*")}


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARK) == mark:
                found.append(process)
        except psutil.Error:
            continue
    return found


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone meanwhile
        return ""


def _is_helper(command: str) -> bool:
    """The run's own fork server and resource tracker: they exit once its last process has."""
    return "multiprocessing.forkserver" in command or "multiprocessing.resource_tracker" in command


@pytest.mark.usefixtures("host_wide")   # counts every semaphore on the host
@pytest.mark.parametrize("fails", [False, True], ids=["learns", "a-row-fails-to-read"])
def test_data_workers_and_their_semaphores_end_with_the_run(tmp_path: Path, fails: bool) -> None:
    job = deep_update(BASE_JOB, {"train": {"steps": 20}, "output": {"trace": False}})
    job["data"] = {"name": "digits", "batch_size": 16, "workers": 2}
    if fails:
        (tmp_path / "bad_rows.py").write_text(BAD_ROWS)
        job["data"] = {"factory": "bad_rows:train", "batch_size": 16, "workers": 2}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    mark, before = uuid.uuid4().hex, _semaphores()
    with open(tmp_path / "stderr.txt", "wb") as err:
        run = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "-q", str(tmp_path / "job.yaml")],
                               cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                               env={**os.environ, MARK: mark})
        try:
            code = run.wait(timeout=150)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    # At once: a leftover DataLoader worker lives on for up to 5 s (its check of its parent).
    left = [c for c in map(_command, _marked(mark)) if c and not _is_helper(c)]
    leaked = sorted(_semaphores() - before)
    _, alive = psutil.wait_procs(_marked(mark), timeout=15)  # the helpers, and any leftover
    for process in alive:
        process.kill()
    stderr = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert code == (1 if fails else 0), stderr
    assert not left, f"processes of the run outlived it: {left}"
    assert not leaked, f"semaphores of the run outlived it: {leaked}"
    assert not alive, f"the run's helpers did not exit: {[p.pid for p in alive]}"
    assert "leaked semaphore" not in stderr, stderr
    if fails:
        # In our words: the row's error, where in the user's code, in which worker; not torch's
        # re-raise with the worker's whole traceback as its message.
        assert re.search(r"ValueError: row 1\d\d is unreadable \(bad_rows.py:\d+ in __getitem__, in DataLoader worker "
                         r"process \d\)", stderr), stderr
        assert "Traceback" not in stderr, stderr
