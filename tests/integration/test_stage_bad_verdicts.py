"""fp16 loss scaling and max_grad_norm clipping on the wire: a stage refuses verdicts, loss scales
and norms that no pipeline could send, keeps its state, and commits a minibatch only once stage
0's verdict on it arrives.

The stage under test is stage_rig's middle stage of a 3-stage job (nm 2), between fake neighbours.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hetpipe import wire
from hetpipe.v1 import wire_pb2
from messages import messages
from stage_rig import STEPS, Code, Rig, frames, middle_stage, refused

pytestmark = pytest.mark.timeout(120)


def verdicts_alone(through: int, skipped: list[int], *, stage: int = 0, vw: int = 0,
                   tensors: list[tuple[str, torch.Tensor]] | None = None,
                   clipped: dict[int, float] | None = None) -> list[wire_pb2.TensorFrame]:
    tag = wire_pb2.CommitTag(vw=vw, stage=stage, verdicts=wire_pb2.Verdicts(through=through, skipped=skipped,
                                                                            clipped=clipped or {}))
    return messages(wire.encode(tensors or [], commit=tag))


def with_tag(request: list[wire_pb2.TensorFrame], **fields: Any) -> list[wire_pb2.TensorFrame]:
    """The frames with more fields set on the first frame's minibatch tag."""
    tag = request[0].minibatch
    for key, value in fields.items():
        if key == "verdicts":
            tag.verdicts.CopyFrom(value)
        else:
            setattr(tag, key, value)
    return request


def test_a_stage_without_loss_scaling_or_clipping_refuses_verdicts_and_norms(make_job) -> None:
    with middle_stage(make_job) as rig:
        before = rig.snapshot()
        refused(rig.stub.Forward, iter(verdicts_alone(1, [])), Code.FAILED_PRECONDITION,
                r"verdicts: this job neither scales its loss nor clips its gradients \(fp16, max_grad_norm only\)")
        rig.stub.Forward(iter(rig.activation(1)), timeout=10)
        rig.wait_until("forwards_done", 1)
        forwarded = rig.snapshot()
        refused(rig.stub.Backward, iter(with_tag(rig.gradient(1), norm_sq=0.25)), Code.INVALID_ARGUMENT,
                "gradient: norm_sq 0.25 of minibatch 1: expected none: this job does not clip its gradients")
        assert rig.snapshot() == forwarded and before["weights_digest"] == forwarded["weights_digest"]


def test_clipping_refuses_bad_norms_and_coefficients_and_commits_with_stage_0s(make_job) -> None:
    with middle_stage(make_job, max_grad_norm=1.0) as rig:
        before = rig.snapshot()
        cases = {
            "a coefficient of 1": (verdicts_alone(1, [], clipped={1: 1.0}), r"clip coefficients \[1\.0\]"),
            "a coefficient of 0": (verdicts_alone(1, [], clipped={1: 0.0}), r"clip coefficients \[0\.0\]"),
            "a NaN coefficient": (verdicts_alone(1, [], clipped={1: float("nan")}), r"clip coefficients \[nan\]"),
            "a coefficient outside what is decided": (verdicts_alone(1, [], clipped={2: 0.5}),
                                                      r"clipped minibatches \[2\] outside \(0, 1\]"),
        }
        for name, (request, match) in cases.items():
            refused(rig.stub.Forward, iter(request), Code.INVALID_ARGUMENT, "verdicts: " + match)
            assert rig.snapshot() == before, name
        rig.stub.Forward(iter(rig.activation(1)), timeout=10)
        rig.wait_until("forwards_done", 1)
        forwarded = rig.snapshot()
        refused(rig.stub.Backward, iter(with_tag(rig.gradient(1), loss_scale=1.0, norm_sq=-1.0)),
                Code.INVALID_ARGUMENT, "gradient: norm_sq -1.0 of minibatch 1: expected a squared norm >= 0")
        for fp16_only, match in (({"loss_scale": 2.0}, "loss_scale 2.0"), ({"loss_scale": 1.0, "overflow": True},
                                                                             "loss_scale 1.0, overflow")):
            refused(rig.stub.Backward, iter(with_tag(rig.gradient(1), norm_sq=1.0, **fp16_only)), Code.INVALID_ARGUMENT,
                    f"gradient: {match} of minibatch 1, but this job does not scale its loss")
        refused(rig.stub.Forward, iter(verdicts_alone(1, [1])), Code.INVALID_ARGUMENT,
                r"verdicts: skipped minibatches \[1\], but this job does not scale its loss")
        assert rig.snapshot() == forwarded

        # The gradient goes back with this stage's squared norm added; the step waits for stage 0.
        rig.stub.Backward(iter(with_tag(rig.gradient(1), loss_scale=1.0, norm_sq=0.25)), timeout=10)
        rig.wait_until("backwards_done", 1)
        rig.prev.wait_for(1)
        _, tag, _ = rig.prev.got[0]
        assert tag.loss_scale == 1.0 and tag.norm_sq > 0.25 and not tag.overflow
        assert rig.snapshot()["local_version"] == 0
        rig.stub.Forward(iter(verdicts_alone(1, [], clipped={1: 0.5})), timeout=10)
        after = rig.wait_until("local_version", 1)
        assert after.weights_digest != before["weights_digest"]
        rig.next.wait_for(2)  # minibatch 1's activation, then the verdict with its coefficient
        _, alone, _ = rig.next.got[1]
        assert (alone.verdicts.through, dict(alone.verdicts.clipped)) == (1, {1: 0.5})
        settled = rig.snapshot()
        refused(rig.stub.Forward, iter(verdicts_alone(1, [], clipped={1: 0.5})), Code.ALREADY_EXISTS,
                "verdicts through minibatch 1 arrived already")
        assert rig.snapshot() == settled


