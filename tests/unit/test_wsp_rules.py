"""The pure WSP rules of hetpipe/wsp.py against DESIGN §3 (L1, G2, G4) and the paper's s_global."""

from __future__ import annotations

import itertools

import pytest

import torch

from hetpipe.wsp import (
    PullDecision,
    clock_distance,
    closes_wave,
    g2_decision,
    may_inject,
    merge_pulled,
    required_min_clock,
    s_global,
    wave_of,
    waves_included,
)

NMS = range(1, 7)
DS = range(0, 5)


def included_minibatches(min_clock: int, nm: int) -> int:
    """How many leading minibatches of every VW weights pulled at c_global >= min_clock include.

    c_global >= c means every VW pushed waves 0 .. c-1, i.e. minibatches 1 .. c*nm.
    """
    return min_clock * nm


# ---- wave_of ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nm", NMS)
def test_wave_of_boundaries(nm: int) -> None:
    for c in range(6):
        assert wave_of(c * nm + 1, nm) == c, "first minibatch of wave c"
        assert wave_of((c + 1) * nm, nm) == c, "last minibatch of wave c"
        assert wave_of((c + 1) * nm + 1, nm) == c + 1, "one past the wave starts the next"


@pytest.mark.parametrize("nm", NMS)
def test_wave_of_holds_exactly_nm_minibatches(nm: int) -> None:
    waves = [wave_of(p, nm) for p in range(1, 10 * nm + 1)]
    for c in range(10):
        assert waves.count(c) == nm
    assert waves == sorted(waves)


@pytest.mark.parametrize(("p", "nm"), [(0, 1), (-1, 2), (1, 0), (3, -1)])
def test_wave_of_rejects_out_of_range(p: int, nm: int) -> None:
    with pytest.raises(ValueError):
        wave_of(p, nm)


# ---- closes_wave -----------------------------------------------------------------------------


