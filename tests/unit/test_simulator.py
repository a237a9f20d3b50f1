"""The pipeline + WSP simulator (DESIGN §4, planning-interfaces.md) against closed forms and the rules.

Analytic cases that a wrong simulator would miss, a replay of its schedule through the
runtime's own StageSchedule (L1, L4), and a property test of its trace against DESIGN §3 with
the same checks that the runtime's traces must pass (tests/trace_rules.py).
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.planner.simulator import SimResult, SimStage, overlapping, simulate
from stage_worker.schedule import StageSchedule, Task, TaskKind
from tests import trace_rules

S = SimStage


def approx(x: float, rel: float = 1e-9) -> object:
    return pytest.approx(x, rel=rel, abs=1e-9)


def rate_between(stages: list[SimStage], nm: int, s1: int, s2: int) -> float:
    """Steady-state seconds per minibatch: the makespan's growth per extra minibatch."""
    t1 = simulate([stages], nm=nm, D=0, steps=s1).makespan_seconds
    t2 = simulate([stages], nm=nm, D=0, steps=s2).makespan_seconds
    return (t2 - t1) / (s2 - s1)


# ---- one VW: closed forms --------------------------------------------------------------------------


@pytest.mark.parametrize("nm", [1, 2, 5])
@pytest.mark.parametrize("steps", [1, 7, 20])
def test_one_stage_runs_back_to_back(nm: int, steps: int) -> None:
    r = simulate([[S(0.125, 0.375)]], nm=nm, D=0, steps=steps)
    assert r.makespan_seconds == approx(steps * 0.5)
    assert r.minibatches_per_second == approx(2.0)
    assert r.per_vw_minibatches_per_second == [approx(2.0)]
    assert r.wait_seconds == [0.0]


def test_nm1_each_minibatch_takes_the_whole_round_trip() -> None:
    stages = [S(0.1, 0.2, 0.01), S(0.3, 0.25, 0.02), S(0.05, 0.4, 0.03), S(0.2, 0.1, 99.0)]  # last send unused
    latency = sum(s.forward_seconds + s.backward_seconds for s in stages) + 2 * (0.01 + 0.02 + 0.03)
    r = simulate([stages], nm=1, D=0, steps=9)
    assert r.makespan_seconds == approx(9 * latency)
    assert r.minibatches_per_second == approx(1 / latency)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("send", [0.0, 0.03])
def test_equal_stages_reach_one_stage_rate(k: int, send: float) -> None:
    f, b = 0.1, 0.2
    stages = [S(f, b, send)] * k
    nm = 2 * k + 2  # enough to cover the round trip with its sends
    assert rate_between(stages, nm, 200, 400) == approx(f + b, rel=1e-6)
    r = simulate([stages], nm=nm, D=0, steps=1000)
    assert r.minibatches_per_second <= 1 / (f + b) * (1 + 1e-9)
    assert r.minibatches_per_second == pytest.approx(1 / (f + b), rel=0.02)
    # Nm = k suffices without send latency: the round trip is k * (f + b).
    if send == 0.0:
        assert rate_between(stages, k, 200, 400) == approx(f + b, rel=1e-6)
        # ... and fewer in flight than that cannot fill it: at most nm per round trip.
        short = simulate([stages], nm=k - 1, D=0, steps=400).minibatches_per_second
        assert short <= (k - 1) / (k * (f + b)) * (1 + 1e-9)
        assert rate_between(stages, k - 1, 200, 400) == pytest.approx(k * (f + b) / (k - 1), rel=0.01)


def test_bottleneck_stage_bounds_throughput() -> None:
    stages = [S(0.1, 0.2, 0.01), S(0.3, 0.25, 0.02), S(0.05, 0.1)]
    bottleneck = max(s.forward_seconds + s.backward_seconds for s in stages)
    for nm in range(1, 10):
        r = simulate([stages], nm=nm, D=0, steps=300)
        assert r.minibatches_per_second <= 1 / bottleneck * (1 + 1e-9)
    assert rate_between(stages, 8, 150, 300) == approx(bottleneck, rel=1e-6)
    slower = [stages[0], S(0.6, 0.5, 0.02), stages[2]]
    assert rate_between(slower, 8, 150, 300) == approx(1.1, rel=1e-6)