def test_bad_verdicts_and_scales_are_refused_and_a_minibatch_waits_for_its_verdict(make_job) -> None:
    with middle_stage(make_job, precision="fp16") as rig:
        _refuses_what_no_pipeline_sends(rig)  # leaves minibatch 1 forwarded
        before = rig.snapshot()

        # Minibatch 1's backward: the gradient goes back at once, the step waits for the verdict.
        rig.stub.Backward(iter(with_tag(rig.gradient(1), loss_scale=1024.0, overflow=True)), timeout=10)
        rig.wait_until("backwards_done", 1)
        rig.prev.wait_for(1)
        method, tag, _ = rig.prev.got[0]
        assert (method, tag.minibatch, tag.loss_scale, tag.overflow) == ("Backward", 1, 1024.0, True)
        waiting = rig.snapshot()
        assert waiting["local_version"] == 0 and waiting["weights_digest"] == before["weights_digest"]

        # Stage 0 skips it: a version without a step, and the verdict goes on to the next stage.
        refused(rig.stub.Forward, iter(verdicts_alone(1, [], clipped={1: 0.5})), Code.INVALID_ARGUMENT,
                r"verdicts: clipped minibatches \[1\], but this job does not clip its gradients")
        assert rig.snapshot()["local_version"] == 0
        rig.stub.Forward(iter(verdicts_alone(1, [1])), timeout=10)
        after = rig.wait_until("local_version", 1)
        assert after.weights_digest == before["weights_digest"], "a skipped minibatch changes no weight"
        rig.next.wait_for(2)  # minibatch 1's activation, then the verdict
        method, alone, tensors = rig.next.got[1]
        assert (method, alone.stage, alone.verdicts.through, list(alone.verdicts.skipped), tensors) == (
            "Forward", 1, 1, [1], [])

        # The same verdicts again: a resend whose answer was lost, counted as delivered, no news.
        settled = rig.snapshot()
        refused(rig.stub.Forward, iter(verdicts_alone(1, [1])), Code.ALREADY_EXISTS,
                "verdicts through minibatch 1 arrived already")
        refused(rig.stub.Forward, iter(verdicts_alone(1, [])), Code.ALREADY_EXISTS,
                "verdicts through minibatch 1 arrived already")
        assert rig.snapshot() == settled


def test_a_resent_activation_whose_verdicts_are_known_now_counts_as_delivered(make_job) -> None:
    """Its first send landed and taught the stage its verdicts; the answer was lost and the link
    sends it again. It must come back ALREADY_EXISTS (the link counts it delivered), not be checked
    against the verdicts it brought itself (INVALID_ARGUMENT, which fails the sending stage)."""
    with middle_stage(make_job, precision="fp16") as rig:
        for p in (1, 2):
            rig.stub.Forward(iter(rig.activation(p)), timeout=10)
        rig.wait_until("forwards_done", 2)
        rig.stub.Backward(iter(with_tag(rig.gradient(1), loss_scale=1024.0, overflow=True)), timeout=10)
        rig.wait_until("backwards_done", 1)
        third = with_tag(rig.activation(3), verdicts=wire_pb2.Verdicts(through=1, skipped=[1]))
        rig.stub.Forward(iter(third), timeout=10)   # stage 0 skipped minibatch 1: the verdict rides on 3
        rig.wait_until("local_version", 1)
        rig.wait_until("forwards_done", 3)
        landed = rig.snapshot()
        refused(rig.stub.Forward, iter(third), Code.ALREADY_EXISTS, "activation for minibatch 3 was already received")
        assert rig.snapshot() == landed


