"""The fp16 loss-scale rules (hetpipe/loss_scale.py) on exact values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import math

import torch

from hetpipe.loss_scale import INITIAL_SCALE, MIN_SCALE, Diverged, LossScale, Verdicts, clip_coefficient


def decided(skipped: set[int], through: int) -> Verdicts:
    v = Verdicts()
    for p in range(1, through + 1):
        v.decide(p, p in skipped)
    return v


def test_the_scale_halves_on_a_skip_and_doubles_after_a_streak() -> None:
    scale = LossScale(growth_interval=3)
    v = decided({2}, through=8)
    # p sees the verdicts <= p - nm (nm 2): S_3 knows 1, S_4 knows the skip of 2.
    got = [scale.for_minibatch(p, 2, v) for p in range(1, 11)]
    half = INITIAL_SCALE / 2
    # 3, 4, 5 good after the skip: doubled from S_7 on (it knows 5); 6, 7, 8: again from S_10
    assert got == [INITIAL_SCALE, INITIAL_SCALE, INITIAL_SCALE, half, half, half, INITIAL_SCALE, INITIAL_SCALE,
                   INITIAL_SCALE, 2 * INITIAL_SCALE]


def test_the_minibatches_in_flight_behind_an_overflow_halve_the_scale_once() -> None:
    """nm 4: 5, 6, 7 and 8 ran at S before the skip of 5 was known, and all overflowed; the scale
    halves once for them (S_9 knows 5). 9 ran at S / 2 and overflowed too: that halves it again (S_13)."""
    scale = LossScale()
    v = decided({5, 6, 7, 8, 9}, through=12)
    got = [scale.for_minibatch(p, 4, v) for p in range(1, 15)]
    assert got == [INITIAL_SCALE] * 8 + [INITIAL_SCALE / 2] * 4 + [INITIAL_SCALE / 4] * 2


def test_the_scale_never_drops_below_one() -> None:
    scale = LossScale(scale=2.0)
    v = decided({1, 2, 3}, through=3)
    assert scale.for_minibatch(4, 1, v) == MIN_SCALE


def test_an_overflow_at_the_smallest_scale_is_divergence() -> None:
    """Skipped at scale 2, the scale halves to 1; skipped again at 1, nothing is left to halve."""
    scale, v = LossScale(scale=2.0), decided(set(), through=0)
    assert scale.for_minibatch(1, 1, v) == 2.0
    v.decide(1, True)
    assert scale.for_minibatch(2, 1, v) == MIN_SCALE
    v.decide(2, False)
    assert scale.for_minibatch(3, 1, v) == MIN_SCALE   # a good step at the smallest scale is no divergence
    v.decide(3, True)
    with pytest.raises(Diverged, match="training diverged: minibatch 3 overflowed in fp16 at the smallest loss scale"):
        scale.for_minibatch(4, 1, v)


def test_a_scale_needs_the_verdicts_up_to_p_minus_nm() -> None:
    with pytest.raises(ValueError, match="minibatch 5: verdicts through 2, need 3"):
        LossScale().for_minibatch(5, 2, decided(set(), through=2))


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(1, 40)), st.integers(1, 4), st.lists(st.integers(0, 40), min_size=1, max_size=40))
def test_the_scale_does_not_depend_on_when_the_verdicts_arrived(skipped: set[int], nm: int, extra: list[int]) -> None:
    """A stage that knows more verdicts than p - nm computes the same S_p as one that knows just those,
    and finds the run diverged at the same minibatch (a skip of one that ran at the smallest scale)."""
    steps = 40
    exact, eager = LossScale(growth_interval=4), LossScale(growth_interval=4)
    full = decided(skipped, steps)

    def scale_of(scale: LossScale, p: int, verdicts: Verdicts) -> float | str:
        try:
            return scale.for_minibatch(p, nm, verdicts)
        except Diverged as exc:
            return str(exc)

    for p in range(1, steps + 1):
        known = decided(skipped & set(range(1, p - nm + 1)), max(0, p - nm))
        more = decided(skipped & set(range(1, steps + 1)), min(steps, max(0, p - nm) + extra[p % len(extra)]))
        got = scale_of(exact, p, known)
        assert got == scale_of(eager, p, more)
        if isinstance(got, str):
            break
    assert full.through == steps


def test_verdicts_are_decided_in_order_and_relayed_once() -> None:
    stage0, stage1 = Verdicts(), Verdicts()
    stage0.decide(1, False)
    stage0.decide(2, True)
    with pytest.raises(ValueError, match="verdict for minibatch 4 after 2"):
        stage0.decide(4, False)
    through, skipped, clipped = stage0.news()
    assert (through, skipped, clipped) == (2, [2], {}) and stage0.news() == (2, [], {})
    stage1.check(through, skipped, steps=10)
    stage1.learn(through, skipped)
    assert [stage1.stepped(p) for p in (1, 2, 3)] == [True, False, None]
    stage0.decide(3, True)
    assert stage0.news() == (3, [3], {}), "only what the next stage was not told yet"


def test_news_told_while_a_verdict_arrives_loses_no_skip() -> None:
    """A middle stage's compute thread builds its news while a gRPC thread learns more: a skip
    that arrives meanwhile is either in this news or in the next, never in neither (the next
    stage would step a minibatch stage 0 skipped)."""
    armed = arrived = False

    class Racing(Verdicts):
        def __getattribute__(self, name: str) -> object:
            nonlocal arrived
            if name == "through" and armed and not arrived:
                arrived = True
                Verdicts.learn(self, 6, [5])   # lands while news reads
            return object.__getattribute__(self, name)

    middle = Racing()
    middle.learn(4, [])
    assert middle.news() == (4, [], {})
    armed = True
    told = [middle.news(), middle.news()]
    assert arrived and told[-1][0] == 6
    assert sorted(p for _, skipped, _ in told for p in skipped) == [5]


@pytest.mark.parametrize(("through", "skipped", "message"), [
    (11, [], "verdicts through minibatch 11, but the run has 10"),
    (5, [6], r"skipped minibatches \[6\] outside \(2, 5\]"),
    (5, [2], r"skipped minibatches \[2\] outside \(2, 5\]"),
])
def test_news_no_stage_0_could_send_is_refused(through: int, skipped: list[int], message: str) -> None:
    v = decided({1}, through=2)
    with pytest.raises(ValueError, match=message):
        v.check(through, skipped, steps=10)
    assert (v.through, v.skipped) == (2, {1}), "a refused message changes nothing"


def test_coefficients_travel_once_and_are_forgotten_once_committed_and_told() -> None:
    stage0, middle, last = Verdicts(), Verdicts(), Verdicts(relays=False)
    stage0.decide(1, False, 0.5)
    stage0.decide(2, True, 0.25)   # a skipped minibatch has no coefficient
    stage0.decide(3, False, 1.0)
    assert stage0.take(1) == 0.5 and stage0.take(2) == 1.0 and stage0.take(3) == 1.0
    news = stage0.news()
    assert news == (3, [2], {1: 0.5}) and stage0.news() == (3, [], {})
    assert not stage0.clipped, "committed and told: forgotten"
    middle.check(*news[:2], steps=10, clipped=news[2])
    middle.learn(*news)
    assert middle.news() == news, "told on before this stage committed it"
    assert middle.clipped == {1: 0.5}, "kept until committed here"
    assert middle.take(1) == 0.5 and not middle.clipped
    last.learn(*news)
    assert last.take(1) == 0.5 and not last.clipped, "the last stage tells no one: forgotten once committed"


@pytest.mark.parametrize(("clipped", "skipped", "message"), [
    ({3: 0.5}, [], r"clipped minibatches \[3\] outside \(0, 2\]"),
    ({1: 1.0}, [], r"clip coefficients \[1\.0\]: expected each in \(0, 1\)"),
    ({1: -0.5}, [], r"clip coefficients \[-0\.5\]"),
    ({1: math.inf}, [], r"clip coefficients \[inf\]"),
    ({1: 0.5}, [1], r"minibatches \[1\] both skipped and clipped"),
])
def test_coefficients_no_stage_0_could_send_are_refused(clipped: dict[int, float], skipped: list[int],
                                                       message: str) -> None:
    v = Verdicts()
    with pytest.raises(ValueError, match=message):
        v.check(2, skipped, steps=10, clipped=clipped)
    assert (v.through, v.clipped) == (0, {})


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=20), st.floats(1e-3, 10.0),
       st.sampled_from([1.0, 1024.0]))
@settings(max_examples=60, deadline=None)
def test_the_coefficient_is_clip_grad_norm_s(values: list[float], max_norm: float, scale: float) -> None:
    grads = [torch.tensor(values[: len(values) // 2 + 1], dtype=torch.float64),
             torch.tensor(values[len(values) // 2 + 1:] or [0.0], dtype=torch.float64)]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm_sq = sum(float(g.square().sum()) for g in grads) * scale ** 2   # as the stages sum them, scaled
    c = clip_coefficient(norm_sq, max_norm, scale)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * c, p.grad, rtol=1e-12, atol=1e-300)


def test_a_norm_that_is_not_finite_is_not_clipped() -> None:
    assert clip_coefficient(math.inf, 1.0) == 1.0 and clip_coefficient(math.nan, 1.0) == 1.0


@given(st.sets(st.integers(1, 60), max_size=12), st.integers(1, 4), st.integers(1, 14))
@settings(max_examples=150, deadline=None)
def test_a_scale_restored_at_a_cut_goes_on_as_without_it(skipped: set[int], nm: int, cut_wave: int) -> None:
    """The last stage's scales for minibatches 1..60, uninterrupted and with a checkpoint at the
    end of wave cut_wave (state() saved, restored() into a fresh stage that knows the verdicts
    through the cut and none before): the same scales, and Diverged at the same minibatch."""
    steps, cut = 60, cut_wave * nm

    def scales(resume_at: int | None) -> list[float | str]:
        scale, verdicts, out = LossScale(scale=4.0, growth_interval=5), Verdicts(), []   # 3 skips reach 1
        for p in range(1, steps + 1):
            if resume_at is not None and p == resume_at + 1:
                scale, known = LossScale.restored(scale.state(verdicts))
                scale.growth_interval = 5
                verdicts = Verdicts(through=resume_at, skipped=known)
            try:
                out.append(scale.for_minibatch(p, nm, verdicts))
            except Diverged:
                return [*out, "diverged"]
            verdicts.decide(p, p in skipped)
        return out

    assert scales(cut) == scales(None)