@pytest.mark.parametrize("stages", [
    [S(0.1, 0.2)] * 3,
    [S(0.1, 0.2, 0.03)] * 4,
    [S(0.3, 0.1, 0.01)] * 4,
])
def test_throughput_does_not_fall_with_nm(stages: list[SimStage]) -> None:
    rates = [simulate([stages], nm=nm, D=0, steps=240).minibatches_per_second for nm in range(1, 13)]
    for a, b in zip(rates, rates[1:]):
        assert b >= a * (1 - 1e-12)
    assert rates[-1] > 2.5 * rates[0]


def test_final_partial_wave_completes_and_is_pushed() -> None:
    # One VW: 10 minibatches with nm=4 (waves of 4, 4, 2) all run.
    r = simulate([[S(0.1, 0.2, 0.01)] * 3], nm=4, D=0, steps=10, trace=True)
    assert r.trace is not None
    trace_rules.check_complete(r.trace, vws=1, stages=3, steps=10)
    assert max(row["wave"] for row in r.trace) == 2
    # Two VWs, no waiting (D large): each finishes when its last push, that of the partial wave
    # 2 at 10 * (f+b), is acknowledged. Without it the end would be 8 * (f+b) + push.
    r = simulate([[S(0.25, 0.5)], [S(0.25, 0.5)]], nm=4, D=1000, steps=10, push_seconds=1.0)
    assert r.makespan_seconds == approx(10 * 0.75 + 1.0)
    # Two VWs with D=0 do not deadlock on the partial wave either.
    r = simulate([[S(0.1, 0.2)] * 2, [S(0.2, 0.4)] * 2], nm=4, D=0, steps=10, push_seconds=0.05, pull_seconds=0.05)
    assert r.makespan_seconds > 10 * 0.6


def test_one_vw_never_waits_on_shards() -> None:
    """One VW runs without shards (LocalSync), so push and pull latencies cost nothing."""
    stages = [S(0.1, 0.2, 0.01)] * 3
    a = simulate([stages], nm=3, D=0, steps=50)
    b = simulate([stages], nm=3, D=0, steps=50, push_seconds=5.0, pull_seconds=5.0)
    assert a == b
    assert b.wait_seconds == [0.0]


# ---- WSP across VWs -------------------------------------------------------------------------------


def test_two_vws_d0_nm1_exact() -> None:
    """Fast (1 s/minibatch) and slow (2 s), one stage, nm=1, D=0: the forward of p needs both
    VWs' wave p-2, so fast runs p at 2(p-1), waiting 1 s before each p >= 2."""
    steps = 10
    r = simulate([[S(0.5, 0.5)], [S(1.0, 1.0)]], nm=1, D=0, steps=steps)
    assert r.makespan_seconds == approx(2 * steps)
    assert r.per_vw_minibatches_per_second == [approx(steps / (2 * steps - 1)), approx(0.5)]
    assert r.wait_seconds == [approx(steps - 1), approx(0.0)]
    assert r.minibatches_per_second == approx(2 * steps / (2 * steps))
    # A pull costs 0.1 s, and every VW needs one per minibatch: slow runs p at 2.1(p-1),
    # fast right after it: it waits 1.1 s, slow 0.1 s, before each p >= 2.
    r = simulate([[S(0.5, 0.5)], [S(1.0, 1.0)]], nm=1, D=0, steps=steps, pull_seconds=0.1)
    assert r.makespan_seconds == approx(2.0 + 2.1 * (steps - 1))
    assert r.wait_seconds == [approx(1.1 * (steps - 1)), approx(0.1 * (steps - 1))]
    assert r.per_vw_minibatches_per_second[0] == approx(steps / (2.1 * (steps - 1) + 1.0))


