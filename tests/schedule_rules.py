"""Trace checks of the micro-batch schedules (docs/design.md, "Schedules"), written out
independently of stage_worker/micro_schedule.py. Rows are the per-minibatch trace lines; each
carries micro_fwd and micro_bwd lists of [m, start, end] (nf1b's one backward: m = 0).

Each check raises AssertionError naming the rule, the VW, the stage and the minibatch.
"""

from __future__ import annotations

from typing import Any

from tests.trace_rules import Row, by_stage, neighbour_rows

Event = tuple[float, float, str, int, int]  # start, end, "F" | "B", p, micro


def _at(r: Row) -> str:
    return f"vw {r['vw']} stage {r['stage']} minibatch {r['p']}"


def expected_order(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """One minibatch's tasks at a stage: gpipe fills then drains; 1f1b (PipeDream-Flush) runs
    stages-1-stage warm-up forwards, then alternates, then drains."""
    if schedule == "gpipe":
        return [("F", m) for m in range(1, micro + 1)] + [("B", m) for m in range(1, micro + 1)]
    warm = min(stages - 1 - stage, micro)
    order: list[tuple[str, int]] = [("F", m) for m in range(1, warm + 1)]
    backs = iter(range(1, micro + 1))
    for m in range(warm + 1, micro + 1):
        order += [("F", m), ("B", next(backs))]
    return order + [("B", m) for m in backs]


def events(r: Row) -> list[Event]:
    return ([(s, e, "F", r["p"], m) for m, s, e in r["micro_fwd"]]
            + [(s, e, "B", r["p"], m) for m, s, e in r["micro_bwd"]])


def check_micro_rows(rows: list[Row], schedule: str, micro: int) -> None:
    """Every row lists each micro-batch's forward once, in order, and its backwards: gpipe and
    1f1b one per micro-batch, nf1b one for the whole minibatch; the row spans them."""
    for r in rows:
        fwd = [m for m, _, _ in r["micro_fwd"]]
        bwd = [m for m, _, _ in r["micro_bwd"]]
        assert fwd == list(range(1, micro + 1)), f"{_at(r)}: forwards of micro-batches {fwd}, expected 1..{micro}"
        want = [0] if schedule == "nf1b" else list(range(1, micro + 1))
        assert bwd == want, f"{_at(r)}: backwards {bwd}, expected {want} under {schedule}"
        for m, s, e in r["micro_fwd"] + r["micro_bwd"]:
            assert s <= e, f"{_at(r)}: micro-batch {m} ends before it starts"
        assert r["fwd_start"] == r["micro_fwd"][0][1] and r["bwd_end"] == r["micro_bwd"][-1][2], (
            f"{_at(r)}: the row's times do not span its micro-batches")


def check_one_thread(rows: list[Row]) -> list[Event]:
    """A stage runs one task at a time; returns its tasks in the order they ran. nf1b's last
    stage runs the last forward and the backward as one task: they touch, never overlap."""
    out = []
    for (v, q), rs in by_stage(rows).items():
        seq = sorted(e for r in rs for e in events(r))
        for a, b in zip(seq, seq[1:]):
            assert a[1] <= b[0], f"vw {v} stage {q}: {b[2]} {b[3]}.{b[4]} started while {a[2]} {a[3]}.{a[4]} ran"
        out += seq
    return out


def check_flushed(rows: list[Row], schedule: str, stages: int, micro: int) -> None:
    """gpipe, 1f1b: each stage runs exactly the schedule's order, minibatch after minibatch, and
    is synchronous: p's forwards and backwards all run on the weights with the updates of every
    earlier minibatch and none of p's (local_version == bwd_version == p - 1)."""
    check_micro_rows(rows, schedule, micro)
    check_one_thread(rows)
    for (v, q), rs in by_stage(rows).items():
        ran = [(kind, p, m) for _, _, kind, p, m in sorted(e for r in rs for e in events(r))]
        want = [(kind, r["p"], m) for r in rs for kind, m in expected_order(schedule, q, stages, micro)]
        for i, (a, b) in enumerate(zip(ran, want)):
            assert a == b, f"vw {v} stage {q}: task {i} was {a[0]} {a[1]}.{a[2]}, {schedule} runs {b[0]} {b[1]}.{b[2]}"
        for r in rs:
            assert r["local_version"] == r["bwd_version"] == r["p"] - 1, (
                f"{_at(r)}: versions {r['local_version']}/{r['bwd_version']}, a synchronous schedule runs p on "
                f"the updates of minibatches 1..{r['p'] - 1}")
    check_micro_causality(rows)


def check_nf1b(rows: list[Row], nm: int, micro: int) -> dict[int, dict[int, int]]:
    """nf1b: forwards of micro-batches in order, one backward per minibatch in p order, after all
    of p's forwards; no weight stashing: p's backward runs on every earlier minibatch's update
    (bwd_version == p - 1) and its first forward on the updates whose backward had ended
    (local_version = the backwards done before it); at most nm minibatches in flight at stage 0.
    Returns each VW's version difference v per minibatch (1 <= v <= nm)."""
    check_micro_rows(rows, "nf1b", micro)
    check_one_thread(rows)
    stages = by_stage(rows)
    for (v, q), rs in stages.items():
        seq = sorted(e for r in rs for e in events(r))
        forwards = [(p, m) for _, _, kind, p, m in seq if kind == "F"]
        assert forwards == sorted(forwards), f"vw {v} stage {q}: forwards out of (p, micro) order"
        backs = [p for _, _, kind, p, _ in seq if kind == "B"]
        assert backs == sorted(backs), f"vw {v} stage {q}: backwards out of p order: {backs[:10]}"
        bwd_ends = sorted(r["micro_bwd"][0][2] for r in rs)
        for r in rs:
            assert r["micro_bwd"][0][1] >= r["micro_fwd"][-1][2], f"{_at(r)}: backward before its last forward"
            assert r["bwd_version"] == r["p"] - 1, (
                f"{_at(r)}: backward on version {r['bwd_version']}, nf1b runs it on the current weights "
                f"(updates 1..{r['p'] - 1})")
            done = sum(1 for t in bwd_ends if t <= r["fwd_start"])
            assert r["local_version"] == done, (
                f"{_at(r)}: forward on version {r['local_version']}, but {done} backwards had ended before it")
            if q == 0:
                assert done >= r["p"] - nm, f"L1 violated at {_at(r)}: only {done} minibatches done (nm={nm})"
    check_micro_causality(rows)
    return {v: version_differences(rows, v) for v in sorted({r["vw"] for r in rows})}


def version_differences(rows: list[Row], vw: int) -> dict[int, int]:
    """TiMePReSt's v per minibatch p: p - the latest q whose backward had ended at stage 0 when
    p's backward began at the last stage."""
    stages = {q: {r["p"]: r for r in rs} for (v, q), rs in by_stage(rows).items() if v == vw}
    first, last = stages[0], stages[max(stages)]
    out = {}
    for p, r in last.items():
        start = r["micro_bwd"][0][1]
        done = [q for q, o in first.items() if q < p and o["micro_bwd"][-1][2] <= start]
        out[p] = p - max(done, default=0)
    return out


def check_micro_causality(rows: list[Row]) -> None:
    """Stage q+1 forwards micro-batch (p, m) only after stage q's forward of it ended; stage q's
    backward of a unit starts only after stage q+1's backward of it ended."""
    for q, r, n in neighbour_rows(rows):
        ends = {m: e for m, _, e in r["micro_fwd"]}
        for m, s, _ in n["micro_fwd"]:
            assert s >= ends[m], f"{_at(n)}: forward of micro-batch {m} before stage {q} sent it"
        later = {m: e for m, _, e in n["micro_bwd"]}
        for m, s, _ in r["micro_bwd"]:
            assert s >= later[m], f"{_at(r)}: backward of micro-batch {m} before stage {q + 1} sent it"


def summary_of(v: dict[int, int]) -> dict[str, Any]:
    values = [v[p] for p in sorted(v)]
    return {"max": max(values), "last": values[-1]}
