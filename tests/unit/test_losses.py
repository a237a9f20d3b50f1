"""stage_worker/losses.py: the last stage's recent losses, and the first one that was NaN or Inf."""

from __future__ import annotations

import math

import torch

from stage_worker.losses import Losses, read


def test_the_first_non_finite_loss_is_kept_however_many_follow() -> None:
    losses = Losses(keep=3)
    assert read(losses.first_bad) == (0, 0.0)
    for p in range(1, 5):
        losses.add(p, torch.tensor(2.0 / p))
    assert read(losses.first_bad) == (0, 0.0)
    losses.add(5, torch.tensor(math.inf))
    for p in range(6, 40):
        losses.add(p, torch.tensor(math.nan))
    assert read(losses.first_bad) == (5, math.inf)
    assert [p for p, _ in losses.recent] == [37, 38, 39]


def test_a_nan_first_loss_is_named() -> None:
    losses = Losses()
    losses.add(1, torch.tensor(math.nan, dtype=torch.float64))
    losses.add(2, torch.tensor(1.0, dtype=torch.float64))
    p, loss = read(losses.first_bad)
    assert p == 1 and math.isnan(loss)
