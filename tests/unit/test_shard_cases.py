"""The shard's WSP clock logic (DESIGN §3 G1, G2, G4; O3) on hand-written cases: Init's idempotence
and conflicts, c_global and the clock distance over keys and VWs, all-or-nothing pushes, the
clock messages, a restore after a crash between a checkpoint and its log clean-up, overflow, and
bf16 pushes into float32 keys. The push log's own cases are in test_push_log.py, exact pulls in
test_wave_hold.py.

The same rules against a reference model, on random interleavings, are in test_shard_property.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from ps_server import adds, headroom
from ps_server import shard as shard_module
from ps_server.durability import Durability
from ps_server.shard import Shard
from ps_server.sync_rule import SyncRule
from shard_reference import Kind, assert_refused, log_push, two_key_shard

pytestmark = pytest.mark.timeout(120)


def ones(key: str, shard: Shard) -> tuple[str, torch.Tensor]:
    return key, torch.ones_like(shard.values[key])


def test_init_is_idempotent_and_conflicts_on_other_values() -> None:
    init = [("a", torch.arange(6, dtype=torch.float64).reshape(2, 3)), ("b", torch.ones(3, dtype=torch.float64))]
    shard = Shard()
    assert not shard.ready
    assert_refused(Kind.NOT_READY, shard.push, 0, 0, [("a", init[0][1])])
    assert_refused(Kind.NOT_READY, shard.pull, 0, ["a"])
    assert shard.init(2, init) is True
    digest = shard.digest()
    init[0][1].add_(100.0)  # the shard keeps its own copy
    assert shard.digest() == digest
    init[0][1].sub_(100.0)
    assert shard.init(2, [(k, v.clone()) for k, v in init]) is False
    assert shard.init(2, list(reversed(init))) is False, "key order does not matter"
    assert shard.init(2, [init[1]]) is False, "a stage may bring a subset again (a retry)"
    conflicts = {
        "other value": [init[0], ("b", torch.full((3,), 2.0, dtype=torch.float64))],
        "other dtype": [init[0], ("b", torch.ones(3, dtype=torch.float32))],
        "other shape": [init[0], ("b", torch.ones(1, 3, dtype=torch.float64))],
    }
    for what, tensors in conflicts.items():
        err = assert_refused(Kind.CONFLICT, shard.init, 2, tensors)
        assert "already initialised with other values for ['b']" in str(err), what
    assert_refused(Kind.CONFLICT, shard.init, 3, init)
    assert_refused(Kind.INVALID, Shard().init, 0, init)
    assert_refused(Kind.INVALID, Shard().init, 2, [])
    assert_refused(Kind.INVALID, Shard().init, 2, [init[0], init[0]])
    for clocks in ([2**63, 0], [0, 10**9 + 1]):   # past int64, past any job: refused before anything is kept
        fresh = Shard()
        err = assert_refused(Kind.INVALID, fresh.init, 2, init, clocks)
        assert "resume clocks must be in [0, 1000000000]" in str(err) and not fresh.ready
    elastic = SyncRule("elastic", alpha=0.25, period=1, total_waves=4)
    err = assert_refused(Kind.INVALID, Shard().init, 2, [init[0], ("n", torch.zeros(2, dtype=torch.int64))],
                         (), elastic)
    assert "sync elastic needs floating-point keys, not ['n']" in str(err)
    assert shard.digest() == digest
    # Each stage of VW 0 brings its own keys: they add up, until training begins.
    assert shard.init(2, [("c", torch.zeros(1, dtype=torch.float64))]) is True
    assert sorted(shard.values) == ["a", "b", "c"] and shard.clocks["c"] == [0, 0]
    shard.push(0, 0, [("c", torch.ones(1, dtype=torch.float64))])
    err = assert_refused(Kind.CONFLICT, shard.init, 2, [("d", torch.zeros(1, dtype=torch.float64))])
    assert "after training began" in str(err)


def test_an_init_at_other_clocks_than_the_shards_is_refused_and_changes_nothing() -> None:
    """Before training every key holds the clocks its Init brought: an Init of the same values
    at other clocks was answered "already initialised" with the clocks left as they were, and new
    keys took other clocks than the keys beside them (a push of both was then refused for good)."""
    shard = Shard()
    assert shard.init(2, [("a", torch.zeros(2))]) is True
    digest = shard.digest()
    err = assert_refused(Kind.CONFLICT, shard.init, 2, [("a", torch.zeros(2))], [5, 5])
    assert "already initialised at clocks [0, 0], not [5, 5]" in str(err)
    err = assert_refused(Kind.CONFLICT, shard.init, 2, [("b", torch.zeros(3))], [5, 5])
    assert "already initialised at clocks [0, 0], not [5, 5]" in str(err)
    assert shard.digest() == digest and sorted(shard.values) == ["a"]
    assert shard.init(2, [("b", torch.zeros(3))], [0, 0]) is True, "all 0, as an Init without clocks"
    shard.push(0, 0, [("a", torch.ones(2)), ("b", torch.ones(3))])
    resumed = Shard()
    assert resumed.init(2, [("a", torch.zeros(2))], [3, 2]) is True
    assert resumed.init(2, [("b", torch.zeros(3))], [3, 2]) is True   # the other stage's keys, same checkpoint
    assert_refused(Kind.CONFLICT, resumed.init, 2, [("c", torch.zeros(1))])
    resumed.push(1, 2, [("a", torch.ones(2)), ("b", torch.ones(3))])
    assert resumed.c_global() == 3


def test_c_global_is_min_over_keys_and_vws() -> None:
    shard = two_key_shard(3)
    assert shard.c_global() == 0
    for c in range(3):  # vw 0 runs three waves ahead on both keys
        assert shard.push(0, c, [ones("a", shard), ones("b", shard)])
    assert shard.c_global() == 0 and shard.vw_clocks() == [3, 0, 0]
    for vw in (1, 2):
        assert shard.push(vw, 0, [ones("a", shard)])
    # Every VW has pushed wave 0 of key a, but not of key b.
    assert shard.c_global(["a"]) == 1
    assert shard.c_global(["b"]) == 0
    assert shard.c_global() == 0, "min over keys too"
    assert shard.vw_clocks(["a"]) == [3, 1, 1] and shard.vw_clocks() == [3, 0, 0]
    assert shard.push(1, 0, [ones("b", shard)])
    assert shard.c_global() == 0, "vw 2 still lacks wave 0 of key b"
    assert shard.push(2, 0, [ones("b", shard)])
    assert shard.c_global() == 1
    assert shard.push(1, 1, [ones("b", shard), ones("a", shard)])
    assert shard.push(2, 1, [ones("a", shard), ones("b", shard)])
    assert shard.c_global() == 2 and shard.c_global(["a", "b"]) == 2
    result = shard.pull(1, ["b", "a"])
    assert result.c_global == 2 and result.own_clock == [2, 2] and result.vw_clocks == [3, 2, 2]
    assert torch.equal(dict(result.values)["a"], torch.full((2, 3), 7.0, dtype=torch.float64))  # 3 + 2 + 2 pushes


def test_clock_distance_is_spread_of_per_vw_min_clocks() -> None:
    shard = two_key_shard(3)
    assert shard.clock_distance() == 0 and shard.max_clock_distance == 0
    for c in range(4):
        shard.push(0, c, [ones("a", shard), ones("b", shard)])
    assert shard.clock_distance() == 4 and shard.max_clock_distance == 4
    shard.push(1, 0, [ones("a", shard)])  # vw 1's clock is the min over keys: still 0
    assert shard.vw_clocks() == [4, 0, 0] and shard.clock_distance() == 4
    for c in range(3):
        shard.push(1, c, [ones("b", shard)])
        shard.push(2, c, [ones("a", shard), ones("b", shard)])
        if c:
            shard.push(1, c, [ones("a", shard)])
    assert shard.vw_clocks() == [4, 3, 3] and shard.clock_distance() == 1
    assert shard.max_clock_distance == 4, "the largest distance ever seen is kept"
    assert Shard().clock_distance() == 0, "no keys yet"
    resumed = Shard()   # a job resumed with its VWs apart: the spread it starts from counts
    assert resumed.init(3, [("a", torch.zeros(2))], [6, 4, 4], SyncRule("wsp", D=1))
    assert resumed.max_clock_distance == 2
    resumed.push(1, 4, [("a", torch.ones(2))])
    assert resumed.max_clock_distance == 2


@pytest.mark.parametrize("bad", ["unknown key", "wrong shape", "wrong dtype", "key twice"])
@pytest.mark.parametrize("position", ["first", "last"])
def test_push_is_all_or_nothing(bad: str, position: str) -> None:
    shard = two_key_shard(2)
    before = shard.digest()
    good = [ones("a", shard), ones("b", shard)]
    wrong = {
        "unknown key": ("zzz", torch.ones(3, dtype=torch.float64)),
        "wrong shape": ("b", torch.ones(2, 3, dtype=torch.float64)),
        "wrong dtype": ("b", torch.ones(3, dtype=torch.float32)),
        "key twice": ("a", torch.ones(2, 3, dtype=torch.float64)),
    }[bad]
    # The bad entry replaces key b (or is added), before or after the good key a.
    rest = [good[0]] if bad in ("wrong shape", "wrong dtype") else good
    deltas = [wrong, *rest] if position == "first" else [*rest, wrong]
    kind = Kind.NOT_OWNED if bad == "unknown key" else Kind.INVALID
    err = assert_refused(kind, shard.push, 0, 0, deltas)
    if bad != "key twice":
        assert wrong[0] in str(err), "the message names the key"
    assert shard.digest() == before and shard.pushes_applied == 0
    assert shard.vw_clocks() == [0, 0]
    assert shard.push(0, 0, good) is True, "the shard still takes good pushes"


def test_clock_messages_say_which_way() -> None:
    shard = two_key_shard(2)
    for c in range(3):
        shard.push(0, c, [ones("a", shard)])
    assert "skips ahead" in str(assert_refused(Kind.CLOCK, shard.push, 0, 4, [ones("a", shard)]))
    assert "goes backwards" in str(assert_refused(Kind.CLOCK, shard.push, 0, 1, [ones("a", shard)]))
    assert shard.push(0, 2, [ones("a", shard)]) is False, "backwards by one = the retry of the last push"
    assert shard.pushes_duplicate == 1
    assert "vw 7" in str(assert_refused(Kind.INVALID, shard.push, 7, 0, [ones("a", shard)]))


def test_restore_survives_crash_between_checkpoint_and_log_cleanup(tmp_path: Path) -> None:
    """Log entries a checkpoint already covers are never replayed twice, even if left on disk."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    for c in range(3):
        for vw in range(2):
            assert shard.push(vw, c, [ones("a", shard), ones("b", shard)])
            dur.journal_push(vw, c, [ones("a", shard), ones("b", shard)])
    saved = {p: p.read_bytes() for p in dur.entries()}
    dur.checkpoint(shard)
    assert not list(dur.entries())
    for p, raw in saved.items():
        p.write_bytes(raw)
    assert shard.push(0, 3, [ones("a", shard)])
    dur.journal_push(0, 3, [ones("a", shard)])
    again, dur2 = Shard(), Durability(str(tmp_path), every_clocks=100)
    assert dur2.restore(again) == 1
    assert again.digest() == shard.digest() and again.pushes_applied == 7
    # New log entries continue after the highest sequence number on disk.
    assert again.push(1, 3, [ones("a", shard)])
    dur2.journal_push(1, 3, [ones("a", shard)])
    third = Shard()
    Durability(str(tmp_path)).restore(third)
    assert third.digest() == again.digest() and third.pushes_applied == 8


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_init_and_pushes_are_refused_and_change_nothing(bad: float) -> None:
    poisoned = torch.zeros(3, dtype=torch.float64)
    poisoned[1] = bad
    assert_refused(Kind.INVALID, Shard().init, 2, [("a", torch.zeros(2, 3, dtype=torch.float64)), ("b", poisoned)])
    shard = two_key_shard()
    digest = shard.digest()
    assert_refused(Kind.INVALID, shard.push, 0, 0, [ones("a", shard), ("b", poisoned)])
    assert shard.digest() == digest and shard.pushes_applied == 0, "all or nothing: key a was not applied either"
    assert shard.push(0, 0, [ones("a", shard), ones("b", shard)]), "a finite retry of the same wave is applied"


