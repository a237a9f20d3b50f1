"""How a stage's local weights meet the other virtual workers' (the lone-VW case lives here too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


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

    def close(self) -> None:
        pass
