"""A Ctrl-C that comes while a launcher stops its processes (hetpipe run's end, its job done or
failed) waits for the stop: a process that does not take its SIGTERM is still killed after the
grace, and the launcher exits rather than wait at exit for that process, which waits for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import with_signals

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]

STUCK = """
import os, signal, sys, time
from hetpipe import children
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a stop that hangs: a stage stuck in a task
children.exit_with_parent(children.launcher_pid(), lambda: os._exit(0))
open(sys.argv[sys.argv.index("--ready-file") + 1], "w").write("127.0.0.1:1 0")
while True:
    time.sleep(1)
"""

LAUNCHER = """
import os, signal, sys, threading
from pathlib import Path
from launch.ending import finish
from launch.interrupts import run_interrupts
from launch.processes import LocalProcesses

def main():
    try:
        with run_interrupts(), LocalProcesses(Path(sys.argv[1])) as procs:
            procs.spawn("stuck_service", "stuck worker")
            procs.wait_ready()
            print(procs.processes[0].popen.pid, flush=True)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()   # Ctrl-C in the grace
    except KeyboardInterrupt:
        return 130
    return 0

finish(main())
"""


def test_a_ctrl_c_during_the_stop_neither_spares_a_stuck_process_nor_hangs_the_launcher(tmp_path: Path) -> None:
    (tmp_path / "stuck_service.py").write_text(STUCK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    try:
        # SIGINT as from a terminal: a suite run in the background ignores it, and so would the launcher.
        out = subprocess.run([*with_signals(default=("INT",)), sys.executable, str(tmp_path / "launcher.py"),
                              str(tmp_path / "logs")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the launcher hung at exit after a Ctrl-C during its stop")
    assert out.returncode == 130, out
    import psutil

    pid = int(out.stdout.split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
