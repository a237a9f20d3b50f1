"""The shard's WSP clock logic (DESIGN §3 G1, G2, G4; O3) against a tiny independent reference model.

A hypothesis state machine drives `ps_server.shard.Shard`, made durable with
`ps_server.durability.Durability` the way the servicer does (Init -> checkpoint; every push ->
log_push once validated and before it is applied, then maybe_checkpoint), through random
interleavings of:

- pushes of the next wave for a random VW and a random subset of keys (stages of one VW own
  different keys of the same shard, so keys of one VW legitimately run at different clocks);
- pushes whose log write fails (nothing applied; the retry then applies);
- retries of any earlier push (the latest one for its keys must be a no-op returning False; an
  older one is a clock going backwards);
- invalid pushes, one fault each (clock ahead / backwards by 2+, unknown VW, unknown key, wrong
  shape, wrong dtype, a key named twice, no keys, keys at different clocks), which must raise
  ShardError of the right kind and change nothing (`digest()` before == after);
- pulls, valid and invalid, whose values and clocks must match the reference;
- checkpoints, including one whose log clean-up was cut short by a crash;
- restarts: a fresh Shard restored by a fresh Durability from the same directory, after which
  every acknowledged push must be there exactly once.

The reference is written from DESIGN §3, not from the Shard: w[key] (float64) plus a clock per
(key, vw) = waves of that VW applied to that key. A push of wave c by vw for keys K is applied
iff every clock (k, vw), k in K, is c; it is a retry (no-op) iff every such clock is c + 1; any
other clock is refused. c_global = min over keys and VWs; a VW's clock is the min over keys.
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
from ps_server.durability import Durability
from ps_server.shard import Shard, ShardError

pytestmark = pytest.mark.timeout(120)

Kind = ShardError.Kind
KEY_SHAPES: list[tuple[str, tuple[int, ...]]] = [("l0.weight", (2, 3)), ("l0.bias", (3,)), ("l1.weight", (2, 3))]
Deltas = list[tuple[str, torch.Tensor]]


# ---- the reference model ---------------------------------------------------------------------------


class RefShard:
    """DESIGN §3 for one shard: float64 weights, a clock per (key, vw), and the acknowledged pushes."""

    def __init__(self, n: int, init: dict[str, torch.Tensor]) -> None:
        self.n = n
        self.w0 = {k: v.clone() for k, v in init.items()}
        self.w = {k: v.clone() for k, v in init.items()}
        self.clock = {(k, v): 0 for k in init for v in range(n)}
        self.acked: list[tuple[int, int, Deltas]] = []   # every push answered "applied", in order
        self.max_distance = 0

    def expect_push(self, vw: int, c: int, deltas: Deltas) -> str | Kind:
        """'applied', 'duplicate', or the kind of refusal; changes nothing."""
        keys = [k for k, _ in deltas]
        if not 0 <= vw < self.n or not keys or len(set(keys)) != len(keys):
            return Kind.INVALID
        if any(k not in self.w for k in keys):
            return Kind.NOT_OWNED
        if any(d.dtype != self.w[k].dtype or d.shape != self.w[k].shape for k, d in deltas):
            return Kind.INVALID
        clocks = [self.clock[(k, vw)] for k in keys]
        if all(x == c for x in clocks):
            return "applied"
        if all(x == c + 1 for x in clocks):
            return "duplicate"
        return Kind.CLOCK

    def apply(self, vw: int, c: int, deltas: Deltas) -> None:
        for k, d in deltas:
            self.w[k] = self.w[k] + d
            self.clock[(k, vw)] = c + 1
        self.acked.append((vw, c, [(k, d.clone()) for k, d in deltas]))
        self.max_distance = max(self.max_distance, clock_distance(self.vw_clocks()))

    def expect_pull(self, vw: int, keys: list[str]) -> Kind | None:
        if not 0 <= vw < self.n or not keys or len(set(keys)) != len(keys):
            return Kind.INVALID
        if any(k not in self.w for k in keys):
            return Kind.NOT_OWNED
        return None

    def vw_clocks(self, keys: list[str] | None = None) -> list[int]:
        ks = list(self.w) if keys is None else keys
        return [min(self.clock[(k, v)] for k in ks) for v in range(self.n)]

    def c_global(self, keys: list[str] | None = None) -> int:
        return min(self.vw_clocks(keys))

    def conserved(self) -> dict[str, torch.Tensor]:
        """O3: w0 + the sum of every acknowledged push, recomputed from scratch."""
        w = {k: v.clone() for k, v in self.w0.items()}
        for _, _, deltas in self.acked:
            for k, d in deltas:
                w[k] = w[k] + d
        return w


def tensor(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def assert_refused(kind: Kind, fn, *args) -> ShardError:  # type: ignore[no-untyped-def]
    with pytest.raises(ShardError) as info:
        fn(*args)
    assert info.value.kind == kind, f"{info.value.kind} ({info.value}), want {kind}"
    assert str(info.value), "a refusal must say what is wrong"
    return info.value


# ---- the state machine -----------------------------------------------------------------------------

INVALID_PUSHES = ["reinit", "ahead", "backwards", "unknown_vw", "unknown_key", "shape", "dtype", "dup_key", "no_keys",
                  "mixed"]


class ShardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Memory-backed when the host has it: the restarts model a killed process, not a lost disk.
        shm = Path("/dev/shm")
        self.dir = Path(tempfile.mkdtemp(prefix="shard-prop-", dir=shm if shm.is_dir() else None))
        self.restarts = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @initialize(n=st.integers(1, 3), nkeys=st.integers(1, 3), every=st.integers(1, 3), seed=st.integers(0, 2**16))
    def init(self, n: int, nkeys: int, every: int, seed: int) -> None:
        self.every = every
        self.shapes = dict(KEY_SHAPES[:nkeys])
        init = [(k, tensor(s, seed + i)) for i, (k, s) in enumerate(self.shapes.items())]
        self.shard = Shard()
        self.dur = Durability(str(self.dir), every)
        assert self.shard.init(n, init) is True
        self.dur.checkpoint(self.shard)  # as the servicer does on a fresh Init
        self.ref = RefShard(n, dict(init))
        assert self.shard.init(n, init) is False, "the same Init again is a no-op"

    # -- helpers -------------------------------------------------------------------------------------

    def _push(self, vw: int, c: int, deltas: Deltas) -> None:
        """Pushes through the shard as the servicer does and checks the outcome against the reference."""
        want = self.ref.expect_push(vw, c, deltas)
        before = self.shard.digest()
        logged: list[int] = []

        def journal() -> None:  # the servicer's: the push log, written before the push is applied
            self.dur.log_push(vw, c, deltas)
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
        self.dur.maybe_checkpoint(self.shard)
        self.ref.apply(vw, c, deltas)

    def _keys(self, data: st.DataObject) -> list[str]:
        return data.draw(st.lists(st.sampled_from(sorted(self.shapes)), min_size=1, unique=True), label="keys")

    def _deltas(self, keys: list[str], seed: int) -> Deltas:
        return [(k, tensor(self.shapes[k], seed + i)) for i, k in enumerate(keys)]

    # -- rules ---------------------------------------------------------------------------------------

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def push_next_wave(self, data: st.DataObject, seed: int) -> None:
        vw = data.draw(st.integers(0, self.ref.n - 1), label="vw")
        keys = self._keys(data)
        c = self.ref.clock[(keys[0], vw)]
        keys = [k for k in keys if self.ref.clock[(k, vw)] == c]  # one wave of one key group
        self._push(vw, c, self._deltas(keys, seed))
        assert self.ref.expect_push(vw, c, self._deltas(keys, seed)) == "duplicate"

    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def push_whose_log_write_fails(self, data: st.DataObject, seed: int) -> None:
        """A push that cannot be logged is not applied (so it is not acknowledged); its retry applies."""
        vw = data.draw(st.integers(0, self.ref.n - 1), label="vw")
        keys = self._keys(data)
        c = self.ref.clock[(keys[0], vw)]
        deltas = self._deltas([k for k in keys if self.ref.clock[(k, vw)] == c], seed)
        before = self.shard.digest()

        def journal() -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError):
            self.shard.push(vw, c, deltas, journal=journal)
        assert self.shard.digest() == before
        assert self.ref.expect_push(vw, c, deltas) == "applied", "the retry is not a duplicate"
        self._push(vw, c, deltas)

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
        assert_refused(Kind.CONFLICT, self.shard.init, self.ref.n, other)
        assert_refused(Kind.CONFLICT, self.shard.init, self.ref.n + 1, list(self.shard.values.items()))
        assert self.shard.digest() == before

    @rule(action=st.sampled_from(["checkpoint", "checkpoint_cut_short", "restart", "restart"]))
    def durability(self, action: str) -> None:
        if action == "checkpoint":
            self.dur.checkpoint(self.shard)
        else:
            getattr(self, action)()

    def checkpoint_cut_short(self) -> None:
        """A crash after the checkpoint is renamed into place but before the old log entries are deleted."""
        log = self.dur.log_dir
        saved = {p.name: p.read_bytes() for p in log.glob("*.pt")}
        self.dur.checkpoint(self.shard)
        for name, raw in saved.items():
            (log / name).write_bytes(raw)
        # ... and a torn write of the next log entry and the next checkpoint, never renamed.
        (log / f"{self.dur._seq + 1:012d}.tmp").write_bytes(b"torn")
        (self.dir / "checkpoint.tmp").write_bytes(b"torn")

    def restart(self) -> None:
        """kill -9 and start again: a fresh shard restored from the directory alone."""
        self.shard = Shard()
        self.dur = Durability(str(self.dir), self.every)
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


MACHINE_SETTINGS = settings(
    max_examples=40, stateful_step_count=30, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_shard_matches_reference_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # The restarts here model a killed process, not a lost machine: the page cache survives, so
    # fsync only costs time (it dominated the run).
    monkeypatch.setattr("ps_server.durability.os.fsync", lambda fd: None)
    run_state_machine_as_test(ShardMachine, settings=MACHINE_SETTINGS)


# ---- plain unit tests -------------------------------------------------------------------------------


def two_key_shard(n: int = 3) -> Shard:
    shard = Shard()
    assert shard.init(n, [("a", torch.zeros(2, 3, dtype=torch.float64)), ("b", torch.ones(3, dtype=torch.float64))])
    return shard


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
    assert shard.digest() == digest
    # Each stage of VW 0 brings its own keys: they add up, until training begins.
    assert shard.init(2, [("c", torch.zeros(1, dtype=torch.float64))]) is True
    assert sorted(shard.values) == ["a", "b", "c"] and shard.clocks["c"] == [0, 0]
    shard.push(0, 0, [("c", torch.ones(1, dtype=torch.float64))])
    err = assert_refused(Kind.CONFLICT, shard.init, 2, [("d", torch.zeros(1, dtype=torch.float64))])
    assert "after training began" in str(err)


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
            dur.log_push(vw, c, [ones("a", shard), ones("b", shard)])
    saved = {p: p.read_bytes() for p in dur.log_dir.glob("*.pt")}
    dur.checkpoint(shard)
    assert not list(dur.log_dir.glob("*.pt"))
    for p, raw in saved.items():
        p.write_bytes(raw)
    assert shard.push(0, 3, [ones("a", shard)])
    dur.log_push(0, 3, [ones("a", shard)])
    again, dur2 = Shard(), Durability(str(tmp_path), every_clocks=100)
    assert dur2.restore(again) == 1
    assert again.digest() == shard.digest() and again.pushes_applied == 7
    # New log entries continue after the highest sequence number on disk.
    assert again.push(1, 3, [ones("a", shard)])
    dur2.log_push(1, 3, [ones("a", shard)])
    third = Shard()
    Durability(str(tmp_path)).restore(third)
    assert third.digest() == again.digest() and third.pushes_applied == 8
