"""Evaluation of held-out rows through VW 0's pipeline (eval: {every, rows}): when stage 0 runs
one, and the last stage's running totals. No gRPC, no threads.

A periodic evaluation k runs once VW 0's first k * every minibatches have finished at every
stage and before minibatch k * every + 1 starts: stage 0 holds that forward back until the
evaluation's forwards have left it, and every stage runs evaluation traffic before training
traffic that arrives after it. So each stage evaluates with exactly the weights its first
k * every updates (and the pulls merged meanwhile) made. Every stage runs an evaluation's
minibatches one task each (stage 0 sends each on before it reads the next: held all at once, an
evaluation's activations took eval.rows / batch_size times a training minibatch's memory) and
merges no pull (or elastic delta) between two of them, and stage 0 starts no training forward
before its last, so one evaluation scores one weight version. The final evaluation runs after
the run, on w_global after every VW's last push: the model that is written out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetpipe.optim import Scored


@dataclass(frozen=True, slots=True)
class EvalResult:
    id: int
    minibatches: int     # VW 0's minibatches trained when it ran
    final: bool
    time: float          # when it finished (time.time())
    rows: int
    loss: float          # mean over the rows (cross_entropy: over the targets it counts)
    accuracy: float      # NaN unless the loss is cross_entropy, and where no target counts


class Schedule:
    """When VW 0's stage 0 runs evaluation k, for a run of `steps` minibatches."""

    def __init__(self, every: int, steps: int) -> None:
        self.every, self.steps = every, steps
        # Periodic evaluations strictly before the end: the final one covers the end.
        self.periodic = (steps - 1) // every if every > 0 else 0
        self.done = 0   # periodic evaluations run so far

    @property
    def final_id(self) -> int:
        return self.periodic + 1

    def due(self, completed: int, in_flight: int) -> int | None:
        """The id of the evaluation stage 0 must run now, if any: VW 0 has finished exactly the
        minibatches before it, with none in flight."""
        k = self.done + 1
        if k <= self.periodic and completed == k * self.every and in_flight == 0:
            return k
        return None

    def allows(self, p: int) -> bool:
        """Whether the forward of p may start: not past a periodic evaluation still to run."""
        k = self.done + 1
        return k > self.periodic or p <= k * self.every

    def ran(self, k: int) -> None:
        assert k == self.done + 1, f"evaluation {k} out of order"
        self.done = k


class Totals:
    """The last stage's sums over one evaluation's minibatches."""

    def __init__(self, batches: int, classification: bool) -> None:
        self.batches, self.classification = batches, classification
        # id -> (minibatches seen, loss summed, targets counted, correct predictions, rows)
        self._open: dict[int, tuple[int, float, int, int, int]] = {}
        self.results: list[EvalResult] = []

    def add(self, k: int, scored: Scored, *, rows: int, minibatches: int, final: bool,
            now: float) -> EvalResult | None:
        """Counts one minibatch of evaluation k (of `rows` rows); the result once its last
        minibatch is in."""
        seen, total, counted, right, count = self._open.get(k, (0, 0.0, 0, 0, 0))
        seen, total, counted, right, count = (seen + 1, total + scored.loss_sum, counted + scored.counted,
                                              right + scored.correct, count + rows)
        if seen < self.batches:
            self._open[k] = (seen, total, counted, right, count)
            return None
        self._open.pop(k, None)
        # No target counted (every one ignored): no loss and no accuracy.
        loss = total / counted if counted else math.nan
        accuracy = right / counted if counted and self.classification else math.nan
        result = EvalResult(k, minibatches, final, now, count, loss, accuracy)
        self.results.append(result)
        return result
