"""What a shard is told and how it says no: the sync rule Init brings, and the refusal kinds
that pick a refused request's gRPC status. Pure: no I/O."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from hetpipe import elastic
from hetpipe.training import MAX_STEPS


class ShardError(Exception):
    """A refused request; `kind` picks the gRPC status."""

    class Kind(enum.Enum):
        INVALID = "invalid"          # malformed: unknown key, wrong shape/dtype, unknown VW
        NOT_OWNED = "not_owned"      # keys this shard does not hold
        CLOCK = "clock"              # a clock that goes backwards or skips ahead
        NOT_READY = "not_ready"      # used before Init
        CONFLICT = "conflict"        # re-Init with different keys or values
        MODE = "mode"                # a call the shard's sync mode does not take (a push under elastic)
        OVERFLOW = "overflow"        # finite, but w_global plus it could pass the dtype's largest value

    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def is_retry(current: set[int], clock: int, what: str, counted: str) -> bool:
    """The clock rule of an update for `clock` (a push, an exchange), whose keys' clocks are
    `current`: True for a retry of the latest (every key at clock + 1), False for the next (every
    key at clock); anything else goes backwards or skips ahead, refused naming `what` and, after
    `counted`, the clocks it found."""
    if current == {clock + 1}:
        return True
    if current != {clock}:
        have = sorted(current)
        direction = "skips ahead" if clock > max(have) else "goes backwards"
        raise ShardError(ShardError.Kind.CLOCK, f"{what} {direction}: {counted} {have}")
    return False


SYNC_MODES = ("wsp", "quorum", "elastic")


@dataclass(frozen=True, slots=True)
class SyncRule:
    """parallel.sync and its arguments, as Init brings them: how pushes (or exchanges) reach w_global."""

    mode: str = "wsp"
    quorum: int = 0          # quorum: on-time VWs that close a round; 0 = a majority of the live VWs
    alpha: float = 0.0       # elastic: the elastic force
    period: int = 1          # elastic: waves between a VW's exchanges
    total_waves: int = 0     # quorum, elastic: waves per VW in the job
    exact: bool = False      # wsp with D = 0: pulls get exactly the waves below c_global (Shard.pull)
    D: int | None = None     # wsp: parallel.D, which pushes are checked against (G4); None: not told

    @property
    def lead(self) -> int | None:
        """wsp: how many waves past c_global a VW may push (G4's D + 1 clock distance); None: unchecked."""
        if self.mode != "wsp":
            return None
        return 0 if self.exact else self.D

    def check(self, virtual_workers: int) -> None:
        def invalid(what: str) -> ShardError:
            return ShardError(ShardError.Kind.INVALID, f"sync {self.mode}: {what}")

        if self.mode not in SYNC_MODES:
            raise ShardError(ShardError.Kind.INVALID, f"sync {self.mode!r}: expected one of {', '.join(SYNC_MODES)}")
        if self.mode != "wsp" and not 1 <= self.total_waves <= MAX_STEPS:
            raise invalid(f"total_waves must be in [1, {MAX_STEPS}], got {self.total_waves}")
        if self.mode == "quorum" and self.quorum > virtual_workers:
            raise invalid(f"quorum {self.quorum} is more than the {virtual_workers} virtual workers")
        if self.mode == "elastic" and not (math.isfinite(self.alpha) and 0 < self.alpha <= elastic.MAX_ALPHA):
            raise invalid(f"alpha must be in (0, {elastic.MAX_ALPHA}], got {self.alpha}")
        if self.mode == "elastic" and not 1 <= self.period <= MAX_STEPS:
            raise invalid(f"period must be in [1, {MAX_STEPS}], got {self.period}")
        if self.exact and self.mode != "wsp":
            raise invalid("exact pulls are for sync wsp with D = 0")
        if self.D is not None and self.mode != "wsp":
            raise invalid(f"distance_bound (D) is for sync wsp, got {self.D}")
        if self.D is not None and not 0 <= self.D <= MAX_STEPS:
            raise invalid(f"distance_bound (D) must be in [0, {MAX_STEPS}], got {self.D}")
        if self.exact and self.D not in (None, 0):
            raise invalid(f"exact pulls are for D = 0, not distance_bound {self.D}")
