"""A stage's side of fp16 loss scaling (hetpipe/loss_scale.py has the rules): what it knows of
stage 0's verdicts, its gradients waiting for theirs, and (the last stage) the loss scale."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetpipe.loss_scale import LossScale, Verdicts
from stage_worker.stage import Grads


@dataclass
class Waiting:
    grads: Grads | None       # None: known to overflow, the verdict can only be "skip"
    scale: float


@dataclass
class Scaling:
    verdicts: Verdicts = field(default_factory=Verdicts)
    loss_scale: LossScale = field(default_factory=LossScale)   # used by the last stage only
    incoming: dict[int, tuple[float, bool]] = field(default_factory=dict)  # p -> (scale, overflow later)
    waiting: dict[int, Waiting] = field(default_factory=dict)  # p -> gradients until p's verdict
    relay: bool = False       # verdicts came alone: pass them on once committed

    def decidable(self) -> list[int]:
        """The waiting minibatches whose verdicts are known, in order (commit them in this order)."""
        return sorted(p for p in self.waiting if p <= self.verdicts.through)