def test_an_evicted_vw_no_longer_holds_c_global_back(tmp_path: Path) -> None:
    """parallel.on_vw_failure continue: c_global and the clock distance count the VWs that are
    left; the evicted VW's applied pushes stay; it may neither push nor pull; it stays evicted
    across a restart; the last VW cannot leave."""
    shard = two_key_shard(3)
    for vw, clock in [(0, 0), (0, 1), (2, 0), (2, 1), (1, 0)]:
        assert shard.push(vw, clock, [ones("a", shard), ones("b", shard)])
    assert shard.c_global() == 1 and shard.clock_distance() == 1
    assert shard.evict(1)
    assert not shard.evict(1), "a second eviction is a no-op"
    assert shard.c_global() == 2 and shard.clock_distance() == 0
    assert torch.equal(shard.values["b"], torch.full((3,), 6.0, dtype=torch.float64)), "vw 1's push stays"
    before = shard.digest()
    pushed = assert_refused(Kind.CLOCK, shard.push, 1, 1, [ones("a", shard), ones("b", shard)])
    pulled = assert_refused(Kind.CLOCK, shard.pull, 1, ["a"])
    assert str(pushed) == str(pulled) == "vw 1 was evicted from the job"
    assert shard.digest() == before

    durability = Durability(str(tmp_path))
    durability.checkpoint(shard)
    restored = Shard()
    durability.restore(restored)
    assert restored.evicted == {1} and restored.c_global() == 2 and restored.digest() == before

    assert shard.evict(0)
    assert "vw 2 is the last one left" in str(assert_refused(Kind.CLOCK, shard.evict, 2))
    assert shard.c_global() == 2


