"""One shard's global weights and per-(key, VW) clocks: the WSP push/pull rules, no I/O."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hetpipe.config import MAX_VIRTUAL_WORKERS
from hetpipe.wsp import clock_distance


class ShardError(Exception):
    """A refused request; `kind` picks the gRPC status."""

    class Kind(enum.Enum):
        INVALID = "invalid"          # malformed: unknown key, wrong shape/dtype, unknown VW
        NOT_OWNED = "not_owned"      # keys this shard does not hold
        CLOCK = "clock"              # a clock that goes backwards or skips ahead
        NOT_READY = "not_ready"      # used before Init
        CONFLICT = "conflict"        # re-Init with different keys or values

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class PullResult:
    values: list[tuple[str, torch.Tensor]]
    own_clock: list[int]     # per key: the puller's waves included
    vw_clocks: list[int]     # per VW: min over the keys
    c_global: int


def _check_finite(what: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """NaN or Inf would poison w_global for every VW for good: refused, naming the keys."""
    bad = [k for k, t in tensors if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ShardError(ShardError.Kind.INVALID, f"{what}: NaN or Inf in {bad[:5]}")


class Shard:
    """w_global and clocks for the keys this shard owns.

    A push of wave c by VW v for key k is applied iff clock[k][v] == c, which then becomes
    c + 1. clock[k][v] == c + 1 means it was applied already: a retry, answered as a no-op.
    Anything else is a clock that goes backwards or skips ahead, and is refused.
    """

    def __init__(self) -> None:
        self.virtual_workers = 0
        self.values: dict[str, torch.Tensor] = {}
        self.clocks: dict[str, list[int]] = {}
        self.pushes_applied = 0
        self.pushes_duplicate = 0
        self.max_clock_distance = 0
        self.evicted: set[int] = set()  # VWs that left the job: c_global no longer waits for them

    @property
    def ready(self) -> bool:
        return self.virtual_workers > 0

    def check_init(self, virtual_workers: int) -> None:
        if not 1 <= virtual_workers <= MAX_VIRTUAL_WORKERS:
            raise ShardError(ShardError.Kind.INVALID,
                             f"virtual_workers must be in [1, {MAX_VIRTUAL_WORKERS}], got {virtual_workers}")

    def init(self, virtual_workers: int, tensors: Sequence[tuple[str, torch.Tensor]],
             clocks: Sequence[int] = ()) -> bool:
        """Registers keys with their initial values (w0); each stage of VW 0 brings its own. A job
        resumed from a checkpoint brings the checkpoint's values and each VW's clock.

        A key already registered must come with the same value: a retried Init is a no-op.
        Returns whether any key was new. New keys are refused once a push has been applied.
        """
        self.check_init(virtual_workers)
        if clocks and len(clocks) != virtual_workers:
            raise ShardError(ShardError.Kind.INVALID, f"{len(clocks)} clocks for {virtual_workers} virtual workers")
        _check_finite("w0", tensors)
        named = dict(tensors)
        if len(named) != len(tensors) or not named:
            raise ShardError(ShardError.Kind.INVALID, "Init needs at least one key, each named once")
        if self.ready and virtual_workers != self.virtual_workers:
            raise ShardError(ShardError.Kind.CONFLICT, f"shard already initialised for {self.virtual_workers} "
                                                       f"virtual workers, not {virtual_workers}")
        clashing = [k for k, v in named.items() if k in self.values and not self._same_tensor(self.values[k], v)]
        if clashing:
            raise ShardError(ShardError.Kind.CONFLICT, f"shard already initialised with other values for {clashing[:5]}")
        new = {k: v for k, v in named.items() if k not in self.values}
        if new and self.pushes_applied:
            raise ShardError(ShardError.Kind.CONFLICT, f"new keys {sorted(new)[:5]} after training began")
        self.virtual_workers = virtual_workers
        for key, value in new.items():
            self.values[key] = value.clone()
            self.clocks[key] = [int(c) for c in clocks] if clocks else [0] * virtual_workers
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
        self._check_vw(vw)
        self._check_keys([k for k, _, _ in metas])
        for key, dtype, shape in metas:
            want = self.values[key]
            if dtype != want.dtype or shape != tuple(want.shape):
                raise ShardError(
                    ShardError.Kind.INVALID,
                    f"{key}: delta is {dtype} {list(shape)}, the key is {want.dtype} {list(want.shape)}",
                )

    def push(self, vw: int, clock: int, deltas: Sequence[tuple[str, torch.Tensor]],
             journal: Callable[[], None] | None = None) -> bool:
        """G1: adds VW vw's wave-`clock` update once. Returns False for a retried duplicate.

        All-or-nothing: every key is validated before any is changed. `journal` (the durable push
        log) runs after validation, right before the update is applied; if it raises, nothing is.
        """
        self.check_push(vw, [(k, d.dtype, tuple(d.shape)) for k, d in deltas])
        _check_finite(f"push of vw {vw} for clock {clock}", deltas)
        keys = [k for k, _ in deltas]
        current = {self.clocks[k][vw] for k in keys}
        if current == {clock + 1}:
            self.pushes_duplicate += 1
            return False
        if current != {clock}:
            have = sorted(current)
            direction = "skips ahead" if clock > max(have) else "goes backwards"
            raise ShardError(
                ShardError.Kind.CLOCK,
                f"push of vw {vw} for clock {clock} {direction}: its clock for these keys is {have}",
            )
        if journal is not None:
            journal()
        for key, delta in deltas:
            self.values[key].add_(delta)
            self.clocks[key][vw] = clock + 1
        self.pushes_applied += 1
        self.max_clock_distance = max(self.max_clock_distance, self.clock_distance())
        return True

    def c_global(self, keys: Sequence[str] | None = None) -> int:
        """Min over keys and VWs of the pushed clock: waves < c_global of every VW are included."""
        self._require_ready()
        live = self._live()
        return min(min(self.clocks[k][v] for v in live) for k in (keys if keys is not None else self.clocks))

    def vw_clocks(self, keys: Sequence[str] | None = None) -> list[int]:
        ks = list(keys if keys is not None else self.clocks)
        return [min(self.clocks[k][v] for k in ks) for v in range(self.virtual_workers)]

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

    def pull(self, vw: int, keys: Sequence[str]) -> PullResult:
        """G2/G3: current values with exactly what they include (call when c_global is enough)."""
        self.check_pull(vw, keys)
        return PullResult(
            values=[(k, self.values[k].clone()) for k in keys],
            own_clock=[self.clocks[k][vw] for k in keys],
            vw_clocks=self.vw_clocks(keys),
            c_global=self.c_global(keys),
        )

    def digest(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self.values):
            h.update(key.encode())
            h.update(self.values[key].contiguous().view(torch.uint8).numpy().tobytes())
            h.update(str(self.clocks[key]).encode())
        h.update(str(sorted(self.evicted)).encode())
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
        }

    def restore(self, snap: Mapping[str, object]) -> None:
        values = snap["values"]
        clocks = snap["clocks"]
        assert isinstance(values, dict) and isinstance(clocks, dict)
        self.virtual_workers = int(snap["virtual_workers"])  # type: ignore[call-overload]
        self.values = {k: v.clone() for k, v in values.items()}
        self.clocks = {k: [int(c) for c in t.tolist()] for k, t in clocks.items()}
        self.pushes_applied = int(snap["pushes_applied"])  # type: ignore[call-overload]
        self.max_clock_distance = int(snap["max_clock_distance"])  # type: ignore[call-overload]
        evicted = snap.get("evicted")
        self.evicted = {int(v) for v in evicted.tolist()} if isinstance(evicted, torch.Tensor) else set()
