"""launch/run_marker: a run found by its output.dir while it lives, and only then; the mark's
folders private whatever the umask; marks nobody holds (ended runs, whatever their pid is now),
marks being made and foreign folders ignored."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from launch import run_marker


@pytest.fixture(autouse=True)
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _runs(temp: Path) -> Path:
    return temp / f"hetpipe-{os.getuid()}" / "runs"


def test_a_run_is_found_while_it_is_marked_and_not_after(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_marker.live_run(out) is None
    with run_marker.marked(out):
        found = run_marker.live_run(out)
        assert found is not None and found.pid == os.getpid()
        assert run_marker.live_run(tmp_path / "another") is None
    assert run_marker.live_run(out) is None
    assert list(_runs(tmp_path).iterdir()) == []


def test_the_folders_are_private_under_a_group_writable_umask(tmp_path: Path) -> None:
    before = os.umask(0o002)
    try:
        with run_marker.marked(tmp_path / "out"):
            assert run_marker.live_run(tmp_path / "out") is not None
    finally:
        os.umask(before)
    for folder in (_runs(tmp_path).parent, _runs(tmp_path)):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def _mark(temp: Path, out: Path, pid: int, created: float) -> Path:
    runs = _runs(temp)
    runs.mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chmod(runs.parent, 0o700)
    path = runs / f"{run_marker._key(out)}.{pid}"
    path.write_text(json.dumps({"pid": pid, "created": created}))
    return path


def test_the_mark_of_a_run_that_was_killed_is_removed(tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(ended.pid).create_time()
    ended.wait()
    path = _mark(tmp_path, tmp_path / "out", ended.pid, created)
    assert run_marker.live_run(tmp_path / "out") is None
    assert not path.exists()


def test_a_pid_now_another_processs_is_not_the_run(tmp_path: Path) -> None:
    path = _mark(tmp_path, tmp_path / "out", os.getpid(), psutil.Process().create_time() - 100.0)
    assert run_marker.live_run(tmp_path / "out") is None
    assert not path.exists()


def test_a_mark_being_written_is_neither_read_nor_removed(tmp_path: Path) -> None:
    runs = _runs(tmp_path)
    runs.mkdir(parents=True, mode=0o700)
    os.chmod(runs.parent, 0o700)
    writing = runs / f"{run_marker._key(tmp_path / 'out')}.{os.getpid()}{run_marker._MAKING}"
    writing.write_text("")
    assert run_marker.live_run(tmp_path / "out") is None
    assert writing.exists()


def test_a_folder_others_can_write_is_not_used(tmp_path: Path) -> None:
    """Another user could name a pid there for our `hetpipe stop` to wait on."""
    path = _mark(tmp_path, tmp_path / "out", os.getpid(), psutil.Process().create_time())
    os.chmod(path.parent, 0o777)
    assert run_marker.live_run(tmp_path / "out") is None
    with run_marker.marked(tmp_path / "elsewhere"):
        assert [p.name for p in path.parent.iterdir()] == [path.name], "marked in a folder others can write"


def test_a_new_run_sweeps_the_marks_of_dead_runs_into_other_folders(tmp_path: Path) -> None:
    """A kill -9'd run's mark, unheld, went only when a run into its own output.dir came: marks of
    tests and one-off folders piled up. Each run now removes every mark nobody holds, and keeps
    those of runs alive (and marks being made)."""
    dead = _mark(tmp_path, tmp_path / "gone", 999_999, 0.0)
    making = _runs(tmp_path) / (dead.name + ".new")
    making.write_text("{}")
    with run_marker.marked(tmp_path / "alive"):
        with run_marker.marked(tmp_path / "out"):
            assert not dead.exists(), "a dead run's mark was left"
            assert making.exists() and run_marker.live_run(tmp_path / "alive") is not None
    odd = _runs(tmp_path) / f"{run_marker._key(tmp_path / 'odd')}.9"
    odd.mkdir()   # not a mark: neither the sweep nor a lookup trips on it
    with run_marker.marked(tmp_path / "out"):
        assert run_marker.live_run(tmp_path / "odd") is None and run_marker.live_run(tmp_path / "out") is not None
