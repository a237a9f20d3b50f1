"""parallel.sync quorum and elastic at the pure shard (ps_server/shard.py, ps_server/quorum.py,
hetpipe/elastic.py), against references written from the rules in docs/design.md §3, not from
the shard.

quorum: contributions are int64 powers of 4 (4**i for VW v's wave c), so w_global - w0 says, digit
by digit, how many times each contribution is in it: a contribution lost or doubled shows. Random
push orders with stragglers (late waves), retries, an eviction, a snapshot/restore swapped in
mid-run and the durable push log replayed at the end, for N in 2..5 and quorum 1, majority, N
and a random size. Q = N is checked against synchronous summed data parallelism exactly.

elastic: float64 dyadic values with alpha 0.25, so every step is exact: one exchange keeps
x_i + x~ and scales x_i - x~ by 1 - 2*alpha; a retry returns the stored delta and changes
nothing; with N VWs every exchange keeps its own x_i + x~, hence the sum of all replicas and
the master.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hetpipe import elastic
from hetpipe.wsp import merge_pulled, waves_included
from ps_server.durability import Durability
from ps_server.quorum import quorum_size
from ps_server.shard import Shard
from ps_server.sync_rule import SyncRule
from shard_reference import Kind, assert_refused

pytestmark = pytest.mark.timeout(120)

KEYS = ("a", "b")
WIDTH = 3


# ---- quorum: a reference written from the rules -------------------------------------------------


class RefRounds:
    """One key under quorum, from the rules: wave c of vw goes to round max(c, rounds closed);
    round r closes (after r - 1) once Q live VWs' own waves r are in it; once every live VW has
    pushed all its waves, everything is applied."""

    def __init__(self, n: int, quorum: int, total: int) -> None:
        self.n, self.quorum, self.total = n, quorum, total
        self.closed = 0
        self.round_of: dict[tuple[int, int], int] = {}
        self.pushed = [0] * n
        self.live = set(range(n))
        self.flushed = False
        self.late = 0

    def need(self) -> int:
        live = len(self.live)
        return live // 2 + 1 if self.quorum == 0 else min(self.quorum, live)

    def push(self, vw: int, wave: int) -> None:
        self.round_of[(vw, wave)] = max(wave, self.closed)
        self.late += wave < self.closed
        self.pushed[vw] = wave + 1
        self.settle()

    def settle(self) -> None:
        def on_time(r: int) -> int:
            return sum(1 for (v, c), rr in self.round_of.items() if rr == r == c and v in self.live)

        while on_time(self.closed) >= self.need():
            self.closed += 1
        if all(self.pushed[v] == self.total for v in self.live):
            self.flushed = True
            self.closed = max(self.closed, self.total)

    def applied(self) -> set[tuple[int, int]]:
        return {vc for vc, r in self.round_of.items() if self.flushed or r < self.closed}


def contribution(vw: int, wave: int, total: int) -> torch.Tensor:
    return torch.full((WIDTH,), 4 ** (vw * total + wave), dtype=torch.int64)


def multiplicities(value: torch.Tensor, n: int, total: int) -> dict[tuple[int, int], int]:
    """How many times each (vw, wave) is in value (w0 = 0): its base-4 digits."""
    assert torch.equal(value, value[:1].expand_as(value))
    rest = int(value[0])
    found = {}
    for i in range(n * total):
        found[(i // total, i % total)] = rest % 4
        rest //= 4
    assert rest == 0, "more than every contribution"
    return found


def check_against(shard: Shard, refs: dict[str, RefRounds], n: int, total: int) -> None:
    for key, ref in refs.items():
        assert shard.c_global([key]) == ref.closed, key
        # Never stricter than WSP: every wave below the slowest live VW's clock is in a closed round,
        # so a pull waits no longer than it would under WSP (and WSP's progress argument holds).
        assert ref.closed >= min(ref.pushed[v] for v in ref.live), key
        applied = ref.applied()
        got = multiplicities(shard.values[key], n, total)
        assert got == {vc: int(vc in applied) for vc in got}, f"{key}: w_global != w0 + the closed rounds"
        for vw in ref.live:
            count = sum(1 for v, _ in applied if v == vw)
            assert {c for v, c in applied if v == vw} == set(range(count)), "applied waves are a prefix"
            assert shard.pull(vw, [key]).own_clock == [count], f"{key}: vw {vw} own_clock"


def quorum_shard(n: int, quorum: int, total: int) -> Shard:
    shard = Shard()
    shard.init(n, [(k, torch.zeros(WIDTH, dtype=torch.int64)) for k in KEYS],
               rule=SyncRule("quorum", quorum=quorum, total_waves=total))
    return shard


def run_quorum_scenario(seed: int, tmp: Path) -> tuple[int, int]:
    """One random run; returns (late contributions, rounds closed by quorum before any flush)."""
    rnd = random.Random(seed)
    n = rnd.randint(2, 5)
    total = rnd.randint(2, min(6, 30 // n))
    quorum = rnd.choice([1, 0, n, rnd.randint(1, n)])
    speed = [rnd.uniform(0.05, 1.0) for _ in range(n)]   # stragglers make late waves
    durability = Durability(str(tmp / f"seed{seed}"), every_clocks=rnd.randint(1, 3))
    shard = quorum_shard(n, quorum, total)
    durability.checkpoint(shard)
    refs = {k: RefRounds(n, quorum, total) for k in KEYS}
    nxt = {(v, k): 0 for v in range(n) for k in KEYS}
    evict_at = rnd.randint(1, n * total) if n >= 3 and rnd.random() < 0.5 else None
    swap_at = rnd.randint(1, n * total)
    early_closes = 0
    step = 0
    while True:
        todo = [v for v in refs["a"].live if any(nxt[(v, k)] < total for k in KEYS)]
        if not todo:
            break
        step += 1
        vw = rnd.choices(todo, weights=[speed[v] for v in todo])[0]
        keys = [k for k in KEYS if nxt[(vw, k)] < total]
        if len(keys) == 2 and nxt[(vw, "a")] != nxt[(vw, "b")] or rnd.random() < 0.5:
            keys = [rnd.choice(keys)]   # a stage owning one key; else both keys at once
        wave = nxt[(vw, keys[0])]
        deltas = [(k, contribution(vw, wave, total)) for k in keys]
        applied = shard.push(vw, wave, deltas, journal=lambda: durability.journal_push(vw, wave, deltas))
        assert applied
        if (captured := durability.maybe_capture(shard)) is not None:  # the servicer's, lock or no lock
            durability.write(captured)
        for k in keys:
            nxt[(vw, k)] += 1
            before = refs[k].closed
            refs[k].push(vw, wave)
            early_closes += 0 if refs[k].flushed else refs[k].closed - before
        check_against(shard, refs, n, total)
        if rnd.random() < 0.2:   # a retry of the latest push: a no-op
            digest = shard.digest()
            assert not shard.push(vw, wave, deltas)
            assert shard.digest() == digest
        if step == evict_at and len(refs["a"].live) > 1:
            gone = rnd.choice(sorted(refs["a"].live))
            assert shard.evict(gone)
            durability.checkpoint(shard)   # as the servicer does
            for ref in refs.values():
                ref.live.discard(gone)
                ref.settle()
            check_against(shard, refs, n, total)
        if step == swap_at:   # a restored snapshot goes on exactly like the original
            restored = Shard()
            restored.restore(shard.snapshot())
            assert restored.digest() == shard.digest()
            shard = restored
    # Nothing lost, nothing doubled: every contribution pushed (an evicted VW's too) is in, once.
    for key, ref in refs.items():
        assert ref.flushed
        got = multiplicities(shard.values[key], n, total)
        assert got == {vc: int(vc in ref.round_of) for vc in got}, key
    replayed = Shard()
    durability_again = Durability(str(tmp / f"seed{seed}"))
    durability_again.restore(replayed)
    assert replayed.digest() == shard.digest(), "checkpoint + push log give the same state"
    return sum(r.late for r in refs.values()), early_closes


def test_quorum_rounds_on_random_push_orders(tmp_path: Path) -> None:
    late = early = 0
    for seed in range(150):
        got_late, got_early = run_quorum_scenario(seed, tmp_path)
        late, early = late + got_late, early + got_early
    # Not vacuous: waves arrived late, and rounds closed by quorum before the final flush.
    assert late > 50 and early > 100, (late, early)


def test_a_snapshot_keeps_the_open_rounds_as_they_were(tmp_path: Path) -> None:
    """The servicer writes a checkpoint after it lets go of the lock, so pushes may land between
    capture and write. Their log entries are past the checkpoint and replay: a snapshot that
    shared an open round's total with the shard would count them twice."""
    total = 4
    shard = quorum_shard(3, 3, total)   # every VW needed: round 0 stays open
    durability = Durability(str(tmp_path))
    durability.checkpoint(shard)

    def push(vw: int) -> None:
        deltas = [(k, contribution(vw, 0, total)) for k in KEYS]
        assert shard.push(vw, 0, deltas, journal=lambda: durability.journal_push(vw, 0, deltas))

    push(0)
    captured = durability.capture(shard)
    push(1)                         # into the open round, after the capture
    durability.write(captured)
    push(2)                         # the round closes
    restored = Shard()
    Durability(str(tmp_path)).restore(restored)
    assert multiplicities(restored.values["a"], 3, total) == multiplicities(shard.values["a"], 3, total)
    assert restored.digest() == shard.digest()


