"""An evaluation's loss and accuracy (hetpipe.optim.score, summed by the last stage's Totals and by
the baselines): a mean over the targets the loss counts, so that targets of IGNORED_LABEL (-100),
which cross_entropy leaves out of its mean, count neither as wrong predictions nor in the loss."""

from __future__ import annotations

import math

import torch
from torch.nn import functional

from hetpipe.optim import IGNORED_LABEL, Scored, score
from stage_worker.evaluation import Totals


def _logits_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(8, 5, dtype=torch.float64)
    targets = logits.argmax(dim=-1).clone()
    targets[1] = (targets[1] + 1) % 5            # one wrong
    targets[4:] = IGNORED_LABEL                  # half ignored
    return logits, targets


def test_ignored_targets_count_neither_in_the_loss_nor_in_the_accuracy() -> None:
    logits, targets = _logits_and_targets()
    scored = score("cross_entropy", logits, targets)
    assert scored.counted == 4 and scored.correct == 3
    kept = functional.cross_entropy(logits[:4], targets[:4])
    assert math.isclose(scored.loss_sum / scored.counted, float(kept), rel_tol=1e-12)


def test_a_minibatch_of_ignored_targets_only_adds_nothing() -> None:
    logits = torch.randn(4, 5)
    assert score("cross_entropy", logits, torch.full((4,), IGNORED_LABEL)) == Scored(0.0, 0, 0)


def test_sequences_count_tokens_and_mse_counts_rows() -> None:
    logits = torch.randn(2, 3, 7)                # (B, T, vocab)
    tokens = logits.argmax(dim=-1)
    tokens[0, 0] = IGNORED_LABEL
    assert (score("cross_entropy", logits, tokens).counted, score("cross_entropy", logits, tokens).correct) == (5, 5)
    out, y = torch.randn(6, 2), torch.randn(6, 2)
    mse = score("mse", out, y)
    assert mse.counted == 6 and mse.correct == 0
    assert math.isclose(mse.loss_sum / 6, float(functional.mse_loss(out, y)), rel_tol=1e-6)


def test_totals_are_the_mean_over_every_counted_target() -> None:
    logits, targets = _logits_and_targets()
    totals = Totals(batches=2, classification=True)
    assert totals.add(1, score("cross_entropy", logits, targets), rows=8, minibatches=10, final=False, now=0.0) is None
    whole = score("cross_entropy", logits[:4], targets[:4])   # the second minibatch: no target ignored
    result = totals.add(1, whole, rows=4, minibatches=10, final=False, now=0.0)
    assert result is not None and result.rows == 12
    assert result.accuracy == 6 / 8
    both = functional.cross_entropy(torch.cat([logits[:4], logits[:4]]), torch.cat([targets[:4], targets[:4]]))
    assert math.isclose(result.loss, float(both), rel_tol=1e-12)


def test_an_evaluation_whose_every_target_is_ignored_has_no_loss_and_no_accuracy() -> None:
    totals = Totals(batches=1, classification=True)
    result = totals.add(1, Scored(0.0, 0, 0), rows=4, minibatches=1, final=True, now=0.0)
    assert result is not None and math.isnan(result.loss) and math.isnan(result.accuracy)
