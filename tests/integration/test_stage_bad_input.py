"""A stage worker refuses bad data-plane messages (activations, gradients, control calls out of
turn, bytes that are not a frame) with the right gRPC status and a message naming the problem,
keeps serving, and keeps its training state unchanged (DESIGN §2: explicit dtype + shape + bytes,
every message tagged (vw, minibatch, version)).

The stage under test is stage_rig's: a real in-process Stage server, the middle stage of a
3-stage job, between two fake neighbours that only record. Bad assignments are in
test_stage_bad_assignment.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from hetpipe import rpc, socket_duplex, wire
from hetpipe.duplex import Duplex
from hetpipe.v1 import stage_pb2, wire_pb2
from shm_handles import forged_handles
from stage_rig import NM, STEPS, Code, Rig, State, frames, middle_stage, refused, unlimited_channel
from stage_worker.runtime import StageRuntime

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def rig(make_job) -> Iterator[Rig]:
    with middle_stage(make_job) as running:
        yield running


# ---- malformed or wrong activations, on a freshly started stage ----------------------------------------


def _header_only(meta: list[wire_pb2.TensorMeta], p: int = 1, data: bytes = b"") -> list[wire_pb2.TensorFrame]:
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=p, stage=0)
    return [wire_pb2.TensorFrame(minibatch=tag, tensors=meta, data=data)]


def _bad_activations(rig: Rig) -> dict[str, tuple[Any, grpc.StatusCode, str]]:
    """name -> (frames, code, regex the message must match)."""
    xs = list(rig.in_spec.shape)
    good = rig.activation(1)
    nbytes = torch.randn(xs).numel() * 4

    def edited(i: int, **kw: Any) -> list[wire_pb2.TensorFrame]:
        """The good frames with tensor i's meta changed."""
        out = [wire_pb2.TensorFrame() for _ in good]
        for o, g in zip(out, good):
            o.CopyFrom(g)
        meta = out[0].tensors[i]
        for k, v in kw.items():
            if k == "shape":
                del meta.shape[:]
                meta.shape.extend(v)
            else:
                setattr(meta, k, v)
        return out

    ok_x = torch.randn(xs)
    wider = torch.randn([xs[0], xs[1] + 1])
    return {
        "unknown dtype code": (edited(0, dtype=99), Code.INVALID_ARGUMENT, "unknown dtype code 99"),
        "wrong dtype": (frames([("activation", ok_x.double())], 1, stage=0),
                        Code.INVALID_ARGUMENT, r"activation: dtype torch\.float64, expected torch\.float32"),
        "too few bytes": (_header_only(good[0].tensors, data=bytes(nbytes - 4)), Code.INVALID_ARGUMENT,
                          rf"byte length {nbytes - 4} does not match the shapes in the header \({nbytes} bytes\)"),
        "too many bytes": (_header_only(good[0].tensors, data=bytes(nbytes + 8)), Code.INVALID_ARGUMENT,
                           rf"byte length .* does not match the shapes in the header \({nbytes} bytes\)"),
        "shape claims more than sent": (edited(0, shape=[xs[0], xs[1] * 1000]), Code.INVALID_ARGUMENT,
                                        rf"activation: shape \[{xs[0]}, {xs[1] * 1000}\], expected"),
        "huge claimed shape": (edited(0, shape=[1 << 20, 1 << 20]), Code.INVALID_ARGUMENT,
                               r"shape \[1048576, 1048576\] spans \d+ bytes, more than the \d+ allowed"),
        "negative dimension": (edited(0, shape=[-1, xs[1]]), Code.INVALID_ARGUMENT,
                               "negative dimension"),
        "too many dims": (edited(0, shape=[1] * 9 + [xs[1]]), Code.INVALID_ARGUMENT,
                          "10 dims, at most 8"),
        "minibatch 0": (rig.activation(0), Code.INVALID_ARGUMENT,
                        rf"minibatch 0: the job has minibatches 1\.\.{STEPS}"),
        "minibatch steps+1": (rig.activation(STEPS + 1), Code.INVALID_ARGUMENT,
                              rf"minibatch {STEPS + 1}: the job has minibatches 1\.\.{STEPS}"),
        "another vw": (rig.activation(1, vw=1), Code.INVALID_ARGUMENT,
                       "tagged for vw 1, but this is stage 1 of vw 0"),
        "wrong sender stage": (rig.activation(1, stage=2), Code.INVALID_ARGUMENT, "sent by stage 2, expected stage 0"),
        "no minibatch tag": ([wire_pb2.TensorFrame(tensors=good[0].tensors, data=good[0].data)] + good[1:],
                             Code.INVALID_ARGUMENT, "lacks the minibatch tag"),
        "wrong activation shape": (frames([("activation", wider)], 1, stage=0),
                                   Code.INVALID_ARGUMENT,
                                   rf"activation: shape \[{xs[0]}, {xs[1] + 1}\], expected \[{xs[0]}, {xs[1]}\]"),
        "a target alongside (they no longer travel)": (
            frames([("activation", ok_x), ("target", torch.zeros(xs[0], dtype=torch.int64))], 1, stage=0),
            Code.INVALID_ARGUMENT, r"activation: expected 1 tensor, got 2"),
        "an evaluation this stage does not run": (rig.activation(1, eval=3), Code.INVALID_ARGUMENT,
                                                  r"activation: evaluation 3 minibatch 1 is not one this stage runs"),
        "empty stream": ([], Code.INVALID_ARGUMENT, "empty tensor stream"),
        "header repeated": (good + [wire_pb2.TensorFrame(minibatch=good[0].minibatch)], Code.INVALID_ARGUMENT,
                            "header fields repeated after the first frame"),
        "oversized frame": (_header_only(good[0].tensors, data=bytes(5 << 20)), Code.RESOURCE_EXHAUSTED,
                            r"(?i)larger than max"),
        "beyond the nm window": (rig.activation(NM + 1), Code.FAILED_PRECONDITION,
                                 rf"activation for minibatch {NM + 1} .*at most nm={NM}"),
    }