def test_late_wave_is_folded_into_the_next_round_to_close_and_does_not_vote() -> None:
    total = 5
    shard = quorum_shard(3, 2, total)

    def push(vw: int, wave: int) -> None:
        assert shard.push(vw, wave, [(k, contribution(vw, wave, total)) for k in KEYS])

    def applied() -> set[tuple[int, int]]:
        return {vc for vc, m in multiplicities(shard.values["a"], 3, total).items() if m}

    push(0, 0)
    assert shard.c_global() == 0 and applied() == set()
    push(1, 0)
    assert shard.c_global() == 1 and applied() == {(0, 0), (1, 0)}
    push(2, 0)                    # late: round 0 is closed, so it waits in round 1
    assert applied() == {(0, 0), (1, 0)} and shard.pull(2, ["a"]).own_clock == [0]
    push(0, 1)                    # round 1 has vw 0's wave 1 on time, vw 2's wave 0 late: no quorum
    assert shard.c_global() == 1 and applied() == {(0, 0), (1, 0)}
    push(1, 1)                    # the quorum: round 1 closes with the late wave in it, once
    assert shard.c_global() == 2 and applied() == {(0, 0), (1, 0), (0, 1), (1, 1), (2, 0)}
    assert shard.pull(2, ["a"]).own_clock == [1] and shard.pull(0, ["a"]).own_clock == [2]