def test_a_push_logged_outside_the_lock_survives_a_checkpoint_taken_before_it_is_applied(tmp_path: Path) -> None:
    """WSP logs a push before taking the shard's lock: a checkpoint in between must not delete its
    entry (the snapshot lacks it); a push refused after logging leaves no entry to replay."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    pending, _ = log_push(dur, 0, 0, [ones("a", shard)])           # logged, not yet applied
    dur.journal_push(1, 0, [ones("b", shard)])
    assert shard.push(1, 0, [ones("b", shard)])
    dur.checkpoint(shard)                                       # another push's checkpoint
    assert dur.written_path(pending).exists(), "the checkpoint freed an unapplied push's entry"
    dur.place(pending)
    assert shard.push(0, 0, [ones("a", shard)])
    dur.settle(pending, applied=True)
    refused, _ = log_push(dur, 0, 5, [ones("a", shard)])            # a clock the shard refuses
    dur.settle(refused, applied=False)
    assert not any(path(refused).exists() for path in (dur.pending_path, dur.written_path, dur.entry_path))
    again = Shard()
    Durability(str(tmp_path)).restore(again)                    # a kill -9 now
    assert again.digest() == shard.digest() and again.pushes_applied == shard.pushes_applied == 2
    dur.sync()
    dur.checkpoint(shard)                                       # settled and on disk: now covered and freed
    assert not list(dur.entries()) and not list(dur.log_dir.glob("*.written"))


def test_a_checkpoint_written_late_never_overwrites_a_newer_one(tmp_path: Path) -> None:
    """The servicer captures a checkpoint under the lock and writes it after: two pushes' captures
    may be written in the other order, and the older must not replace the newer, whose write
    deleted the entries the older one lacks."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=1)
    dur.checkpoint(shard)
    both = [ones("a", shard), ones("b", shard)]
    for vw in (0, 1):
        dur.journal_push(vw, 0, both)
        assert shard.push(vw, 0, both)
    older = dur.maybe_capture(shard)
    for vw in (0, 1):
        dur.journal_push(vw, 1, both)
        assert shard.push(vw, 1, both)
    newer = dur.maybe_capture(shard)
    assert older is not None and newer is not None and older.covered < newer.covered
    dur.write(newer)
    assert not list(dur.entries())
    dur.write(older)
    again = Shard()
    Durability(str(tmp_path)).restore(again)
    assert again.digest() == shard.digest() and again.pushes_applied == 4


FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
RULES = {"wsp": SyncRule(), "exact": SyncRule("wsp", exact=True), "quorum": SyncRule("quorum", total_waves=4)}


def _at(dtype: torch.dtype, **elements: float) -> torch.Tensor:
    """Three elements, zero but those named (i0, i1, i2), as fractions of the dtype's largest value."""
    t = torch.zeros(3, dtype=dtype)
    for name, fraction in elements.items():
        t[int(name[1:])] = fraction * torch.finfo(dtype).max
    return t


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rule", list(RULES))
def test_a_finite_push_that_would_overflow_w_global_is_refused_and_changes_nothing(dtype: torch.dtype,
                                                                                   rule: str) -> None:
    """An Inf in w_global reaches every VW at its next pull and stays, whether a push brought it or
    a sum of finite ones made it. Under quorum the sum waits in a round: that is refused too."""
    shard = Shard()
    shard.init(2, [("a", torch.zeros(3, dtype=dtype))], (), RULES[rule])
    assert shard.push(0, 0, [("a", _at(dtype, i0=0.75))])
    digest = shard.digest()
    message = str(assert_refused(Kind.OVERFLOW, shard.push, 1, 0, [("a", _at(dtype, i0=0.75))]))
    assert "push of vw 1 for clock 0: adding it could overflow w_global in ['a']" in message
    assert shard.digest() == digest and shard.pushes_applied == 1 and shard.clocks["a"] == [1, 0]
    beside = [("a", _at(dtype, i1=0.75))]   # no element overflows
    if rule == "quorum":   # the bound decides: the round's sum, not w_global + u, is what comes next
        assert_refused(Kind.OVERFLOW, shard.push, 1, 0, beside)
        assert shard.digest() == digest
        return
    assert shard.push(1, 0, beside), "w_global + u itself decides where the bound cannot"
    assert torch.equal(shard.values["a"], _at(dtype, i0=0.75, i1=0.75))


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_bound_grown_loose_is_measured_again_not_refused(dtype: torch.dtype) -> None:
    """Each push grows its key's bound by its own largest |u|, and the bound never shrinks by
    itself: pushes that cancel out leave it loose, and the key is measured again once it nears
    the limit."""
    shard = Shard()
    shard.init(2, [("a", torch.zeros(3, dtype=dtype))])
    for vw, clock, fraction in [(0, 0, 0.3), (1, 0, -0.3), (0, 1, 0.3), (1, 1, 0.3)]:
        assert shard.push(vw, clock, [("a", _at(dtype, i0=fraction))]), (vw, clock)
    assert shard.headroom.bounds["a"] < torch.finfo(dtype).max
    assert_refused(Kind.OVERFLOW, shard.push, 0, 2, [("a", _at(dtype, i0=0.5))])
    assert shard.push(0, 2, [("a", _at(dtype, i0=-0.5))]), "the same size the other way: applied"
    again = Shard()   # a restored shard starts with no bounds, and measures
    again.restore(shard.snapshot())
    assert_refused(Kind.OVERFLOW, again.push, 1, 2, [("a", _at(dtype, i0=0.95))])
    assert again.push(1, 2, [("a", _at(dtype, i0=-0.95))])


