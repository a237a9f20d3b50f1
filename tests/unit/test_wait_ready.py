"""LocalProcesses.wait_ready: it says which processes it still waits for while they start (a slow
torch import on a loaded host), reads each one's address once it serves, and names one that dies
or never serves."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hetpipe.errors import JobFailed
from launch.processes import LocalProcesses, Process

pytestmark = pytest.mark.timeout(30)


def _processes(tmp_path: Path, codes: list[int | None]) -> LocalProcesses:
    """Children that stay up (None) or end at once with a code; each publishes nothing itself."""
    procs = LocalProcesses(tmp_path / "logs")
    for i, code in enumerate(codes):
        child = subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep(30) if {code} is None else sys.exit({code})"])
        if code is not None:
            child.wait()
        procs.processes.append(Process(f"stage worker {i}", child, tmp_path / f"w{i}.log",  # type: ignore[arg-type]
                                       ready_file=tmp_path / f"w{i}.ready"))
    return procs


def _serve(ready: Path, address: str) -> None:
    """What a service does (hetpipe.service): its ready file written whole, by a rename."""
    ready.with_suffix(".tmp").write_text(address)
    ready.with_suffix(".tmp").rename(ready)


def test_wait_ready_names_what_it_still_waits_for_until_each_serves(tmp_path: Path) -> None:
    procs = _processes(tmp_path, [None, None, None])
    notices: list[str] = []
    _serve(tmp_path / "w0.ready", "127.0.0.1:5000 9000")
    serve = threading.Timer(0.35, lambda: (_serve(tmp_path / "w2.ready", "127.0.0.1:5002 9002"),
                                           _serve(tmp_path / "w1.ready", "127.0.0.1:5001 9001")))
    serve.start()
    try:
        procs.wait_ready(timeout=10, notice=notices.append, every=0.1)
    finally:
        serve.cancel()
        procs.stop_all()
    assert [(p.address, p.metrics_port) for p in procs.processes] == [
        ("127.0.0.1:5000", 9000), ("127.0.0.1:5001", 9001), ("127.0.0.1:5002", 9002)]
    assert notices and notices[0].startswith("waiting for stage worker 1, stage worker 2 to start serving (0s of 10; "
                                             f"logs in {tmp_path / 'logs'})")
    assert all(n.startswith("waiting for stage worker 1") for n in notices), notices


def test_wait_ready_names_a_process_that_died_or_never_served(tmp_path: Path) -> None:
    procs = _processes(tmp_path, [None, 1])
    _serve(tmp_path / "w0.ready", "127.0.0.1:5000 9000")
    (tmp_path / "w1.log").write_text("Traceback ...\nImportError: no module named torch\n")
    with pytest.raises(JobFailed, match=r"stage worker 1 exited with code 1 before serving; log .*w1\.log:\n"
                                        r"Traceback \.\.\.\nImportError: no module named torch"):
        procs.wait_ready(timeout=10)
    procs.stop_all()
    (tmp_path / "late").mkdir()
    late = _processes(tmp_path / "late", [None])
    try:
        with pytest.raises(JobFailed, match=r"stage worker 0 did not start serving within 0s; log "):
            late.wait_ready(timeout=0.2)
    finally:
        late.stop_all()
