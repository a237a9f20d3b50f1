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
from stage_worker.scaling import Incoming
from stage_worker.schedule import INPUT, Rejection, ScheduleError

Metas = list[tuple[torch.dtype, tuple[int, ...]]]   # each received tensor's dtype and shape

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

    def check_forward(self, s: Loaded, header: wire_pb2.TensorFrame, metas: Metas, *,
                      training: bool) -> tuple[int, int, int] | None:
        """Refuses an activation (or fp16 verdicts alone) that offer_forward would refuse for what its
        header says, tensors' dtypes and shapes included; changes nothing. The servicer calls it
        before anything is allocated for the tensors (a GPU stage pins them). Returns the minibatch,
        evaluation and micro-batch; None for verdicts alone."""
        if s.setup.first:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "stage 0 reads its own data and takes no activations")
        if header.WhichOneof("header") == "commit":
            _check_verdicts_alone(s, header.commit, len(metas))
            return None
        p, k = _check(s, header, len(metas), s.setup.stage - 1, "activation")
        if k and p in self.eval_received.get(k, ()):  # the last stage would count it twice
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"activation: evaluation {k} minibatch {p} arrived already")
        if k and training and s.evals is not None and k == s.evals.schedule.final_id:
            # Stage 0 sends it once every stage is done: taken earlier, it would hold back every
            # periodic evaluation queued behind it, and take the real one's place.
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"activation: the final evaluation's minibatch {p} "
                                                                "came while this stage still trains: it follows the run")
        m, spec = _micro(s, header, "activation", s.setup.specs.activation, training=not k)
        spec.check("activation", *metas[0])
        if not k:
            _check_training(s, p, m, "forward", training)
        _check_verdicts(s, header.minibatch.verdicts, "activation")
        return p, k, m

    def offer_forward(self, s: Loaded, bundle: Bundle, *, training: bool) -> None:
        """An activation from the previous stage (training: not yet DONE, which takes evaluations
        only), or fp16 verdicts alone."""
        checked = self.check_forward(s, bundle.header, _metas(bundle), training=training)
        if checked is None:
            tag = bundle.header.commit
            assert s.scaling is not None
            s.scaling.verdicts.learn(tag.verdicts.through, tag.verdicts.skipped, tag.verdicts.clipped)
            s.scaling.relay = True
            self.received += 1
            return
        p, k, m = checked
        x = bundle.tensors[0][1]
        verdicts = bundle.header.minibatch.verdicts
        if k:
            self.eval_received.setdefault(k, set()).add(p)
            self.evals.append((k, p, x.to(s.compute.device, non_blocking=True)))
        else:
            self.forward[_accept(s, p, m, "forward")] = x.to(s.compute.device, non_blocking=True)
        if s.scaling is not None:
            s.scaling.verdicts.learn(verdicts.through, verdicts.skipped, verdicts.clipped)
        self.received += 1

    def check_backward(self, s: Loaded, header: wire_pb2.TensorFrame, metas: Metas, *,
                       training: bool) -> tuple[int, int]:
        """check_forward's twin for a gradient from the next stage; returns its minibatch and micro-batch."""
        if s.setup.last:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the last stage computes the loss and takes no gradients")
        p, _ = _check(s, header, len(metas), s.setup.stage + 1, "gradient")
        m, spec = _micro(s, header, "gradient", s.setup.specs.output, training=True)
        spec.check("gradient", *metas[0])
        _check_training(s, p, m, "backward", training)
        tag = header.minibatch
        if s.scaling is not None and not (math.isfinite(tag.loss_scale) and tag.loss_scale >= 1.0):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"gradient: loss_scale {tag.loss_scale} of minibatch {p}: expected a finite scale >= 1")
        if s.scaling is not None and not s.scaling.fp16 and (tag.loss_scale != 1.0 or tag.overflow):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"gradient: loss_scale {tag.loss_scale}{', overflow' if tag.overflow else ''} of minibatch {p}, "
                           "but this job does not scale its loss")
        if tag.norm_sq < 0 or (tag.norm_sq != 0 and (s.scaling is None or not s.scaling.max_grad_norm)):
            # NaN and +inf are norms of gradients that are not finite: clip_coefficient leaves them
            # alone, and the loss names them (a refusal would fail the sender's link instead).
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"gradient: norm_sq {tag.norm_sq} of minibatch {p}: expected " +
                           ("a squared norm >= 0" if s.scaling is not None and s.scaling.max_grad_norm
                            else "none: this job does not clip its gradients"))
        if s.scaling is not None and m:
            _check_micro_verdict(s, p, m, tag)
        return p, m

    def offer_backward(self, s: Loaded, bundle: Bundle, *, training: bool) -> None:
        """A gradient from the next stage."""
        p, m = self.check_backward(s, bundle.header, _metas(bundle), training=training)
        tag = bundle.header.minibatch
        self.backward[_accept(s, p, m, "backward")] = bundle.tensors[0][1].to(s.compute.device, non_blocking=True)
        if s.scaling is not None:
            s.scaling.incoming[p] = Incoming(tag.loss_scale, tag.overflow, tag.norm_sq)
        self.received += 1