def test_solo_quorum_never_waits_and_the_last_waves_are_flushed() -> None:
    total = 3
    shard = quorum_shard(2, 1, total)
    for wave in range(total):
        assert shard.push(0, wave, [(k, contribution(0, wave, total)) for k in KEYS])
        assert shard.c_global() == wave + 1, "solo: each wave closes its round alone"
    assert shard.push(1, 0, [(k, contribution(1, 0, total)) for k in KEYS])
    assert shard.push(1, 1, [(k, contribution(1, 1, total)) for k in KEYS])
    assert multiplicities(shard.values["a"], 2, total)[(1, 0)] == 0, "late waves wait in round 3, which no one closes"
    assert shard.push(1, 2, [(k, contribution(1, 2, total)) for k in KEYS])
    assert all(m == 1 for m in multiplicities(shard.values["a"], 2, total).values()), "the final flush"
    assert shard.c_global() == total and shard.pull(1, ["a"]).own_clock == [total]
    assert_refused(Kind.CLOCK, shard.push, 0, total, [("a", contribution(0, 0, total))])  # past the last wave


def test_eviction_lowers_the_quorum_and_a_waiting_round_closes() -> None:
    total = 4
    shard = quorum_shard(3, 3, total)
    shard.push(0, 0, [(k, contribution(0, 0, total)) for k in KEYS])
    shard.push(1, 0, [(k, contribution(1, 0, total)) for k in KEYS])
    assert shard.c_global() == 0
    shard.evict(2)                # quorum 3 of the 2 left: both of them
    assert shard.c_global() == 1
    assert quorum_size(0, 5) == 3 and quorum_size(0, 4) == 3 and quorum_size(0, 1) == 1 and quorum_size(4, 2) == 2


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_quorum_of_all_is_synchronous_summed_data_parallelism(n: int) -> None:
    """Q = N: w_global is always w0 plus whole rounds, each the sum of every VW's update of that
    wave: what synchronous data parallelism with summed updates holds after each step."""
    rnd = random.Random(n)
    total = 6
    g = torch.Generator().manual_seed(n)
    w0 = torch.randint(-50, 50, (WIDTH,), generator=g).to(torch.float64)
    updates = [[torch.randint(-1000, 1000, (WIDTH,), generator=g).to(torch.float64) for _ in range(total)]
               for _ in range(n)]
    sync_dp = [w0.clone()]
    for r in range(total):
        sync_dp.append(sync_dp[-1] + sum(updates[v][r] for v in range(n)))
    shard = Shard()
    shard.init(n, [("a", w0.clone())], rule=SyncRule("quorum", quorum=n, total_waves=total))
    pushed = [0] * n
    while min(pushed) < total:
        vw = rnd.choice([v for v in range(n) if pushed[v] < total and pushed[v] - min(pushed) < 2])
        shard.push(vw, pushed[vw], [("a", updates[vw][pushed[vw]])])
        pushed[vw] += 1
        assert shard.c_global() == min(pushed), "with Q = N no wave is late: rounds = WSP's c_global"
        assert torch.equal(shard.values["a"], sync_dp[min(pushed)]), "a step of synchronous summed DP"


