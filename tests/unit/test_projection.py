"""Pal et al.'s DP-vs-hybrid projection (coordinator/planner/projection.py): the paper's Inception-V3
figure from its own inputs, the rules of Eq. 3-6 over grids of inputs, and refusals naming the key."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import given, settings

from coordinator.planner.projection import (
    EpochCurve, Inputs, Scaling, hybrid_over_dp, parse_inputs, project, recommend, su_dp, su_hybrid,
)
from hetpipe.config import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "projection-inception-v3.yaml"


def _raw() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return raw


def _inputs(points: dict[int, float], su_m: float = 1.5, m: int = 2, se: float | dict[int, float] = 1.0,
            mini_batch: int = 1) -> Inputs:
    scaling = Scaling(uniform=se) if isinstance(se, float) else Scaling(se=se)
    return Inputs(mini_batch=mini_batch, scaling=scaling, epochs=EpochCurve(points), su_mp={m: su_m})


# --- the paper's figure ---------------------------------------------------------------------------


def test_inception_v3_at_64_gpus_is_the_papers_1_155() -> None:
    # §5: "When moving from 32 GPUs to 64 GPUs ... the hybrid-strategy will outperform DP alone by
    # at least 15.5%". Eq. 6 with SE_N = 1 (§4.3), SU^2 = 1.32 (Table 1, DLPlacer), E_32 = 4 and
    # E_64 = 7 (§5: "from four to seven ... beyond 2048 (i.e., 32 GPUs)"): 1.32/2 * 7/4 = 1.155.
    inputs = parse_inputs(_raw())
    row = recommend(inputs, 32, 2)
    assert f"{row.ratio:.3f}" == "1.155"
    assert row.ratio == pytest.approx(1.32 / 2 * 7 / 4)
    assert row.strategy == "hybrid: 32-way DP x 2-way MP"
    # The manual placement's 21% (§5) would have projected only 5.9% here.
    manual = parse_inputs({**_raw(), "su_mp": {2: 1.21}})
    assert f"{hybrid_over_dp(manual, 32, 2):.3f}" == "1.059"


def test_inception_v3_recommends_dp_up_to_32_gpus_and_the_hybrid_beyond() -> None:
    # §5: "beyond 32 GPUs, a hybrid parallelization strategy performs better than DP-only". The
    # 256-GPU 1.265 only checks consistency: the example's E_128 = 12 was inferred from it.
    rows = {r.devices: r for r in project(parse_inputs(_raw()))}
    assert sorted(rows) == [32, 64, 128, 256]
    assert rows[32].strategy == "DP: 32-way" and rows[32].ratio < 1
    assert all(rows[d].strategy.startswith("hybrid") for d in (64, 128, 256))
    assert f"{rows[256].ratio:.3f}" == "1.265"
    # Eq. 3 at 64 GPUs: 64 * E_1/E_64 = 64 * 4/7; Eq. 5 with N = 32: 1.32 * 32 * 4/4.
    assert rows[64].su_dp == pytest.approx(64 * 4 / 7) and rows[64].su_hybrid == pytest.approx(1.32 * 32)


# --- the rules, over grids of inputs ----------------------------------------------------------------

# Epoch curves over batches 1..256 (mini-batch 1, so the batch is N): flat, rising, rising sharply,
# and one that falls first (GNMT's tuned hyper-parameters, §5).
CURVES = [
    {1: 4, 256: 4},
    {1: 4, 16: 5, 64: 8, 256: 30},
    {1: 2, 8: 2, 32: 9, 128: 40, 256: 200},
    {1: 6, 4: 5, 32: 5.5, 256: 9},
]
DEVICES = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("points", CURVES)
def test_mp_without_speedup_only_matches_dp_at_n(points: dict[int, float]) -> None:
    # SU^M = 1: the hybrid is N-way DP with idle devices, so it equals SU_N exactly and beats
    # M×N-way DP only where adding devices to DP made it slower.
    for n, m, se in itertools.product(DEVICES, (2, 4), (1.0, 0.8)):
        if m * n > 256:
            continue
        inputs = _inputs(points, su_m=1.0, m=m, se=se)
        assert su_hybrid(inputs, n, m) == pytest.approx(su_dp(inputs, n))
        assert (hybrid_over_dp(inputs, n, m) > 1) == (su_dp(inputs, m * n) < su_dp(inputs, n) * (1 - 1e-12))


@pytest.mark.parametrize("points", CURVES)
def test_the_ratio_grows_with_the_mp_speedup_and_matches_eq_6(points: dict[int, float]) -> None:
    for n, m in itertools.product(DEVICES, (2, 4)):
        if m * n > 256:
            continue
        ratios = [hybrid_over_dp(_inputs(points, su_m=su, m=m), n, m) for su in (0.5, 1.0, 1.2, 1.32, 2.0, 3.9)]
        assert all(a < b for a, b in itertools.pairwise(ratios)), (n, m, ratios)
        inputs = _inputs(points, m=m)
        # The ratio is the two speedups' quotient (E_1 cancels) ...
        assert hybrid_over_dp(inputs, n, m) == pytest.approx(su_hybrid(inputs, n, m) / su_dp(inputs, m * n))
        # ... and crosses 1 exactly at Eq. 6's bound SU^M = M * SE_MN/SE_N * E_N/E_MN.
        bound = m * inputs.e(n) / inputs.e(m * n)
        assert hybrid_over_dp(_inputs(points, su_m=bound, m=m), n, m) == pytest.approx(1.0)


def test_without_any_efficiency_loss_the_hybrid_needs_su_mp_above_m() -> None:
    for m, su, n in itertools.product((2, 3, 4), (1.0, 1.32, 1.99, 2.0, 2.01, 3.5, 4.5), (1, 2, 8, 32)):
        row = recommend(_inputs({1: 3, 1024: 3}, su_m=su, m=m), n, m)
        assert row.ratio == pytest.approx(su / m)
        assert row.strategy.startswith("hybrid") == (su > m), (m, su, row)  # a tie goes to DP


def test_lower_scaling_efficiency_at_m_x_n_favours_the_hybrid() -> None:
    for se_mn in (1.0, 0.95, 0.9, 0.7, 0.5):
        inputs = _inputs({1: 4, 256: 4}, su_m=1.32, se={32: 1.0, 64: se_mn})
        assert hybrid_over_dp(inputs, 32, 2) == pytest.approx(1.32 / 2 / se_mn)


def test_a_measured_speedup_is_n_times_the_scaling_efficiency() -> None:
    by_speedup = parse_inputs({**_raw(), "se": None, "speedup": {32: 30.4, 64: 57.6}})
    by_se = parse_inputs({**_raw(), "se": {32: 0.95, 64: 0.9}})
    assert hybrid_over_dp(by_speedup, 32, 2) == pytest.approx(hybrid_over_dp(by_se, 32, 2))
    assert hybrid_over_dp(by_se, 32, 2) == pytest.approx(1.32 / 2 * 0.95 / 0.9 * 7 / 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.floats(0.5, 100)), min_size=2, max_size=8,
                unique_by=lambda p: p[0]), st.data())
def test_epochs_interpolate_linearly_in_log2_of_the_batch(pairs: list[tuple[int, float]], data: st.DataObject) -> None:
    points = {2 ** k: e for k, e in pairs}
    curve = EpochCurve(points)
    for batch, epochs in points.items():
        assert curve.epochs(batch) == epochs
    lo, hi = min(points), max(points)
    batch = data.draw(st.integers(lo, hi))
    below = max(b for b in points if b <= batch)
    above = min(b for b in points if b >= batch)
    value = curve.epochs(batch)
    assert min(points[below], points[above]) - 1e-9 <= value <= max(points[below], points[above]) + 1e-9
    if below < batch < above:
        t = math.log2(batch / below) / math.log2(above / below)
        assert value == pytest.approx(points[below] + t * (points[above] - points[below]))
    for outside in (lo - 1, hi + 1):
        if outside >= 1:
            with pytest.raises(ConfigError, match=rf"epochs: no epoch count for global batch {outside}: .*"
                                                  "does not extrapolate"):
                curve.epochs(outside)


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    ({"su_mp": {2: 0}}, r"su_mp\.2: expected a finite number > 0, got 0"),
    ({"su_mp": {2: -1.32}}, r"su_mp\.2: expected a finite number > 0"),
    ({"su_mp": {1: 1.0}}, r"su_mp\.1: expected an integer >= 2, got 1"),
    ({"su_mp": {"two": 1.32}}, r"su_mp\.two: expected an integer key"),
    ({"se": 1.5}, r"se: expected a number in \(0, 1\]"),
    ({"se": 0}, r"se: expected a number in \(0, 1\]"),
    ({"se": {64: 0}}, r"se\.64: expected a number in \(0, 1\]"),
    ({"se": None, "speedup": {4: 5}}, r"speedup\.4: expected a number in \(0, 4\]"),
    ({"se": {64: 0.9}, "speedup": {64: 57.6}}, r"speedup\.64: N = 64 also has se\.64"),
    ({"se": None}, r"se: missing"),
    ({"epochs": {}}, r"epochs: expected a mapping of global batch -> epochs with at least one point"),
    ({"epochs": {2048: 0}}, r"epochs\.2048: expected a finite number > 0, got 0"),
    ({"epochs": {-64: 4}}, r"epochs\.-64: expected an integer >= 1"),
    ({"epochs": [4, 7]}, r"epochs: expected a mapping with integer keys"),
    ({"mini_batch": 0}, r"mini_batch: expected an integer >= 1, got 0"),
    ({"devices": []}, r"devices: expected a non-empty list"),
    ({"devices": [64, 1]}, r"devices\[1\]: expected an integer >= 2, got 1"),
    ({"su_mp_2": 1.32}, r"su_mp_2: unknown key \(did you mean su_mp\?\); known keys are"),
    ({"model": 3}, r"model: expected a name"),
])
def test_bad_inputs_are_refused_naming_the_key(change: dict[str, Any], message: str) -> None:
    raw = {k: v for k, v in {**_raw(), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        parse_inputs(raw)


@pytest.mark.parametrize("key", ["mini_batch", "devices", "epochs"])
def test_a_missing_key_is_named(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: missing$"):
        parse_inputs({k: v for k, v in _raw().items() if k != key})


def test_what_the_projection_needs_but_lacks_is_named() -> None:
    # Beyond the points (512 GPUs: batch 32768), no E_1 (the points start past one device's
    # batch), no SE for a count, no MP speedup, no count that M divides.
    with pytest.raises(ConfigError, match=r"epochs: no epoch count for global batch 32768 "
                                          r"\(512 devices x mini_batch 64\): the points cover 64\.\.16384"):
        project(parse_inputs({**_raw(), "devices": [512]}))
    no_e1 = {**_raw(), "epochs": {2048: 4, 4096: 7}}
    with pytest.raises(ConfigError, match=r"global batch 64 \(1 device x mini_batch 64\)"):
        project(parse_inputs(no_e1))
    assert f"{hybrid_over_dp(parse_inputs(no_e1), 32, 2):.3f}" == "1.155"  # E_1 cancels in the ratio
    with pytest.raises(ConfigError, match=r"se: no scaling efficiency for N = 64 devices \(give se\.64"):
        project(parse_inputs({**_raw(), "se": {32: 1.0}, "devices": [64]}))
    with pytest.raises(ConfigError, match=r"su_mp: no model-parallel speedup given"):
        project(parse_inputs({k: v for k, v in _raw().items() if k != "su_mp"}))
    with pytest.raises(ConfigError, match=r"su_mp: no model-parallel speedup for M = 4"):
        recommend(parse_inputs(_raw()), 16, 4)
    with pytest.raises(ConfigError, match=r"devices: none of \[63\] is a multiple of an M in su_mp \(2\)"):
        project(parse_inputs({**_raw(), "devices": [63]}))
    assert issubclass(ConfigError, ValueError)
