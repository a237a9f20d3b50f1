"""A stage worker's shutdown stops its gRPC server whatever stopping its runtime raises: left
serving, the process never exits, so nothing (a launcher, compose's restart policy) replaces
it, and it holds its job for nobody. (The shard's: test_ps_durability.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
FAILING_STOP = ("import sys\nfrom stage_worker import runtime\n"
                "def stop(self):\n    raise RuntimeError('closing a link failed')\n"
                "runtime.StageRuntime.stop = stop\n"
                "from stage_worker.__main__ import main\nmain(sys.argv[1:])\n")


def test_a_stage_whose_runtime_fails_to_stop_still_exits(tmp_path: Path) -> None:
    ready = tmp_path / "stage.ready"
    with open(tmp_path / "stage.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", FAILING_STOP, "--host", "127.0.0.1", "--port", "0",
                                 "--metrics-port", "0", "--ready-file", str(ready), "--exit-with-parent"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stage.log").read_text()[-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)   # a hang's guard, not a speed bound
        assert "closing a link failed" in (tmp_path / "stage.log").read_text()
    finally:
        proc.kill()
        proc.wait(10)
