"""Exact pulls (wsp with D = 0, BSP; ps_server/wave_hold.py) through the shard: a pull gets
every VW's waves below c_global and none later, bit for bit, whenever it arrives; a wave goes
into the values in VW order, whatever the order its pushes arrived in; G4 refuses a push two
waves past c_global; across a restart and an eviction too."""

from __future__ import annotations

import itertools

from pathlib import Path

import pytest
import torch

from ps_server.durability import Durability
from ps_server.shard import Shard
from ps_server.sync_rule import SyncRule
from shard_reference import Kind, assert_refused, log_push

pytestmark = pytest.mark.timeout(120)
EXACT = SyncRule("wsp", exact=True)


@pytest.mark.parametrize("push_dtype", [torch.float32, torch.bfloat16])
def test_an_exact_pull_is_the_same_bit_for_bit_before_and_after_a_faster_vws_next_push(
        push_dtype: torch.dtype) -> None:
    """D = 0 is synchronous SGD whatever the timing: a pull that arrives after a faster VW's next
    push answers exactly what it would have before it. (Taking that push back out of the values,
    (w + u) - u, would differ from w in the last bit of about 2% of the elements.)"""
    g = torch.Generator().manual_seed(7)
    w0 = torch.randn(4096, generator=g)
    u = [(torch.randn(4096, generator=g) * 1e-2).to(push_dtype) for _ in range(3)]

    def pulled(late: bool) -> tuple[torch.Tensor, list[int]]:
        shard = Shard()
        shard.init(2, [("a", w0.clone())], (), EXACT)
        assert shard.push(0, 0, [("a", u[0])]) and shard.push(1, 0, [("a", u[1])])
        if late:
            assert shard.push(1, 1, [("a", u[2])])
            assert torch.equal(shard.values["a"], w0 + u[0].float() + u[1].float()), "wave 1 held"
            assert len(shard.hold.deltas("a")) == 1 and torch.equal(shard.hold.deltas("a")[0], u[2]), "O3: held, once"
        result = shard.pull(0, ["a"])
        return result.values[0][1], result.own_clock

    (early, own_early), (late, own_late) = pulled(False), pulled(True)
    assert torch.equal(early, w0 + u[0].float() + u[1].float())
    assert torch.equal(late, early) and own_early == own_late == [1]


def test_a_wave_goes_in_in_vw_order_whatever_the_order_its_pushes_arrive_in() -> None:
    """D = 0 repeats bit for bit: float addition does not associate, so the values take a wave's
    pushes in VW order, once the last of them has arrived, not in their order of arrival."""
    g = torch.Generator().manual_seed(11)
    w0 = torch.randn(4096, generator=g)
    u = [[torch.randn(4096, generator=g) * 1e-2 for _ in range(3)] for _ in range(2)]   # u[wave][vw]
    results = []
    for order in itertools.permutations(range(3)):
        shard = Shard()
        shard.init(3, [("a", w0.clone())], (), EXACT)
        for wave in range(2):
            for vw in order:
                assert shard.push(vw, wave, [("a", u[wave][vw])])
                done = vw == order[-1]
                assert not shard.hold if done else shard.hold.wave("a") == wave
        results.append(shard.values["a"])
    want = w0
    for wave in range(2):
        for vw in range(3):
            want = want + u[wave][vw]
    assert all(torch.equal(r, want) for r in results)
    arrival = ((w0 + u[0][2]) + u[0][0]) + u[0][1]
    assert not torch.equal(arrival, (w0 + u[0][0] + u[0][1] + u[0][2])), "the orders' sums differ: the test means something"


def test_an_exact_shard_refuses_a_push_two_waves_past_c_global() -> None:
    """G4 at D = 0: a VW runs at most one wave past c_global, which is what lets exact pulls hold
    one wave per key. A push past that is refused and changes nothing; once the slowest VW has
    pushed, it is applied."""
    shard = Shard()
    one = [("a", torch.ones(2, 3, dtype=torch.float64)), ("b", torch.ones(3, dtype=torch.float64))]
    shard.init(2, [(k, torch.zeros_like(v)) for k, v in one], (), EXACT)
    assert shard.push(0, 0, one)
    digest = shard.digest()
    err = assert_refused(Kind.CLOCK, shard.push, 0, 1, one)
    assert "G4 with D = 0 takes wave c only once c_global >= c - D, and c_global is [0] for ['a', 'b']" in str(err)
    assert shard.digest() == digest
    assert shard.push(1, 0, one) and shard.push(0, 1, one)
    assert torch.equal(shard.pull(1, ["a"]).values[0][1], torch.full((2, 3), 2.0, dtype=torch.float64))


