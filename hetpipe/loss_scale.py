"""What every stage of a virtual worker agrees on per minibatch (pure rules, no threads): fp16's
dynamic loss scale and skipped steps, and the clip coefficient of train.max_grad_norm.

The last stage multiplies minibatch p's loss by a scale S_p; every stage checks its gradients of
p and adds their squared norm to the later stages'. Only stage 0, whose backward of p comes last,
can know whether any stage's gradients of p were not finite, and their global norm: it decides p
(step it, or skip it, and by what coefficient its gradients are clipped), and the decision
travels forward along the pipeline with the activations. Every other stage keeps its gradients
of p until the decision arrives and commits them in minibatch order: all stages step p, or none
does, each clipped as torch.nn.utils.clip_grad_norm_ clips the whole model's gradients.

A decision for p reaches stage q before the activation of p + Nm (stage 0 injects p + Nm only
after its backward of p, L1), so the forward of m still sees every update <= m - Nm (L2). S_p is
computed from the decisions <= p - Nm alone, which the last stage always has by then: the scale
does not depend on timing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000   # decided-good minibatches in a row before the scale doubles
MIN_SCALE = 1.0          # as torch.amp.GradScaler: halve on an overflow, double after a streak


class Diverged(ValueError):
    """A minibatch overflowed at the smallest scale: halving the scale can help no more (the
    weights or the loss are not finite), as DeepSpeed ends a run at its minimum loss scale."""


@dataclass
class LossScale:
    """The last stage's scale, advanced by the verdicts in minibatch order."""

    scale: float = INITIAL_SCALE
    growth_interval: int = GROWTH_INTERVAL
    through: int = 0      # verdicts 1..through are folded in
    _good: int = 0
    _ran: dict[int, float] = field(default_factory=dict)   # p -> S_p, until p's verdict is folded in

    def advance(self, verdicts: Verdicts, upto: int) -> None:
        """Folds in the verdicts of minibatches through..min(upto, verdicts.through). Diverged
        where a minibatch that ran at the smallest scale was skipped."""
        for p in range(self.through + 1, min(upto, verdicts.through) + 1):
            ran = self._ran.pop(p, None)
            if p in verdicts.skipped:
                if ran is not None and ran <= MIN_SCALE:
                    raise Diverged(f"training diverged: minibatch {p} overflowed in fp16 at the smallest loss "
                                   f"scale ({MIN_SCALE:g})")
                # An overflow at a scale already halved since p ran says nothing of the smaller one:
                # the Nm - 1 minibatches in flight behind an overflow at S would otherwise each halve
                # it again, for one event 2^(Nm - 1) times too small.
                if ran is None or ran <= self.scale:
                    self.scale = max(MIN_SCALE, self.scale / 2)
                self._good = 0
            else:
                self._good += 1
                if self._good == self.growth_interval:
                    self.scale *= 2
                    self._good = 0
            self.through = p

    def state(self, verdicts: Verdicts) -> dict[str, Any]:
        """What a checkpoint keeps for the scales after its cut to come out as without it: the
        scale and its streak, the minibatches whose verdicts are still to be folded in (their
        scales, and which of them were skipped)."""
        return {"scale": self.scale, "good": self._good, "through": self.through,
                "ran": [[p, s] for p, s in sorted(self._ran.items())],
                "skipped": sorted(p for p in verdicts.skipped if p > self.through)}

    @classmethod
    def restored(cls, state: Mapping[str, Any]) -> tuple[LossScale, set[int]]:
        """state()'s scale, and the skips to put back into the stage's verdicts."""
        ran = {int(p): float(s) for p, s in state["ran"]}
        scale = cls(scale=float(state["scale"]), through=int(state["through"]), _good=int(state["good"]), _ran=ran)
        return scale, {int(p) for p in state["skipped"]}

    def for_minibatch(self, p: int, nm: int, verdicts: Verdicts) -> float:
        """S_p: the scale after the verdicts of minibatches <= p - nm (always known here by then)."""
        if verdicts.through < p - nm:
            raise ValueError(f"minibatch {p}: verdicts through {verdicts.through}, need {p - nm}")
        self.advance(verdicts, p - nm)
        self._ran[p] = self.scale
        return self.scale