@pytest.mark.parametrize("quorum", [1, 0, 3])
def test_g3_merge_after_a_quorum_pull_loses_and_doubles_nothing(quorum: int) -> None:
    """The stage's G3 merge (hetpipe/wsp.py) on a quorum shard's pull: the pulled w_global plus the
    stage's own waves >= own_clock (its applied waves) holds every closed-round contribution and
    every own wave, each once, also while own waves wait in open rounds."""
    n, total = 3, 6
    merges = pending_seen = 0
    for seed in range(20):
        merges, pending_seen = _merge_scenario(random.Random(seed), n, total, quorum, merges, pending_seen)
    assert merges > 50 and (quorum == 3 or pending_seen > 10), (merges, pending_seen)


def _merge_scenario(rnd: random.Random, n: int, total: int, quorum: int, merges: int,
                    pending_seen: int) -> tuple[int, int]:
    shard = quorum_shard(n, quorum, total)
    pushed = [0] * n
    own: dict[int, list[torch.Tensor]] = {}   # vw 0's wave sums not yet known to be in w_global
    while min(pushed) < total:
        vw = rnd.choice([v for v in range(n) if pushed[v] < total])
        wave = pushed[vw]
        if vw == 0:
            own[wave] = [contribution(0, wave, total)]
        shard.push(vw, wave, [("a", contribution(vw, wave, total))])
        pushed[vw] += 1
        if rnd.random() < 0.5 and pushed[0] < total:
            current = pushed[0]
            own[current] = [contribution(0, current, total)]   # the wave under way, not pushed yet
            pull = shard.pull(0, ["a"])
            local = merge_pulled([pull.values[0][1]], pull.own_clock, own)[0]
            got = multiplicities(local, n, total)
            in_global = multiplicities(shard.values["a"], n, total)
            want = {(v, c): 1 if v == 0 and c <= current else in_global[(v, c)] for v, c in got}
            assert got == want, f"pushed {pushed}: the merge lost or doubled a wave"
            pending_seen += pull.own_clock[0] < pushed[0]
            for w in [w for w in own if w < waves_included(pull.own_clock)]:
                del own[w]
            del own[current]
            merges += 1
    return merges, pending_seen


