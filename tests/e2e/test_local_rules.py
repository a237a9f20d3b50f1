"""L1-L4 (DESIGN §3) checked on the per-minibatch trace of real k-stage runs, with and without
random per-task delays; and the trace checker itself shown to catch each broken rule."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from launch.local import run_local
from trace_rules import (
    Row,
    by_stage,
    check_causality,
    check_complete,
    check_in_flight,
    check_local_rules,
    check_min_clock,
    check_order,
    check_versions,
    load_trace,
    max_in_flight,
)

# Hard limit against hangs; a run takes ~12 s on an idle 2-core machine, far longer on a busy one.
pytestmark = pytest.mark.timeout(300)

EMULATED = {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 4}]}],
            "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.02}}


# ---- real runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [None, [0.0, 0.01]], ids=["fixed", "random-delays"])
@pytest.mark.parametrize(("nm", "k", "steps"), [(2, 3, 30), (4, 4, 32)], ids=["nm2-k3", "nm4-k4"])
def test_trace_keeps_local_rules(make_job, inject_faults, tmp_path: Path, nm: int, k: int, steps: int, delay: Any) -> None:
    overrides: dict[str, Any] = {
        "cluster": EMULATED,
        "train": {"steps": steps},
        "parallel": {"stages_per_vw": k, "nm": nm, "D": 0},
        "output": {"trace": True},
    }
    if delay is not None:
        inject_faults(task_delay=tuple(delay))
    job = make_job(overrides)
    summary = run_local(job, quiet=True)
    assert summary["nm"] == nm and summary["stages_per_vw"] == k

    trace_dir = tmp_path / "out" / "trace"
    assert sorted(p.name for p in trace_dir.iterdir()) == [f"vw0_stage{q}.jsonl" for q in range(k)]
    rows = load_trace(trace_dir)
    check_complete(rows, vws=1, stages=k, steps=steps)
    check_local_rules(rows, nm)
    check_min_clock(rows, nm, D=0)  # a lone VW: c_global is its own clock

    # The run really pipelined up to the limit, so the checks above were not vacuous: stage 0 held
    # nm minibatches in flight and ran forwards exactly nm updates stale.
    stage0 = by_stage(rows)[(0, 0)]
    assert max_in_flight(stage0) == nm
    assert any(r["local_version"] == r["p"] - nm for r in stage0 if r["p"] > nm)
    # The last stage runs F+B as one task (L4), so it always sees every earlier update.
    assert all(r["local_version"] == r["p"] - 1 for r in by_stage(rows)[(0, k - 1)])


# ---- the checker catches every broken rule ---------------------------------------------------------


def simulate(k: int, nm: int, steps: int, *, window: int | None = None, seed: int = 0) -> list[Row]:
    """A trace of one VW from a small event-driven model of the pipeline with random task times.

    Each stage runs one task at a time; stage 0 injects p once p-window has finished there. With
    window=nm it keeps every rule; a larger window breaks L1 (and so L2's staleness bound).
    """
    window = window or nm
    rng = random.Random(seed)
    free = [0.0] * k
    version = [0] * k
    next_f, next_b = [1] * k, [1] * k
    fwd_end: dict[tuple[int, int], float] = {}
    bwd_end: dict[tuple[int, int], float] = {}
    rows: dict[tuple[int, int], Row] = {}
    while any(n <= steps for n in next_b):
        candidates = []
        for q in range(k):
            p = next_f[q]
            if p <= steps:
                ready = (0.0 if p <= window else bwd_end.get((0, p - window))) if q == 0 else fwd_end.get((q - 1, p))
                if ready is not None:
                    candidates.append((max(free[q], ready), q, "F", p))
            p = next_b[q]
            if q < k - 1 and p < next_f[q] and (q + 1, p) in bwd_end:
                candidates.append((max(free[q], bwd_end[(q + 1, p)]), q, "B", p))
        start, q, kind, p = min(candidates)
        t_f, t_b = rng.uniform(1, 2), rng.uniform(2, 4)
        if kind == "F":
            rows[(q, p)] = {"vw": 0, "stage": q, "p": p, "wave": (p - 1) // nm, "local_version": version[q],
                            "min_clock": version[q] // nm, "fwd_start": start, "fwd_end": start + t_f}
            fwd_end[(q, p)] = free[q] = start + t_f
            next_f[q] += 1
            if q < k - 1:
                continue
            start += t_f  # the last stage runs F+B as one task
        row = rows[(q, p)]
        row.update(bwd_version=row["local_version"], bwd_start=start, bwd_end=start + t_b)
        bwd_end[(q, p)] = free[q] = start + t_b
        version[q] += 1
        next_b[q] += 1
    return [rows[key] for key in sorted(rows)]


def row(rows: list[Row], stage: int, p: int) -> Row:
    return next(r for r in rows if r["stage"] == stage and r["p"] == p)


@pytest.mark.parametrize(("k", "nm"), [(1, 1), (2, 1), (3, 2), (4, 4), (4, 3)])
def test_checker_accepts_a_valid_trace(k: int, nm: int) -> None:
    rows = simulate(k, nm, 20, seed=k * 10 + nm)
    check_complete(rows, vws=1, stages=k, steps=20)
    check_local_rules(rows, nm)
    check_min_clock(rows, nm, D=0)
    assert max_in_flight(by_stage(rows)[(0, 0)]) == (nm if k > 1 else 1)


@pytest.fixture
def valid() -> list[Row]:
    rows = simulate(3, 2, 12, seed=1)
    check_local_rules(rows, 2)
    return copy.deepcopy(rows)


def test_checker_catches_l1_too_many_in_flight() -> None:
    rows = simulate(3, 2, 12, window=3)
    with pytest.raises(AssertionError, match=r"L1 violated at vw 0 stage 0 minibatch \d+: injected while"):
        check_in_flight(rows, 2)
    with pytest.raises(AssertionError, match="L2 violated.*missing updates"):
        check_versions(rows, 2)  # an extra minibatch in flight also makes a forward too stale
    with pytest.raises(AssertionError):
        check_local_rules(rows, 2)


def test_checker_catches_l1_overlap_at_a_later_stage(valid: list[Row]) -> None:
    row(valid, 1, 1)["bwd_end"] = 1e9  # p=1 never leaves stage 1, so p=3 makes three in flight
    with pytest.raises(AssertionError, match="L1 violated at vw 0 stage 1: 3 minibatches in flight"):
        check_in_flight(valid, 2)


def test_checker_catches_l2_stale_weights(valid: list[Row]) -> None:
    r = row(valid, 1, 6)
    r["local_version"] = r["bwd_version"] = 3
    with pytest.raises(AssertionError, match="L2 violated at vw 0 stage 1 minibatch 6: .*version 3, missing"):
        check_versions(valid, 2)


def test_checker_catches_l2_future_weights(valid: list[Row]) -> None:
    r = row(valid, 2, 5)
    r["local_version"] = r["bwd_version"] = 5
    with pytest.raises(AssertionError, match="L2 violated at vw 0 stage 2 minibatch 5: .*includes minibatch 5"):
        check_versions(valid, 2)


def test_checker_catches_a_version_that_is_not_the_count_of_updates(valid: list[Row]) -> None:
    # Within the staleness bound, but not what the stage had applied: an update was lost.
    r = next(r for r in valid if r["local_version"] > max(0, r["p"] - 2))
    r["local_version"] -= 1
    r["bwd_version"] -= 1
    with pytest.raises(AssertionError, match=rf"L2/L3 violated at vw 0 stage {r['stage']} minibatch {r['p']}: .*backwards had finished"):
        check_versions(valid, 2)


def test_checker_catches_broken_weight_stashing(valid: list[Row]) -> None:
    row(valid, 1, 4)["bwd_version"] += 1
    with pytest.raises(AssertionError, match="weight stashing violated at vw 0 stage 1 minibatch 4"):
        check_versions(valid, 2)


def test_checker_catches_a_wrong_wave(valid: list[Row]) -> None:
    row(valid, 0, 3)["wave"] = 0
    with pytest.raises(AssertionError, match="minibatch 3: wave 0, expected 1"):
        check_versions(valid, 2)


def test_checker_catches_forwards_out_of_order(valid: list[Row]) -> None:
    a, b = row(valid, 1, 2), row(valid, 1, 3)
    a["p"], b["p"] = 3, 2
    with pytest.raises(AssertionError, match="L4 violated at vw 0 stage 1: forward of 3 started before forward of 2"):
        check_order(valid)


def test_checker_catches_backwards_out_of_order(valid: list[Row]) -> None:
    a, b = row(valid, 0, 2), row(valid, 0, 3)
    assert b["fwd_end"] <= a["bwd_start"]
    for key in ("bwd_start", "bwd_end"):
        a[key], b[key] = b[key], a[key]
    with pytest.raises(AssertionError, match="L4 violated at vw 0 stage 0: backward of 3 started before backward of 2"):
        check_order(valid)


def test_checker_catches_two_tasks_at_once_on_one_stage(valid: list[Row]) -> None:
    first, second = row(valid, 1, 1), row(valid, 1, 2)
    second["fwd_start"] = (first["fwd_start"] + first["fwd_end"]) / 2
    with pytest.raises(AssertionError, match="stage 1: task F 2 started .* while task F 1 ran"):
        check_order(valid)


def test_checker_catches_a_forward_before_its_input(valid: list[Row]) -> None:
    row(valid, 2, 4)["fwd_start"] = row(valid, 1, 4)["fwd_end"] - 0.01
    with pytest.raises(AssertionError, match="stage 2 minibatch 4: forward started before stage 1 finished"):
        check_causality(valid)


def test_checker_catches_a_backward_before_its_gradient(valid: list[Row]) -> None:
    row(valid, 0, 4)["bwd_start"] = row(valid, 1, 4)["bwd_end"] - 0.01
    with pytest.raises(AssertionError, match="stage 0 minibatch 4: backward started before stage 1 finished"):
        check_causality(valid)


def test_checker_catches_g2_stale_global_weights(valid: list[Row]) -> None:
    check_min_clock(valid, 2, D=0)
    row(valid, 1, 8)["min_clock"] = 2  # needs floor(8/2) - 1 - 0 = 3
    with pytest.raises(AssertionError, match=r"G2 violated at vw 0 stage 1 minibatch 8: min_clock 2 < 3"):
        check_min_clock(valid, 2, D=0)
    check_min_clock(valid, 2, D=1)  # the same trace is fine with one more wave of slack


@pytest.mark.parametrize("damage", ["drop", "duplicate", "extra", "field"])
def test_checker_catches_an_incomplete_trace(valid: list[Row], damage: str) -> None:
    if damage == "drop":
        valid.remove(row(valid, 1, 7))
        match = r"no row for \(vw, stage, p\) \[\(0, 1, 7\)\]"
    elif damage == "duplicate":
        valid.append(dict(row(valid, 2, 3)))
        match = "two rows for vw 0 stage 2 minibatch 3"
    elif damage == "extra":
        valid.append(dict(row(valid, 2, 12), p=13))
        match = r"unexpected rows .*\(0, 2, 13\)"
    else:
        del row(valid, 0, 1)["bwd_version"]
        match = r"lacks fields \['bwd_version'\]"
    with pytest.raises(AssertionError, match=match):
        check_complete(valid, vws=1, stages=3, steps=12)


def test_load_trace_reads_every_file(tmp_path: Path, valid: list[Row]) -> None:
    for q, rs in by_stage(valid).items():
        (tmp_path / f"vw{q[0]}_stage{q[1]}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    loaded = load_trace(tmp_path)
    assert [{k: v for k, v in r.items() if k != "_where"} for r in loaded] == valid
    check_complete(loaded, vws=1, stages=3, steps=12)
