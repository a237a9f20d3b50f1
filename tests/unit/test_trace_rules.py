"""The trace checkers themselves (tests/trace_rules.py): each catches the break it names."""

from __future__ import annotations

import pytest

from tests.trace_rules import Row, check_min_clock_at_shards

NM, D, VWS = 2, 0, 2


def _trace() -> tuple[list[Row], list[Row]]:
    """Two VWs, two shards, nm 2, D 0: wave w's pushes (clock w) applied at 10w + 5 (+ 1 at
    shard 1); the forward of p at 10 * (p // nm) + 7, just after the pushes its G2 needs."""
    rows = [{"vw": v, "stage": 0, "p": p, "fwd_start": 10.0 * (p // NM) + 7.0} for v in range(VWS) for p in range(1, 9)]
    shard_rows: list[Row] = []
    for w in range(4):
        for v in range(VWS):
            shard_rows.append({"shard": 0, "event": "push", "vw": v, "clock": w, "start": 10.0 * w + 4,
                               "end": 10.0 * w + 5, "duplicate": False})
            shard_rows.append({"shard": 1, "event": "push", "vw": v, "clock": w, "start": 10.0 * w + 4,
                               "end": 10.0 * w + 5, "added": 10.0 * w + 6, "duplicate": False})
            shard_rows.append({"shard": 1, "event": "pull", "vw": v, "clock": w, "start": 10.0 * w + 6,
                               "end": 10.0 * w + 6})
    return rows, shard_rows


def test_a_trace_that_keeps_g2_passes() -> None:
    rows, shard_rows = _trace()
    check_min_clock_at_shards(rows, shard_rows, NM, D, VWS)
    shard_rows.append(dict(shard_rows[0], end=99.0, duplicate=True))   # a retry's duplicate adds nothing
    check_min_clock_at_shards(rows, shard_rows, NM, D, VWS)


def test_a_forward_before_the_pushes_it_needs_is_caught_whatever_min_clock_it_reports() -> None:
    """p 6 needs c_global 2: both VWs' pushes of clock 1, applied by 16 (shard 1's sums added then);
    its forward at 37 would not wait for a push applied at 40."""
    rows, shard_rows = _trace()
    late = next(e for e in shard_rows if (e["shard"], e["vw"], e["clock"]) == (1, 1, 1) and e["event"] == "push")
    late["added"] = 40.0
    with pytest.raises(AssertionError, match=r"G2 at the shards, vw 0 stage 0 minibatch 6: its forward started at "
                                             r"37\.000000, before vw 1's push of clock 1 was applied at 40\.000000"):
        check_min_clock_at_shards(rows, shard_rows, NM, D, VWS)
    check_min_clock_at_shards(rows, shard_rows, NM, D + 1, VWS)   # one more wave of slack: p 6 needs clock 0 only, p 8 at 47 clock 1


def test_a_push_the_shards_never_applied_is_caught() -> None:
    rows, shard_rows = _trace()
    shard_rows.remove(next(e for e in shard_rows if (e["shard"], e["vw"], e["clock"]) == (0, 0, 2)))
    with pytest.raises(AssertionError, match=r"G2 at the shards, vw 0 stage 0 minibatch 8: needs c_global 3, but the "
                                             r"shards applied 1 of vw 0's 2 pushes of clock 2"):
        check_min_clock_at_shards(rows, shard_rows, NM, D, VWS)
