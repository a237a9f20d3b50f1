"""coordinator/partition.py against a brute-force oracle over every contiguous split."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.partition import partition


def all_splits(n: int, k: int) -> list[list[tuple[int, int]]]:
    """Every way to cut n layers into k non-empty contiguous ranges [b, e)."""
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        out.append(list(itertools.pairwise(bounds)))
    return out


def bottleneck(costs: Sequence[float], ranges: Sequence[tuple[int, int]]) -> float:
    return max(math.fsum(costs[b:e]) for b, e in ranges)


def assert_valid(ranges: list[tuple[int, int]], n: int, k: int) -> None:
    assert len(ranges) == k
    assert ranges[0][0] == 0 and ranges[-1][1] == n, "the ranges cover every layer"
    for b, e in ranges:
        assert b < e, f"empty stage {b, e}"
    for (_, e), (b, _) in itertools.pairwise(ranges):
        assert e == b, "contiguous, no gaps or overlaps"


costs_strategy = st.one_of(
    st.lists(st.integers(0, 20).map(float), min_size=1, max_size=8),
    st.lists(st.floats(0.0, 100.0, allow_nan=False, allow_infinity=False), min_size=1, max_size=8),
)


@settings(max_examples=400, deadline=None)
@given(costs=costs_strategy, data=st.data())
def test_matches_brute_force(costs: list[float], data: st.DataObject) -> None:
    n = len(costs)
    k = data.draw(st.integers(1, n), label="k")
    ranges = partition(costs, k)
    assert_valid(ranges, n, k)
    optimum = min(bottleneck(costs, split) for split in all_splits(n, k))
    assert math.isclose(bottleneck(costs, ranges), optimum, rel_tol=1e-9, abs_tol=1e-12), (ranges, optimum)
    assert partition(costs, k) == ranges, "deterministic"


def test_exhaustive_small_integer_instances() -> None:
    # Every cost vector over {0,1,3} up to 5 layers, every k: exact equality, no float slack.
    for n in range(1, 6):
        for costs in itertools.product((0.0, 1.0, 3.0), repeat=n):
            for k in range(1, n + 1):
                ranges = partition(costs, k)
                assert_valid(ranges, n, k)
                assert bottleneck(costs, ranges) == min(bottleneck(costs, s) for s in all_splits(n, k))


def test_known_answers() -> None:
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert partition([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert partition([7.0], 1) == [(0, 1)]
    # A heavy last layer gets a stage of its own.
    assert bottleneck([1, 1, 1, 1, 10], partition([1, 1, 1, 1, 10], 2)) == 10


@pytest.mark.parametrize(("n", "k"), [(3, 4), (0, 1), (2, 0), (2, -1), (0, 0)])
def test_rejects_impossible_stage_counts(n: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"{n} layers into {k}"):
        partition([1.0] * n, k)
