"""ps_server/headroom.py, pure: the magnitude every push is measured by, the bound it grows, and
when a key is measured again or a sum computed. The shard's refusals built on it are in
test_shard_cases.py (push) and test_sync_modes.py (exchange)."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from ps_server.headroom import Headroom, grow, magnitude

pytestmark = pytest.mark.timeout(120)

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", FLOATS)
def test_magnitude_is_the_largest_absolute_value_and_never_misses_a_nan_or_inf(dtype: torch.dtype) -> None:
    big = torch.full((64,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(big.sum()), "finite values whose sum overflows..."
    assert magnitude(big) == float(big[0]), "...are measured as they are, not refused"
    assert magnitude(-big) == float(big[0]) and magnitude(torch.tensor([-3.0, 2.0], dtype=dtype)) == 3.0
    assert magnitude(torch.empty(0, dtype=dtype)) == 0.0
    for where in (0, 31, 63):
        for bad, expected in ((float("nan"), math.nan), (float("inf"), math.inf), (float("-inf"), math.inf)):
            poisoned = big.clone()
            poisoned[where] = bad
            got = magnitude(poisoned)
            assert (math.isnan(got) if math.isnan(expected) else got == expected), (where, bad, got)
        both = big.clone()
        both[where], both[(where + 1) % 64] = float("inf"), float("nan")
        assert math.isnan(magnitude(both)), "NaN wins over Inf: either is refused, NaN names it better"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(FLOATS), st.integers(0, 2**31), st.floats(-30, 30), st.floats(-30, 30))
def test_the_bound_holds_for_the_sum_as_the_dtype_rounds_it(dtype: torch.dtype, seed: int, w_exp: float,
                                                          u_exp: float) -> None:
    """|fl(w + u)| <= grow(max |w|, max |u|) for every element, in every float dtype: rounding the
    sum up is allowed for."""
    g = torch.Generator().manual_seed(seed)
    # |w|, |u| <= 2**14: within every dtype's range (fp16's largest is 65504); rounding is relative.
    w = (torch.randn(257, generator=g, dtype=torch.float64).clamp(-4, 4) * 2.0 ** min(w_exp, 12)).to(dtype)
    u = (torch.randn(257, generator=g, dtype=torch.float64).clamp(-4, 4) * 2.0 ** min(u_exp, 12)).to(dtype)
    w[0], u[0] = w.abs().max(), u.abs().max()   # the worst case: both largest, one sign, one element
    assert magnitude(w + u) <= grow(magnitude(w), magnitude(u), dtype)


def test_room_measures_a_key_only_where_its_bound_comes_near_the_limit() -> None:
    top = torch.finfo(torch.float32).max
    reached: list[str] = []
    computed: list[str] = []

    def reach(key: str) -> float:
        reached.append(key)
        return values[key]

    def exact(key: str, update: torch.Tensor) -> float:
        computed.append(key)
        return sums[key]

    room = Headroom()
    u = torch.zeros(2)   # only its dtype matters here: room takes the sizes it is given
    values, sums = {"a": 1.0, "b": 0.5 * top}, {"a": 2.0, "b": 0.75 * top}
    grown, over = room.room([("a", u), ("b", u)], {"a": 1.0, "b": 0.25 * top}, reach, exact)
    assert not over and reached == ["a", "b"], "a key with no bound yet is measured"
    assert grown["a"] == grow(1.0, 1.0, torch.float32) and not computed
    room.commit(grown)

    reached.clear()
    grown, over = room.room([("a", u), ("b", u)], {"a": 1.0, "b": 0.25 * top}, reach, exact)
    assert not over and reached == ["b"], "a bound far from the limit is trusted; one near it is measured again"
    assert computed == [], "the fresh measure was enough"

    values["b"] = 0.9 * top
    grown, over = room.room([("b", u)], {"b": 0.25 * top}, reach, exact)
    assert computed == ["b"] and not over and grown["b"] == 0.75 * top, "w + u itself decides last"
    sums["b"] = math.inf
    assert room.room([("b", u)], {"b": 0.25 * top}, reach, exact)[1] == ["b"]
    assert room.room([("b", u)], {"b": 0.25 * top}, reach, None)[1] == ["b"], "quorum: the bound alone"
    assert room.room([("a", u)], {"a": math.nan}, reach, exact)[1] == ["a"], "an Inf delta (elastic) is over"
    assert room.bounds["b"] == grow(0.5 * top, 0.25 * top, torch.float32), "room() changed no bound"
    assert room.room([("i", torch.zeros(2, dtype=torch.int64))], {}, reach, exact) == ({}, []), \
        "integer keys have no headroom to keep"
