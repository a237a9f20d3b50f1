"""Plain single-process training with the job's data order and optimizer: the oracle for O1/O2."""

from __future__ import annotations

import dataclasses

import torch

from hetpipe import data, datasets, draws, model_init, models
from hetpipe.config import JobConfig
from hetpipe.optim import compute_loss, make_optimizer, score, step_at


def initial_model(job: JobConfig) -> torch.nn.Sequential:
    """w0, whole: model.init if given, else the per-layer seeded initialisation the stages use."""
    model = models.build(job)
    if job.model.init:
        model_init.initialise(job, model)
    return model


def minibatch(job: JobConfig, dataset: torch.utils.data.Dataset, p: int, vw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minibatch p of VW vw, in the DESIGN §8 order."""
    rows = data.minibatch_rows(p, vw, virtual_workers=job.parallel.virtual_workers, batch_size=job.data.batch_size,
                               rows=len(dataset), shuffle=job.data.shuffle, seed=job.train.seed)  # type: ignore[arg-type]
    return data.read_rows(job, dataset, rows.tolist(), (draws.TRAIN_DRAW, vw, p))


def train_reference(job: JobConfig, steps: int | None = None, device: str = "cpu") -> torch.nn.Sequential:
    """Synchronous data parallelism with summed updates over the job's VWs (one VW: plain training).

    Each step every VW v computes its gradient on its minibatch p (clipped by
    torch.nn.utils.clip_grad_norm_ to train.max_grad_norm, as each VW clips its own); plain SGD
    then applies the sum of the VWs' updates, weight decay included: each VW's step decays w, so
    the sum decays it N times. With N=1 this is ordinary training with any optimizer.
    """
    model = initial_model(job).to(device)
    dataset = datasets.training_set(job)
    params = [p for _, p in models.trainable(model)]
    n = job.parallel.virtual_workers
    if n > 1 and (job.train.optimizer.name != "sgd" or job.train.optimizer.momentum):
        raise ValueError("the N-VW reference is defined for plain SGD only")
    # N VWs: each VW's update -lr * (g_v + wd * w) is summed, so the decay goes into each VW's term
    # (one step decaying w once would take N - 1 decays fewer than the shards' sum).
    decay = job.train.optimizer.weight_decay if n > 1 else 0.0
    optimizer = make_optimizer(params, dataclasses.replace(job.train.optimizer, weight_decay=0.0) if decay
                               else job.train.optimizer)
    for p in range(1, (steps or job.train.steps) + 1):
        total = [torch.zeros_like(w) for w in params]
        for vw in range(n):
            x, y = minibatch(job, dataset, p, vw)
            x, y = x.to(device), y.to(device)
            # Micro-batch schedules: each micro-batch's loss weighted 1/m, the gradients summed.
            m = job.parallel.microbatches
            mine = [torch.zeros_like(w) for w in params]
            for xs, ys in zip(x.chunk(m), y.chunk(m)):
                loss = compute_loss(job.train.loss, model(xs), ys) / m if m > 1 else compute_loss(
                    job.train.loss, model(xs), ys)
                for t, g in zip(mine, torch.autograd.grad(loss, params)):
                    t.add_(g)
            if job.train.max_grad_norm:   # clip_grad_norm_ scales the parameters' .grad in place: `mine`
                for w, g in zip(params, mine):
                    w.grad = g
                torch.nn.utils.clip_grad_norm_(params, job.train.max_grad_norm)
            for t, g, w in zip(total, mine, params):
                t.add_(g)
                if decay:
                    t.add_(w.detach(), alpha=decay)
        for w, g in zip(params, total):
            w.grad = g  # summed: each VW's SGD update -lr*g_v is applied once
        step_at(optimizer, job.train, p)
    return model


@torch.no_grad()
def accuracy(job: JobConfig, model: torch.nn.Module, dataset: torch.utils.data.Dataset, batch: int = 1024) -> float:
    """Share of rows (or tokens) of dataset whose argmax prediction matches the label (of those
    not IGNORED_LABEL)."""
    correct = total = 0
    n = len(dataset)  # type: ignore[arg-type]
    for i in range(0, n, batch):
        x, y = data.read_rows(job, dataset, range(i, min(n, i + batch)), (draws.CHECK_DRAW, i))
        scored = score("cross_entropy", model(x), y)
        correct, total = correct + scored.correct, total + scored.counted
    return correct / total