@pytest.mark.parametrize(("nm", "steps"), list(itertools.product(NMS, range(1, 20))))
def test_closes_wave_once_per_wave_including_final_partial(nm: int, steps: int) -> None:
    closing = [p for p in range(1, steps + 1) if closes_wave(p, nm, steps)]
    # One push per wave, ceil(steps / nm) in all, the last at the final minibatch.
    assert len(closing) == -(-steps // nm)
    assert closing[-1] == steps
    assert [wave_of(p, nm) for p in closing] == list(range(len(closing)))
    for p in closing[:-1]:
        assert p % nm == 0, "every wave but the last closes at its nm-th minibatch"
    # Every minibatch belongs to exactly the wave closed at or after it.
    for p in range(1, steps + 1):
        closer = next(q for q in closing if q >= p)
        assert wave_of(closer, nm) == wave_of(p, nm)


def test_closes_wave_examples() -> None:
    assert [p for p in range(1, 11) if closes_wave(p, 4, 10)] == [4, 8, 10]
    assert [p for p in range(1, 9) if closes_wave(p, 4, 8)] == [4, 8]
    assert [p for p in range(1, 4) if closes_wave(p, 1, 3)] == [1, 2, 3]


# ---- may_inject (L1) -------------------------------------------------------------------------


@pytest.mark.parametrize("nm", NMS)
def test_may_inject_exactly_after_p_minus_nm_completed(nm: int) -> None:
    for p in range(1, 8 * nm):
        for completed in range(0, p):
            assert may_inject(p, nm, completed) == (completed >= p - nm), (p, completed)


@pytest.mark.parametrize("nm", NMS)
def test_may_inject_keeps_at_most_nm_in_flight(nm: int) -> None:
    # Injecting greedily in p order with `completed` finished leaves exactly nm in flight.
    for completed in range(0, 20):
        injected = max(p for p in range(1, 100) if may_inject(p, nm, completed))
        assert injected - completed == nm


def test_may_inject_first_wave_needs_nothing() -> None:
    assert all(may_inject(p, 4, 0) for p in range(1, 5))
    assert not may_inject(5, 4, 0)
    assert may_inject(5, 4, 1)


# ---- required_min_clock (G2) ------------------------------------------------------------------


def test_g2_worked_example_d0_nm4() -> None:
    """DESIGN §3 G2: D=0, Nm=4."""
    nm, D = 4, 0
    for p in (1, 2, 3, 4, 5, 6, 7):
        assert required_min_clock(p, nm, D) == 0, f"minibatch {p} does not wait"
    assert required_min_clock(8, nm, D) == 1, "minibatch 8 waits for wave 0 of all VWs"
    assert included_minibatches(1, nm) == 4
    assert required_min_clock(12, nm, D) == 2, "minibatch 12 needs waves 0 and 1"
    assert s_global(nm, D) == 6


def test_s_global_formula() -> None:
    assert s_global(4, 0) == 6
    assert s_global(1, 0) == 0  # Nm=1, D=0 is BSP: each step sees every VW's previous step
    for nm, D in itertools.product(NMS, DS):
        assert s_global(nm, D) == (D + 1) * nm + nm - 2


@pytest.mark.parametrize(("nm", "D"), list(itertools.product(NMS, DS)))
def test_required_min_clock_is_the_weakest_pull_meeting_s_global(nm: int, D: int) -> None:
    """The paper's bound: p's weights include every VW's minibatches <= p - (s_global + 1).

    required_min_clock(p) guarantees that, and one clock less would not: it is the exact
    minimum, so pulls never wait longer than WSP demands.
    """
    s = s_global(nm, D)
    tight = 0
    for p in range(1, 12 * nm + 2 * s + 3):
        c = required_min_clock(p, nm, D)
        must_include = max(0, p - (s + 1))
        assert included_minibatches(c, nm) >= must_include, (p, c)
        if c > 0:
            assert included_minibatches(c - 1, nm) < must_include, f"p={p}: min_clock {c} is stricter than needed"
        tight += included_minibatches(c, nm) == must_include and must_include > 0
        # DESIGN's phrasing: waves <= floor(p/nm) - D - 2 of every VW are included.
        last_wave = p // nm - D - 2
        if last_wave >= 0:
            assert c - 1 >= last_wave
        # Never ahead of the VW itself: no wave at or after p's own is required.
        assert c <= wave_of(p, nm)
    assert tight > 0, "the s_global bound is attained for some p"


@pytest.mark.parametrize(("nm", "D"), list(itertools.product(NMS, DS)))
def test_required_min_clock_steps_by_one_at_wave_ends(nm: int, D: int) -> None:
    clocks = [required_min_clock(p, nm, D) for p in range(1, 15 * nm)]
    for p, (a, b) in enumerate(itertools.pairwise(clocks), start=1):
        # From p to p+1 the requirement rises by at most one wave, and only when p+1 closes a wave.
        assert b - a in (0, 1)
        if b > a:
            assert (p + 1) % nm == 0


@pytest.mark.parametrize(("nm", "D"), list(itertools.product(NMS, DS)))
def test_clock_distance_bounded_by_d_plus_one(nm: int, D: int) -> None:
    """G4: a VW finishes wave c (reaching clock c+1) only after pulling c_global >= c - D."""
    for c in range(12):
        strictest = max(required_min_clock(p, nm, D) for p in range(c * nm + 1, (c + 1) * nm + 1))
        assert (c + 1) - strictest <= D + 1
        if c >= D:
            assert (c + 1) - strictest == D + 1, "no stricter than D requires"


def test_larger_d_never_waits_more() -> None:
    for nm in NMS:
        for p in range(1, 60):
            clocks = [required_min_clock(p, nm, D) for D in range(0, 8)]
            assert clocks == sorted(clocks, reverse=True)
            assert required_min_clock(p, nm, 10**6) == 0, "huge D approaches ASP"


# ---- clock_distance --------------------------------------------------------------------------


def test_clock_distance() -> None:
    assert clock_distance([]) == 0
    assert clock_distance([3]) == 0
    assert clock_distance([3, 5, 4]) == 2
    assert clock_distance(iter([7, 2, 9])) == 7


@pytest.mark.parametrize("nm", range(1, 7))
@pytest.mark.parametrize("D", range(0, 4))
def test_final_partial_wave_asks_what_its_full_wave_would(nm: int, D: int) -> None:
    """G4 at the end of a run: the last minibatch closes its (partial) wave, so its forward must
    wait as the wave's full last minibatch would; the clock distance then stays <= D+1."""
    for steps in range(1, 5 * nm + 1):
        c = wave_of(steps, nm)
        need = required_min_clock(steps, nm, D, steps)
        assert need == max(0, c - D) == required_min_clock((c + 1) * nm, nm, D)
        # finishing wave c puts this VW at clock c+1; the slowest is at >= need
        assert (c + 1) - need <= D + 1
        for p in range(1, steps):
            assert required_min_clock(p, nm, D, steps) == required_min_clock(p, nm, D)


# ---- the G2 decision and the G3 merge (hetpipe/wsp.py) ---------------------------------------------


def test_g2_decision_waits_exactly_when_required_and_prefetches_the_next_wave() -> None:
    # D = 0, nm = 4, weights known to include c_global 0: minibatch 7's forward may run, and the
    # pull that minibatch 8 (the next wave's first) needs goes out now; minibatch 8 itself waits.
    assert g2_decision(7, 4, 0, 100, have=0) == PullDecision(True, 1)
    assert g2_decision(8, 4, 0, 100, have=0) == PullDecision(False, 1)
    # Holding c_global 1, minibatch 8 runs, and the pull for minibatch 12 (c_global 2) goes out.
    assert g2_decision(8, 4, 0, 100, have=1) == PullDecision(True, 2)
    assert g2_decision(8, 4, 0, 100, have=2) == PullDecision(True, None)
    # Nothing to pull for the first waves, and nothing past the end of the run.
    assert g2_decision(1, 4, 0, 100, have=0) == PullDecision(True, None)
    assert g2_decision(100, 4, 0, 100, have=24) == PullDecision(True, None)


@pytest.mark.parametrize(("nm", "D", "steps"), [(1, 0, 9), (2, 1, 13), (4, 0, 30), (3, 2, 31)])
def test_g2_decision_agrees_with_required_min_clock(nm: int, D: int, steps: int) -> None:
    for p in range(1, steps + 1):
        for have in range(0, steps // nm + 2):
            d = g2_decision(p, nm, D, steps, have)
            assert d.allowed == (required_min_clock(p, nm, D, steps) <= have)
            if not d.allowed:
                assert d.pull == required_min_clock(p, nm, D, steps)
            elif d.pull is not None:  # a prefetch asks for more than is held, never for less
                assert d.pull > have


def test_g3_merge_adds_exactly_the_own_waves_the_pull_lacks() -> None:
    # Two parameters; w_global holds this VW's waves < 2 of the first and < 1 of the second.
    pulled = [torch.tensor([10.0]), torch.tensor([20.0])]
    own = {1: [torch.tensor([1.0]), torch.tensor([2.0])], 2: [torch.tensor([100.0]), torch.tensor([200.0])]}
    merged = merge_pulled(pulled, [2, 1], own)
    # First: wave 1 is already in w_global, wave 2 is not. Second: neither is.
    assert [float(m) for m in merged] == [10.0 + 100.0, 20.0 + 2.0 + 200.0]
    assert waves_included([2, 1]) == 1, "only waves below every parameter's own clock can be dropped"
    assert merge_pulled(pulled, [3, 3], own) == pulled


def test_g3_merge_loses_nothing_and_counts_nothing_twice() -> None:
    # Simulate a VW whose local weights are w0 + every own update; w_global holds its waves below
    # own_clock and the other VWs' updates. After the merge the own updates appear exactly once.
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(5, generator=gen, dtype=torch.float64)
    own = {c: [torch.randn(5, generator=gen, dtype=torch.float64)] for c in range(6)}
    others = torch.randn(5, generator=gen, dtype=torch.float64)
    for own_clock in range(7):
        w_global = w0 + others + sum((own[c][0] for c in range(own_clock)), torch.zeros(5, dtype=torch.float64))
        (merged,) = merge_pulled([w_global], [own_clock], own)
        want = w0 + others + sum((u[0] for u in own.values()), torch.zeros(5, dtype=torch.float64))
        torch.testing.assert_close(merged, want, rtol=0, atol=1e-12)