def test_bad_activations_are_refused_and_change_nothing(rig: Rig) -> None:
    before = rig.snapshot()
    assert before["state"] == State.RUNNING and before["received"] == 0 and before["weights_digest"]
    for name, (request, code, match) in _bad_activations(rig).items():
        try:
            refused(rig.stub.Forward, iter(request), code, match)
            assert rig.snapshot() == before, "a refused message changed the stage's state"
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    assert not rig.next.got and not rig.prev.got, "a refused activation was passed on"

    # The stage still takes a valid activation, runs it, and passes it on with its version.
    rig.stub.Forward(iter(rig.activation(1)), timeout=10)
    rig.wait_until("forwards_done", 1)
    rig.next.wait_for(1)
    method, tag, tensors = rig.next.got[0]
    assert (method, tag.vw, tag.minibatch, tag.stage, tag.weight_version) == ("Forward", 0, 1, 1, 0)
    assert [(n, list(t.shape)) for n, t in tensors] == [("activation", list(rig.out_spec.shape))]
    after = rig.snapshot()
    assert (after["received"], after["forwards_done"], after["in_flight"]) == (1, 1, 1)
    assert after["weights_digest"] == before["weights_digest"]  # a forward does not update weights


def test_a_gpu_stage_refuses_a_forged_shape_before_it_allocates_pinned_memory(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU stage receives host bytes into pinned memory, page-locked as it is allocated: a header
    that claims a tensor other than the one the stage takes is refused from the header, before
    anything is allocated for it. (This stage computes on the CPU: its `gpu` and wire.empty, the
    allocator decode uses, are stood in for.)"""
    allocated: list[tuple[list[int], bool]] = []

    def empty(shape: Any, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        allocated.append((list(shape), pinned))
        return torch.empty(tuple(shape), dtype=dtype)

    monkeypatch.setattr(wire, "empty", empty)
    monkeypatch.setattr(StageRuntime, "gpu", property(lambda self: torch.device("cuda", 0)))
    xs, gs = list(rig.in_spec.shape), list(rig.out_spec.shape)

    def forged(good: list[wire_pb2.TensorFrame], shape: list[int]) -> list[wire_pb2.TensorFrame]:
        """The good header claiming `shape`, followed by 100 bytes."""
        first = wire_pb2.TensorFrame()
        first.CopyFrom(good[0])
        del first.tensors[0].shape[:]
        first.tensors[0].shape.extend(shape)
        first.data = bytes(100)
        return [first]

    before = rig.snapshot()
    link = Duplex(rig.stub.ForwardLink, deadline_s=10)
    for call, request, match in [
        (rig.stub.Forward, iter(forged(rig.activation(1), [xs[0], xs[1] * 1000])),
         rf"activation: shape \[{xs[0]}, {xs[1] * 1000}\], expected \[{xs[0]}, {xs[1]}\]"),
        (lambda frame, timeout: link.call(frame), forged(rig.activation(1), [xs[0] * 1000, xs[1]])[0],
         rf"activation: shape \[{xs[0] * 1000}, {xs[1]}\], expected"),
        (rig.stub.Backward, iter(forged(rig.gradient(1), [gs[0], gs[1] * 1000])),
         rf"gradient: shape \[{gs[0]}, {gs[1] * 1000}\], expected \[{gs[0]}, {gs[1]}\]"),
    ]:
        refused(call, request, Code.INVALID_ARGUMENT, match)
        assert not allocated, f"allocated {allocated} for a header it refuses"
        assert rig.snapshot() == before
    link.close()
    # A good activation still lands in (stood-in) pinned memory (the fake next stage decodes its
    # output after that, unpinned).
    rig.stub.Forward(iter(rig.activation(1)), timeout=10)
    rig.wait_until("forwards_done", 1)
    assert allocated[0] == (xs, True)


def test_duplicates_and_unexpected_gradients_are_refused(rig: Rig) -> None:
    # A gradient for a minibatch this stage never forwarded.
    before = rig.snapshot()
    refused(rig.stub.Backward, iter(rig.gradient(1)), Code.FAILED_PRECONDITION,
            "gradient for minibatch 1, which this stage has not forwarded")
    assert rig.snapshot() == before

    rig.stub.Forward(iter(rig.activation(1)), timeout=10)
    rig.wait_until("forwards_done", 1)
    before = rig.snapshot()
    bad_gradients = {
        "duplicate activation": (rig.stub.Forward, rig.activation(1), Code.ALREADY_EXISTS,
                                 "activation for minibatch 1 was already received"),
        "gradient never forwarded": (rig.stub.Backward, rig.gradient(2), Code.FAILED_PRECONDITION,
                                     "gradient for minibatch 2, which this stage has not forwarded"),
        "gradient minibatch 0": (rig.stub.Backward, rig.gradient(0), Code.INVALID_ARGUMENT,
                                 rf"gradient for minibatch 0: the job has minibatches 1\.\.{STEPS}"),
        "gradient another vw": (rig.stub.Backward, rig.gradient(1, vw=3), Code.INVALID_ARGUMENT,
                                "gradient: tagged for vw 3, but this is stage 1 of vw 0"),
        "gradient wrong sender": (rig.stub.Backward, rig.gradient(1, stage=0), Code.INVALID_ARGUMENT,
                                  "gradient: sent by stage 0, expected stage 2"),
        "gradient wrong shape": (rig.stub.Backward,
                                 frames([("gradient", torch.randn(rig.out_spec.shape[0], 3))], 1, stage=2),
                                 Code.INVALID_ARGUMENT, r"gradient: shape \[\d+, 3\], expected"),
        "gradient wrong dtype": (rig.stub.Backward,
                                 frames([("gradient", torch.randn(rig.out_spec.shape).double())], 1, stage=2),
                                 Code.INVALID_ARGUMENT, r"gradient: dtype torch\.float64, expected torch\.float32"),
        "gradient two tensors": (rig.stub.Backward,
                                 frames([("gradient", torch.randn(rig.out_spec.shape))] * 2, 1, stage=2),
                                 Code.INVALID_ARGUMENT, r"gradient: expected 1 tensor, got 2"),
    }
    for name, (call, request, code, match) in bad_gradients.items():
        try:
            refused(call, iter(request), code, match)
            assert rig.snapshot() == before, "a refused message changed the stage's state"
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None

    # The valid gradient is still accepted: one backward, one local update (L3), the gradient
    # goes on to the previous stage tagged with the stashed version.
    rig.stub.Backward(iter(rig.gradient(1)), timeout=10)
    after = rig.wait_until("backwards_done", 1)
    assert (after.local_version, after.in_flight, after.received) == (1, 0, 2)
    assert after.weights_digest != before["weights_digest"]
    rig.prev.wait_for(1)
    method, tag, tensors = rig.prev.got[0]
    assert (method, tag.minibatch, tag.stage, tag.weight_version) == ("Backward", 1, 1, 0)
    assert [(n, list(t.shape)) for n, t in tensors] == [("gradient", list(rig.in_spec.shape))]

    done = rig.snapshot()
    refused(rig.stub.Backward, iter(rig.gradient(1)), Code.ALREADY_EXISTS, "gradient for minibatch 1 was already received")
    refused(rig.stub.Forward, iter(rig.activation(1)), Code.ALREADY_EXISTS, "activation for minibatch 1 was already received")
    assert rig.snapshot() == done


def test_the_final_evaluation_waits_for_the_stages_merge_and_takes_each_minibatch_once(make_job) -> None:
    """The driver asks VW 0's stages in turn, so stage 0's held-out rows may reach this stage before
    its own Evaluate: they wait for its merge of w_global (else the evaluation scores other
    weights than those written out). A repeated one is refused: the last stage would count it
    twice and finish the evaluation a minibatch early."""
    from conftest import deep_update

    with_eval = {"data": {"eval_fraction": 0.2}, "eval": {"every": 0, "rows": 32}}
    with middle_stage(lambda overrides: make_job(deep_update(overrides, with_eval))) as rig:
        for p in range(1, STEPS + 1):
            rig.stub.Forward(iter(rig.activation(p)), timeout=10)
            rig.wait_until("forwards_done", p)
            rig.stub.Backward(iter(rig.gradient(p)), timeout=10)
            rig.wait_until("backwards_done", p)
        rig.wait_until("backwards_done", STEPS)
        evals = rig.runtime._s.evals if rig.runtime._s else None
        assert evals is not None
        final, sent = evals.schedule.final_id, len(rig.next.got)
        rig.stub.Forward(iter(rig.activation(1, eval=final)), timeout=10)
        refused(rig.stub.Forward, iter(rig.activation(1, eval=final)), Code.ALREADY_EXISTS,
                rf"evaluation {final} minibatch 1 arrived already")
        time.sleep(0.5)
        assert len(rig.next.got) == sent, "the final evaluation ran before this stage merged w_global"
        refused(rig.stub.Evaluate, stage_pb2.EvalRequest(min_clock=10**6), Code.INVALID_ARGUMENT,
                r"min_clock 1000000 is past the job's last wave clock")
        rig.stub.Evaluate(stage_pb2.EvalRequest(min_clock=0), timeout=10)
        rig.next.wait_for(sent + 1)
        time.sleep(0.2)
        assert [(m, t.eval, t.minibatch) for m, t, _ in rig.next.got[sent:]] == [("Forward", final, 1)]
        assert rig.runtime._final_merged


def test_a_resend_after_training_ended_counts_as_delivered_and_nothing_new_is_taken(rig: Rig) -> None:
    """The last gradient's answer was lost, and the stage finished (DONE) before the link sent it
    again: ALREADY_EXISTS, which the link counts as delivered. FAILED_PRECONDITION would fail the
    sending stage, and the job, at its very end."""
    sent: dict[str, list[wire_pb2.TensorFrame]] = {}
    for p in range(1, STEPS + 1):
        sent["activation"] = rig.activation(p)
        rig.stub.Forward(iter(sent["activation"]), timeout=10)
        rig.wait_until("forwards_done", p)
        sent["gradient"] = rig.gradient(p)
        rig.stub.Backward(iter(sent["gradient"]), timeout=10)
        rig.wait_until("backwards_done", p)
    rig.wait_until("state", State.DONE)
    done = rig.snapshot()
    refused(rig.stub.Backward, iter(sent["gradient"]), Code.ALREADY_EXISTS,
            f"gradient for minibatch {STEPS} was already received")
    refused(rig.stub.Forward, iter(sent["activation"]), Code.ALREADY_EXISTS,
            f"activation for minibatch {STEPS} was already received")
    refused(rig.stub.Forward, iter(rig.activation(STEPS + 1)), Code.FAILED_PRECONDITION,
            f"activation for minibatch {STEPS + 1} refused in state DONE: training has ended")
    assert rig.snapshot() == done and rig.status().state == State.DONE


def test_control_calls_out_of_turn_are_refused(rig: Rig) -> None:
    before = rig.snapshot()
    refused(rig.stub.Start, wire_pb2.Empty(), Code.FAILED_PRECONDITION, "cannot start in state RUNNING")
    refused(rig.stub.Assign, stage_pb2.StageAssignment(job_json=rig.job.to_json()), Code.FAILED_PRECONDITION,
            "stage already assigned")
    refused(rig.stub.Evaluate, stage_pb2.EvalRequest(), Code.FAILED_PRECONDITION,
            "evaluate: this stage has no evaluation to run in state RUNNING")
    assert rig.snapshot() == before


def test_get_weights_of_a_key_named_twice_is_refused(rig: Rig) -> None:
    """Each copy of a key was sent again: 20000 copies of a name (200 KB) asked 82 MB of this
    stage's 4 KiB weight, and a large model's embedding, terabytes."""
    before = rig.snapshot()
    names = [m.name for f in rig.stub.GetWeights(stage_pb2.WeightsRequest(), timeout=10) for m in f.tensors]
    with pytest.raises(grpc.RpcError) as info:
        list(rig.stub.GetWeights(stage_pb2.WeightsRequest(keys=[names[0], *names, names[0]] * 10_000), timeout=10))
    assert info.value.code() == Code.INVALID_ARGUMENT, info.value
    assert info.value.details() == f"keys named more than once: {names}"
    got = [(m.name, list(m.shape)) for f in rig.stub.GetWeights(stage_pb2.WeightsRequest(keys=names[::-1]), timeout=10)
           for m in f.tensors]
    assert [n for n, _ in got] == names[::-1]
    assert rig.snapshot() == before


def test_bytes_that_are_not_a_frame_are_refused(rig: Rig) -> None:
    before = rig.snapshot()
    channel = unlimited_channel(rig.address)
    try:
        refused(rpc.Stub(channel, "Stage").Forward, iter([b"\xff\xff\xff\xff"]), Code.INVALID_ARGUMENT,
                "malformed TensorFrame")
    finally:
        channel.close()
    assert rig.snapshot() == before



def test_micro_batches_are_checked_against_the_schedule(make_job, rig: Rig) -> None:
    """A hetpipe stage takes whole minibatches; a gpipe stage micro-batches of the right shape
    and index, each once, in its window; an nf1b stage's gradients are of whole minibatches."""
    before = rig.snapshot()
    refused(rig.stub.Forward, iter(rig.activation(1, micro=2)), Code.INVALID_ARGUMENT,
            "micro-batch 2, but schedule hetpipe's activations carry whole minibatches")
    assert rig.snapshot() == before
    with middle_stage(make_job, {"schedule": "gpipe", "nm": 1, "microbatches": 2}) as gpipe:
        half = [gpipe.in_spec.shape[0] // 2, *gpipe.in_spec.shape[1:]]
        x = torch.randn(half, dtype=gpipe.in_spec.dtype)
        start = gpipe.snapshot()
        for frames_, code, match in [
            (gpipe.activation(1, micro=1), Code.INVALID_ARGUMENT, r"activation: shape \[16, 32\], expected \[8, 32\]"),
            (frames([("activation", x)], 1, stage=0, micro=3), Code.INVALID_ARGUMENT,
             r"micro-batch 3 of minibatch 1: expected 1\.\.2"),
            (frames([("activation", x)], 1, stage=0), Code.INVALID_ARGUMENT,
             r"micro-batch 0 of minibatch 1: expected 1\.\.2"),
            (frames([("activation", x)], 2, stage=0, micro=1), Code.FAILED_PRECONDITION, "at most nm=1"),
        ]:
            refused(gpipe.stub.Forward, iter(frames_), code, match)
            assert gpipe.snapshot() == start, f"refused {match} changed the stage"
        gpipe.stub.Forward(iter(frames([("activation", x)], 1, stage=0, micro=1)), timeout=10)
        refused(gpipe.stub.Forward, iter(frames([("activation", x)], 1, stage=0, micro=1)), Code.ALREADY_EXISTS,
                "micro-batch 1 of minibatch 1 was already received")
    with middle_stage(make_job, {"schedule": "nf1b", "nm": 2, "microbatches": 2}) as nf1b:
        g = torch.randn([nf1b.out_spec.shape[0] // 2, *nf1b.out_spec.shape[1:]], dtype=nf1b.out_spec.dtype)
        refused(nf1b.stub.Backward, iter(frames([("gradient", g)], 1, stage=2, micro=1)), Code.INVALID_ARGUMENT,
                r"gradient for micro-batch 1 of minibatch 1: expected 0 \(the whole minibatch\)")
        refused(nf1b.stub.Backward, iter(frames([("gradient", g)], 1, stage=2)), Code.INVALID_ARGUMENT,
                r"gradient: shape \[8, 32\], expected \[16, 32\]")


@pytest.mark.parametrize("channel", ["stream", "socket"])
def test_bad_shared_memory_handles_are_refused_and_change_nothing(rig: Rig, channel: str) -> None:
    """parallel.transport shm: an activation whose bytes a handle names in /dev/shm. A handle that
    is forged, stale or malformed is refused before anything is read into the stage; a current
    one is taken like gRPC frames. The same over the held gRPC stream and the link socket."""
    bundle = wire.decode(rig.activation(1))
    before = rig.snapshot()
    # One-frame bundles take a link's long-lived stream (or socket): each refusal ends it with its
    # status, the next call opens another, and the good handle goes through the same one at the end.
    link: Any = Duplex(rig.stub.ForwardLink, deadline_s=10)
    if channel == "socket":
        link = socket_duplex.SocketDuplex(lambda: rig.stub.LinkSocket(wire_pb2.Empty(), timeout=5), "Forward", 10)

    def encoded(frame: wire_pb2.TensorFrame) -> Any:
        return frame.SerializeToString() if channel == "socket" else frame
    with forged_handles(bundle.tensors, minibatch=bundle.header.minibatch) as handles:
        for name, (request, code, match) in handles.bad.items():
            try:
                refused(rig.stub.Forward, iter(request), code, match)
                if len(request) == 1:
                    refused(lambda frame, timeout: link.call(encoded(frame)), request[0], code, match)
                assert rig.snapshot() == before, "a refused handle changed the stage's state"
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
        link.call(encoded(handles.good[0]))
        link.close()
    rig.wait_until("forwards_done", 1)
    rig.next.wait_for(1)
    assert rig.snapshot()["received"] == 1
