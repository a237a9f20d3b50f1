"""What ends a minibatch at a stage, and what its neighbours are told: the step of p (L3) and
its wave's update (G1), now or, with fp16 loss scaling or train.max_grad_norm, once stage 0's
verdict on p arrives; the tags of the activations and gradients it sends."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from hetpipe.loss_scale import clip_coefficient, grad_norm
from hetpipe.training import learning_rate
from hetpipe.v1 import wire_pb2
from hetpipe.wsp import closes_wave, wave_of
from stage_worker.links import Link, Outgoing
from stage_worker.loaded import Loaded
from stage_worker.scaling import Incoming, Waiting
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
    """An activation for the next stage; it carries the verdicts it has not had yet (fp16, max_grad_norm)."""
    header = tag(s, p, version, evaluation, micro)
    if s.scaling is not None:
        header.verdicts.CopyFrom(_news(s))
    assert s.next is not None
    return s.next, Outgoing(header, [("activation", out)])


def _news(s: Loaded) -> wire_pb2.Verdicts:
    """The verdicts the next stage has not been told yet (telling it marks them told)."""
    assert s.scaling is not None
    through, skipped, clipped = s.scaling.verdicts.news()
    return wire_pb2.Verdicts(through=through, skipped=skipped, clipped=clipped)


def commit(s: Loaded, p: int, grads: Grads, *, scale: float = 1.0, clip: float = 1.0, skip: bool = False,
           norm: float | None = None) -> None:
    """L3: p's step (or, fp16, its skip), its gradients unscaled then clipped, folded into its
    wave's update (G1). norm: the VW's gradient norm of p before clipping (stage 0's, traced)."""
    lr = learning_rate(s.job.train, p)
    update = s.compute.commit(grads, scale=scale, clip=clip, skip=skip, into=s.sync.spare_update(), lr=lr)
    s.sync.after_update(p, update)
    if closes_wave(p, s.job.nm, s.job.train.steps):
        s.sync.on_wave_end(wave_of(p, s.job.nm))
    agreed = {} if s.scaling is None else {"loss_scale": scale, "clip": clip, "stepped": not skip,
                                           "committed": time.time()}
    if norm is not None:
        agreed["grad_norm"] = norm
    s.trace.commit(p, lr=lr, **agreed)


def commit_decided(s: Loaded) -> None:
    """Commits, in minibatch order, the gradients whose verdicts have arrived; passes on verdicts
    that came alone (after the last minibatch)."""
    if s.scaling is None:
        return
    for p in s.scaling.decidable():
        waiting = s.scaling.waiting.pop(p)
        stepped = s.scaling.verdicts.stepped(p)
        if stepped and waiting.grads is None:
            raise RuntimeError(f"minibatch {p} overflowed here, but stage 0 decided to step it")
        commit(s, p, waiting.grads or [], scale=waiting.scale, clip=s.scaling.verdicts.take(p), skip=not stepped)
    if s.scaling.relay and s.next is not None:
        s.next.send(Outgoing(wire_pb2.CommitTag(vw=s.setup.vw, stage=s.setup.stage, verdicts=_news(s)), []))
    s.scaling.relay = False


class Agreed(NamedTuple):
    """What p's gradient tells the previous stage: whether p overflowed here or later (fp16), and
    the squared norms of the gradients here and later, summed (max_grad_norm)."""
    overflow: bool
    norm_sq: float


def agreed_backward(s: Loaded, p: int, grads: Grads, grad_in: torch.Tensor | None, scale: float,
                    later: Incoming | None) -> Agreed:
    """fp16 or max_grad_norm: stage 0 decides p and commits it; any other stage keeps its
    gradients until the verdict arrives. later: what the next stage's gradient said (None: the
    last stage)."""
    assert s.scaling is not None
    if p in s.overflow_at:
        grads = [None if g is None else torch.full_like(g, math.inf) for g in grads]
    overflow = (later is not None and later.overflow) or p in s.overflow_at or (
        s.scaling.fp16 and not s.compute.finite(grads, grad_in))
    norm_sq = 0.0
    if s.scaling.max_grad_norm and not overflow:
        norm_sq = (later.norm_sq if later is not None else 0.0) + s.compute.norm_sq(grads)
    if s.setup.first:
        clip = clip_coefficient(norm_sq, s.scaling.max_grad_norm, scale) if s.scaling.max_grad_norm else 1.0
        s.scaling.verdicts.decide(p, overflow, clip)
        norm = grad_norm(norm_sq, scale) if s.scaling.max_grad_norm and not overflow else math.nan
        commit(s, p, grads, scale=scale, clip=s.scaling.verdicts.take(p), skip=overflow,
               norm=norm if math.isfinite(norm) else None)   # the trace is strict JSON
        # No activation follows to carry them: after the last minibatch, or (until the driver
        # lets the stages past) after a checkpoint's cut, which waits for every stage's commits.
        cut = p % s.job.nm == 0 and s.cuts.is_cut(p // s.job.nm)
        if (p == s.job.train.steps or cut) and s.next is not None:
            s.scaling.relay = True
            commit_decided(s)
    else:
        s.scaling.waiting[p] = Waiting(None if overflow else grads, scale)
    return Agreed(overflow, norm_sq)


def gradient(s: Loaded, p: int, version: int, grad_in: torch.Tensor | None, scale: float = 0.0,
             agreed: Agreed | None = None, *, micro: int = 0) -> list[Send]:
    """The gradient for the previous stage; with fp16 or max_grad_norm, p's loss scale and what
    this stage and the later ones agreed to tell."""
    if s.prev is None:
        return []
    assert grad_in is not None
    header = tag(s, p, version, micro=micro)
    if agreed is not None:
        header.loss_scale, header.overflow, header.norm_sq = scale, agreed.overflow, agreed.norm_sq
    return [(s.prev, Outgoing(header, [("gradient", grad_in)]))]
