"""What the neighbour stages send a stage: each activation and gradient checked against the
stage's assignment and schedule, then held until the compute thread takes it. The runtime calls
it under its own lock."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

import grpc
import torch

from hetpipe.errors import Rejected
from hetpipe.v1 import wire_pb2
from hetpipe.wire import Bundle
from stage_worker.assignment import TensorSpec
from stage_worker.loaded import Loaded
from stage_worker.micro_schedule import MicroSchedule
from stage_worker.schedule import Rejection, ScheduleError

_SCHEDULE_CODES = {
    Rejection.UNKNOWN: grpc.StatusCode.INVALID_ARGUMENT,
    Rejection.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Rejection.WINDOW: grpc.StatusCode.FAILED_PRECONDITION,
    Rejection.ORDER: grpc.StatusCode.FAILED_PRECONDITION,
    Rejection.NOT_ACCEPTED: grpc.StatusCode.FAILED_PRECONDITION,
}


class Inbox:
    def __init__(self) -> None:
        # minibatch p -> activation or gradient; micro-batch schedules: (p, micro) ->
        self.forward: dict[Hashable, torch.Tensor] = {}
        self.backward: dict[Hashable, torch.Tensor] = {}
        self.evals: deque[tuple[int, int, torch.Tensor]] = deque()   # (evaluation, minibatch, x)
        self.eval_received: dict[int, set[int]] = {}   # evaluation -> its minibatches taken
        self.received = 0

    def offer_forward(self, s: Loaded, bundle: Bundle, *, training: bool) -> None:
        """An activation from the previous stage (training: not yet DONE, which takes evaluations
        only), or fp16 verdicts alone."""
        if s.setup.first:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "stage 0 reads its own data and takes no activations")
        if bundle.header.WhichOneof("header") == "commit":
            self._offer_verdicts(s, bundle)
            return
        p, k = _check(s, bundle, s.setup.stage - 1, "activation", training)
        if k and p in self.eval_received.get(k, ()):  # the last stage would count it twice
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"activation: evaluation {k} minibatch {p} arrived already")
        x = bundle.tensors[0][1]
        m, spec = _micro(s, bundle, "activation", s.setup.specs.activation, training=not k)
        spec.check("activation", x)
        verdicts = bundle.header.minibatch.verdicts
        _check_verdicts(s, verdicts, "activation")
        if k:
            self.eval_received.setdefault(k, set()).add(p)
            self.evals.append((k, p, x.to(s.compute.device, non_blocking=True)))
        else:
            self.forward[_accept(s, p, m, "forward")] = x.to(s.compute.device, non_blocking=True)
        if s.scaling is not None:
            s.scaling.verdicts.learn(verdicts.through, verdicts.skipped)
        self.received += 1

    def _offer_verdicts(self, s: Loaded, bundle: Bundle) -> None:
        tag = bundle.header.commit
        if s.scaling is None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "verdicts: this job does not scale its loss (fp16 only)")
        if tag.vw != s.setup.vw or tag.stage != s.setup.stage - 1:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"verdicts: from stage {tag.stage} of vw {tag.vw}, "
                                                             f"expected stage {s.setup.stage - 1} of vw {s.setup.vw}")
        if bundle.tensors:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"verdicts: expected no tensors, got {len(bundle.tensors)}")
        _check_verdicts(s, tag.verdicts, "verdicts")
        s.scaling.verdicts.learn(tag.verdicts.through, tag.verdicts.skipped)
        s.scaling.relay = True
        self.received += 1

    def offer_backward(self, s: Loaded, bundle: Bundle, *, training: bool) -> None:
        """A gradient from the next stage."""
        if s.setup.last:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the last stage computes the loss and takes no gradients")
        p, _ = _check(s, bundle, s.setup.stage + 1, "gradient", training)
        grad = bundle.tensors[0][1]
        m, spec = _micro(s, bundle, "gradient", s.setup.specs.output, training=True)
        spec.check("gradient", grad)
        tag = bundle.header.minibatch
        if s.scaling is not None and not (math.isfinite(tag.loss_scale) and tag.loss_scale >= 1.0):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"gradient: loss_scale {tag.loss_scale} of minibatch {p}: expected a finite scale >= 1")
        self.backward[_accept(s, p, m, "backward")] = grad.to(s.compute.device, non_blocking=True)
        if s.scaling is not None:
            s.scaling.incoming[p] = (tag.loss_scale, tag.overflow)
        self.received += 1


def _check(s: Loaded, bundle: Bundle, from_stage: int, what: str, training: bool) -> tuple[int, int]:
    """(minibatch, evaluation) of a valid single-tensor input from stage from_stage."""
    if bundle.header.WhichOneof("header") != "minibatch":
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: first frame lacks the minibatch tag")
    tag = bundle.header.minibatch
    if tag.vw != s.setup.vw:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: tagged for vw {tag.vw}, but this is {s.setup.name}")
    if tag.stage != from_stage:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: sent by stage {tag.stage}, expected stage {from_stage}")
    if len(bundle.tensors) != 1:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: expected 1 tensor, got {len(bundle.tensors)}")
    if tag.eval and (s.evals is None or not 1 <= tag.minibatch <= len(s.evals.batches)
                     or tag.eval > s.evals.schedule.final_id or what != "activation"):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: evaluation {tag.eval} minibatch {tag.minibatch} "
                                                         f"is not one this stage runs")
    if not training and not tag.eval:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                       f"{what} for minibatch {tag.minibatch} refused in state DONE: training has ended")
    return int(tag.minibatch), int(tag.eval)


def _micro(s: Loaded, bundle: Bundle, what: str, whole: TensorSpec, *, training: bool) -> tuple[int, TensorSpec]:
    """The micro-batch an input names, and the spec its tensor must meet (whole: a minibatch's):
    only the micro-batch schedules' training traffic has one (their schedule checks its range)."""
    m = int(bundle.header.minibatch.micro)
    if training and isinstance(s.schedule, MicroSchedule):
        try:
            s.schedule.check_unit(int(bundle.header.minibatch.minibatch), m, what)
        except ScheduleError as exc:
            raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None
        return m, whole.split(s.schedule.micro) if m else whole
    if m:
        whose = "an evaluation's" if not training else f"schedule {s.job.parallel.schedule}'s"
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{what}: micro-batch {m}, but {whose} {what}s carry whole minibatches")
    return m, whole


def _check_verdicts(s: Loaded, verdicts: wire_pb2.Verdicts, what: str) -> None:
    if s.scaling is None:
        return
    try:
        s.scaling.verdicts.check(verdicts.through, verdicts.skipped, s.job.train.steps)
    except ValueError as exc:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {exc}") from None


def _accept(s: Loaded, p: int, m: int, kind: str) -> Hashable:
    """Offers the input to the schedule; returns the key it is held under until it runs."""
    sched = s.schedule
    try:
        if isinstance(sched, MicroSchedule):
            (sched.accept_forward if kind == "forward" else sched.accept_backward)(p, m)
            return (p, m)
        (sched.accept_forward if kind == "forward" else sched.accept_backward)(p)
        return p
    except ScheduleError as exc:
        raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None