def grad_norm(norm_sq: float, scale: float = 1.0) -> float:
    """The L2 norm of gradients at loss scale `scale` whose squared norms sum to norm_sq, unscaled."""
    return math.sqrt(norm_sq) / scale


def clip_coefficient(norm_sq: float, max_norm: float, scale: float = 1.0) -> float:
    """What torch.nn.utils.clip_grad_norm_ multiplies gradients by, for gradients at loss scale
    `scale` whose squared L2 norms sum to norm_sq: min(1, max_norm / (norm + 1e-6)) of the
    unscaled norm. 1 where the norm is not finite (NaN or Inf gradients): fp16 skips such a
    minibatch, and fp32 or bf16 steps it as without clipping."""
    norm = grad_norm(norm_sq, scale)
    return min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else 1.0


@dataclass
class Verdicts:
    """What a stage knows of stage 0's decisions, and what it has told its next stage. Only the
    coefficients not yet committed here, or not yet told (relays: there is a next stage), are kept."""

    through: int = 0
    skipped: set[int] = field(default_factory=set)
    clipped: dict[int, float] = field(default_factory=dict)   # p -> its clip coefficient, where < 1
    told: int = 0         # the next stage knows 1..told
    relays: bool = True   # a next stage is told (the last stage tells none)
    committed: int = 0    # this stage has taken the coefficients of 1..committed

    def decide(self, p: int, overflow: bool, coefficient: float = 1.0) -> None:
        """Stage 0, after its backward of p (backwards run in p order)."""
        if p != self.through + 1:
            raise ValueError(f"verdict for minibatch {p} after {self.through}")
        if overflow:
            self.skipped.add(p)
        elif coefficient < 1.0:
            self.clipped[p] = coefficient
        self.through = p

    def check(self, through: int, skipped: Iterable[int], steps: int, clipped: Mapping[int, float] | None = None) -> None:
        """ValueError for news that no stage 0 of a run of `steps` minibatches could have sent."""
        if through > steps:
            raise ValueError(f"verdicts through minibatch {through}, but the run has {steps}")
        new = set(skipped)
        if any(not self.through < p <= through for p in new):
            raise ValueError(f"skipped minibatches {sorted(new)[:5]} outside ({self.through}, {through}]")
        clipped = clipped or {}
        if any(not self.through < p <= through for p in clipped):
            raise ValueError(f"clipped minibatches {sorted(clipped)[:5]} outside ({self.through}, {through}]")
        if both := sorted(new & set(clipped)):
            raise ValueError(f"minibatches {both[:5]} both skipped and clipped")
        if bad := [c for c in clipped.values() if not (math.isfinite(c) and 0.0 < c < 1.0)]:
            raise ValueError(f"clip coefficients {bad[:3]}: expected each in (0, 1)")

    def learn(self, through: int, skipped: Iterable[int], clipped: Mapping[int, float] | None = None) -> None:
        """Merges what the previous stage says (checked first)."""
        if through > self.through:
            self.skipped |= set(skipped)
            self.clipped.update(clipped or {})
            self.through = through

    def news(self) -> tuple[int, list[int], dict[int, float]]:
        """(through, skipped and clipped since the last news) for the next stage; marks them told.

        The compute thread asks while a gRPC thread may learn(): through is read once, before
        the skipped and clipped (which learn() extends first), so news never claims a minibatch
        without its skip or coefficient. Copying the set and the dict is one step under the GIL."""
        through = self.through
        out = sorted(p for p in set(self.skipped) if self.told < p <= through)
        clipped = {p: c for p, c in dict(self.clipped).items() if self.told < p <= through}
        self.told = through
        self._forget()
        return through, out, clipped

    def stepped(self, p: int) -> bool | None:
        """True: step p; False: skip it; None: not decided yet."""
        return None if p > self.through else p not in self.skipped

    def take(self, p: int) -> float:
        """p's clip coefficient (1: none), for p's commit here; commits run in p order."""
        self.committed = p
        coefficient = self.clipped.get(p, 1.0)
        self._forget()
        return coefficient

    def _forget(self) -> None:
        done = min(self.told, self.committed) if self.relays else self.committed
        for p in list(self.clipped):   # a copy: a gRPC thread may learn() meanwhile (only later ones)
            if p <= done:
                self.clipped.pop(p, None)
