"""`hetpipe trace` on a real run (2 VWs x 2 stages, 2 shards): valid trace-event JSON whose tracks
and slices match what ran: one forward and one backward per minibatch and stage, one compute thread
per stage, and on each shard's track every push it applied."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hetpipe import timeline
from hetpipe.timeline import compute_tid, push_tid, shard_tid, vw_pid
from hetpipe.wsp import total_waves
from launch.local import run_local

pytestmark = pytest.mark.timeout(180)
HETPIPE = [sys.executable, "-m", "launch.cli"]
VWS, STAGES, SHARDS, STEPS, NM = 2, 2, 2, 12, 2


def _x(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _check(doc: dict[str, Any], summary: dict[str, Any]) -> None:
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
    for e in doc["traceEvents"]:
        assert {"ph", "pid", "tid", "name"} <= e.keys(), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and isinstance(e["dur"], int | float), e
            assert e["ts"] >= 0 and e["dur"] >= 0, e
    threads = Counter((e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name")
    named = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert all(n == 1 for n in threads.values()), threads
    ps = vw_pid(VWS)
    assert processes == {**{vw_pid(v): f"vw {v}" for v in range(VWS)}, ps: "parameter servers"}
    compute = {(vw_pid(v), compute_tid(q)) for v in range(VWS) for q in range(STAGES)}
    pushes = {(vw_pid(v), push_tid(q)) for v in range(VWS) for q in range(STAGES)}
    shards = {(ps, shard_tid(j)) for j in range(SHARDS)}
    assert set(threads) == compute | pushes | shards  # exactly one track per stage thread and per shard
    for v in range(VWS):
        for q in range(STAGES):
            assert named[(vw_pid(v), compute_tid(q))] == f"stage {q} (cpu)"
            assert named[(vw_pid(v), push_tid(q))] == f"stage {q} pushes"
    assert {named[t] for t in shards} == {f"shard {j}" for j in range(SHARDS)}

    events = _x(doc)
    assert all((e["pid"], e["tid"]) in set(threads) for e in events), "a slice on an unnamed track"
    kinds = Counter(e["cat"] for e in events)
    assert kinds["forward"] == kinds["backward"] == VWS * STAGES * STEPS
    for track in compute:
        slices = sorted((e for e in events if (e["pid"], e["tid"]) == track), key=lambda e: e["ts"])
        assert Counter(e["name"] for e in slices if e["cat"] == "forward") == {f"F {p}": 1 for p in range(1, STEPS + 1)}
        for a, b in zip(slices, slices[1:]):  # one compute thread: forwards, backwards, idle waits in turn
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{track}: {a['name']} overlaps {b['name']}"
    waves = total_waves(STEPS, NM)
    for track in pushes:
        assert sorted(e["args"]["wave"] for e in events if (e["pid"], e["tid"]) == track) == list(range(waves))
    applied = [e for e in events if e["cat"] == "ps_push" and not e["args"]["duplicate"]]
    assert len(applied) == summary["pushes_applied"] > 0
    assert {e["args"]["vw"] for e in applied} == set(range(VWS))
    assert any(e["cat"] == "ps_pull" for e in events)
    for track in shards:  # a shard applies and answers under one lock: its slices never overlap
        slices = sorted((e for e in events if (e["pid"], e["tid"]) == track), key=lambda e: e["ts"])
        for a, b in zip(slices, slices[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{track}: {a['name']} overlaps {b['name']}"


def test_trace_of_a_real_run_is_valid_trace_event_json(make_job, tmp_path: Path) -> None:
    job = make_job({"train": {"steps": STEPS},
                    "parallel": {"virtual_workers": VWS, "stages_per_vw": STAGES, "nm": NM, "D": 1, "ps_shards": SHARDS},
                    "output": {"trace": True}})
    summary = run_local(job, quiet=True)
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "trace" / "ps").iterdir()) == [f"shard{j}.jsonl" for j in range(SHARDS)]
    pushes = [json.loads(line) for j in range(SHARDS)
              for line in (out / "trace" / "ps" / f"shard{j}.jsonl").read_text().splitlines()]
    pushes = [r for r in pushes if r["event"] == "push"]
    assert len(pushes) == summary["pushes_applied"] > 0, "a line per push each shard took"
    for r in pushes:   # the phases bench/sync_latency.py reads, in the order they happen
        assert r["received"] <= r["arrived"] <= r["scanned"] <= r["start"] <= r["end"] <= r.get("added", r["end"]), r
    pulls = [json.loads(line) for path in sorted((out / "trace" / "sync").glob("*.jsonl"))
             for line in path.read_text().splitlines()]
    pulls = [r for r in pulls if r["event"] == "pull"]
    assert pulls and all(r["sent"] <= r["answered"] <= r["replied"] <= r["merged"] for r in pulls), pulls[:3]

    path, count = timeline.export(out)
    assert path == out / "trace.json"
    doc = json.loads(path.read_text())
    assert len(doc["traceEvents"]) == count
    _check(doc, summary)

    cli = subprocess.run([*HETPIPE, "trace", str(out), "-o", str(tmp_path / "cli.json")],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads((tmp_path / "cli.json").read_text()) == doc


def test_cli_refuses_a_run_without_a_trace(tmp_path: Path) -> None:
    cli = subprocess.run([*HETPIPE, "trace", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "output.trace: true" in cli.stderr and "Traceback" not in cli.stderr
