"""The loss and optimizer every trainer builds from the job: stages, the reference, the baselines."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd

from hetpipe.training import ADAM_LIKE, OptimizerConfig, TrainConfig, learning_rate


COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # train.precision


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of train.precision (None: the model's own dtype); activations and
    gradients travel between stages in it."""
    return COMPUTE_DTYPES[precision]


def autocast(dtype: torch.dtype | None, device_type: str) -> contextlib.AbstractContextManager[object]:
    """The forward under autocast to compute dtype `dtype` (compute_dtype's); nothing for None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


def to_compute(dtype: torch.dtype | None, t: torch.Tensor) -> torch.Tensor:
    """A tensor as it crosses a stage boundary: floating ones in the compute dtype, whatever
    autocast kept in float32 (a layer norm's output, say), so that both ends agree on it."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def for_loss(dtype: torch.dtype | None, out: torch.Tensor) -> torch.Tensor:
    """A model's output as the loss reads it: float32 under a 16-bit compute dtype, its own
    otherwise (float64 stays float64)."""
    return out.float() if dtype is not None else out


def use_foreach(params: Sequence[torch.Tensor]) -> bool:
    """Multi-tensor kernels on a GPU (one launch per step, not one per parameter); the per-tensor
    loop on the CPU. Every trainer of a job decides the same way, so the oracles compare like with
    like."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def squared_norm(grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The squared L2 norm of all these gradients, as clip_grad_norm_ takes it (per-tensor norms,
    squared and summed in float64), left on their device; 0 where there are none."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(present)).double().square().sum()


class StageOptimizer:
    """A stage's SGD, Adam or AdamW step: torch.optim's own functional kernels, so bit for bit what
    torch.optim.SGD/Adam/AdamW compute with the same foreach choice and learning rate, the state
    held here as plain tensors.

    Not torch.optim's classes: their first step imports torch._dynamo, 1.2 s and 70 MB in every
    stage process; the functional kernels do not.
    """

    def __init__(self, params: Sequence[torch.Tensor], cfg: OptimizerConfig) -> None:
        self.params, self.cfg = list(params), cfg
        self.momentum: list[torch.Tensor | None] = [None] * len(self.params)
        adam_like = cfg.name in ADAM_LIKE
        self.exp_avg = [torch.zeros_like(p) for p in self.params] if adam_like else []
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params] if adam_like else []
        self.steps = [torch.tensor(0.0, dtype=_get_scalar_dtype()) for _ in self.params] if adam_like else []

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float) -> None:
        """Applies one step with these gradients (one per parameter, in order), at learning rate
        lr (training.learning_rate of the minibatch)."""
        cfg, params = self.cfg, self.params
        foreach = use_foreach(params)
        if cfg.name in ADAM_LIKE:
            kernel = adamw if cfg.name == "adamw" else adam
            kernel(params, list(grads), self.exp_avg, self.exp_avg_sq, [], self.steps, foreach=foreach,
                   amsgrad=False, beta1=cfg.betas[0], beta2=cfg.betas[1], lr=lr, weight_decay=cfg.weight_decay,
                   eps=cfg.eps, maximize=False)
        else:
            sgd(params, list(grads), self.momentum, foreach=foreach, weight_decay=cfg.weight_decay,
                momentum=cfg.momentum, lr=lr, dampening=0.0, nesterov=False, maximize=False)

    @torch.no_grad()
    def step_tracked(self, grads: Sequence[torch.Tensor], lr: float, into: list[torch.Tensor]) -> list[torch.Tensor]:
        """step(), also writing the update u = w_after - w_before into `into` (buffers shaped as
        the parameters), which it returns.

        SGD forms u = -lr * d first (d: the gradient after weight decay and momentum, as torch's
        sgd forms it) and adds it, so w_after is exactly w_before + u, as every shard adds it: two
        passes over the weights where a copy, the step and the difference took three (torch's
        fused w - lr * d may round once where this rounds twice). Adam and AdamW step, then take
        the difference."""
        params = self.params
        foreach = use_foreach(params)
        if self.cfg.name in ADAM_LIKE:
            torch._foreach_copy_(into, params)
            self.step(grads, lr)
            if foreach:   # -w_before + w_after: two multi-tensor launches, signed zeros exact
                torch._foreach_mul_(into, -1.0)
                torch._foreach_add_(into, params)
            else:         # one pass per tensor
                for u, p in zip(into, params):
                    torch.sub(p, u, out=u)
            return into
        d = self._direction(list(grads), foreach)
        if foreach:
            torch._foreach_copy_(into, d)
            torch._foreach_mul_(into, -lr)
            torch._foreach_add_(params, into)
        else:
            for u, g, p in zip(into, d, params):
                torch.mul(g, -lr, out=u)
                p.add_(u)
        return into

    def _direction(self, grads: list[torch.Tensor], foreach: bool) -> list[torch.Tensor]:
        """SGD's step direction, as torch's sgd forms it (dampening 0, no Nesterov): the gradient
        plus weight_decay * w, then through the momentum buffer."""
        cfg, params = self.cfg, self.params
        if cfg.weight_decay != 0:
            grads = (list(torch._foreach_add(grads, params, alpha=cfg.weight_decay)) if foreach
                     else [g.add(p, alpha=cfg.weight_decay) for g, p in zip(grads, params)])
        if cfg.momentum == 0:
            return grads
        if foreach and all(b is not None for b in self.momentum):
            bufs = [b for b in self.momentum if b is not None]
            torch._foreach_mul_(bufs, cfg.momentum)
            torch._foreach_add_(bufs, grads)
            return bufs
        for i, g in enumerate(grads):
            buf = self.momentum[i]
            if buf is None:
                self.momentum[i] = g.detach().clone()
            else:
                buf.mul_(cfg.momentum).add_(g)
        return [b for b in self.momentum if b is not None]


def make_optimizer(params: list[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    foreach = use_foreach(params)  # as StageOptimizer decides: the oracles compare like with like
    if cfg.name in ADAM_LIKE:
        kind = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        return kind(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=foreach)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, foreach=foreach)


def step_at(optimizer: torch.optim.Optimizer, train: TrainConfig, p: int) -> None:
    """A make_optimizer optimizer's step for minibatch p, at its learning rate (as a stage's
    StageOptimizer takes it), then the gradients cleared."""
    lr = learning_rate(train, p)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# torch.nn.functional.cross_entropy skips targets of this value (its ignore_index): not a class.
IGNORED_LABEL = -100


@dataclass(frozen=True, slots=True)
class Scored:
    """One evaluation minibatch's share of the evaluation's loss and accuracy."""

    loss_sum: float   # its mean loss times `counted` (0 where it counts nothing)
    counted: int      # what its loss is a mean over: rows (mse), or targets not IGNORED_LABEL
    correct: int      # of those targets, the ones the output's argmax names (cross_entropy)


def score(kind: str, output: torch.Tensor, target: torch.Tensor) -> Scored:
    """compute_loss's mean with what it averages over, so that minibatches sum to the mean over
    the evaluation; ignored targets count neither in the loss nor in the accuracy."""
    if kind == "mse":
        rows = int(output.shape[0])
        return Scored(float(compute_loss(kind, output, target)) * rows, rows, 0)
    counted = target != IGNORED_LABEL
    n = int(counted.sum())
    if n == 0:   # cross_entropy's mean over no target is NaN
        return Scored(0.0, 0, 0)
    correct = int(((output.argmax(dim=-1) == target) & counted).sum())
    return Scored(float(compute_loss(kind, output, target)) * n, n, correct)


def compute_loss(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mse":
        return nn.functional.mse_loss(output, target)
    # Sequence models: (B, T, V) logits against (B, T) tokens.
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
