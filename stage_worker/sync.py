"""How a stage's local weights meet the other virtual workers': the protocol the compute thread
calls, the lone VW's case, and what the shard-backed syncs (wsp_sync, elastic_sync) share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConfig:
    vw: int
    nm: int
    D: int
    steps: int
    keys: tuple[str, ...]           # this stage's parameters, in order
    key_shards: tuple[int, ...]     # owning shard of each key
    addresses: tuple[str, ...]      # shard i at index i
    push_hold_s: float = 0.0        # an emulated network (DESIGN §5) holds each push this long
    pull_hold_s: float = 0.0        # and each pull reply
    trace_dir: str = ""             # the sync trace goes here ("" = off)
    trace_name: str = ""            # e.g. vw0_stage1.jsonl
    ledger: bool = False            # and O3's ledger of acknowledged pushes (output.ledger)
    repeat_push: float = 0.0        # fault injection: resend an acknowledged push with this probability
    seed: int = 0
    sync: str = "wsp"               # parallel.sync: wsp, quorum (the shards close rounds), elastic (ElasticSync)
    quorum: int = 0                 # quorum: on-time VWs that close a round (0: a majority)
    alpha: float = 0.0              # elastic: the elastic force
    period: int = 1                 # elastic: waves between exchanges
    shared_memory: tuple[bool, ...] = ()  # per shard: it shares this host, pushes and pulls go through /dev/shm
    push_dtype: str = ""            # "bfloat16": float32 wave sums are pushed rounded to it (train.precision bf16)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncCallbacks:
    on_failure: Callable[[str], None]       # the stage cannot go on (a shard is gone)
    wake: Callable[[], None]                # a push was acknowledged or a pull answered
    next_forward: Callable[[], int]         # the minibatch whose forward runs next
    observe_push: Callable[[float], None] = lambda seconds: None
    observe_pull: Callable[[float], None] = lambda seconds: None


def in_parallel(call: Callable[[T], R], items: list[T]) -> list[R]:
    """call(item) for every item at once, results in order; raises the first error as soon as it
    comes (a shard that refuses a pull for good is not reported only once another shard's held-back
    pull gives up: the call still under way goes on in its thread until it ends, or closing cuts it
    short). Pushes and pulls go to every shard at once: one round trip, not one per shard. Daemon
    threads, not an executor: a pull the shards hold back must never delay the process's exit."""
    if len(items) == 1:
        return [call(items[0])]
    results: list[R | None] = [None] * len(items)
    errors: list[BaseException] = []
    done: list[int] = []
    ended = threading.Condition()

    def run(i: int, item: T) -> None:
        error: BaseException | None = None
        try:
            results[i] = call(item)
        except BaseException as exc:  # re-raised in the caller's thread
            error = exc
        with ended:
            if error is not None:
                errors.append(error)
            done.append(i)
            ended.notify_all()

    for i, item in enumerate(items):
        threading.Thread(target=run, args=(i, item), daemon=True).start()
    with ended:
        ended.wait_for(lambda: bool(errors) or len(done) == len(items))
        if errors:
            raise errors[0]
    return cast(list[R], results)


class Weights(Protocol):
    """What a sync may do to the stage's local weights (StageCompute)."""

    @property
    def device(self) -> str: ...

    def set_weights(self, values: list[torch.Tensor]) -> None: ...

    def overwrite(self, fill: Callable[[list[torch.Tensor]], None]) -> None:
        """fill(params) writes the live weights in place (a pull merged straight from shared memory)."""
        ...


class Sync(Protocol):
    """Called by the stage's compute thread only, so implementations need no lock of their own
    for the state they share with it; background RPCs hand results over via apply_pending."""

    def forward_allowed(self, p: int) -> bool:
        """G2: whether the weights are fresh enough for the forward of p (may start a pull)."""
        ...

    def after_update(self, p: int, update: list[torch.Tensor]) -> None:
        """L3/G1: u_p was applied locally; fold it into the current wave's sum. The sync owns
        `update` from here on (the caller made it for this call and keeps no reference)."""
        ...

    def spare_update(self) -> list[torch.Tensor] | None:
        """Buffers shaped as the parameters that the sync no longer needs, for the next update to
        be written into (None: the caller allocates). A model-sized allocation every step costs
        more than the step's copy and subtraction."""
        ...

    def on_wave_end(self, wave: int) -> None:
        """G1: the stage finished wave c (or the final partial wave): push its sum."""
        ...

    def apply_pending(self, weights: Weights) -> None:
        """G3: merge a completed pull into the local weights."""
        ...

    @property
    def min_clock(self) -> int:
        """The c_global the local weights are known to include."""
        ...

    @property
    def clock(self) -> int:
        """Waves this stage has completed."""
        ...

    @property
    def wait_seconds(self) -> float:
        ...

    @property
    def shm_bytes(self) -> int:
        """Tensor bytes pushed or pulled through shared memory (a shard on this host)."""
        ...

    @property
    def waiting(self) -> bool:
        """A forward is blocked on a pull right now."""
        ...

    def finished(self) -> bool:
        """All pushes acknowledged."""
        ...

    @property
    def acked_waves(self) -> int:
        """Waves whose push every shard acknowledged (a lone VW: every wave completed)."""
        ...

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it."""
        ...

    def restore(self, state: dict[str, Any], device: str) -> None:
        ...

    def initialise(self, virtual_workers: int, values: list[torch.Tensor]) -> None:
        """Gives the shards this stage's keys' initial values (VW 0's stages)."""
        ...

    def pull_now(self, weights: Weights, min_clock: int) -> None:
        """Merges w_global at c_global >= min_clock before it returns."""
        ...

    def interrupt(self) -> None:
        """A wait in pull_now ends now (RuntimeError): the stage is stopping."""
        ...

    def close(self) -> None:
        ...


class LocalSync:
    """One VW and no parameter server: the local weights hold every update there is."""

    def __init__(self) -> None:
        self._clock = 0

    def forward_allowed(self, p: int) -> bool:
        return True

    def after_update(self, p: int, update: list[torch.Tensor]) -> None:
        pass

    def spare_update(self) -> list[torch.Tensor] | None:
        return None   # a lone VW tracks no updates

    def on_wave_end(self, wave: int) -> None:
        self._clock = wave + 1

    def apply_pending(self, weights: Weights) -> None:
        pass

    @property
    def min_clock(self) -> int:
        # With one VW, c_global is this VW's own clock, and its updates are all local.
        return self._clock

    @property
    def clock(self) -> int:
        return self._clock

    @property
    def wait_seconds(self) -> float:
        return 0.0

    @property
    def shm_bytes(self) -> int:
        return 0

    @property
    def waiting(self) -> bool:
        return False

    def finished(self) -> bool:
        return True

    @property
    def acked_waves(self) -> int:
        return self._clock

    def state(self) -> dict[str, Any]:
        return {"clock": self._clock}

    def restore(self, state: dict[str, Any], device: str) -> None:
        self._clock = int(state["clock"])

    def initialise(self, virtual_workers: int, values: list[torch.Tensor]) -> None:
        pass

    def pull_now(self, weights: Weights, min_clock: int) -> None:
        pass  # the local weights are w_global

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass
