"""Plain single-process training with the job's data order and optimizer: the oracle for O1/O2."""

from __future__ import annotations

import torch

from hetpipe import data as datasets
from hetpipe.config import JobConfig
from hetpipe.zoo import build_model
from hetpipe.optim import compute_loss, make_optimizer


def initial_model(job: JobConfig) -> torch.nn.Sequential:
    """w0: model.init if given (loaded with weights_only=True), else the seeded zoo init."""
    model = build_model(job.model.name, job.model.args, seed=job.train.seed, dtype=getattr(torch, job.train.dtype))
    if job.model.init:
        state = torch.load(job.resolve(job.model.init), map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model


def train_reference(job: JobConfig, steps: int | None = None) -> torch.nn.Sequential:
    """Synchronous data parallelism with summed updates over the job's VWs (one VW: plain training).

    Each step every VW v computes its gradient on its minibatch p; plain SGD then applies the sum
    of the VWs' updates. With N=1 this is ordinary training with any optimizer.
    """
    model = initial_model(job)
    dataset = datasets.load_dataset(job)
    params = list(model.parameters())
    n = job.parallel.virtual_workers
    if n > 1 and (job.train.optimizer.name != "sgd" or job.train.optimizer.momentum):
        raise ValueError("the N-VW reference is defined for plain SGD only")
    optimizer = make_optimizer(params, job.train.optimizer)
    for p in range(1, (steps or job.train.steps) + 1):
        total = [torch.zeros_like(w) for w in params]
        for vw in range(n):
            x, y = datasets.minibatch(dataset, p, vw, job)
            loss = compute_loss(job.train.loss, model(x), y)
            grads = torch.autograd.grad(loss, params)
            for t, g in zip(total, grads):
                t.add_(g)
        for w, g in zip(params, total):
            w.grad = g  # summed: each VW's SGD update -lr*g_v is applied once
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model