def test_a_replayed_log_takes_every_push_the_shard_took_in_whatever_order(tmp_path: Path) -> None:
    """WSP numbers log entries before the shard's lock, so two VWs' pushes may be applied in the
    other order than they are numbered. Near the limit one order can overflow where the other did
    not: a push the shard took must not be refused on replay. Applied, they are replayed in the
    order of their places; killed before either was applied (no places), the one that overflows
    in the log's order waits and goes in after the other."""
    top = torch.finfo(torch.float64).max
    for applied in (True, False):
        folder = tmp_path / str(applied)
        shard, durability = Shard(), Durability(str(folder), every_clocks=100)
        shard.init(2, [("a", torch.tensor([0.5 * top, 0.0], dtype=torch.float64))])
        durability.checkpoint(shard)   # as Init's: what the log replays onto
        first, up = log_push(durability, 0, 0, [("a", torch.tensor([0.6 * top, 1.0], dtype=torch.float64))])
        second, down = log_push(durability, 1, 0, [("a", torch.tensor([-0.6 * top, 2.0], dtype=torch.float64))])
        for seq, vw, logged in ((second, 1, down), (first, 0, up)):   # in the other order, or not at all
            if applied:
                durability.place(seq)
                assert shard.push(vw, 0, logged)
                durability.settle(seq, applied=True)
        restored = Shard()
        assert Durability(str(folder), every_clocks=100).restore(restored) == 2
        assert restored.clocks["a"] == [1, 1]
        assert torch.equal(restored.values["a"], torch.tensor([0.5 * top, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("rule", [SyncRule(), SyncRule("wsp", exact=True), SyncRule("quorum", quorum=3, total_waves=2)])
def test_a_float32_key_takes_bf16_pushes_widened_and_logs_and_replays_them(tmp_path: Path, rule: SyncRule) -> None:
    """A bf16 job pushes its wave sums in bfloat16 (stage_worker/wsp_sync.py). The shard adds
    exactly the pushed values, and what it holds aside (a quorum's open round, an exact shard's
    waves ahead) sums them in float32: two bf16 pushes summed in bf16 would round. Its log keeps
    the bytes that came and replays the same."""
    w0 = torch.linspace(-1, 1, 4)
    shard, durability = Shard(), Durability(str(tmp_path), every_clocks=100)
    shard.init(3, [("a", w0.clone())], (), rule)
    durability.checkpoint(shard)
    one, small = torch.full((4,), 1.0, dtype=torch.bfloat16), torch.full((4,), 3 / 256, dtype=torch.bfloat16)
    assert (one + small).float().tolist() != (one.float() + small.float()).tolist(), "the case rounds in bf16"
    for vw, wave, u in ((0, 0, one), (1, 0, small), (2, 0, one), (0, 1, one), (1, 1, small)):
        seq, logged = log_push(durability, vw, wave, [("a", u)])
        assert logged[0][1].dtype == torch.bfloat16
        durability.place(seq)
        assert shard.push(vw, wave, logged)
        durability.settle(seq, applied=True)
    durability.sync()
    wave0 = w0 + (one.float() + small.float() + one.float())
    if rule.mode == "quorum":   # wave 1's round waits for its one VW: held open, summed
        assert torch.equal(shard.values["a"], wave0)
        assert torch.equal(shard.rounds["a"].open[1].total, one.float() + small.float())
    elif rule.exact:   # c_global is 1: wave 1 is held, as pushed, and the pull gets wave 0's sums
        assert torch.equal(shard.values["a"], wave0) and torch.equal(shard.pull(2, ["a"]).values[0][1], wave0)
        assert [d.tolist() for d in shard.hold.deltas("a")] == [one.tolist(), small.tolist()]
    else:
        assert torch.equal(shard.values["a"], wave0 + one.float() + small.float())
    assert shard.values["a"].dtype == torch.float32
    assert shard.push(1, 1, [("a", small)]) is False, "a retried bf16 push is a duplicate as any other"
    restored = Shard()
    assert Durability(str(tmp_path), every_clocks=100).restore(restored) == 5
    assert restored.digest() == shard.digest()


@pytest.mark.parametrize("chunk", [3, 4, 1 << 20])
def test_a_bf16_push_is_added_a_chunk_at_a_time_bit_for_bit(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """Under plain WSP a bf16 push stays bf16 until it is added, widened a chunk at a time
    (ps_server.adds): the sum is the whole widened push's, every element, whatever the chunks (a
    last one shorter, or one chunk for all), and the overflow bound grows by float32's rounding,
    the key's, not bfloat16's."""
    monkeypatch.setattr(adds, "CHUNK", chunk)
    g = torch.Generator().manual_seed(chunk)
    w0 = torch.randn(2, 5, generator=g)
    shard = Shard()
    shard.init(2, [("a", w0.clone())])
    pushes = [(torch.randn(2, 5, generator=g) * 1e-3).to(torch.bfloat16) for _ in range(3)]
    want = w0.clone()
    for clock, u in enumerate(pushes):
        bound = shard.headroom.bounds.get("a")
        assert shard.push(0, clock, [("a", u)])
        want.add_(u.float())
        assert torch.equal(shard.values["a"], want), clock
        size = float(u.float().abs().max())
        if bound is not None:
            assert shard.headroom.bounds["a"] == headroom.grow(bound, size, torch.float32)
    assert shard.values["a"].dtype == torch.float32


def test_an_accepted_push_counts_at_once_and_adds_its_sums_when_told() -> None:
    """Shard.accept does a push's bookkeeping and leaves its sums to Shard.add (the servicer adds
    them outside its lock): clocks and counts move at accept, the values at add, and a retry
    accepted meanwhile is the duplicate it is, with nothing left to add."""
    shard = two_key_shard(2)
    u = [ones("a", shard), ones("b", shard)]
    sums = shard.accept(0, 0, u)
    assert sums is not None and sums.keys == {"a", "b"}
    assert shard.key_clocks(0) == [1, 1] and shard.pushes_applied == 1
    assert torch.equal(shard.values["a"], torch.zeros(2, 3, dtype=torch.float64)), "no sum before add()"
    assert shard.accept(0, 0, u) is None and shard.pushes_duplicate == 1
    shard.add(sums)
    assert torch.equal(shard.values["a"], torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(shard.values["b"], torch.full((3,), 2.0, dtype=torch.float64))


def test_bf16_sums_of_two_keys_added_at_once_each_widen_in_a_buffer_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The servicer adds the sums of pushes of other keys at once, on two threads: each add
    widens its bf16 chunks in a buffer no other add writes meanwhile."""
    monkeypatch.setattr(adds, "CHUNK", 4)
    g = torch.Generator().manual_seed(11)
    w0 = {key: torch.randn(4000, generator=g) for key in ("a", "b")}
    shard = Shard()
    shard.init(1, [(key, value.clone()) for key, value in w0.items()])
    want = {key: value.clone() for key, value in w0.items()}
    for clock in range(5):
        updates = {key: torch.randn(4000, generator=g).to(torch.bfloat16) for key in w0}
        sums = [shard.accept(0, clock, [(key, u)]) for key, u in updates.items()]
        start = threading.Barrier(2)

        def add(s: shard_module.Sums | None) -> None:
            assert s is not None
            start.wait()
            shard.add(s)

        threads = [threading.Thread(target=add, args=(s,)) for s in sums]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for key, u in updates.items():
            want[key].add_(u.float())
            assert torch.equal(shard.values[key], want[key]), (clock, key)


def test_only_a_float32_key_takes_a_narrower_push_and_only_bf16() -> None:
    shard = Shard()
    shard.init(1, [("f32", torch.zeros(3)), ("f64", torch.zeros(3, dtype=torch.float64))])
    digest = shard.digest()
    for key, dtype in (("f64", torch.bfloat16), ("f32", torch.float16), ("f32", torch.float64)):
        err = assert_refused(Kind.INVALID, shard.push, 0, 0, [(key, torch.ones(3, dtype=dtype))])
        assert f"{key}: delta is {dtype}" in str(err)
    elastic = Shard()
    elastic.init(1, [("f32", torch.zeros(3))], (), SyncRule("elastic", alpha=0.5, period=1, total_waves=2))
    err = assert_refused(Kind.INVALID, elastic.exchange, 0, 0, [("f32", torch.ones(3, dtype=torch.bfloat16))])
    assert "f32: value is torch.bfloat16" in str(err), "an elastic replica is the weights: never narrowed"
    assert shard.digest() == digest and shard.pushes_applied == 0
