"""bench/sync_latency.py: a traced run's pushes and pulls, phase by phase, from its sync and shard traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import sync_latency  # noqa: E402

sys.path.remove(str(ROOT / "bench"))


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def traced(tmp_path: Path) -> Path:
    """Two stages' sync traces and a shard's, with times in seconds that make each phase known."""
    _write(tmp_path / "trace" / "sync" / "vw0_stage0.jsonl", [
        {"event": "push", "wave": 0, "queued": 10.0, "start": 10.5, "end": 12.0},
        {"event": "pull", "min_clock": 1, "c_global": 1, "sent": 11.0, "answered": 13.875, "replied": 14.0,
         "merged": 14.25},
        {"event": "pull_wait", "p": 4, "min_clock": 1, "start": 13.0, "end": 14.25, "c_global": 1},
    ])
    _write(tmp_path / "trace" / "sync" / "vw1_stage0.jsonl", [
        {"event": "push", "wave": 0, "queued": 20.0, "start": 20.0, "end": 23.0},
        {"event": "exchange", "clock": 1, "sent": 30.0, "replied": 30.5, "merged": 31.0},   # an elastic run's
    ])
    _write(tmp_path / "trace" / "ps" / "shard0.jsonl", [
        {"shard": 0, "event": "push", "vw": 0, "clock": 0, "received": 10.6, "arrived": 10.75, "scanned": 10.8,
         "start": 11.0, "end": 11.1, "added": 11.5},
        {"shard": 0, "event": "push", "vw": 1, "clock": 0, "received": 20.1, "start": 20.2, "end": 20.3},   # no sums to add
        {"shard": 0, "event": "pull", "vw": 0, "clock": 1, "requested": 11.0, "start": 13.0, "end": 13.5,
         "written": 13.75},
    ])
    return tmp_path


def test_each_phase_is_timed_from_the_fields_that_bound_it(traced: Path) -> None:
    got = dict(sync_latency.phases(traced))
    assert got["push queued, waiting for the pusher"] == [0.5, 0.0]
    assert got["push: to the host, to every shard, acknowledged"] == [1.5, 3.0]
    assert got["shard: push arriving (and logged)"] == pytest.approx([0.15])
    assert got["shard: push scanned for NaN and overflow"] == pytest.approx([0.05])
    assert got["shard: push waiting for the lock and its keys"] == pytest.approx([0.2]), "a row without the stamps is left out"
    assert got["shard: push's sums added"] == pytest.approx([0.4]), "a push with nothing to add has no add phase"
    assert got["pull: sent until answered (its wait for c_global included)"] == [3.0]
    assert got["shard: pull waiting for c_global and for its keys' adds"] == [2.0]
    assert got["shard: pull's shared-memory slot written"] == [0.25]
    assert got["pull: its reply received (onto a GPU stage's GPU)"] == [0.125]
    assert got["pull answered, waiting for the compute thread's merge"] == [0.25]
    assert got["a forward blocked on G2 (pull_wait)"] == [1.25]
    assert got["exchange: sent until answered"] == [0.5] and got["shard: exchange under the lock"] == []


def test_the_report_has_a_line_per_phase_seen_and_the_command_names_a_missing_trace(traced: Path,
                                                                                     tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sync_latency.py"), str(traced)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("push: to the host"))
    assert line.split()[-4:] == ["2", "2250.0", "3000.0", "4.50"], "count, median ms, p90 ms, total s"
    empty = tmp_path / "untraced"
    empty.mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sync_latency.py"), str(empty)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no trace/sync/ (run the job with output.trace: true)" in done.stderr