def test_fast_vw_is_held_to_the_slow_one_with_d0() -> None:
    fast, slow = [S(0.1, 0.2, 0.01)] * 2, [S(0.2, 0.4, 0.01)] * 2
    nm, steps = 2, 200
    alone = simulate([fast], nm=nm, D=0, steps=steps).minibatches_per_second
    r = simulate([fast, slow], nm=nm, D=0, steps=steps, trace=True)
    fast_rate, slow_rate = r.per_vw_minibatches_per_second
    assert alone > 1.8 * slow_rate
    # Fast ends at most D+1 waves ahead of slow: it cannot finish before slow finished wave W-D-2.
    waves = math.ceil(steps / nm)
    assert fast_rate <= slow_rate * steps / ((waves - 1) * nm) * (1 + 1e-9)
    assert r.wait_seconds[0] > 0.3 * steps * 0.3   # it idles a good part of the time
    assert r.wait_seconds[1] == approx(0.0)
    assert r.trace is not None
    check_clock_distance(r.trace, nm=nm, D=0, steps=steps)


def test_large_d_lets_vws_run_independently() -> None:
    fast, slow = [S(0.1, 0.2, 0.01)] * 3, [S(0.2, 0.4, 0.01)] * 3
    r = simulate([fast, slow], nm=3, D=1000, steps=100)
    for vw, stages in enumerate((fast, slow)):
        alone = simulate([stages], nm=3, D=0, steps=100)
        assert r.per_vw_minibatches_per_second[vw] == approx(alone.minibatches_per_second)
    assert r.wait_seconds == [0.0, 0.0]
    assert r.makespan_seconds == approx(simulate([slow], nm=3, D=0, steps=100).makespan_seconds)


def test_larger_d_never_slows_the_fast_vw() -> None:
    fast, slow = [S(0.1, 0.2, 0.01)] * 2, [S(0.15, 0.3, 0.01)] * 2
    rates = [simulate([fast, slow], nm=2, D=D, steps=120, push_seconds=0.02, pull_seconds=0.02)
             .per_vw_minibatches_per_second[0] for D in range(0, 8)]
    for a, b in zip(rates, rates[1:]):
        assert b >= a * (1 - 1e-12)
    assert rates[-1] > 1.1 * rates[0]


def test_vws_with_different_k_finish() -> None:
    r = simulate([[S(0.1, 0.2)] * 2, [S(0.05, 0.1)] * 4, [S(0.3, 0.6)]], nm=2, D=0, steps=30,
                 push_seconds=0.01, pull_seconds=0.01, trace=True)
    assert r.trace is not None and len(r.trace) == 30 * (2 + 4 + 1)
    assert r.minibatches_per_second == approx(3 * 30 / r.makespan_seconds)


def test_sixteen_vws_by_four_stages_is_fast() -> None:
    vws = [[S(0.01 * (1 + v % 3), 0.02 * (1 + v % 3), 0.001)] * 4 for v in range(16)]
    started = time.process_time()
    r = simulate(vws, nm=4, D=1, steps=200, push_seconds=0.005, pull_seconds=0.005)
    assert time.process_time() - started < 1.0
    assert r.minibatches_per_second > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(vws=[], nm=1, D=0, steps=1), "at least one virtual worker"),
    (dict(vws=[[]], nm=1, D=0, steps=1), "at least one stage"),
    (dict(vws=[[S(-1.0, 0.1)]], nm=1, D=0, steps=1), r"vws\[0\]\[0\].forward_seconds"),
    (dict(vws=[[S(0.1, 0.1, math.nan)]], nm=1, D=0, steps=1), "send_seconds"),
    (dict(vws=[[S(0.1, 0.1)]], nm=0, D=0, steps=1), "nm"),
    (dict(vws=[[S(0.1, 0.1)]], nm=1, D=-1, steps=1), "D"),
    (dict(vws=[[S(0.1, 0.1)]], nm=1, D=0, steps=-1), "steps"),
    (dict(vws=[[S(0.1, 0.1)]], nm=1, D=0, steps=1, pull_seconds=-1.0), "pull_seconds"),
])
def test_bad_input_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate(**kwargs)


def test_zero_steps() -> None:
    r = simulate([[S(0.1, 0.1)], [S(0.1, 0.1)]], nm=2, D=0, steps=0)
    assert r == SimResult(0.0, [0.0, 0.0], [0.0, 0.0], 0.0)


# ---- the schedule replayed through the runtime's StageSchedule -------------------------------------


