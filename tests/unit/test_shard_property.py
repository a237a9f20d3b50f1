"""The shard's WSP clock logic (DESIGN §3 G1, G2, G4; O3) against a tiny independent reference model.

A hypothesis state machine drives `ps_server.shard.Shard`, made durable with
`ps_server.durability.Durability` the way the servicer does (Init -> checkpoint; every push ->
journal_push once validated and before it is applied, then maybe_capture, whose checkpoint is
written later, outside the lock), through random interleavings of:

- pushes of the next wave for a random VW and a random subset of keys (stages of one VW own
  different keys of the same shard, so keys of one VW legitimately run at different clocks);
- pushes whose log write fails (nothing applied; the retry then applies);
- retries of any earlier push (the latest one for its keys must be a no-op returning False; an
  older one is a clock going backwards);
- invalid pushes, one fault each (clock ahead / backwards by 2+, unknown VW, unknown key, wrong
  shape, wrong dtype, a key named twice, no keys, keys at different clocks), which must raise
  ShardError of the right kind and change nothing (`digest()` before == after);
- pulls, valid and invalid, whose values and clocks must match the reference; on a shard of
  exact pulls (wsp with D = 0), with only the waves below each key's c_global, bit for bit;
- on a shard told D (exact pulls are D = 0), pushes G4 forbids: wave c of a key whose c_global
  is below c - D, refused;
- checkpoints, including one whose log clean-up was cut short by a crash, and captured ones
  written late and out of order (an older one must not overwrite a newer one) or never (killed);
- restarts: a fresh Shard restored by a fresh Durability from the same directory, after which
  every acknowledged push must be there exactly once.

The reference (tests/shard_reference.py) is written from DESIGN §3, not from the Shard: w[key]
(float64) plus a clock per (key, vw) = waves of that VW applied to that key. A push of wave c by
vw for keys K is applied iff every clock (k, vw), k in K, is c; it is a retry (no-op) iff every
such clock is c + 1; any other clock is refused. c_global = min over keys and VWs; a VW's clock
is the min over keys.

Hand-written cases of the same rules are in test_shard_cases.py.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hetpipe.wsp import clock_distance
from ps_server.durability import Durability, Snapshot
from ps_server.shard import Shard
from ps_server.sync_rule import ShardError, SyncRule
from shard_reference import Deltas, Kind, RefShard, assert_refused, log_push, tensor

pytestmark = pytest.mark.timeout(120)

KEY_SHAPES: list[tuple[str, tuple[int, ...]]] = [("l0.weight", (2, 3)), ("l0.bias", (3,)), ("l1.weight", (2, 3))]


# ---- the state machine -----------------------------------------------------------------------------

INVALID_PUSHES = ["reinit", "ahead", "backwards", "unknown_vw", "unknown_key", "shape", "dtype", "dup_key", "no_keys",
                  "mixed", "past_g4"]


class ShardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Memory-backed when the host has it: the restarts model a killed process, not a lost disk.
        shm = Path("/dev/shm")
        self.dir = Path(tempfile.mkdtemp(prefix="shard-prop-", dir=shm if shm.is_dir() else None))
        self.restarts = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(n=st.integers(1, 3), nkeys=st.integers(1, 3), every=st.integers(1, 3), seed=st.integers(0, 2**16),
                bound=st.sampled_from(["untold", "exact", 1, 2]))
    def init(self, n: int, nkeys: int, every: int, seed: int, bound: str | int) -> None:
        self.every = every
        self.shapes = dict(KEY_SHAPES[:nkeys])
        init = [(k, tensor(s, seed + i)) for i, (k, s) in enumerate(self.shapes.items())]
        self.shard = Shard()
        self.dur = Durability(str(self.dir), every)
        exact, D = bound == "exact", None if bound == "untold" else 0 if bound == "exact" else int(bound)
        self.rule = SyncRule("wsp", exact=exact, D=D)
        assert self.shard.init(n, init, (), self.rule) is True
        self.dur.checkpoint(self.shard)  # as the servicer does on a fresh Init
        self.captured: list[Snapshot] = []  # checkpoints captured and not yet written
        self.ref = RefShard(n, dict(init), exact=exact, D=D)
        assert self.shard.init(n, init, (), self.rule) is False, "the same Init again is a no-op"

    # -- helpers -------------------------------------------------------------------------------------

    def _push(self, vw: int, c: int, deltas: Deltas) -> None:
        """Pushes through the shard as the servicer does and checks the outcome against the reference."""
        want = self.ref.expect_push(vw, c, deltas)
        keys = [k for k, _ in deltas]
        if 0 <= vw < self.ref.n and all(k in self.shapes for k in keys):   # what the servicer lets wait
            g4 = all(self.ref.clock[(k, vw)] == c for k in keys) and self.ref.past_g4(c, keys)
            assert self.shard.held_back(vw, c, keys) == g4
        before = self.shard.digest()
        logged: list[int] = []

        def journal() -> None:  # the servicer's: the push log, written before the push is applied
            self.dur.journal_push(vw, c, deltas)
            logged.append(1)

        if isinstance(want, Kind):
            assert_refused(want, self.shard.push, vw, c, deltas, journal)
            assert self.shard.digest() == before, f"refused push ({want}) changed the shard"
            assert not logged, "a refused push must not reach the log"
            return
        applied = self.shard.push(vw, c, deltas, journal=journal)
        if want == "duplicate":
            assert applied is False
            assert self.shard.digest() == before, "a retried push changed the shard"
            assert not logged, "a duplicate must not reach the log"
            return
        assert applied is True and logged == [1]
        self._capture()
        self.ref.apply(vw, c, deltas)

    def _capture(self) -> None:
        """The servicer's: a checkpoint captured under the lock when due, written after it."""
        snapshot = self.dur.maybe_capture(self.shard)
        if snapshot is not None:
            self.captured.append(snapshot)

    def _keys(self, data: st.DataObject) -> list[str]:
        return data.draw(st.lists(st.sampled_from(sorted(self.shapes)), min_size=1, unique=True), label="keys")

    def _deltas(self, keys: list[str], seed: int) -> Deltas:
        return [(k, tensor(self.shapes[k], seed + i)) for i, k in enumerate(keys)]

    # -- rules ---------------------------------------------------------------------------------------

    def _next_wave(self, data: st.DataObject) -> tuple[int, int, list[str]]:
        """A VW, its next wave for a group of its keys, and those keys (none where G4, with the D
        the shard was told, lets that VW push none of them yet)."""
        vw = data.draw(st.integers(0, self.ref.n - 1), label="vw")
        keys = self._keys(data)
        c = self.ref.clock[(keys[0], vw)]
        keys = [k for k in keys if self.ref.clock[(k, vw)] == c]  # one wave of one key group
        return vw, c, [k for k in keys if not self.ref.past_g4(c, [k])]

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def push_next_wave(self, data: st.DataObject, seed: int) -> None:
        vw, c, keys = self._next_wave(data)
        if not keys:
            return
        self._push(vw, c, self._deltas(keys, seed))
        assert self.ref.expect_push(vw, c, self._deltas(keys, seed)) == "duplicate"

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def push_whose_log_write_fails(self, data: st.DataObject, seed: int) -> None:
        """A push that cannot be logged is not applied (so it is not acknowledged); its retry applies."""
        vw, c, keys = self._next_wave(data)
        if not keys:
            return
        deltas = self._deltas(keys, seed)
        before = self.shard.digest()

        def journal() -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError):
            self.shard.push(vw, c, deltas, journal=journal)
        assert self.shard.digest() == before
        assert self.ref.expect_push(vw, c, deltas) == "applied", "the retry is not a duplicate"
        self._push(vw, c, deltas)

    @rule(data=st.data(), seed=st.integers(0, 2**16), ahead=st.booleans(),
          between=st.sampled_from([None, None, "checkpoint", "restart"]))
    def push_logged_before_the_lock(self, data: st.DataObject, seed: int, ahead: bool, between: str | None) -> None:
        """The servicer's WSP path: the entry is written before the shard's lock is taken, then the
        push is applied or refused and the entry settled; another push's checkpoint, or a kill -9,
        may come in between. Killed there, the push was never acknowledged: the restored shard
        replays a valid one (its retry is then a duplicate) and skips a refused one."""
        vw = data.draw(st.integers(0, self.ref.n - 1), label="vw")
        keys = self._keys(data)
        c = self.ref.clock[(keys[0], vw)]
        deltas = self._deltas([k for k in keys if self.ref.clock[(k, vw)] == c], seed)
        c += 1 if ahead else 0   # skips a wave: refused once it is checked, after it was logged
        want = self.ref.expect_push(vw, c, deltas)
        seq, logged = log_push(self.dur, vw, c, deltas)
        if between == "checkpoint":
            self.dur.checkpoint(self.shard)
        elif between == "restart":
            if want == "applied":
                self.ref.apply(vw, c, deltas)
            self.restart()
            return
        self._apply_logged(vw, c, deltas, seq, logged)

    def _apply_logged(self, vw: int, c: int, deltas: Deltas, seq: int, logged: Deltas) -> None:
        """The servicer's WSP apply: from the push's entry, under the lock; then the entry settled."""
        want = self.ref.expect_push(vw, c, deltas)
        try:
            self.dur.place(seq)
            applied = self.shard.push(vw, c, logged)
        except ShardError as exc:
            assert want == exc.kind, f"refused with {exc.kind}, the reference says {want}"
            applied = False
        self.dur.settle(seq, applied=applied)
        assert applied == (want == "applied")
        if applied:
            self._capture()
            self.ref.apply(vw, c, deltas)

    @precondition(lambda self: self.ref.n > 1)
    @rule(data=st.data(), seed=st.integers(0, 2**16), restart=st.booleans())
    def pushes_applied_in_another_order_than_logged(self, data: st.DataObject, seed: int, restart: bool) -> None:
        """Two VWs' pushes logged before the lock, the one logged second applied first (it took
        the lock first); then maybe a kill -9. Sums depend on their order in their last bits, and
        check_state compares bit for bit: restore must replay the order of the applies."""
        first, second = data.draw(st.permutations(range(self.ref.n)), label="vws")[:2]
        logged = []
        for vw in (first, second):
            keys = self._keys(data)
            c = self.ref.clock[(keys[0], vw)]
            deltas = self._deltas([k for k in keys if self.ref.clock[(k, vw)] == c], seed + vw)
            logged.append((vw, c, deltas, *log_push(self.dur, vw, c, deltas)))
        for vw, c, deltas, seq, tensors in reversed(logged):
            self._apply_logged(vw, c, deltas, seq, tensors)
        if restart:
            self.restart()

    @precondition(lambda self: self.ref.acked)
    @rule(data=st.data(), latest=st.booleans())
    def retry_push(self, data: st.DataObject, latest: bool) -> None:
        """A retry of the latest push for its keys is a no-op; of an older one, a clock going backwards."""
        vw, c, deltas = self.ref.acked[-1] if latest else data.draw(st.sampled_from(self.ref.acked), label="retried")
        want = self.ref.expect_push(vw, c, deltas)
        assert want == "duplicate" if latest else want in ("duplicate", Kind.CLOCK)
        self._push(vw, c, deltas)

    @rule(data=st.data(), fault=st.sampled_from(INVALID_PUSHES), seed=st.integers(0, 2**16))
    def invalid_push(self, data: st.DataObject, fault: str, seed: int) -> None:
        vw = data.draw(st.integers(0, self.ref.n - 1), label="vw")
        keys = self._keys(data)
        c = self.ref.clock[(keys[0], vw)]
        keys = [k for k in keys if self.ref.clock[(k, vw)] == c]
        deltas = self._deltas(keys, seed)
        bad = data.draw(st.integers(0, len(deltas) - 1), label="bad key index")
        k0 = deltas[bad][0]
        if fault == "reinit":
            self.reinit_with_other_values(seed)
            return
        if fault == "ahead":
            c += data.draw(st.integers(1, 5), label="ahead by")  # c + 1 already skips wave c
        elif fault == "backwards":
            if c < 2:
                return
            c -= data.draw(st.integers(2, c), label="back by")
        elif fault == "unknown_vw":
            vw = self.ref.n + data.draw(st.integers(0, 3), label="vw past the end")
        elif fault == "unknown_key":
            deltas.insert(bad, ("not.mine", tensor((2, 3), seed)))
        elif fault == "shape":
            shape = self.shapes[k0]
            wrong = [(*shape, 1), (shape[0] + 1, *shape[1:])] + ([shape[::-1]] if shape[::-1] != shape else [])
            deltas[bad] = (k0, tensor(data.draw(st.sampled_from(wrong), label="wrong shape"), seed))
        elif fault == "dtype":
            deltas[bad] = (k0, deltas[bad][1].to(data.draw(st.sampled_from([torch.float32, torch.float16]))))
        elif fault == "dup_key":
            deltas.append((k0, deltas[bad][1].clone()))
        elif fault == "no_keys":
            deltas = []
        elif fault == "past_g4":   # the next wave, of keys a slower VW holds back by more than D
            deltas = [(k, d) for k, d in deltas if self.ref.past_g4(c, [k])]
            if not deltas:
                return
        elif fault == "mixed":
            clocks = {k: self.ref.clock[(k, vw)] for k in self.shapes}
            if len(set(clocks.values())) < 2:
                return
            deltas = self._deltas(sorted(self.shapes), seed)
            c = data.draw(st.sampled_from(sorted(set(clocks.values()))), label="clock of one key")
        want = self.ref.expect_push(vw, c, deltas)
        assert isinstance(want, Kind), f"{fault} must be refused"
        self._push(vw, c, deltas)

    @rule(data=st.data(), fault=st.sampled_from([None, None, "unknown_vw", "unknown_key", "no_keys", "dup_key"]))
    def pull(self, data: st.DataObject, fault: str | None) -> None:
        if fault is not None:
            self.invalid_pull(data, fault)
            return
        vw = data.draw(st.integers(0, self.ref.n - 1), label="vw")
        keys = data.draw(st.permutations(sorted(self.shapes)), label="order")
        keys = keys[: data.draw(st.integers(1, len(keys)), label="how many")]
        result = self.shard.pull(vw, keys)
        assert [k for k, _ in result.values] == keys
        if self.rule.exact:   # the values at c_global, bit for bit
            want, own = self.ref.exact_pull(vw, keys)
            for k, v in result.values:
                assert v.dtype == torch.float64 and torch.equal(v, want[k]), k
            assert result.own_clock == own
        else:
            for k, v in result.values:
                assert v.dtype == torch.float64 and torch.equal(v, self.ref.w[k]), k
            assert result.own_clock == [self.ref.clock[(k, vw)] for k in keys]
        assert result.vw_clocks == self.ref.vw_clocks(keys)
        assert result.c_global == self.ref.c_global(keys)
        # The pulled tensors are copies: changing them must not touch w_global.
        before = self.shard.digest()
        for _, v in result.values:
            v.add_(1.0)
        assert self.shard.digest() == before

    def invalid_pull(self, data: st.DataObject, fault: str) -> None:
        vw, keys = 0, sorted(self.shapes)
        if fault == "unknown_vw":
            vw = self.ref.n + data.draw(st.integers(0, 3))
        elif fault == "unknown_key":
            keys = [*keys, "not.mine"]
        elif fault == "no_keys":
            keys = []
        else:
            keys = [*keys, keys[0]]
        want = self.ref.expect_pull(vw, keys)
        assert want is not None
        before = self.shard.digest()
        assert_refused(want, self.shard.pull, vw, keys)
        assert_refused(want, self.shard.check_pull, vw, keys)
        assert self.shard.digest() == before

    def reinit_with_other_values(self, seed: int) -> None:
        before = self.shard.digest()
        other = [(k, tensor(s, seed) + 1000.0) for k, s in self.shapes.items()]
        assert_refused(Kind.CONFLICT, self.shard.init, self.ref.n, other, (), self.rule)
        assert_refused(Kind.CONFLICT, self.shard.init, self.ref.n + 1, list(self.shard.values.items()), (), self.rule)
        assert self.shard.digest() == before

    @rule(action=st.sampled_from(["checkpoint", "checkpoint_cut_short", "restart", "restart"]))
    def durability(self, action: str) -> None:
        if action == "checkpoint":
            self.dur.checkpoint(self.shard)
        else:
            getattr(self, action)()

    @precondition(lambda self: getattr(self, "captured", None))
    @rule(data=st.data())
    def write_captured(self, data: st.DataObject) -> None:
        """A checkpoint captured by some push, written now: maybe after one captured later."""
        snapshot = self.captured.pop(data.draw(st.integers(0, len(self.captured) - 1), label="captured"))
        self.dur.write(snapshot)

    def checkpoint_cut_short(self) -> None:
        """A crash after the checkpoint is renamed into place but before the old log entries are deleted."""
        log = self.dur.log_dir
        saved = {p.name: p.read_bytes() for p in log.glob("*.safetensors")}
        self.dur.checkpoint(self.shard)
        for name, raw in saved.items():
            (log / name).write_bytes(raw)
        # ... and a torn write of the next log entry and the next checkpoint, never renamed.
        (log / f"{self.dur._seq + 1:012d}.safetensors.tmp").write_bytes(b"torn")
        (self.dir / "checkpoint.pt.tmp").write_bytes(b"torn")

    def restart(self) -> None:
        """kill -9 and start again: a fresh shard restored from the directory alone."""
        self.shard = Shard()
        self.dur = Durability(str(self.dir), self.every)
        self.captured = []  # killed before they were written
        self.dur.restore(self.shard)
        self.restarts += 1
        self.check_state()

    # -- invariants ----------------------------------------------------------------------------------

    @invariant()
    def check_state(self) -> None:
        if not hasattr(self, "ref"):
            return
        s, ref = self.shard, self.ref
        assert s.ready and s.virtual_workers == ref.n
        assert sorted(s.values) == sorted(ref.w)
        for k in ref.w:
            assert torch.equal(s.values[k], ref.w[k]), f"{k} differs from the reference"
            assert s.clocks[k] == [ref.clock[(k, v)] for v in range(ref.n)], k
        assert s.c_global() == ref.c_global()
        assert s.vw_clocks() == ref.vw_clocks()
        assert s.clock_distance() == clock_distance(ref.vw_clocks())
        assert s.max_clock_distance == ref.max_distance
        assert s.pushes_applied == len(ref.acked), "every acknowledged push exactly once"
        conserved = ref.conserved()
        for k in ref.w:
            assert torch.equal(s.values[k], conserved[k]), f"O3 fails for {k}"
            if ref.exact:   # the waves not yet complete: held, each push once
                held = s.hold.deltas(k)
                assert len(held) == len(ref.held(k)) and all(map(torch.equal, held, ref.held(k))), f"O3: {k}'s held"
            else:
                assert not s.hold


MACHINE_SETTINGS = settings(
    max_examples=40, stateful_step_count=30, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_shard_matches_reference_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # The restarts here model a killed process, not a lost machine: the page cache survives, so
    # fsync only costs time (it dominated the run).
    monkeypatch.setattr("hetpipe.outputs.os.fsync", lambda fd: None)  # the shard's durable saves
    run_state_machine_as_test(ShardMachine, settings=MACHINE_SETTINGS)
