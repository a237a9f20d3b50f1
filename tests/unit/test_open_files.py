"""hetpipe/service.py raise_open_files_limit: every service raises its soft limit on open files,
which its shared-memory mappings use up (a descriptor each), to the hard limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_service_raises_its_soft_limit_on_open_files_to_the_hard_one() -> None:
    # In a child whose soft limit starts at 256, as a login shell's might; its hard limit is ours.
    code = ("import resource; from hetpipe import service;"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE);"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard));"
            "got = service.raise_open_files_limit();"
            "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0];"
            "want = service.MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard;"
            "print(got, now, want)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    got, now, want = (int(x) for x in out.stdout.split())
    assert got == now == want > 256
