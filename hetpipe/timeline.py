"""A run's trace/ as a Chrome trace-event timeline (Perfetto, chrome://tracing): `hetpipe trace`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetpipe import outputs
from hetpipe.outputs import TRACE_FILE

Row = dict[str, Any]
_STAGE_FILE = re.compile(r"vw(\d+)_stage(\d+)\.jsonl")
_SHARD_FILE = re.compile(r"shard(\d+)\.jsonl")


class TraceMissing(ValueError):
    """The output directory has no trace to draw (the job ran without output.trace, or not yet)."""


# ---- tracks: one process per VW (a compute and a push track per stage), one for the shards ----------


def vw_pid(vw: int) -> int:
    return vw + 1   # pid 0 is the idle task to some viewers


def compute_tid(stage: int) -> int:
    """The stage's compute thread: forwards, backwards, and the idle parts of its pull waits."""
    return 2 * stage + 1


def push_tid(stage: int) -> int:
    """The stage's pusher thread: pushes overlap compute, and slices on one track must nest."""
    return 2 * stage + 2


def shard_tid(shard: int) -> int:
    return shard + 1


@dataclass(frozen=True, slots=True)
class Span:
    """One forward or backward on a stage: of a whole minibatch (m None) or of micro-batch m of it."""

    kind: str          # "F" or "B"
    p: int
    m: int | None
    start: float       # time.time() seconds
    end: float

    @property
    def name(self) -> str:
        return f"{self.kind} {self.p}" if self.m is None else f"{self.kind} {self.p}.{self.m}"


def compute_spans(row: Row) -> list[Span]:
    """The forwards and backwards of one trace row: its micro-batches' (`micro_fwd`, `micro_bwd`:
    [[m, start, end], ...], m 0 for the whole minibatch) when it has them, else its one span each."""
    p, out = int(row["p"]), []
    for kind, micro, start, end in (("F", "micro_fwd", "fwd_start", "fwd_end"), ("B", "micro_bwd", "bwd_start", "bwd_end")):
        if row.get(micro):
            out += [Span(kind, p, int(m) or None, float(s), float(e)) for m, s, e in row[micro]]
        elif start in row and end in row:
            out.append(Span(kind, p, None, float(row[start]), float(row[end])))
    return out


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _gaps(start: float, end: float, busy: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end] less the (merged, sorted) busy intervals."""
    out, at = [], start
    for s, e in busy:
        if e <= at or s >= end:
            continue
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if at < end:
        out.append((at, end))
    return out


def idle_fraction(spans: Sequence[Span]) -> float:
    """The stage's bubble: the part of [first start, last end] in which it computed nothing."""
    if not spans:
        return 0.0
    busy = _union((s.start, s.end) for s in spans)
    total = busy[-1][1] - busy[0][0]
    return 1.0 - sum(e - s for s, e in busy) / total if total > 0 else 0.0


# ---- reading trace/ ------------------------------------------------------------------------------


@dataclass(slots=True)
class TraceData:
    """What trace/ holds: per-minibatch rows, each stage's sync rows and each shard's rows."""

    stages: list[Row] = field(default_factory=list)                           # trace/vw{v}_stage{q}.jsonl
    sync: dict[tuple[int, int], list[Row]] = field(default_factory=dict)      # trace/sync/vw{v}_stage{q}.jsonl
    shards: dict[int, list[Row]] = field(default_factory=dict)                # trace/ps/shard{j}.jsonl
    summary: dict[str, Any] = field(default_factory=dict)                     # summary.json, if the run ended


def _rows(path: Path) -> list[Row]:
    """The file's JSON lines; a line cut short (a process killed mid-write) is left out."""
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def load(out_dir: str | Path) -> TraceData:
    """Reads OUTPUT_DIR/trace/; TraceMissing if it is absent or holds no per-minibatch line. With a
    summary.json, files of VWs, stages or shards the run did not have (an earlier job's) are skipped."""
    out_dir = Path(out_dir)
    trace = out_dir / "trace"
    if not out_dir.is_dir():
        raise TraceMissing(f"{out_dir}: no such folder (give the output.dir of a traced run)")
    if not trace.is_dir():
        raise TraceMissing(f"{out_dir}: no trace/ directory; run the job with output.trace: true")
    data = TraceData()
    summary_path = out_dir / "summary.json"
    if summary_path.is_file():
        try:
            loaded = json.loads(summary_path.read_text())
            data.summary = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            pass
    vws, stages = data.summary.get("virtual_workers"), data.summary.get("stages_per_vw")
    shards = data.summary.get("ps_shards")

    def ours(vw: int, stage: int) -> bool:
        return (vws is None or vw < vws) and (stages is None or stage < stages)

    for path in sorted(trace.glob("vw*_stage*.jsonl")):
        if (match := _STAGE_FILE.fullmatch(path.name)) and ours(int(match[1]), int(match[2])):
            data.stages += [r for r in _rows(path) if {"vw", "stage", "p"} <= r.keys()]
    for path in sorted((trace / "sync").glob("vw*_stage*.jsonl")):
        if (match := _STAGE_FILE.fullmatch(path.name)) and ours(int(match[1]), int(match[2])):
            data.sync[(int(match[1]), int(match[2]))] = _rows(path)
    for path in sorted((trace / "ps").glob("shard*.jsonl")):
        if (match := _SHARD_FILE.fullmatch(path.name)) and (shards is None or int(match[1]) < shards):
            data.shards[int(match[1])] = _rows(path)
    if not data.stages:
        raise TraceMissing(f"{trace}: no per-minibatch trace lines (trace/vw*_stage*.jsonl); "
                           "run the job with output.trace: true")
    return data