def replay_through_stage_schedule(rows: list[dict], stages: list[SimStage], nm: int, steps: int) -> None:
    """Feeds each stage's arrivals and task ends, in time order, to the runtime's StageSchedule:
    every task the simulator started must be the one StageSchedule picks at that moment, and
    the stage never idles while StageSchedule has a task ready."""
    k = len(stages)
    at = {(r["stage"], r["p"]): r for r in rows}
    for q in range(k):
        sched = StageSchedule(stage=q, num_stages=k, nm=nm, steps=steps)
        events: list[tuple[float, int, str, int]] = []   # (time, order, what, p): end < arrive < start
        if q > 0:
            free = 0.0
            for p in range(1, steps + 1):  # the previous stage's one ordered sender
                free = max(free, at[(q - 1, p)]["fwd_end"]) + stages[q - 1].send_seconds
                events.append((free, 1, "arrive_f", p))
        if q < k - 1:
            free = 0.0
            for p in range(1, steps + 1):
                free = max(free, at[(q + 1, p)]["bwd_end"]) + stages[q].send_seconds
                events.append((free, 1, "arrive_b", p))
        for p in range(1, steps + 1):
            r = at[(q, p)]
            if q == k - 1:
                events += [(r["fwd_start"], 2, "start_fb", p), (r["bwd_end"], 0, "end_fb", p)]
            else:
                events += [(r["fwd_start"], 2, "start_f", p), (r["fwd_end"], 0, "end_f", p),
                           (r["bwd_start"], 2, "start_b", p), (r["bwd_end"], 0, "end_b", p)]
        events.sort()
        kinds = {"f": TaskKind.FORWARD, "b": TaskKind.BACKWARD, "fb": TaskKind.FORWARD_BACKWARD}
        running = None
        for i, (t, _, what, p) in enumerate(events):
            if what == "arrive_f":
                sched.accept_forward(p)
            elif what == "arrive_b":
                sched.accept_backward(p)
            elif what.startswith("start"):
                task = Task(kinds[what[6:]], p)
                assert running is None, f"stage {q}: {task} started while {running} ran"
                assert sched.next_task() == task, f"stage {q} at {t}: simulator ran {task}, runtime picks {sched.next_task()}"
                running = task
            else:
                assert running == Task(kinds[what[4:]], p)
                sched.complete(running)
                running = None
            last_at_t = i + 1 == len(events) or events[i + 1][0] > t
            if last_at_t and running is None:
                assert sched.next_task() is None, f"stage {q} idles at {t} with {sched.next_task()} ready"
        assert sched.done


def test_schedule_matches_the_runtime_stage_schedule() -> None:
    rng = random.Random(7)
    for _ in range(150):
        k, nm, steps = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 14)
        stages = [S(rng.uniform(0.01, 1), rng.uniform(0.01, 1), rng.choice([0.0, rng.uniform(0, 0.5)]))
                  for _ in range(k)]
        r = simulate([stages], nm=nm, D=0, steps=steps, trace=True)
        assert r.trace is not None
        replay_through_stage_schedule(r.trace, stages, nm, steps)


# ---- property: the simulated trace keeps DESIGN §3 -------------------------------------------------


def wave_ends(rows: list[dict], nm: int, steps: int) -> dict[tuple[int, int], list[float]]:
    """(vw, stage) -> the time each wave ended there (the backward of its last minibatch)."""
    at = {(r["vw"], r["stage"], r["p"]): r for r in rows}
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (v, q, p), r in sorted(at.items()):
        if p % nm == 0 or p == steps:
            out[(v, q)].append(r["bwd_end"])
    return out


def check_g2_times(rows: list[dict], *, nm: int, D: int, steps: int, push: float, pull: float) -> None:
    """No forward of p starts before every VW's wave floor(p/nm)-2-D has been pushed at that
    stage and a pull has brought it back: bwd_end of the wave's last minibatch + push + pull."""
    ends = wave_ends(rows, nm, steps)
    vws = sorted({r["vw"] for r in rows})
    for r in rows:
        c = r["p"] // nm - 2 - D
        if c < 0:
            continue
        ready = max(ends[(u, r["stage"])][c] for u in vws) + push + pull
        assert r["fwd_start"] >= ready - 1e-9, (
            f"G2 violated at vw {r['vw']} stage {r['stage']} p {r['p']}: forward at {r['fwd_start']}, "
            f"but wave {c} of every VW is only back at {ready}"
        )


