"""One shard's global weights and per-(key, VW) clocks: the WSP push/pull rules (and quorum's
rounds, elastic averaging's master), no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hetpipe import elastic
from hetpipe.buffers import raw_bytes
from hetpipe.parallelism import MAX_VIRTUAL_WORKERS
from hetpipe.training import MAX_STEPS
from hetpipe.wsp import NARROWED_PUSH, clock_distance
from ps_server import headroom
from ps_server.adds import Adder
from ps_server.exchanges import Exchanges
from ps_server.quorum import KeyRounds
from ps_server.sync_rule import ShardError, SyncRule, is_retry
from ps_server.wave_hold import WaveHold


@dataclass(frozen=True, slots=True)
class ExchangeResult:
    deltas: list[tuple[str, torch.Tensor]]   # alpha * (replica - master) per key, added to the master
    applied: bool                             # False: a retry, answered with the stored deltas


@dataclass(frozen=True, slots=True)
class Sums:
    """An accepted push whose bookkeeping is done (clocks, bounds, what exact pulls keep) and whose
    sums are still to be added to w_global: Shard.add() does that, once. Until then the keys'
    values lack the push that their clocks already count."""

    keys: frozenset[str]
    adds: list[tuple[torch.Tensor, torch.Tensor]]   # (w_global's tensor, the push's delta)


@dataclass(frozen=True, slots=True)
class PullResult:
    values: list[tuple[str, torch.Tensor]]
    own_clock: list[int]     # per key: the puller's waves included
    vw_clocks: list[int]     # per VW: min over the keys
    c_global: int


class Shard:
    """w_global and clocks for the keys this shard owns.

    A push of wave c by VW v for key k is applied iff clock[k][v] == c, which then becomes
    c + 1. clock[k][v] == c + 1 means it was applied already: a retry, answered as a no-op.
    Anything else is a clock that goes backwards or skips ahead, and is refused.

    Under sync quorum an accepted push waits in its key's round (ps_server/quorum.py) until the
    round closes; under sync elastic the values are the master x~, which only exchanges change.

    Exact (wsp with D = 0, BSP): a key's wave that c_global has not reached is held back until
    every live VW has pushed it, then added in VW order (ps_server/wave_hold.py): a pull gets
    w_global with every VW's waves below c_global and none later, and the same sums in the same
    order whatever the order of arrival.
    Under WSP with D told (every Init of a job names it), a push of wave c of a key whose
    c_global is below c - D, which would take a VW past G4's clock distance D + 1, is refused.
    """

    def __init__(self) -> None:
        self.virtual_workers = 0
        self.values: dict[str, torch.Tensor] = {}
        self.clocks: dict[str, list[int]] = {}
        self.pushes_applied = 0
        self.pushes_duplicate = 0
        self.max_clock_distance = 0
        self.evicted: set[int] = set()  # VWs that left the job: c_global no longer waits for them
        self.rule = SyncRule()
        self.rounds: dict[str, KeyRounds] = {}                  # quorum: per key
        self.exchanges = Exchanges()                            # elastic: each (key, VW)'s, for its retry
        self.hold = WaveHold()                                  # exact: each key's waves not yet complete
        self.headroom = headroom.Headroom()   # how far each key is from overflowing; not state (derived)
        self._adder = Adder()   # a bf16 push's adds, widened a chunk at a time

    @property
    def ready(self) -> bool:
        return self.virtual_workers > 0

    @property
    def generation(self) -> tuple[int, int, int]:
        """Differs whenever the values may have changed since: only an applied push or exchange
        changes them, or an eviction (a quorum round may close). Init adds keys and leaves the
        values of the others; restore builds a new servicer."""
        return self.pushes_applied, self.exchanges.applied, len(self.evicted)

    def check_init(self, virtual_workers: int, rule: SyncRule = SyncRule()) -> None:
        if not 1 <= virtual_workers <= MAX_VIRTUAL_WORKERS:
            raise ShardError(ShardError.Kind.INVALID,
                             f"virtual_workers must be in [1, {MAX_VIRTUAL_WORKERS}], got {virtual_workers}")
        rule.check(virtual_workers)

    def init(self, virtual_workers: int, tensors: Sequence[tuple[str, torch.Tensor]],
             clocks: Sequence[int] = (), rule: SyncRule = SyncRule()) -> bool:
        """Registers keys with their initial values (w0); each stage of VW 0 brings its own. A job
        resumed from a checkpoint brings the checkpoint's values and each VW's clock.

        A key already registered must come with the same value: a retried Init is a no-op.
        Returns whether any key was new. New keys are refused once a push has been applied.
        """
        self.check_init(virtual_workers, rule)
        if clocks and len(clocks) != virtual_workers:
            raise ShardError(ShardError.Kind.INVALID, f"{len(clocks)} clocks for {virtual_workers} virtual workers")
        if clocks and rule.mode != "wsp":  # a checkpoint holds no open rounds, no exchange counts
            raise ShardError(ShardError.Kind.INVALID, f"resuming with clocks is for sync wsp, not {rule.mode}")
        if clocks and rule.exact and len(set(clocks)) > 1:  # the values hold no record of which waves are ahead
            raise ShardError(ShardError.Kind.INVALID, f"exact pulls resume with every VW at one clock, not {list(clocks)[:8]}")
        if any(not 0 <= c <= MAX_STEPS for c in clocks):
            raise ShardError(ShardError.Kind.INVALID, f"resume clocks must be in [0, {MAX_STEPS}], got {list(clocks)[:8]}")
        if rule.mode == "elastic":  # alpha * (replica - master) is a fraction
            integral = [k for k, v in tensors if not v.is_floating_point()]
            if integral:
                raise ShardError(ShardError.Kind.INVALID, f"sync elastic needs floating-point keys, not {integral[:5]}")
        headroom.magnitudes("w0", tensors)
        named = dict(tensors)
        if len(named) != len(tensors) or not named:
            raise ShardError(ShardError.Kind.INVALID, "Init needs at least one key, each named once")
        if self.ready and virtual_workers != self.virtual_workers:
            raise ShardError(ShardError.Kind.CONFLICT, f"shard already initialised for {self.virtual_workers} "
                                                       f"virtual workers, not {virtual_workers}")
        if self.ready and rule != self.rule:
            raise ShardError(ShardError.Kind.CONFLICT, f"shard already initialised for {self.rule}, not {rule}")
        clashing = [k for k, v in named.items() if k in self.values and not self._same_tensor(self.values[k], v)]
        if clashing:
            raise ShardError(ShardError.Kind.CONFLICT, f"shard already initialised with other values for {clashing[:5]}")
        new = {k: v for k, v in named.items() if k not in self.values}
        training = bool(self.pushes_applied or self.exchanges.applied)
        if new and training:
            raise ShardError(ShardError.Kind.CONFLICT, f"new keys {sorted(new)[:5]} after training began")
        # Until training begins every key holds the clocks its Init brought, one set for the job
        # (a checkpoint's, or all 0): an Init at other clocks is not a retry, and its keys beside the
        # others' would never take a push of both (a key's clock must match).
        wanted = [int(c) for c in clocks] if clocks else [0] * virtual_workers
        held = next(iter(self.clocks.values()), wanted)
        if not training and held != wanted:
            raise ShardError(ShardError.Kind.CONFLICT, f"shard already initialised at clocks {held[:8]}, "
                                                       f"not {wanted[:8]}")
        self.virtual_workers = virtual_workers
        self.rule = rule
        for key, value in new.items():
            self.values[key] = value.clone()
            self.clocks[key] = list(wanted)
            if rule.mode == "quorum":
                self.rounds[key] = KeyRounds(virtual_workers)
            elif rule.mode == "elastic":
                self.exchanges.add_key(key, virtual_workers)
        if new and clocks:   # a resumed job's spread: later pushes only record what they widen
            self.max_clock_distance = max(self.max_clock_distance, self.clock_distance())
        return bool(new)

    @staticmethod
    def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))

    def _require_ready(self) -> None:
        if not self.ready:
            raise ShardError(ShardError.Kind.NOT_READY, "shard has no keys yet: Init first")

    def _check_vw(self, vw: int) -> None:
        if not 0 <= vw < self.virtual_workers:
            raise ShardError(ShardError.Kind.INVALID, f"unknown vw {vw}: the job has vws 0..{self.virtual_workers - 1}")
        if vw in self.evicted:
            raise ShardError(ShardError.Kind.CLOCK, f"vw {vw} was evicted from the job")

    def _live(self) -> list[int]:
        return [v for v in range(self.virtual_workers) if v not in self.evicted]

    def evict(self, vw: int) -> bool:
        """A VW leaves the job: its applied pushes stay in w_global, c_global and the clock
        distance no longer count it, and it may neither push nor pull. Returns whether it was
        new; the last VW cannot leave."""
        self._require_ready()
        if vw in self.evicted:
            return False
        self._check_vw(vw)
        if self._live() == [vw]:
            raise ShardError(ShardError.Kind.CLOCK, f"vw {vw} is the last one left: the job cannot go on without it")
        self.evicted.add(vw)
        self._settle(list(self.rounds))  # quorum: a round may now have the quorum of the VWs left
        # exact: a wave it had not pushed may now be complete (the caller lets no add run meanwhile)
        self.add(Sums(frozenset(), self._released(self.hold.keys())[1]))
        return True

    def _check_keys(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ShardError(ShardError.Kind.INVALID, "no keys given")
        if len(set(keys)) != len(keys):
            raise ShardError(ShardError.Kind.INVALID, "a key is named twice")
        foreign = [k for k in keys if k not in self.values]
        if foreign:
            raise ShardError(ShardError.Kind.NOT_OWNED, f"keys not owned by this shard: {foreign[:5]}")

    def check_push(self, vw: int, metas: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """What a push must name: a known VW, keys of this shard, each once, in the key's dtype and
        shape. Callable on the header alone, before any tensor is received."""
        self._require_ready()
        if self.rule.mode == "elastic":
            raise ShardError(ShardError.Kind.MODE, f"push of vw {vw}: this shard runs sync elastic, whose "
                                                   "replicas exchange with the master (Exchange) and push nothing")
        self._check_metas(vw, metas, "delta", narrowed=True)

    def _check_metas(self, vw: int, metas: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], what: str,
                     narrowed: bool = False) -> None:
        """narrowed: a key also takes its NARROWED_PUSH dtype (a bf16 job's pushes)."""
        self._check_vw(vw)
        self._check_keys([k for k, _, _ in metas])
        for key, dtype, shape in metas:
            want = self.values[key]
            taken = dtype == want.dtype or (narrowed and NARROWED_PUSH.get(want.dtype) == dtype)
            if not taken or shape != tuple(want.shape):
                raise ShardError(
                    ShardError.Kind.INVALID,
                    f"{key}: {what} is {dtype} {list(shape)}, the key is {want.dtype} {list(want.shape)}",
                )

    def push(self, vw: int, clock: int, deltas: Sequence[tuple[str, torch.Tensor]],
             journal: Callable[[], None] | None = None, sizes: dict[str, float] | None = None, *,
             applied_before: bool = False) -> bool:
        """G1: adds VW vw's wave-`clock` update once. Returns False for a retried duplicate.

        All-or-nothing: every key is validated before any is changed. `journal` (the durable push
        log) runs after validation, right before the update is applied; if it raises, nothing is.
        sizes: push_sizes(vw, clock, deltas), where the caller has measured them already.
        applied_before: a push that log replay brings back (G4 is not asked again: see accept).
        """
        sums = self.accept(vw, clock, deltas, journal, sizes, applied_before=applied_before)
        if sums is not None:
            self.add(sums)
        return sums is not None

    def accept(self, vw: int, clock: int, deltas: Sequence[tuple[str, torch.Tensor]],
               journal: Callable[[], None] | None = None, sizes: dict[str, float] | None = None, *,
               applied_before: bool = False) -> Sums | None:
        """push() but for the adds to w_global, which it returns (None: a duplicate), for add().
        The servicer adds them outside its lock: until add() returns, nothing may read or add
        to those keys' values (pulls, other pushes of them, snapshots, digests).

        applied_before: log replay of a push that this shard applied before (its entry has a place),
        when it met G4. A power cut may since have taken a slower VW's unsynced push from the log
        (its pusher shared the machine and died with it): the push is kept all the same, as it may
        have been acknowledged, and exact pulls hold its wave with the others'."""
        self.check_push(vw, [(k, d.dtype, tuple(d.shape)) for k, d in deltas])
        quorum = self.rule.mode == "quorum"
        if quorum:
            # A bf16 push is widened whole for the sums that quorum rounds keep in the key's
            # dtype. Otherwise it stays bf16 until it is added, a chunk at a time (ps_server.adds): its
            # magnitudes below are those of its widened values, widening being exact.
            deltas = [(k, d if d.dtype == self.values[k].dtype else d.to(self.values[k].dtype)) for k, d in deltas]
        what = headroom.push_what(vw, clock)
        if sizes is None:
            sizes = headroom.push_sizes(vw, clock, deltas)
        keys = [k for k, _ in deltas]
        if is_retry({self.clocks[k][vw] for k in keys}, clock, what, "its clock for these keys is"):
            self.pushes_duplicate += 1
            return None
        if quorum and clock >= self.rule.total_waves:
            raise ShardError(ShardError.Kind.CLOCK, f"push of vw {vw} for clock {clock}: the job has "
                                                    f"{self.rule.total_waves} waves per virtual worker")
        lead = self.rule.lead
        past = {} if lead is None else self._past_lead(clock, keys, lead)
        if past and not applied_before:
            raise self._past_g4(vw, clock, past, lead)
        # Under quorum w_global + u is not the next state (the round may wait): the bound decides.
        # Exact: the sums the values take as u's wave goes in, in VW order, so far.
        exact = self.rule.exact
        after = None if quorum else (lambda key, u: self._after_wave(key, clock, vw, u)) if exact else self._after
        grown = self._room(what, deltas, sizes, after)
        # A round's first contribution is copied here, before the journal: nothing after it may
        # fail half-way (a MemoryError there left some keys counted and others not).
        firsts = {k: d.clone() for k, d in deltas if self.rounds[k].takes_copy(clock)} if quorum else {}
        if journal is not None:
            journal()
        self.headroom.commit(grown)
        adds: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, delta in deltas:
            if quorum:
                self.rounds[key].add(vw, clock, delta, first=firsts.get(key))
            elif exact:
                self.hold.hold(key, clock, vw, delta)
            else:
                adds.append((self.values[key], delta))
            self.clocks[key][vw] = clock + 1
        changed = frozenset(keys)
        if exact:
            changed, adds = self._released(keys)
        self._settle(keys if quorum else [])
        self.pushes_applied += 1
        if not past:   # replayed past G4: what made the gap is a slower VW's lost push
            self._note_distance(vw, replayed=applied_before)
        return Sums(changed, adds)

    def _note_distance(self, vw: int, *, replayed: bool = False) -> None:
        """max_clock_distance after vw's push. Only a push that leaves vw the fastest can widen the
        spread: after a power cut took a slower VW's pushes, that VW's catch-up does not count.
        replayed: log replay, where a spread past G4's D + 1 is not counted either. Each push met G4
        when it was applied, so only a lost push can make one: of another key, whose clock counts
        in a VW's (the min over keys), where it does not in the push's own G4 check."""
        clocks = self.vw_clocks()
        live = [clocks[v] for v in self._live()]
        distance = clock_distance(live)
        lead = self.rule.lead
        if replayed and lead is not None and distance > lead + 1:
            return
        if clocks[vw] >= max(live):
            self.max_clock_distance = max(self.max_clock_distance, distance)

    def _released(self, keys: Iterable[str]) -> tuple[frozenset[str], list[tuple[torch.Tensor, torch.Tensor]]]:
        """exact: the keys among these whose held waves every live VW has now pushed, and those
        waves' adds, in wave then VW order."""
        released, adds = set(), []
        for key in keys:
            wave = self.hold.wave(key)
            if wave is not None and (c_global := self._key_c_global(key)) > wave:
                released.add(key)
                adds += [(self.values[key], delta) for delta in self.hold.release(key, c_global)]
        return frozenset(released), adds

    def add(self, sums: Sums) -> None:
        """Adds an accepted push's sums to w_global (what accept() left to do)."""
        for value, delta in sums.adds:
            self._adder.add(value, delta)

    def _key_c_global(self, key: str) -> int:
        return min(self.clocks[key][v] for v in self._live())

    def held_back(self, vw: int, clock: int, keys: Iterable[str]) -> bool:
        """Whether G4 holds vw's push of wave `clock` back now (its next wave for every key, some
        key's c_global below clock - D): the servicer lets it wait for the slower VWs, as a pull
        waits, since c_global can step back while a restarted shard's pushers send again what a
        power cut took from its log."""
        lead = self.rule.lead
        keys = list(keys)
        if lead is None or not 0 <= vw < self.virtual_workers or not all(k in self.clocks for k in keys):
            return False
        return all(self.clocks[k][vw] == clock for k in keys) and bool(self._past_lead(clock, keys, lead))

    def _past_lead(self, clock: int, keys: Sequence[str], lead: int) -> dict[str, int]:
        return {k: c for k in keys if clock > (c := self._key_c_global(k)) + lead}

    @staticmethod
    def _past_g4(vw: int, clock: int, past: dict[str, int], lead: int | None) -> ShardError:
        """G4: a VW pushes wave c only once c_global >= c - D (a stage's G2 wait before the wave's last
        forward ensures it), so the clock distance never passes D + 1. Exact pulls (D = 0) then hold
        one wave per key (WaveHold)."""
        return ShardError(ShardError.Kind.CLOCK,
                          f"push of vw {vw} for clock {clock}: G4 with D = {lead} takes wave c only once c_global "
                          f">= c - D, and c_global is {sorted(set(past.values()))} for {sorted(past)[:5]}")

    def _room(self, what: str, updates: Sequence[tuple[str, torch.Tensor]], sizes: dict[str, float],
              after: Callable[[str, torch.Tensor], float] | None) -> dict[str, float]:
        """Each key's headroom bound once its update is added; refused where it could overflow.
        after(key, u): max |x| over what key holds once u is in (None: the bound decides alone)."""
        grown, over = self.headroom.room(updates, sizes, self._reach, after, {k: self.values[k].dtype for k, _ in updates})
        if over:
            raise ShardError(ShardError.Kind.OVERFLOW, f"{what}: adding it could overflow w_global in {over[:5]} "
                                                      "(past the largest finite value of the key's dtype)")
        return grown

    def _reach(self, key: str) -> float:
        """A fresh bound of |x| over what key may hold: its values, plus (quorum) its open rounds,
        which are added to them in turn; one rounding per sum."""
        book = self.rounds.get(key)
        waiting = [] if book is None else [r.total for r in book.open.values() if r.total is not None]
        waiting += self.hold.deltas(key)
        total = headroom.magnitude(self.values[key]) + sum(headroom.magnitude(t) for t in waiting)
        return total * (1 + torch.finfo(self.values[key].dtype).eps) ** (len(waiting) + 1)

    def _after(self, key: str, u: torch.Tensor) -> float:
        """max |x| over key's values once u is added."""
        return headroom.magnitude(self.values[key] + u)

    def _after_wave(self, key: str, wave: int, vw: int, u: torch.Tensor) -> float:
        """exact: max |x| over the sums key's values take as its held waves go in with vw's u of
        `wave`, in wave then VW order (each push checks the sums of those come so far; the last, all)."""
        x = self.values[key]
        peak = headroom.magnitude(x)   # the bound this commits must cover what the values hold now
        for delta in self.hold.deltas(key, joined=(wave, vw, u)):
            x = x + delta
            peak = max(peak, headroom.magnitude(x))
        return peak

    def _settle(self, keys: Sequence[str]) -> None:
        """quorum: closes every round of these keys that has its quorum; once every live VW has
        pushed its last wave for a key, applies all that still waits (the final flush)."""
        live = self._live()
        for key in keys:
            book = self.rounds[key]
            book.close_ready(self.values[key], self.rule.quorum, live)
            if all(self.clocks[key][v] >= self.rule.total_waves for v in live):
                book.flush(self.values[key], self.rule.total_waves)

    # ---- elastic averaging ---------------------------------------------------------------------

    def check_exchange(self, vw: int, metas: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """What an exchange must name, like a push: checkable on the header alone."""
        self._require_ready()
        if self.rule.mode != "elastic":
            raise ShardError(ShardError.Kind.MODE, f"exchange of vw {vw}: this shard runs sync {self.rule.mode}; "
                                                   "exchanges are for sync elastic")
        self._check_metas(vw, metas, "value")

    def exchange(self, vw: int, clock: int, replica: Sequence[tuple[str, torch.Tensor]],
                 journal: Callable[[], None] | None = None) -> ExchangeResult:
        """Exchange `clock` of VW vw: delta = alpha * (x_i - x~) per key, x~ += delta, once per
        (vw, key, clock); the VW subtracts delta from its replica. A retry of its latest exchange
        gets the stored deltas and changes nothing. Validated whole first; `journal` as for push."""
        self.check_exchange(vw, [(k, t.dtype, tuple(t.shape)) for k, t in replica])
        what = f"exchange of vw {vw} for clock {clock}"
        headroom.magnitudes(what, replica)
        stored = self.exchanges.retry(vw, clock, [k for k, _ in replica])
        if stored is not None:
            return ExchangeResult(stored, applied=False)
        last = elastic.total_exchanges(self.rule.total_waves, self.rule.period)
        if clock >= last:
            raise ShardError(ShardError.Kind.CLOCK, f"exchange of vw {vw} for clock {clock}: the job has {last} "
                                                    "exchanges per virtual worker")
        computed = [(key, elastic.elastic_delta(value, self.values[key], self.rule.alpha)) for key, value in replica]
        # replica - master may overflow: an Inf delta is refused as an overflow, not as the replica's.
        grown = self._room(what, computed, {k: headroom.magnitude(d) for k, d in computed}, self._after)
        # The reply's copies before the journal: nothing after it may fail half-way.
        deltas = [(key, delta.clone()) for key, delta in computed]
        if journal is not None:
            journal()
        self.headroom.commit(grown)
        for key, delta in computed:
            self.values[key].add_(delta)
        self.exchanges.record(vw, clock, computed)
        self.max_clock_distance = max(self.max_clock_distance, self.clock_distance())
        return ExchangeResult(deltas, applied=True)

    # ---- clocks ----------------------------------------------------------------------------------

    def _clock(self, key: str, vw: int) -> int:
        """vw's clock for key: its waves pushed, or (elastic) the waves its exchanges followed."""
        if self.rule.mode == "elastic":
            return elastic.waves_covered(self.exchanges.count[key][vw], self.rule.period, self.rule.total_waves)
        return self.clocks[key][vw]

    def key_clocks(self, vw: int) -> list[int]:
        """vw's clock for every key of this shard."""
        return [self._clock(k, vw) for k in self.clocks]

    def c_global(self, keys: Sequence[str] | None = None) -> int:
        """Min over keys and VWs of the pushed clock: waves < c_global of every VW are included.
        quorum: the min over keys of the rounds closed (every VW's waves < c_global included)."""
        self._require_ready()
        ks = keys if keys is not None else self.clocks
        if self.rule.mode == "quorum":
            return min(self.rounds[k].closed for k in ks)
        live = self._live()
        return min(min(self._clock(k, v) for v in live) for k in ks)

    def vw_clocks(self, keys: Sequence[str] | None = None) -> list[int]:
        ks = list(keys if keys is not None else self.clocks)
        return [min(self._clock(k, v) for k in ks) for v in range(self.virtual_workers)]

    def clock_distance(self) -> int:
        """G4: spread between the fastest and slowest VW (each VW's clock = min over keys)."""
        if not self.ready:
            return 0
        clocks = self.vw_clocks()
        return clock_distance([clocks[v] for v in self._live()])

    def check_pull(self, vw: int, keys: Sequence[str]) -> None:
        self._require_ready()
        self._check_vw(vw)
        self._check_keys(keys)

    def pull(self, vw: int, keys: Sequence[str], *, copy: bool = True) -> PullResult:
        """G2/G3: current values with exactly what they include (call when c_global is enough).
        copy=False: the live tensors, for a caller that copies them out before it lets go of
        the shard's lock."""
        self.check_pull(vw, keys)
        # G3 adds the puller's own waves >= own_clock: under quorum those not yet in a closed round.
        quorum = self.rule.mode == "quorum"
        own = [self.rounds[k].applied[vw] if quorum else self._clock(k, vw) for k in keys]
        if self.rule.exact:   # its own waves from c_global on are taken out too: G3 adds them back
            own = [min(o, self._key_c_global(k)) for o, k in zip(own, keys)]
        return PullResult(
            values=[(k, self.values[k].clone() if copy else self.values[k]) for k in keys],
            own_clock=own,
            vw_clocks=self.vw_clocks(keys),
            c_global=self.c_global(keys),
        )

    def digest(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self.values):
            h.update(key.encode())
            h.update(raw_bytes(self.values[key]))
            h.update(str(self.clocks[key]).encode())
        h.update(str(sorted(self.evicted)).encode())
        self.hold.feed(h)   # exact: the waves not yet complete
        if self.rule.mode != "wsp":
            h.update(str(self.rule).encode())
            for key in sorted(self.rounds):
                self.rounds[key].feed(h)
            self.exchanges.feed(h)
        return h.hexdigest()

    # ---- durability ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """Plain tensors and ints only, so it loads with torch.load(weights_only=True)."""
        return {
            "virtual_workers": self.virtual_workers,
            "values": {k: v.clone() for k, v in self.values.items()},
            "clocks": {k: torch.tensor(c, dtype=torch.int64) for k, c in self.clocks.items()},
            "pushes_applied": self.pushes_applied,
            "max_clock_distance": self.max_clock_distance,
            "evicted": torch.tensor(sorted(self.evicted), dtype=torch.int64),
            "sync": {"mode": self.rule.mode, "quorum": self.rule.quorum, "alpha": self.rule.alpha,
                     "period": self.rule.period, "total_waves": self.rule.total_waves, "exact": self.rule.exact,
                     "D": self.rule.D},
            "held": self.hold.snapshot(),
            "rounds": {k: book.snapshot() for k, book in self.rounds.items()},
            **self.exchanges.snapshot(),
        }

    def restore(self, snap: Mapping[str, object]) -> None:
        values = snap["values"]
        clocks = snap["clocks"]
        assert isinstance(values, dict) and isinstance(clocks, dict)
        self.virtual_workers = int(snap["virtual_workers"])  # type: ignore[call-overload]
        self.values = {k: v.clone() for k, v in values.items()}
        self.headroom = headroom.Headroom()
        self.clocks = {k: [int(c) for c in t.tolist()] for k, t in clocks.items()}
        self.pushes_applied = int(snap["pushes_applied"])  # type: ignore[call-overload]
        self.max_clock_distance = int(snap["max_clock_distance"])  # type: ignore[call-overload]
        evicted = snap.get("evicted")
        self.evicted = {int(v) for v in evicted.tolist()} if isinstance(evicted, torch.Tensor) else set()
        rule, rounds = snap.get("sync") or {}, snap.get("rounds") or {}
        assert isinstance(rule, dict) and isinstance(rounds, dict)
        self.rule = SyncRule(**rule)
        self.rounds = {k: KeyRounds.restored(book) for k, book in rounds.items()}
        self.exchanges = Exchanges.restored(snap)
        if snap.get("at_c_global"):   # an older version's copies of values at c_global: not the held waves
            raise ValueError("a checkpoint of exact pulls from an earlier version of the shard: start the job afresh")
        held = snap.get("held") or {}
        assert isinstance(held, dict)
        self.hold = WaveHold.restored(held)
