"""A launcher's scratch folder (launch/processes.py RunDir): swept once its launcher is gone, never
while it lives, and nothing that is not one is touched."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from launch.processes import RunDir

REPO = Path(__file__).resolve().parents[2]


def test_a_dead_launchers_folders_are_swept_and_a_live_ones_kept() -> None:
    live = RunDir()
    foreign = Path(tempfile.mkdtemp(prefix=RunDir.PREFIX))  # no lock file: not a run folder
    try:
        # A launcher that ends without cleaning up, as under kill -9: it prints its folders and exits.
        code = ("import os, sys; from launch.processes import RunDir; r = RunDir(); "
                "print(r.path); print((r.path / 'forkserver_dir').read_text()); sys.stdout.flush(); os._exit(0)")
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        dead, forkserver = (Path(line) for line in out.stdout.split())
        assert dead.is_dir() and forkserver.is_dir() and forkserver.name.startswith("pymp-")
        removed = RunDir.sweep()
        assert dead.name in removed and not dead.exists() and not forkserver.exists()
        assert live.path.is_dir() and live.path.name not in removed, "a live launcher's folder was swept"
        assert foreign.is_dir() and foreign.name not in removed
    finally:
        live.cleanup()
        foreign.rmdir()
    assert not live.path.exists()
    live.cleanup()  # a second cleanup (stop_all, then __exit__) is a no-op


def test_another_users_run_folder_is_left_alone() -> None:
    """It could name one of our live fork servers' folders as its own: never read, never swept."""
    import os
    import shutil

    import pytest

    if os.geteuid() != 0:
        pytest.skip("making a folder another user's needs root")
    code = ("import os, sys; from launch.processes import RunDir; r = RunDir(); "
            "print(r.path); print((r.path / 'forkserver_dir').read_text()); sys.stdout.flush(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    theirs, forkserver = (Path(line) for line in out.stdout.split())
    try:
        os.chown(theirs, 65534, 65534)
        assert theirs.name not in RunDir.sweep()
        assert theirs.is_dir() and forkserver.is_dir()
    finally:
        shutil.rmtree(theirs, ignore_errors=True)
        shutil.rmtree(forkserver, ignore_errors=True)