def test_exact_pulls_take_out_the_waves_c_global_has_not_reached(tmp_path: Path) -> None:
    """wsp with D = 0 (BSP): a pull gets every VW's waves below c_global and none later, whether it
    arrives before or after a faster VW's next push; G3's own_clock says so. Across a restart and
    an eviction too. Without exact, WSP's lower bound lets the later wave in."""
    def full(value: float, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.float64)

    def pushes(shard: Shard) -> None:
        for vw, wave, value in [(0, 0, 1.0), (1, 0, 2.0), (1, 1, 10.0)]:
            assert shard.push(vw, wave, [("a", full(value)), ("b", full(value, (3,)))])

    exact, loose = Shard(), Shard()
    for shard, rule in ((exact, SyncRule("wsp", exact=True)), (loose, SyncRule())):
        assert shard.init(2, [("a", full(0.0)), ("b", full(1.0, (3,)))], (), rule)
        pushes(shard)
    assert torch.equal(loose.pull(0, ["a"]).values[0][1], full(13.0)), "WSP alone: the later wave is in"
    assert torch.equal(exact.values["a"], full(3.0)), "the values hold the complete wave"
    assert [float(d[0, 0]) for d in exact.hold.deltas("a")] == [10.0], "O3: and the hold the rest, once"
    for vw, own in ((0, [1, 1]), (1, [1, 1])):   # vw 1's own wave 1 is taken out too: G3 adds it back
        result = exact.pull(vw, ["a", "b"])
        assert torch.equal(result.values[0][1], full(3.0)) and torch.equal(result.values[1][1], full(4.0, (3,)))
        assert result.own_clock == own and result.c_global == 1 and result.vw_clocks == [1, 2]

    durability = Durability(str(tmp_path))
    durability.checkpoint(exact)
    assert exact.push(0, 1, [("a", full(100.0))])   # logged after the checkpoint: replayed
    durability.journal_push(0, 1, [("a", full(100.0))])
    restored = Shard()
    Durability(str(tmp_path)).restore(restored)
    assert restored.digest() == exact.digest() and restored.rule.exact
    assert torch.equal(restored.pull(0, ["a"]).values[0][1], full(113.0)), "a's c_global is 2: all in"
    assert torch.equal(restored.pull(0, ["b"]).values[0][1], full(4.0, (3,))), "b's is 1: vw 1's wave 1 out"

    assert restored.evict(0)   # b's c_global moves on without vw 0: vw 1's wave 1 is in
    assert torch.equal(restored.pull(1, ["b"]).values[0][1], full(14.0, (3,))) and not restored.hold

    err = assert_refused(Kind.INVALID, Shard().init, 2, [("a", full(0.0))], [3, 4], SyncRule("wsp", exact=True))
    assert "every VW at one clock" in str(err)
    err = assert_refused(Kind.INVALID, Shard().init, 2, [("a", full(0.0))], (),
                         SyncRule("quorum", total_waves=4, exact=True))
    assert "exact pulls are for sync wsp" in str(err)


def test_an_exact_shard_keeps_its_own_copy_of_a_push_it_holds(tmp_path: Path) -> None:
    """A WSP push is applied from its log entry, whose file a checkpoint frees and a later push
    writes over: a held push must not change with it (the checkpoint's copy takes its place)."""
    shard, durability = Shard(), Durability(str(tmp_path))
    assert shard.init(3, [("a", torch.zeros(4, dtype=torch.float64))], (), SyncRule("wsp", exact=True))
    for vw, value in ((1, 2.0), (2, 5.0)):
        seq, logged = log_push(durability, vw, 0, [("a", torch.full((4,), value, dtype=torch.float64))])
        durability.place(seq)
        assert shard.push(vw, 0, logged)
        durability.settle(seq, applied=True)
        durability.checkpoint(shard)   # frees the entry: vw 2's push is written over vw 1's file
    assert torch.equal(shard.pull(0, ["a"]).values[0][1], torch.zeros(4, dtype=torch.float64))
    seq, logged = log_push(durability, 0, 0, [("a", torch.full((4,), 1.0, dtype=torch.float64))])
    durability.place(seq)
    assert shard.push(0, 0, logged)
    assert torch.equal(shard.values["a"], torch.full((4,), 8.0, dtype=torch.float64)), "1 + 2 + 5, as pushed"


def test_a_push_that_goes_in_before_a_held_one_is_checked_against_the_values_it_joins() -> None:
    """VW 1's push is held; VW 0's, which the wave adds first, would overflow the values on its
    own: refused (the key's bound covers the values, not only the sums after each delta)."""
    top = torch.finfo(torch.float32).max
    shard = Shard()
    shard.init(2, [("a", torch.full((4,), 0.9 * top))], (), EXACT)
    assert shard.push(1, 0, [("a", torch.full((4,), -0.9 * top))])
    digest = shard.digest()
    assert_refused(Kind.OVERFLOW, shard.push, 0, 0, [("a", torch.full((4,), 0.3 * top))])
    assert shard.digest() == digest
    assert shard.push(0, 0, [("a", torch.full((4,), -0.3 * top))])
    assert torch.isfinite(shard.values["a"]).all()
