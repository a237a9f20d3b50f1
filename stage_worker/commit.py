"""What ends a minibatch at a stage, and what its neighbours are told: the step of p (L3) and
its wave's update (G1), now or, with fp16 loss scaling, once stage 0's verdict on p arrives; the
tags of the activations and gradients it sends."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from hetpipe.training import learning_rate
from hetpipe.v1 import wire_pb2
from hetpipe.wsp import closes_wave, wave_of
from stage_worker.links import Link, Outgoing
from stage_worker.loaded import Loaded
from stage_worker.scaling import Waiting
from stage_worker.stage import Grads

Send = tuple[Link, Outgoing]


class Ran(NamedTuple):
    """What a task leaves to the compute loop: its messages, the forward's share of its seconds
    (a task that is both), and what runs once the messages are on their way: p's commit, so that
    the previous stage's backward does not wait for this one's optimizer step (nor, on a GPU, the
    copy of the gradient it sends for the step's kernels)."""
    sends: list[Send]
    forward: float = 0.0
    then: Callable[[], None] | None = None


def tag(s: Loaded, p: int, version: int, evaluation: int = 0, micro: int = 0) -> wire_pb2.MinibatchTag:
    """Names minibatch p (or evaluation's batch p), its micro-batch, and the weight version it ran on."""
    return wire_pb2.MinibatchTag(vw=s.setup.vw, minibatch=p, weight_version=version, stage=s.setup.stage,
                                 eval=evaluation, micro=micro)


def activation(s: Loaded, p: int, version: int, out: torch.Tensor, evaluation: int = 0, *, micro: int = 0) -> Send:
    """An activation for the next stage; with fp16 it carries the verdicts it has not had yet."""
    header = tag(s, p, version, evaluation, micro)
    if s.scaling is not None:
        header.verdicts.CopyFrom(_news(s))
    assert s.next is not None
    return s.next, Outgoing(header, [("activation", out)])


def _news(s: Loaded) -> wire_pb2.Verdicts:
    """fp16: the verdicts the next stage has not been told yet (telling it marks them told)."""
    assert s.scaling is not None
    through, skipped = s.scaling.verdicts.news()
    return wire_pb2.Verdicts(through=through, skipped=skipped)


def commit(s: Loaded, p: int, grads: Grads, *, scale: float = 1.0, skip: bool = False) -> None:
    """L3: p's step (or, fp16, its skip), folded into its wave's update (G1)."""
    update = s.compute.commit(grads, scale=scale, skip=skip, into=s.sync.spare_update(),
                              lr=learning_rate(s.job.train, p))
    s.sync.after_update(p, update)
    if closes_wave(p, s.job.nm, s.job.train.steps):
        s.sync.on_wave_end(wave_of(p, s.job.nm))
    fp16 = {"loss_scale": scale, "stepped": not skip, "committed": time.time()} if s.scaling is not None else {}
    s.trace.commit(p, **fp16)


def commit_decided(s: Loaded) -> None:
    """fp16: commits, in minibatch order, the gradients whose verdicts have arrived; passes on
    verdicts that came alone (after the last minibatch)."""
    if s.scaling is None:
        return
    for p in s.scaling.decidable():
        waiting = s.scaling.waiting.pop(p)
        stepped = s.scaling.verdicts.stepped(p)
        if stepped and waiting.grads is None:
            raise RuntimeError(f"minibatch {p} overflowed here, but stage 0 decided to step it")
        commit(s, p, waiting.grads or [], scale=waiting.scale, skip=not stepped)
    if s.scaling.relay and s.next is not None:
        s.next.send(Outgoing(wire_pb2.CommitTag(vw=s.setup.vw, stage=s.setup.stage, verdicts=_news(s)), []))
    s.scaling.relay = False


def scaled_backward(s: Loaded, p: int, grads: Grads, grad_in: torch.Tensor | None, scale: float,
                    later: bool) -> bool:
    """fp16: stage 0 decides p and commits it; any other stage keeps its gradients until the
    verdict arrives. Returns whether p overflowed here or on a later stage."""
    assert s.scaling is not None
    if p in s.overflow_at:
        grads = [None if g is None else torch.full_like(g, math.inf) for g in grads]
    overflow = later or p in s.overflow_at or not s.compute.finite(grads, grad_in)
    if s.setup.first:
        s.scaling.verdicts.decide(p, overflow)
        commit(s, p, grads, scale=scale, skip=overflow)
        if p == s.job.train.steps and s.next is not None:  # no activation follows to carry them
            s.scaling.relay = True
            commit_decided(s)
    else:
        s.scaling.waiting[p] = Waiting(None if overflow else grads, scale)
    return overflow


def gradient(s: Loaded, p: int, version: int, grad_in: torch.Tensor | None, scale: float = 0.0,
             overflow: bool = False, *, micro: int = 0) -> list[Send]:
    """The gradient for the previous stage; with fp16, p's loss scale and whether p overflowed
    here or later."""
    if s.prev is None:
        return []
    assert grad_in is not None
    header = tag(s, p, version, micro=micro)
    header.loss_scale, header.overflow = scale, overflow
    return [(s.prev, Outgoing(header, [("gradient", grad_in)]))]