# ---- the conversion ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Slice:
    pid: int
    tid: int
    name: str
    cat: str
    start: float
    end: float
    args: dict[str, Any]


def version_differences(first_backward_end: Mapping[int, float], last_backward_start: Mapping[int, float]) -> dict[int, int]:
    """TiMePReSt's version difference v of each minibatch p: p - q, where q is the latest minibatch
    whose backward had finished at stage 0 (so its update is in every stage's weights) when p's
    backward began at the last stage. v = 1 iff consecutive backward passes never overlap."""
    ends = sorted(first_backward_end.items())
    out = {}
    for p, start in sorted(last_backward_start.items()):
        done = [q for q, end in ends if q < p and end <= start]
        out[p] = p - (max(done) if done else 0)
    return out



def nf1b_version_differences(rows: Sequence[Row]) -> dict[tuple[int, int], int]:
    """(vw, p) -> v, from the rows of runs whose backwards are of whole minibatches (nf1b)."""
    out: dict[tuple[int, int], int] = {}
    for v in sorted({int(r["vw"]) for r in rows}):
        mine = [r for r in rows if int(r["vw"]) == v and r.get("micro_bwd")]
        if not mine or any(m != 0 for r in mine for m, _, _ in r["micro_bwd"]):
            continue
        last = max(int(r["stage"]) for r in mine)
        first_end = {int(r["p"]): float(r["bwd_end"]) for r in mine if int(r["stage"]) == 0}
        last_start = {int(r["p"]): float(r["bwd_start"]) for r in mine if int(r["stage"]) == last}
        out |= {(v, p): d for p, d in version_differences(first_end, last_start).items()}
    return out


def _stage_slices(data: TraceData) -> list[_Slice]:
    out: list[_Slice] = []
    busy: dict[tuple[int, int], list[tuple[float, float]]] = {}
    differences = nf1b_version_differences(data.stages)
    for r in data.stages:
        v, q = int(r["vw"]), int(r["stage"])
        common = {k: r[k] for k in ("p", "wave", "local_version", "min_clock") if k in r}
        for s in compute_spans(r):
            args = {**common, **({"m": s.m} if s.m is not None else {})}
            if s.kind == "B" and "bwd_version" in r:
                args["bwd_version"] = r["bwd_version"]
            if s.kind == "B" and (v, int(r["p"])) in differences:  # nf1b: TiMePReSt's v
                args["version_difference"] = differences[(v, int(r["p"]))]
            out.append(_Slice(vw_pid(v), compute_tid(q), s.name, "forward" if s.kind == "F" else "backward",
                              s.start, s.end, args))
            busy.setdefault((v, q), []).append((s.start, s.end))
    for (v, q), rows in data.sync.items():
        merged = _union(busy.get((v, q), []))
        for r in rows:
            if r.get("event") == "push":
                out.append(_Slice(vw_pid(v), push_tid(q), f"push wave {r['wave']}", "push", r["start"], r["end"],
                                  {"wave": r["wave"], "queued_ms": 1e3 * (r["start"] - r.get("queued", r["start"]))}))
            elif r.get("event") == "exchange":   # elastic: the replica sent, the shards' answer merged in
                out.append(_Slice(vw_pid(v), push_tid(q), f"exchange {r['clock']}", "exchange", r["sent"], r["merged"],
                                  {"clock": r["clock"], "answered_ms": 1e3 * (r["replied"] - r["sent"])}))
            elif r.get("event") == "pull_wait":
                # The compute thread runs other tasks (backwards) while a forward waits: only the
                # idle stretches of the wait are drawn, so that the compute track never overlaps.
                args = {"p": r["p"], "min_clock": r["min_clock"], "c_global": r.get("c_global"),
                        "wait_ms": 1e3 * (r["end"] - r["start"])}
                out += [_Slice(vw_pid(v), compute_tid(q), "pull wait", "pull_wait", s, e, args)
                        for s, e in _gaps(r["start"], r["end"], merged)]
    return out