# ---- elastic -------------------------------------------------------------------------------------


def dyadic(seed: int, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    """Multiples of 1/8 below 64: sums, differences and quarters of them stay exact in float64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-512, 512, shape, generator=g).to(torch.float64) / 8


def elastic_shard(n: int, *, period: int = 1, total: int = 8, alpha: float = 0.25) -> Shard:
    shard = Shard()
    shard.init(n, [("w", dyadic(0)), ("b", dyadic(1, (3,)))],
               rule=SyncRule("elastic", alpha=alpha, period=period, total_waves=total))
    return shard


def test_one_exchange_keeps_the_sum_and_scales_the_difference_exactly() -> None:
    shard = elastic_shard(2)
    master = {k: v.clone() for k, v in shard.values.items()}
    replica = {"w": dyadic(10), "b": dyadic(11, (3,))}
    result = shard.exchange(1, 0, list(replica.items()))
    assert result.applied
    for key, delta in result.deltas:
        x, m = replica[key] - delta, shard.values[key]
        assert torch.equal(delta, 0.25 * (replica[key] - master[key]))
        assert torch.equal(m, master[key] + delta)
        assert torch.equal(x + m, replica[key] + master[key]), "x_i + x~ is unchanged"
        assert torch.equal(x - m, (1 - 2 * 0.25) * (replica[key] - master[key])), "x_i - x~ scaled by 1 - 2 alpha"


def test_a_retried_exchange_returns_the_stored_delta_and_changes_nothing() -> None:
    shard = elastic_shard(2)
    replica = [("w", dyadic(10)), ("b", dyadic(11, (3,)))]
    first = shard.exchange(0, 0, replica)
    digest, applied = shard.digest(), shard.exchanges.applied
    again = shard.exchange(0, 0, [("w", dyadic(99)), ("b", dyadic(98, (3,)))])  # whatever it carries
    assert not again.applied and shard.digest() == digest and shard.exchanges.applied == applied
    assert [k for k, _ in again.deltas] == ["w", "b"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first.deltas, again.deltas))
    part = shard.exchange(0, 0, [("b", dyadic(11, (3,)))])   # part of it: that key's delta
    assert torch.equal(part.deltas[0][1], first.deltas[1][1]) and shard.digest() == digest


def test_exchanges_of_several_vws_conserve_each_pair_and_the_total() -> None:
    """N VWs, each exchange between x_i and x~ alone: x_i + x~ is unchanged by it, so the sum of all
    N replicas and the master changes only by the VWs' own training steps (none here)."""
    n, rnd = 4, random.Random(3)
    shard = elastic_shard(n, total=6)
    replicas = {v: {"w": dyadic(20 + v), "b": dyadic(40 + v, (3,))} for v in range(n)}
    total_before = {k: sum(r[k] for r in replicas.values()) + shard.values[k] for k in ("w", "b")}
    done = [0] * n
    while min(done) < 6:
        vw = rnd.choice([v for v in range(n) if done[v] < 6])
        pair = {k: replicas[vw][k] + shard.values[k] for k in ("w", "b")}
        result = shard.exchange(vw, done[vw], list(replicas[vw].items()))
        for key, delta in result.deltas:
            replicas[vw][key] = replicas[vw][key] - delta
            assert torch.equal(replicas[vw][key] + shard.values[key], pair[key])
        done[vw] += 1
        assert shard.c_global() == min(done), "period 1: an exchange per wave"
    for key in ("w", "b"):
        assert torch.equal(sum(r[key] for r in replicas.values()) + shard.values[key], total_before[key])
    spread = max(float((replicas[v]["w"] - shard.values["w"]).abs().max()) for v in range(n))
    assert spread < float((dyadic(20) - dyadic(0)).abs().max()), "the replicas were pulled towards the master"


def test_exchange_refusals_change_nothing() -> None:
    shard = elastic_shard(2, period=2, total=5)   # exchanges after waves 1, 3 and 4: three
    replica = [("w", dyadic(10)), ("b", dyadic(11, (3,)))]
    shard.exchange(0, 0, replica)
    digest = shard.digest()
    nan = dyadic(12)
    nan[0, 0] = float("nan")
    cases = {
        Kind.INVALID: [(2, 1, replica), (0, 1, [("w", torch.zeros(3, 2, dtype=torch.float64))]),
                       (0, 1, [("w", dyadic(10).float())]), (0, 1, [("w", nan)]), (0, 1, [("w", dyadic(1)), ("w", dyadic(1))]),
                       (0, 1, [])],
        Kind.NOT_OWNED: [(0, 1, [("w", dyadic(10)), ("l9.weight", dyadic(10))])],
        Kind.CLOCK: [(0, 2, replica), (1, 1, replica), (1, 3, replica)],
    }
    for kind, calls in cases.items():
        for vw, clock, tensors in calls:
            assert_refused(kind, shard.exchange, vw, clock, tensors)
            assert shard.digest() == digest, (kind, vw, clock)
    shard.exchange(0, 1, replica)
    shard.exchange(0, 2, replica)
    assert_refused(Kind.CLOCK, shard.exchange, 0, 3, replica)   # the job has 3 exchanges per VW
    assert_refused(Kind.MODE, shard.push, 0, 0, replica)        # elastic pushes nothing
    wsp = Shard()
    wsp.init(2, [("w", dyadic(0))])
    assert_refused(Kind.MODE, wsp.exchange, 0, 0, [("w", dyadic(1))])
    assert shard.evict(1) and shard.c_global() == 5, "vw 0 exchanged after its last wave"
    assert_refused(Kind.CLOCK, shard.exchange, 1, 0, replica)


def test_an_exchange_whose_delta_would_overflow_is_refused_and_changes_nothing() -> None:
    """Both finite, the replica and the master can still be further apart than a float holds:
    replica - master is then Inf, refused as an overflow (not as the replica's NaN or Inf)."""
    big = 2.0 ** 1023   # powers of two: every sum and half below is exact
    shard = Shard()
    shard.init(2, [("w", torch.tensor([big, 1.0], dtype=torch.float64))],
               rule=SyncRule("elastic", alpha=0.5, period=1, total_waves=2))
    digest = shard.digest()
    far = [("w", torch.tensor([-big, 1.0], dtype=torch.float64))]   # -2**1024: past float64
    message = str(assert_refused(Kind.OVERFLOW, shard.exchange, 0, 0, far))
    assert "exchange of vw 0 for clock 0: adding it could overflow w_global in ['w']" in message
    assert shard.digest() == digest and shard.exchanges.applied == 0
    result = shard.exchange(0, 0, [("w", torch.tensor([big / 4, 3.0], dtype=torch.float64))])
    assert result.applied and torch.equal(shard.values["w"], torch.tensor([big / 8 * 5, 2.0], dtype=torch.float64))


def test_elastic_state_survives_snapshot_and_log_replay(tmp_path: Path) -> None:
    durability = Durability(str(tmp_path / "ckpt"), every_clocks=3)   # one checkpoint mid-way, at c_global 3
    shard = elastic_shard(3, total=4)
    durability.checkpoint(shard)
    rnd = random.Random(5)
    done = [0] * 3
    last: dict[int, list[tuple[str, torch.Tensor]]] = {}
    while min(done) < 4:
        vw = rnd.choice([v for v in range(3) if done[v] < 4])
        replica = [("w", dyadic(100 + 10 * vw + done[vw])), ("b", dyadic(200 + 10 * vw + done[vw], (3,)))]
        clock = done[vw]
        last[vw] = shard.exchange(vw, clock, replica,
                                  journal=lambda: durability.journal_exchange(vw, clock, replica)).deltas
        if (captured := durability.maybe_capture(shard)) is not None:  # the servicer's, lock or no lock
            durability.write(captured)
        done[vw] += 1
    restored = Shard()
    assert Durability(str(tmp_path / "ckpt")).restore(restored) > 0, "some exchanges came back from the log"
    assert restored.digest() == shard.digest() and restored.exchanges.applied == 12
    again = Shard()
    again.restore(shard.snapshot())
    assert again.digest() == shard.digest()
    for vw, deltas in last.items():   # a retry after a restart still gets the very same delta
        retry = restored.exchange(vw, 3, [(k, torch.zeros_like(d)) for k, d in deltas])
        assert not retry.applied and all(torch.equal(a, b) for (_, a), (_, b) in zip(deltas, retry.deltas))


def test_exchange_schedule() -> None:
    assert [elastic.exchange_after(w, 2, 5) for w in range(5)] == [None, 0, None, 1, 2]
    assert [elastic.exchange_after(w, 1, 3) for w in range(3)] == [0, 1, 2]
    assert elastic.total_exchanges(5, 2) == 3 and elastic.total_exchanges(4, 2) == 2
    assert [elastic.waves_covered(e, 2, 5) for e in range(4)] == [0, 2, 4, 5]


def test_sync_rule_is_checked_at_init() -> None:
    w = [("w", dyadic(0))]
    bad = [SyncRule("gossip"), SyncRule("quorum", quorum=3, total_waves=2), SyncRule("quorum", total_waves=0),
           SyncRule("elastic", alpha=0.0, total_waves=2), SyncRule("elastic", alpha=0.6, total_waves=2),
           SyncRule("elastic", alpha=float("nan"), total_waves=2), SyncRule("elastic", alpha=0.1, period=0, total_waves=2)]
    for rule in bad:
        assert_refused(Kind.INVALID, Shard().init, 2, w, (), rule)
    shard = Shard()
    shard.init(2, w, rule=SyncRule("quorum", total_waves=2))
    assert_refused(Kind.CONFLICT, shard.init, 2, w, (), SyncRule("quorum", quorum=2, total_waves=2))
    assert_refused(Kind.INVALID, Shard().init, 2, w, (1, 1), SyncRule("quorum", total_waves=2))


@pytest.mark.parametrize("mode", ["elastic", "quorum"])
def test_an_apply_that_runs_out_of_memory_changes_nothing_and_its_retry_applies(mode: str, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies an exchange answers with, and a quorum round's first total, are made before the
    journal entry: a MemoryError among them (the servicer answers RESOURCE_EXHAUSTED, which the
    client retries) left some keys applied and others not, so the retry was refused as going
    backwards and a restart replayed a state the shard had never served."""
    durability = Durability(str(tmp_path))
    shard = Shard()
    rule = (SyncRule("elastic", alpha=0.5, period=1, total_waves=4) if mode == "elastic"
            else SyncRule("quorum", quorum=2, total_waves=4))
    shard.init(2, [("a", torch.zeros(4)), ("b", torch.zeros(4))], rule=rule)
    durability.checkpoint(shard)
    update = [("a", torch.ones(4)), ("b", torch.ones(4))]
    before = shard.digest()

    def apply() -> bool:
        if mode == "elastic":
            return shard.exchange(0, 0, update, journal=lambda: durability.journal_exchange(0, 0, update)).applied
        return shard.push(0, 0, update, journal=lambda: durability.journal_push(0, 0, update)) is not None

    real_clone, clones = torch.Tensor.clone, []

    def second_clone_fails(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        clones.append(1)
        if len(clones) == 2:
            raise MemoryError("no room for one more key-sized tensor")
        return real_clone(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "clone", second_clone_fails)
        with pytest.raises(MemoryError):
            apply()
    assert shard.digest() == before, "nothing applied, nothing counted"
    assert apply()
    restored = Shard()
    Durability(str(tmp_path)).restore(restored)
    assert restored.digest() == shard.digest()