def check_clock_distance(rows: list[dict], *, nm: int, D: int, steps: int) -> None:
    """G4: when a VW finishes a full wave c at a stage, every other VW has finished wave c-D-1 there.

    Not the final partial wave: its last minibatch p < (c+1)*nm has floor(p/nm) = c, so G2
    only asks for wave c-D-2 of the others, and the distance can reach D+2 at the very end.
    """
    ends = wave_ends(rows, nm, steps)
    for (v, q), mine in ends.items():
        for (u, q2), theirs in ends.items():
            if q2 != q or u == v:
                continue
            for c, t in enumerate(mine):
                if c - D - 1 >= 0 and (c + 1) * nm <= steps:
                    assert theirs[c - D - 1] <= t + 1e-9, (
                        f"G4 violated: vw {v} finished wave {c} at stage {q} at {t} before vw {u} finished "
                        f"wave {c - D - 1} ({theirs[c - D - 1]})"
                    )


times = st.floats(min_value=0.01, max_value=1.0, allow_nan=False, allow_infinity=False)
sends = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=0.5))


@st.composite
def configs(draw: st.DrawFn) -> dict:
    n, k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    vws = [[S(draw(times), draw(times), draw(sends)) for _ in range(k)] for _ in range(n)]
    return dict(vws=vws, nm=draw(st.integers(1, 4)), D=draw(st.integers(0, 2)), steps=draw(st.integers(1, 12)),
                push_seconds=draw(sends), pull_seconds=draw(sends))


@settings(max_examples=100, deadline=None)
@given(configs())
def test_simulated_trace_keeps_the_rules(cfg: dict) -> None:
    r = simulate(**cfg, trace=True)
    rows, nm, D, steps = r.trace, cfg["nm"], cfg["D"], cfg["steps"]
    n, k = len(cfg["vws"]), len(cfg["vws"][0])
    assert rows is not None
    trace_rules.check_complete(rows, vws=n, stages=k, steps=steps)
    trace_rules.check_local_rules(rows, nm)        # L1, L2/L3 versions, L4 order, causality, one task at a time
    trace_rules.check_min_clock(rows, nm, D)       # G2 as the runtime's trace records it
    for row in rows:  # the last stage runs F+B as one task
        if row["stage"] == k - 1:
            assert row["bwd_start"] == row["fwd_end"]
    for row in rows:  # durations are the stage's own
        s = cfg["vws"][row["vw"]][row["stage"]]
        assert row["fwd_end"] - row["fwd_start"] == approx(s.forward_seconds)
        assert row["bwd_end"] - row["bwd_start"] == approx(s.backward_seconds)
    if n > 1:
        check_g2_times(rows, nm=nm, D=D, steps=steps, push=cfg["push_seconds"], pull=cfg["pull_seconds"])
        check_clock_distance(rows, nm=nm, D=D, steps=steps)
    else:
        assert r.wait_seconds == [0.0]
    # The results agree with the trace.
    last_end = max(row["bwd_end"] for row in rows)
    assert r.makespan_seconds >= last_end - 1e-9
    assert r.makespan_seconds <= last_end + (cfg["push_seconds"] * math.ceil(steps / nm) if n > 1 else 0) + 1e-9
    assert r.minibatches_per_second == approx(n * steps / r.makespan_seconds)
    assert all(w >= 0 for w in r.wait_seconds)
    for v in range(n):
        vw_end = max(row["bwd_end"] for row in rows if row["vw"] == v)
        assert steps / r.per_vw_minibatches_per_second[v] >= vw_end - 1e-9


def test_the_stages_whose_keys_meet_are_those_whose_shares_of_the_model_overlap() -> None:
    """overlapping()'s closed form (one range per VW shape, where the simulator scanned every
    stage for every stage: O(S^2), 21 s at 1024 VWs x 16 stages) against the overlap itself, for
    every pair of VW sizes up to 40 stages."""
    for k in range(1, 41):
        for ku in range(1, 41):
            for q in range(k):
                meets = [j for j in range(ku) if q * ku < (j + 1) * k and j * k < (q + 1) * ku]
                assert list(overlapping(q, k, ku)) == meets, (q, k, ku)
