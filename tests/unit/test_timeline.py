"""hetpipe/timeline.py on hand-made trace rows: tracks, names, times, micro-batches, pull waits cut
to the compute thread's idle stretches, shard events, and what a missing trace is refused with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetpipe import timeline
from hetpipe.timeline import Span, TraceData, TraceMissing, chrome_trace, compute_tid, push_tid, shard_tid, vw_pid

T = 1_700_000_000.0  # time.time() seconds, as the stages write them


def row(vw: int, stage: int, p: int, fwd: tuple[float, float], bwd: tuple[float, float], **extra: Any) -> dict[str, Any]:
    return {"vw": vw, "stage": stage, "p": p, "wave": (p - 1) // 2, "local_version": p - 1, "bwd_version": p - 1,
            "min_clock": 0, "fwd_start": T + fwd[0], "fwd_end": T + fwd[1], "bwd_start": T + bwd[0],
            "bwd_end": T + bwd[1], **extra}


def micro(*spans: tuple[int, float, float]) -> list[list[float]]:
    return [[m, T + s, T + e] for m, s, e in spans]


def xs(doc: dict[str, Any], pid: int | None = None, tid: int | None = None) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and pid in (None, e["pid"]) and tid in (None, e["tid"])]


def names(doc: dict[str, Any], kind: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == kind}


def check_trace_events(doc: dict[str, Any]) -> None:
    """The JSON Object Format's rules that a viewer relies on; every compute track one thread."""
    json.loads(json.dumps(doc))
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
    for e in doc["traceEvents"]:
        assert {"ph", "pid", "tid", "name"} <= e.keys(), e
        assert e["pid"] >= 1, f"pid 0 is the idle task to some viewers: {e}"
        if e["ph"] == "X":
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0 and e["dur"] >= 0, e
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in xs(doc):
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    # Two tracks sharing a tid would merge into one thread with two names: each named once.
    named = [(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sorted(named) == sorted(set(named)), f"a thread named twice: {named}"
    assert set(tracks) <= set(named), f"tracks without a thread_name: {set(tracks) - set(named)}"
    for track, events in tracks.items():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"track {track}: {a['name']} overlaps {b['name']}"


def test_minibatch_rows_become_forward_and_backward_slices_on_one_track_per_stage() -> None:
    rows = [row(0, 0, 1, (0.0, 0.1), (0.3, 0.5)), row(0, 0, 2, (0.1, 0.2), (0.5, 0.7)),
            row(0, 1, 1, (0.1, 0.15), (0.15, 0.2)), row(0, 1, 2, (0.2, 0.25), (0.25, 0.3))]
    summary = {"plan": [{"vw": 0, "stage": 0, "gpu": "titan-v"}, {"vw": 0, "stage": 1, "gpu": "rtx-2060"}]}
    doc = chrome_trace(TraceData(stages=rows, summary=summary))
    check_trace_events(doc)
    assert names(doc, "process_name") == {(vw_pid(0), 0): "vw 0"}
    assert names(doc, "thread_name") == {(vw_pid(0), compute_tid(0)): "stage 0 (titan-v)",
                                         (vw_pid(0), compute_tid(1)): "stage 1 (rtx-2060)"}
    stage0 = xs(doc, vw_pid(0), compute_tid(0))
    assert [e["name"] for e in stage0] == ["F 1", "F 2", "B 1", "B 2"]
    f1 = stage0[0]
    assert (f1["ts"], f1["dur"], f1["cat"]) == (0.0, pytest.approx(1e5), "forward")  # microseconds from the earliest
    assert f1["args"] == {"p": 1, "wave": 0, "local_version": 0, "min_clock": 0}
    assert stage0[2]["ts"] == pytest.approx(3e5) and stage0[2]["args"]["bwd_version"] == 0
    assert len(xs(doc)) == 8 and not any(e["name"] == "process_name" and e["args"]["name"] == "parameter servers"
                                         for e in doc["traceEvents"])


def test_micro_batches_are_drawn_instead_of_the_minibatch_span() -> None:
    gpipe = row(0, 0, 1, (0.0, 0.2), (0.2, 0.6), micro_fwd=micro((1, 0.0, 0.1), (2, 0.1, 0.2)),
                micro_bwd=micro((1, 0.2, 0.4), (2, 0.4, 0.6)))
    # 1f1b interleaves: the minibatch's forward and backward spans overlap, its micro-batches do not.
    one_f_one_b = row(0, 1, 1, (0.1, 0.35), (0.2, 0.5), micro_fwd=micro((1, 0.1, 0.2), (2, 0.25, 0.35)),
                      micro_bwd=micro((1, 0.2, 0.25), (2, 0.35, 0.5)))
    nf1b = row(1, 0, 1, (0.0, 0.2), (0.3, 0.4), micro_fwd=micro((1, 0.0, 0.1), (2, 0.1, 0.2)),
               micro_bwd=micro((0, 0.3, 0.4)))
    doc = chrome_trace(TraceData(stages=[gpipe, one_f_one_b, nf1b], summary={"parallel": {"schedule": "1f1b"}}))
    check_trace_events(doc)
    assert [e["name"] for e in xs(doc, vw_pid(0), compute_tid(0))] == ["F 1.1", "F 1.2", "B 1.1", "B 1.2"]
    assert [e["name"] for e in xs(doc, vw_pid(0), compute_tid(1))] == ["F 1.1", "B 1.1", "F 1.2", "B 1.2"]
    assert [e["name"] for e in xs(doc, vw_pid(1), compute_tid(0))] == ["F 1.1", "F 1.2", "B 1"]
    assert xs(doc, vw_pid(0), compute_tid(0))[1]["args"]["m"] == 2
    assert "m" not in xs(doc, vw_pid(1), compute_tid(0))[2]["args"]
    assert doc["otherData"]["schedule"] == "1f1b"
    assert {"name": "process_labels", "ph": "M", "pid": vw_pid(1), "tid": 0,
            "args": {"labels": "schedule 1f1b"}} in doc["traceEvents"]


def test_pull_waits_fill_only_the_idle_stretches_and_pushes_get_their_own_track() -> None:
    rows = [row(0, 0, 1, (0.0, 0.1), (0.4, 0.5)), row(0, 0, 2, (0.1, 0.2), (0.8, 0.9))]
    sync = [{"event": "pull_wait", "p": 3, "min_clock": 1, "start": T + 0.2, "end": T + 0.7, "c_global": 1},
            {"event": "push", "wave": 0, "queued": T + 0.9, "start": T + 0.95, "end": T + 1.0},
            {"event": "pull", "min_clock": 1, "c_global": 1, "sent": T + 0.2, "replied": T + 0.6, "merged": T + 0.7}]
    doc = chrome_trace(TraceData(stages=rows, sync={(0, 0): sync}))
    check_trace_events(doc)
    compute = xs(doc, vw_pid(0), compute_tid(0))
    waits = [(e["ts"], e["ts"] + e["dur"]) for e in compute if e["name"] == "pull wait"]
    assert waits == [pytest.approx((2e5, 4e5)), pytest.approx((5e5, 7e5))]  # around B 1 at 0.4-0.5
    assert all(e["args"]["p"] == 3 and e["args"]["min_clock"] == 1 for e in compute if e["cat"] == "pull_wait")
    [push] = xs(doc, vw_pid(0), push_tid(0))
    assert push["name"] == "push wave 0" and push["args"]["queued_ms"] == pytest.approx(50)
    assert names(doc, "thread_name")[(vw_pid(0), push_tid(0))] == "stage 0 pushes"


def test_tracks_are_laid_out_as_documented() -> None:
    """The layout written out, not derived from vw_pid/compute_tid/push_tid: VW v is pid v + 1 (pid
    0 is the idle task to some viewers); stage q computes on tid 2q + 1 and pushes on tid 2q + 2;
    the parameter servers are the pid after the last VW's, shard j on tid j + 1."""
    rows = [row(0, 0, 1, (0.0, 0.1), (0.3, 0.4)), row(0, 1, 1, (0.1, 0.2), (0.2, 0.3)),
            row(1, 0, 1, (0.0, 0.1), (0.1, 0.2))]
    sync = {(0, q): [{"event": "push", "wave": 0, "start": T + start, "end": T + start + 0.1}]
            for q, start in ((0, 0.5), (1, 0.35))}
    shard = [{"event": "push", "vw": 0, "clock": 0, "start": T + 0.55, "end": T + 0.56}]
    doc = chrome_trace(TraceData(stages=rows, sync=sync, shards={0: shard}))
    check_trace_events(doc)
    assert names(doc, "process_name") == {(1, 0): "vw 0", (2, 0): "vw 1", (3, 0): "parameter servers"}
    assert names(doc, "thread_name") == {(1, 1): "stage 0", (1, 2): "stage 0 pushes", (1, 3): "stage 1",
                                         (1, 4): "stage 1 pushes", (2, 1): "stage 0", (3, 1): "shard 0"}
    tracks: dict[tuple[int, int], list[str]] = {}
    for e in xs(doc):
        tracks.setdefault((e["pid"], e["tid"]), []).append(e["name"])
    assert tracks == {(1, 1): ["F 1", "B 1"], (1, 2): ["push wave 0"], (1, 3): ["F 1", "B 1"],
                      (1, 4): ["push wave 0"], (2, 1): ["F 1", "B 1"], (3, 1): ["push vw 0 wave 0"]}


def test_shard_rows_become_one_track_per_shard_in_a_parameter_server_process() -> None:
    rows = [row(0, 0, 1, (0.0, 0.1), (0.1, 0.2)), row(1, 0, 1, (0.0, 0.1), (0.1, 0.2))]
    shard = [{"shard": 1, "event": "push", "vw": 1, "clock": 0, "start": T + 0.3, "end": T + 0.31,
              "received": T + 0.25, "duplicate": False},
             {"shard": 1, "event": "push", "vw": 1, "clock": 0, "start": T + 0.4, "end": T + 0.41, "duplicate": True},
             {"shard": 1, "event": "pull", "vw": 0, "clock": 1, "start": T + 0.5, "end": T + 0.5,
              "requested": T + 0.2, "c_global": 1}]
    doc = chrome_trace(TraceData(stages=rows, shards={1: shard}))
    check_trace_events(doc)
    ps = vw_pid(2)
    assert names(doc, "process_name")[(ps, 0)] == "parameter servers"
    assert names(doc, "thread_name")[(ps, shard_tid(1))] == "shard 1"
    events = xs(doc, ps, shard_tid(1))
    assert [e["name"] for e in events] == ["push vw 1 wave 0", "duplicate push vw 1 wave 0", "pull vw 0 min_clock 1"]
    assert events[0]["args"]["received_ms_before"] == pytest.approx(50)
    assert events[2]["args"]["waited_ms"] == pytest.approx(300) and events[2]["dur"] == 0


def test_elastic_exchanges_are_drawn_as_pushes_are() -> None:
    """EA-Pipe's replica exchanges are its synchronisation: on the stage's push track (sent to
    merged) and on the shard's track, as pushes."""
    rows = [row(0, 0, 1, (0.0, 0.1), (0.1, 0.2))]
    sync = [{"event": "exchange", "clock": 0, "sent": T + 0.2, "replied": T + 0.25, "merged": T + 0.3}]
    shard = [{"shard": 0, "event": "exchange", "vw": 0, "clock": 0, "start": T + 0.21, "end": T + 0.24,
              "received": T + 0.205, "duplicate": False}]
    doc = chrome_trace(TraceData(stages=rows, sync={(0, 0): sync}, shards={0: shard}))
    check_trace_events(doc)
    [sent] = xs(doc, vw_pid(0), push_tid(0))
    assert (sent["name"], sent["cat"], sent["dur"]) == ("exchange 0", "exchange", pytest.approx(1e5))
    assert sent["args"]["answered_ms"] == pytest.approx(50)
    [taken] = xs(doc, vw_pid(1), shard_tid(0))
    assert (taken["name"], taken["cat"]) == ("exchange vw 0 wave 0", "ps_exchange")


def test_idle_fraction_is_the_uncovered_part_of_the_stage_span() -> None:
    spans = [Span("F", 1, None, 0.0, 1.0), Span("B", 1, None, 2.0, 3.0), Span("F", 2, 1, 2.5, 4.0)]
    assert timeline.idle_fraction(spans) == pytest.approx(0.25)
    assert timeline.idle_fraction([]) == 0.0


def test_load_refuses_a_missing_or_empty_trace_and_skips_an_earlier_jobs_files(tmp_path: Path) -> None:
    with pytest.raises(TraceMissing, match="no such folder"):
        timeline.load(tmp_path / "typo")
    with pytest.raises(TraceMissing, match="output.trace: true"):
        timeline.load(tmp_path)
    (tmp_path / "trace").mkdir()
    with pytest.raises(TraceMissing, match="no per-minibatch trace lines"):
        timeline.load(tmp_path)
    for v in (0, 1):
        (tmp_path / "trace" / f"vw{v}_stage0.jsonl").write_text(
            json.dumps(row(v, 0, 1, (0.0, 0.1), (0.1, 0.2))) + "\n" + '{"vw": 0, "sta')  # cut short by a kill
    # An earlier job in the same directory had 2 VWs, 2 stages and 2 shards; this one 1, 1 and 1.
    (tmp_path / "trace" / "sync").mkdir()
    for v, q in ((0, 0), (1, 0), (0, 1)):
        (tmp_path / "trace" / "sync" / f"vw{v}_stage{q}.jsonl").write_text(
            json.dumps({"event": "push", "wave": 0, "start": T + 0.2, "end": T + 0.3}) + "\n")
    (tmp_path / "trace" / "ps").mkdir()
    for j in (0, 1):
        (tmp_path / "trace" / "ps" / f"shard{j}.jsonl").write_text(
            json.dumps({"event": "push", "vw": 0, "clock": 0, "start": T + 0.2, "end": T + 0.3}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"virtual_workers": 1, "stages_per_vw": 1, "ps_shards": 1}))
    data = timeline.load(tmp_path)
    assert [(r["vw"], r["p"]) for r in data.stages] == [(0, 1)]
    assert list(data.sync) == [(0, 0)] and len(data.sync[(0, 0)]) == 1
    assert list(data.shards) == [0] and len(data.shards[0]) == 1
    path, count = timeline.export(tmp_path)
    assert path == tmp_path / "trace.json" and len(json.loads(path.read_text())["traceEvents"]) == count


def test_cli_exits_2_naming_the_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    assert main(["trace", str(tmp_path)]) == 2
    assert "no trace/ directory" in capsys.readouterr().err
    (tmp_path / "trace").mkdir()
    assert main(["trace", str(tmp_path), "-o", str(tmp_path / "x.json")]) == 2
    assert "no per-minibatch trace lines" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