def _shard_slices(data: TraceData, pid: int) -> list[_Slice]:
    out: list[_Slice] = []
    for j, rows in data.shards.items():
        for r in rows:
            v, c = r["vw"], r["clock"]
            if r.get("event") in ("push", "exchange"):   # an elastic exchange is a push that is answered
                name = f"{'duplicate ' if r.get('duplicate') else ''}{r['event']} vw {v} wave {c}"
                args = {"vw": v, "wave": c, "duplicate": bool(r.get("duplicate")),
                        "checkpoint": bool(r.get("checkpoint")),
                        "received_ms_before": 1e3 * (r["start"] - r.get("received", r["start"]))}
                out.append(_Slice(pid, shard_tid(j), name, f"ps_{r['event']}", r["start"], r["end"], args))
            elif r.get("event") == "pull":
                args = {"vw": v, "min_clock": c, "c_global": r.get("c_global"),
                        "waited_ms": 1e3 * (r["start"] - r.get("requested", r["start"]))}
                out.append(_Slice(pid, shard_tid(j), f"pull vw {v} min_clock {c}", "ps_pull", r["start"], r["end"],
                                  args))
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _schedule(summary: dict[str, Any]) -> str | None:
    for where in (summary, summary.get("parallel") or {}):
        if isinstance(where, dict) and isinstance(where.get("schedule"), str):
            return str(where["schedule"])
    return None


def chrome_trace(data: TraceData) -> dict[str, Any]:
    """The JSON Object Format of the Trace Event Format: "M" events naming a process per VW (a
    compute and a push track per stage) and one for the parameter servers (a track per shard),
    then "X" events, ts and dur in microseconds from the earliest time in the run."""
    vws = sorted({int(r["vw"]) for r in data.stages} | {v for v, _ in data.sync})
    stages = sorted({(int(r["vw"]), int(r["stage"])) for r in data.stages} | set(data.sync))
    ps_pid = vw_pid(max(vws, default=-1) + 1)
    slices = _stage_slices(data) + _shard_slices(data, ps_pid)
    t0 = min((s.start for s in slices), default=0.0)
    gpus = {(int(s["vw"]), int(s["stage"])): str(s["gpu"]).replace(" (emulated)", ", emulated")
            for s in data.summary.get("plan") or [] if isinstance(s, dict) and {"vw", "stage", "gpu"} <= s.keys()}
    schedule = _schedule(data.summary)
    events: list[dict[str, Any]] = []
    for v in vws:
        events.append(_meta("process_name", vw_pid(v), 0, {"name": f"vw {v}"}))
        events.append(_meta("process_sort_index", vw_pid(v), 0, {"sort_index": v}))
        if schedule:
            events.append(_meta("process_labels", vw_pid(v), 0, {"labels": f"schedule {schedule}"}))
    for v, q in stages:
        gpu = gpus.get((v, q))
        events.append(_meta("thread_name", vw_pid(v), compute_tid(q), {"name": f"stage {q}" + (f" ({gpu})" if gpu else "")}))
        events.append(_meta("thread_sort_index", vw_pid(v), compute_tid(q), {"sort_index": compute_tid(q)}))
        if (v, q) in data.sync:
            events.append(_meta("thread_name", vw_pid(v), push_tid(q), {"name": f"stage {q} pushes"}))
            events.append(_meta("thread_sort_index", vw_pid(v), push_tid(q), {"sort_index": push_tid(q)}))
    if data.shards:
        events.append(_meta("process_name", ps_pid, 0, {"name": "parameter servers"}))
        events.append(_meta("process_sort_index", ps_pid, 0, {"sort_index": ps_pid}))
        for j in sorted(data.shards):
            events.append(_meta("thread_name", ps_pid, shard_tid(j), {"name": f"shard {j}"}))
            events.append(_meta("thread_sort_index", ps_pid, shard_tid(j), {"sort_index": j}))
    for s in sorted(slices, key=lambda s: (s.pid, s.tid, s.start)):
        ts, end = _us(s.start - t0), _us(s.end - t0)
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": s.pid, "tid": s.tid, "ts": ts,
                       "dur": round(max(0.0, end - ts), 3), "args": s.args})
    other = {"t0_unix_seconds": t0, **({"schedule": schedule} if schedule else {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def export(out_dir: str | Path, out_file: str | Path | None = None) -> tuple[Path, int]:
    """Writes OUTPUT_DIR/trace.json (or out_file); returns its path and the number of events."""
    doc = chrome_trace(load(out_dir))
    path = Path(out_file) if out_file is not None else Path(out_dir) / TRACE_FILE
    outputs.write_named(path, json.dumps(doc, separators=(",", ":")) + "\n")
    return path, len(doc["traceEvents"])
