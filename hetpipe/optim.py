"""The loss and optimizer every trainer builds from the job: stages, the reference, the baselines."""

from __future__ import annotations

import torch
from torch import nn

from hetpipe.config import OptimizerConfig


def make_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor loop matches single-process training bit for bit.
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, foreach=False)


def compute_loss(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mse":
        return nn.functional.mse_loss(output, target)
    # Sequence models: (B, T, V) logits against (B, T) tokens.
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
