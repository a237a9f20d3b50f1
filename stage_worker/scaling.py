"""A stage's side of what its VW agrees on per minibatch (hetpipe/loss_scale.py has the rules):
what it knows of stage 0's verdicts, its gradients waiting for theirs, and (the last stage) the
loss scale. Made for fp16 (loss scaling) and for train.max_grad_norm (clipping)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetpipe.loss_scale import LossScale, Verdicts
from stage_worker.stage import Grads


@dataclass
class Waiting:
    grads: Grads | None       # None: known to overflow, the verdict can only be "skip"
    scale: float


@dataclass
class Incoming:
    """What p's gradient from the next stage says besides its tensor."""
    scale: float              # the last stage's loss scale of p (1 without fp16)
    overflow: bool            # some later stage's gradients of p were not finite
    norm_sq: float            # their squared norms, summed (max_grad_norm)


@dataclass
class Scaling:
    fp16: bool                # the loss is scaled (else every scale is 1 and nothing overflows)
    max_grad_norm: float      # 0: no clipping
    verdicts: Verdicts = field(default_factory=Verdicts)
    loss_scale: LossScale = field(default_factory=LossScale)   # used by the last stage, fp16 only
    incoming: dict[int, Incoming] = field(default_factory=dict)
    waiting: dict[int, Waiting] = field(default_factory=dict)  # p -> gradients until p's verdict
    relay: bool = False       # verdicts came alone: pass them on once committed

    def decidable(self) -> list[int]:
        """The waiting minibatches whose verdicts are known, in order (commit them in this order)."""
        return sorted(p for p in self.waiting if p <= self.verdicts.through)
