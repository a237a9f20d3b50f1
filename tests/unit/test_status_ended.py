"""`hetpipe status --job` of a run that has ended: how it ended, and when (a run stopped before it
started leaves the last one's status.json, told apart by its time); a status.json without a usable
time still reads."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from launch.status import _ended


@pytest.mark.parametrize("finished, when", [
    (time.mktime((2026, 11, 29, 14, 5, 9, 0, 0, -1)), " 2026-11-29 14:05:09"),
    (None, ""), ("yesterday", ""), (float("nan"), ""), (True, ""),
], ids=["a time", "null", "text", "nan", "bool"])
def test_an_ended_run_says_how_and_when(tmp_path: Path, capsys: pytest.CaptureFixture[str], finished: object,
                                        when: str) -> None:
    (tmp_path / "status.json").write_text(json.dumps({"state": "FAILED", "reason": "stage 1 of vw 0 died",
                                                      "finished": finished}))
    assert _ended(tmp_path, as_json=False) == 1
    out = capsys.readouterr().out
    assert out == f"job: FAILED (ended{when}; no coordinator is running): stage 1 of vw 0 died\n"
    (tmp_path / "status.json").write_text(json.dumps({"state": "FAILED"}))
    assert _ended(tmp_path, as_json=False) == 1 and re.match(r"job: FAILED \(ended; ", capsys.readouterr().out)