def _metas(bundle: Bundle) -> Metas:
    return [(t.dtype, tuple(t.shape)) for _, t in bundle.tensors]


def _check_verdicts_alone(s: Loaded, tag: wire_pb2.CommitTag, tensors: int) -> None:
    if s.scaling is None:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                       "verdicts: this job neither scales its loss nor clips its gradients (fp16, max_grad_norm only)")
    if tag.vw != s.setup.vw or tag.stage != s.setup.stage - 1:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"verdicts: from stage {tag.stage} of vw {tag.vw}, "
                                                         f"expected stage {s.setup.stage - 1} of vw {s.setup.vw}")
    if tensors:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"verdicts: expected no tensors, got {tensors}")
    known = s.scaling.verdicts
    # A coefficient forgotten once committed and told counts as known.
    if tag.verdicts.through <= known.through and set(tag.verdicts.skipped) <= known.skipped and all(
            known.clipped.get(p, c) == c for p, c in tag.verdicts.clipped.items()):
        # Only the minibatches after the last verdicts can be new: this is a resend (its answer lost).
        raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"verdicts through minibatch {tag.verdicts.through} "
                                                       "arrived already")
    _check_verdicts(s, tag.verdicts, "verdicts")


def _check(s: Loaded, header: wire_pb2.TensorFrame, tensors: int, from_stage: int, what: str) -> tuple[int, int]:
    """(minibatch, evaluation) of a valid single-tensor input from stage from_stage."""
    if header.WhichOneof("header") != "minibatch":
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: first frame lacks the minibatch tag")
    tag = header.minibatch
    if tag.vw != s.setup.vw:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: tagged for vw {tag.vw}, but this is {s.setup.name}")
    if tag.stage != from_stage:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: sent by stage {tag.stage}, expected stage {from_stage}")
    if tensors != 1:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: expected 1 tensor, got {tensors}")
    if tag.eval and (s.evals is None or not 1 <= tag.minibatch <= len(s.evals.batches)
                     or tag.eval > s.evals.schedule.final_id or what != "activation"):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: evaluation {tag.eval} minibatch {tag.minibatch} "
                                                         f"is not one this stage runs")
    return int(tag.minibatch), int(tag.eval)


def _check_training(s: Loaded, p: int, m: int, kind: str, training: bool) -> None:
    """A training input that came already is a resend whose answer was lost: ALREADY_EXISTS, which
    the sender counts as delivered, before anything that has changed since it first came (the
    stage may have finished: DONE; its verdicts may be known now) could refuse it."""
    try:
        s.schedule.check_new(kind, p, m)
    except ScheduleError as exc:
        raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None
    if not training:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                       f"{INPUT[kind]} for minibatch {p} refused in state DONE: training has ended")


def _micro(s: Loaded, header: wire_pb2.TensorFrame, what: str, whole: TensorSpec, *,
           training: bool) -> tuple[int, TensorSpec]:
    """The micro-batch an input names, and the spec its tensor must meet (whole: a minibatch's):
    only the micro-batch schedules' training traffic has one (their schedule checks its range)."""
    m = int(header.minibatch.micro)
    if training and isinstance(s.schedule, MicroSchedule):
        try:
            s.schedule.check_unit(int(header.minibatch.minibatch), m, what)
        except ScheduleError as exc:
            raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None
        return m, whole.split(s.schedule.micro) if m else whole
    if m:
        whose = "an evaluation's" if not training else f"schedule {s.job.parallel.schedule}'s"
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{what}: micro-batch {m}, but {whose} {what}s carry whole minibatches")
    return m, whole


def _check_micro_verdict(s: Loaded, p: int, m: int, tag: wire_pb2.MinibatchTag) -> None:
    """gpipe, 1f1b with fp16 or max_grad_norm: every gradient of p carries p's one loss scale, and
    only the last micro-batch's whether p overflowed and its norm (stage_worker/micro.py): a claim
    on an earlier one would be lost."""
    assert s.scaling is not None and isinstance(s.schedule, MicroSchedule)
    if m < s.schedule.micro and (tag.overflow or tag.norm_sq != 0):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"gradient for micro-batch {m} of minibatch {p}: overflow {tag.overflow}, norm_sq "
                       f"{tag.norm_sq}; only the last micro-batch's ({s.schedule.micro}) says those")
    earlier = s.scaling.incoming.get(p)
    if earlier is not None and earlier.scale != tag.loss_scale:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"gradient for micro-batch {m} of minibatch {p}: loss_scale {tag.loss_scale}, but its earlier "
                       f"micro-batches came at {earlier.scale}: a minibatch has one loss scale")


def _check_verdicts(s: Loaded, verdicts: wire_pb2.Verdicts, what: str) -> None:
    if s.scaling is None:
        return
    if verdicts.skipped and not s.scaling.fp16:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: skipped minibatches {list(verdicts.skipped)[:5]}, "
                                                         "but this job does not scale its loss")
    if verdicts.clipped and not s.scaling.max_grad_norm:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: clipped minibatches {sorted(verdicts.clipped)[:5]}, "
                                                         "but this job does not clip its gradients")
    try:
        s.scaling.verdicts.check(verdicts.through, verdicts.skipped, s.job.train.steps, verdicts.clipped)
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