def _refuses_what_no_pipeline_sends(rig: Rig) -> None:
    before = rig.snapshot()
    x = torch.randn(rig.in_spec.shape)
    cases = {
        "verdicts from stage 2": (rig.stub.Forward, verdicts_alone(1, [], stage=2), Code.INVALID_ARGUMENT,
                                  "verdicts: from stage 2 of vw 0, expected stage 0 of vw 0"),
        "verdicts for another vw": (rig.stub.Forward, verdicts_alone(1, [], vw=1), Code.INVALID_ARGUMENT,
                                    "verdicts: from stage 0 of vw 1, expected stage 0 of vw 0"),
        "verdicts with a tensor": (rig.stub.Forward, verdicts_alone(1, [], tensors=[("activation", x)]),
                                   Code.INVALID_ARGUMENT, "verdicts: expected no tensors, got 1"),
        "verdicts past the run": (rig.stub.Forward, verdicts_alone(STEPS + 1, []), Code.INVALID_ARGUMENT,
                                  rf"verdicts: verdicts through minibatch {STEPS + 1}, but the run has {STEPS}"),
        "a skip outside what is decided": (rig.stub.Forward, verdicts_alone(2, [3]), Code.INVALID_ARGUMENT,
                                           r"verdicts: skipped minibatches \[3\] outside \(0, 2\]"),
        "an activation with a skip it cannot know": (
            rig.stub.Forward, with_tag(rig.activation(1), verdicts=wire_pb2.Verdicts(through=1, skipped=[2])),
            Code.INVALID_ARGUMENT, r"activation: skipped minibatches \[2\] outside \(0, 1\]"),
    }
    for name, (call, request, code, match) in cases.items():
        try:
            refused(call, iter(request), code, match)
            assert rig.snapshot() == before, "a refused message changed the stage's state"
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert not rig.next.got, "a refused message was passed on"

    rig.stub.Forward(iter(rig.activation(1)), timeout=10)  # to have a gradient to refuse
    rig.wait_until("forwards_done", 1)
    started = rig.snapshot()
    for scale, match in ((0.0, "loss_scale 0.0 of minibatch 1"), (float("nan"), "loss_scale nan of minibatch 1"),
                         (0.5, "loss_scale 0.5 of minibatch 1")):
        refused(rig.stub.Backward, iter(with_tag(rig.gradient(1), loss_scale=scale)), Code.INVALID_ARGUMENT,
                rf"gradient: {match}: expected a finite scale >= 1")
        assert rig.snapshot() == started
    refused(rig.stub.Backward, iter(with_tag(rig.gradient(2), loss_scale=1024.0)), Code.FAILED_PRECONDITION,
            "gradient for minibatch 2, which this stage has not forwarded")


def test_gpipe_refuses_claims_on_a_micro_batch_before_the_last_and_a_second_loss_scale(make_job) -> None:
    """gpipe with fp16 and clipping: every gradient of p carries p's one loss scale, and only the
    last micro-batch's whether p overflowed and its norm (the stage reads them there alone); the
    refusals change nothing, and the right gradients go on to stage 0."""
    with middle_stage(make_job, {"schedule": "gpipe", "nm": 1, "microbatches": 2},
                      precision="fp16", max_grad_norm=1.0) as rig:
        def half(spec: Any) -> list[int]:
            return [spec.shape[0] // 2, *spec.shape[1:]]

        for m in (1, 2):
            x = torch.randn(half(rig.in_spec), dtype=rig.in_spec.dtype)
            rig.stub.Forward(iter(frames([("activation", x)], 1, stage=0, micro=m)), timeout=10)
        rig.next.wait_for(2)

        def gradient(m: int, **tag: Any) -> list[wire_pb2.TensorFrame]:
            g = torch.randn(half(rig.out_spec), dtype=rig.out_spec.dtype)
            return with_tag(frames([("gradient", g)], 1, stage=2, micro=m), **tag)

        before = rig.snapshot()
        for claim in ({"overflow": True}, {"norm_sq": 123.0}):
            refused(rig.stub.Backward, iter(gradient(1, loss_scale=4.0, **claim)), Code.INVALID_ARGUMENT,
                    r"gradient for micro-batch 1 of minibatch 1: overflow .*; only the last micro-batch's \(2\) says those")
        assert rig.snapshot() == before
        rig.stub.Backward(iter(gradient(1, loss_scale=4.0)), timeout=10)
        rig.prev.wait_for(1)
        taken = rig.snapshot()
        refused(rig.stub.Backward, iter(gradient(2, loss_scale=8.0)), Code.INVALID_ARGUMENT,
                r"micro-batch 2 of minibatch 1: loss_scale 8\.0, but its earlier micro-batches came at 4\.0")
        assert rig.snapshot() == taken
        rig.stub.Backward(iter(gradient(2, loss_scale=4.0, norm_sq=0.5)), timeout=10)
        rig.prev.wait_for(2)
        sent = [(tag.micro, tag.loss_scale, tag.overflow, tag.norm_sq > 0.5) for _, tag, _ in rig.prev.got]
        assert sent == [(1, 4.0, False, False), (2, 4.0, False, True)], "p's norm: the later stages' and its own"
