"""stage_worker/stage.py: weight stashing (L2) and the local optimizer step (L3), checked against
values worked out by hand on a one-weight stage; and its optimizer against torch.optim."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetpipe.training import LrSchedule, OptimizerConfig, TrainConfig, learning_rate
from hetpipe.optim import StageOptimizer, make_optimizer, step_at
from stage_worker.stage import StageCompute

SGD = OptimizerConfig(name="sgd", lr=0.1)


def _linear(w: float, b: float) -> nn.Sequential:
    layer = nn.Linear(1, 1).double()
    with torch.no_grad():
        layer.weight.fill_(w)
        layer.bias.fill_(b)
    return nn.Sequential(layer)


def _wb(c: StageCompute) -> tuple[float, float]:
    return float(c.params[0].detach()), float(c.params[1].detach())


def x(v: float) -> torch.Tensor:
    return torch.tensor([[v]], dtype=torch.float64)


def test_two_minibatches_in_flight_use_the_stashed_weights() -> None:
    # w = 2, b = 0; lr 0.1; the next stage sends back gradient 1 for every output.
    c = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=True)
    out1, v1 = c.forward(1, x(1.0))
    out2, v2 = c.forward(2, x(3.0))
    assert (float(out1), v1, float(out2), v2) == (2.0, 0, 6.0, 0)

    # Backward of 1 on version 0: dw = 1 * 1, db = 1, grad in = 1 * w = 2. Step: w 1.9, b -0.1.
    grad_in, version, grads = c.backward(1, x(1.0))
    update = c.commit(grads, lr=SGD.lr)
    assert (float(grad_in), version) == (2.0, 0)
    assert _wb(c) == (1.9, -0.1) and c.version == 1
    assert [round(float(u), 12) for u in update] == [-0.1, -0.1]

    # Backward of 2 on its stash (w = 2, not 1.9): dw = 1 * 3, db = 1, grad in = 2.
    # Applied to the current weights: w = 1.9 - 0.3 = 1.6, b = -0.1 - 0.1 = -0.2.
    grad_in, version, grads = c.backward(2, x(1.0))
    update = c.commit(grads, lr=SGD.lr)
    assert (float(grad_in), version) == (2.0, 0)
    assert _wb(c) == (1.9 - 0.3, -0.2) and c.version == 2
    assert [round(float(u), 12) for u in update] == [-0.3, -0.1]
    assert c.stashed_versions == 0, "a finished backward drops its stash"

    # Minibatch 3 runs on the latest weights (L2): 1.6 * 2 - 0.2 = 3.0, version 2.
    out3, v3 = c.forward(3, x(2.0))
    assert (round(float(out3), 12), v3) == (3.0, 2)


def test_minibatches_forwarded_between_two_updates_share_one_stash() -> None:
    c = StageCompute(_linear(1.0, 0.0), SGD, loss="mse", device="cpu", track_updates=False)
    for p in (1, 2, 3):
        c.forward(p, x(1.0))
    assert c.stashed_versions == 1
    c.commit(c.backward(1, x(1.0))[2], lr=SGD.lr)
    c.forward(4, x(1.0))
    assert c.stashed_versions == 2  # version 0 (minibatches 2, 3) and version 1 (minibatch 4)


def test_a_loss_scaled_minibatch_is_stepped_unscaled_or_skipped_whole() -> None:
    """fp16's loss scale: the gradients of loss x 1024 divided by 1024 give the unscaled step; a
    skipped minibatch is a version without a step; an infinite gradient is seen."""
    c = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=True)
    loss, grad_in, version, grads, _ = c.forward_backward(1, x(1.0), x(0.0), scale=1024.0)
    assert (float(loss), float(grad_in)) == (4.0, 8.0 * 1024), "the loss is reported unscaled"
    assert c.finite(grads, grad_in)
    update = c.commit(grads, scale=1024.0, lr=SGD.lr)
    assert _wb(c) == (1.6, -0.4) and c.version == 1
    assert [round(float(u), 12) for u in update] == [-0.4, -0.4]
    *_, grads, _ = c.forward_backward(2, x(1.0), x(0.0), scale=1024.0)
    assert c.commit(grads, scale=1024.0, skip=True, lr=SGD.lr) == [torch.zeros(1, 1, dtype=torch.float64),
                                                       torch.zeros(1, dtype=torch.float64)]
    assert _wb(c) == (1.6, -0.4) and c.version == 2, "skipped: no step, but a version"
    assert not c.finite([torch.tensor([1.0, float("inf")])], None)
    assert not c.finite([None], torch.tensor([float("nan")]))


def test_the_last_stage_runs_forward_loss_backward_and_step_as_one_task() -> None:
    # out = 2 * 1 + 0 = 2 against target 0: mse loss 4, dloss/dout = 4, dw = 4, db = 4, grad in = 8.
    c = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=True)
    loss, grad_in, version, grads, _ = c.forward_backward(1, x(1.0), x(0.0))
    update = c.commit(grads, lr=SGD.lr)
    assert (loss, float(grad_in), version) == (4.0, 8.0, 0)
    assert _wb(c) == (1.6, -0.4) and c.version == 1
    assert [round(float(u), 12) for u in update] == [-0.4, -0.4]


def test_a_lone_vw_tracks_no_updates_and_weights_can_be_replaced() -> None:
    c = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=False)
    *_, grads, _ = c.forward_backward(1, x(1.0), x(0.0))
    update = c.commit(grads, lr=SGD.lr)
    assert update == [], "no copy of the weights without WSP"
    c.set_weights([torch.tensor([[5.0]], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)])
    out, version = c.forward(2, x(1.0))
    assert (float(out), version) == (6.0, 1), "set_weights changes the weights, not the version"


@pytest.mark.parametrize("merge", ["set_weights", "overwrite"])
def test_a_pull_merged_between_two_forwards_reaches_the_next_one(merge: str) -> None:
    """A pull changes the weights, not the version (G3): the forward it let through (G2) runs on
    the merged weights, not on the stash the forward before it made at the same version; that
    earlier minibatch's backward still runs on what its forward saw (L2)."""
    c = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=True)
    out1, _ = c.forward(1, x(1.0))
    pulled = [torch.tensor([[5.0]], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)]
    if merge == "set_weights":          # a pull received in gRPC frames
        c.set_weights(pulled)
    else:                               # a pull copied from the shard's slot in place
        c.overwrite(lambda params: [p.copy_(v) for p, v in zip(params, pulled)])
    out2, v2 = c.forward(2, x(1.0))
    assert (float(out1), float(out2), v2) == (2.0, 6.0, 0)
    grad_in, version, _ = c.backward(1, x(1.0))
    assert (float(grad_in), version) == (2.0, 0), "minibatch 1's backward on its own stash (w = 2)"


def test_a_stage_without_parameters_still_counts_its_minibatches() -> None:
    c = StageCompute(nn.Sequential(nn.ReLU()), SGD, loss="mse", device="cpu", track_updates=True)
    out, _ = c.forward(1, torch.tensor([[-1.0, 2.0]], dtype=torch.float64))
    grad_in, version, grads = c.backward(1, torch.tensor([[1.0, 1.0]], dtype=torch.float64))
    update = c.commit(grads, lr=SGD.lr)
    assert out.tolist() == [[0.0, 2.0]] and grad_in.tolist() == [[0.0, 1.0]]
    assert (version, update, c.version) == (0, [], 1)


@pytest.mark.parametrize("cfg", [
    OptimizerConfig(name="sgd", lr=0.1),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
    OptimizerConfig(name="adam", lr=0.01),
    OptimizerConfig(name="adam", lr=0.003, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    OptimizerConfig(name="adamw", lr=0.003, betas=(0.9, 0.95), weight_decay=0.1),
], ids=["sgd", "sgd-momentum-wd", "adam", "adam-wd", "adamw"])
@pytest.mark.parametrize("schedule", [LrSchedule(), LrSchedule(warmup_steps=2, decay="cosine", min_lr=1e-4)],
                         ids=["constant", "warmup-cosine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_stage_optimizer_is_bit_for_bit_torch_optim(cfg: OptimizerConfig, schedule: LrSchedule,
                                                    dtype: torch.dtype) -> None:
    """A stage's step of minibatch p at learning_rate(p) is torch.optim's, stepped by step_at as
    the reference and the baselines step it."""
    train = TrainConfig(steps=6, optimizer=cfg, lr_schedule=schedule)
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(3, 4, generator=gen, dtype=dtype), torch.randn(5, generator=gen, dtype=dtype)]
    theirs = [nn.Parameter(p.clone()) for p in ours]
    reference = make_optimizer(theirs, cfg)
    mine = StageOptimizer(ours, cfg)
    for p in range(1, train.steps + 1):
        grads = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in ours]
        mine.step(grads, learning_rate(train, p))
        for w, g in zip(theirs, grads):
            w.grad = g.clone()
        step_at(reference, train, p)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b.detach())
    assert all(w.grad is None for w in theirs), "step_at clears the gradients"


@pytest.mark.parametrize("cfg", [
    OptimizerConfig(name="sgd", lr=0.1),
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
    OptimizerConfig(name="adamw", lr=0.003, betas=(0.9, 0.95), weight_decay=0.1),
], ids=["sgd", "sgd-momentum-wd", "adamw"])
@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_tracked_step_returns_exactly_what_it_added(cfg: OptimizerConfig, foreach: bool, dtype: torch.dtype,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """step_tracked's u is exactly w_after - w_before in the sense the shards rely on:
    w_before + u == w_after bit for bit; its weights are torch.optim's (SGD: within the one
    rounding its fused w - lr * d saves; Adam(W): bit for bit). foreach: the GPU's kernels, run
    on the CPU."""
    monkeypatch.setattr("hetpipe.optim.use_foreach", lambda params: foreach)
    train = TrainConfig(steps=6, optimizer=cfg, lr_schedule=LrSchedule(warmup_steps=2, decay="cosine"))
    gen = torch.Generator().manual_seed(1)
    ours = [torch.randn(3, 4, generator=gen, dtype=dtype), torch.randn(5, generator=gen, dtype=dtype)]
    theirs = [nn.Parameter(p.clone()) for p in ours]
    reference = make_optimizer(theirs, cfg)
    mine = StageOptimizer(ours, cfg)
    into = [torch.full_like(p, float("nan")) for p in ours]   # stale buffers: every element written
    for p in range(1, train.steps + 1):
        grads = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in ours]
        before = [w.clone() for w in ours]
        update = mine.step_tracked([g.clone() for g in grads], learning_rate(train, p), into)
        assert update is into
        for w_before, u, w_after in zip(before, update, ours):
            assert torch.equal(w_before + u, w_after)
        for w, g in zip(theirs, grads):
            w.grad = g
        step_at(reference, train, p)
        for a, b in zip(ours, theirs):
            if cfg.name == "sgd":
                torch.testing.assert_close(a, b.detach(), rtol=0, atol=8 * torch.finfo(dtype).eps)
            else:
                assert torch.equal(a, b.detach())
    if cfg.momentum:
        for buf, w in zip(mine.momentum, theirs):
            torch.testing.assert_close(buf, reference.state[w]["momentum_buffer"], rtol=0, atol=8 * torch.finfo(dtype).eps)


def test_adamw_decays_the_weights_themselves() -> None:
    """AdamW's weight decay shrinks a weight whose gradient is zero (decoupled); Adam's adds
    weight_decay * w to the gradient, and Adam's normalised step then moves it by about lr."""
    steps = {}
    for name in ("adam", "adamw"):
        w = [torch.tensor([1.0], dtype=torch.float64)]
        StageOptimizer(w, OptimizerConfig(name=name, lr=0.1, weight_decay=0.1)).step([torch.zeros(1, dtype=torch.float64)], 0.1)
        steps[name] = 1.0 - float(w[0])
    assert steps["adamw"] == pytest.approx(0.1 * 0.1), "decoupled: w -= lr * weight_decay * w"
    assert steps["adam"] == pytest.approx(0.1, rel=1e-6), "coupled: the decay is a gradient, normalised"


def test_the_weights_digest_covers_zero_dimensional_state() -> None:
    """BatchNorm's num_batches_tracked is 0-d: a digest that viewed it as bytes without flattening
    raised; it now counts in the digest like any other entry."""
    model = nn.Sequential(nn.Linear(2, 2).double(), nn.BatchNorm1d(2).double())
    c = StageCompute(model, SGD, loss="mse", device="cpu", track_updates=False)
    before = c.digest()
    with torch.no_grad():
        model[1].num_batches_tracked.add_(1)
    assert c.digest() != before and len(before) == 64


def test_an_update_written_into_given_buffers_is_the_same_update_bit_for_bit() -> None:
    """Sync.spare_update's buffers take the update in place of a fresh allocation: same values,
    their storage, and a skipped step (fp16) writes zeros there too."""
    fresh = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=True)
    reused = StageCompute(_linear(2.0, 0.0), SGD, loss="mse", device="cpu", track_updates=True)
    buffers = [torch.full((1, 1), 7.0, dtype=torch.float64), torch.full((1,), 7.0, dtype=torch.float64)]
    for p, value in ((1, 1.0), (2, 3.0)):
        updates = []
        for c, into in ((fresh, None), (reused, buffers)):
            c.forward(p, x(value))
            grads = c.backward(p, x(1.0))[2]
            updates.append(c.commit(grads, into=into, lr=SGD.lr))
        assert all(torch.equal(a, b) for a, b in zip(*updates)) and _wb(fresh) == _wb(reused)
        assert all(u is b for u, b in zip(updates[1], buffers))
    skipped = reused.commit([None, None], skip=True, into=buffers, lr=SGD.lr)
    assert all(u is b and not u.any() for u, b in zip(skipped, buffers)) and reused.version == 3


def test_a_forwards_dropout_is_drawn_for_its_minibatch_whatever_was_drawn_before() -> None:
    """forward_draws: the masks of p's forward follow from (train.seed, vw, stage, p) alone, not
    from what the process drew before (a fork server's generator, another stage, a reader's
    draws), so that a run repeats and a resumed one goes on as the uninterrupted one would; the
    micro-batch forwards by (p, micro) likewise."""
    from hetpipe.draws import forward_draws

    def compute(seed: int, vw: int = 0, stage: int = 0) -> StageCompute:
        return StageCompute(nn.Sequential(nn.Dropout(0.5)), SGD, loss="mse", device="cpu", track_updates=False,
                            stash=False, draws=forward_draws(seed, vw, stage, "cpu"))

    ones = torch.ones(4, 256)
    first = compute(7).forward(1, ones)[0]
    torch.rand(1000)   # the process's generator moves on
    again = compute(7).forward(1, ones)[0]
    assert torch.equal(first, again)
    for other in (compute(7).forward(2, ones)[0], compute(8).forward(1, ones)[0], compute(7, vw=1).forward(1, ones)[0],
                  compute(7, stage=1).forward(1, ones)[0]):
        assert not torch.equal(first, other)
    micro = compute(7).forward_micro((1, 0), ones, keep=True)[0]
    assert torch.equal(micro, compute(7).forward_micro((1, 0), ones, keep=False)[0])
    assert not torch.equal(micro, compute(7).forward_micro((1, 1), ones, keep=True)[0])
    unseeded = StageCompute(nn.Sequential(nn.Dropout(0.5)), SGD, loss="mse", device="cpu", track_updates=False, stash=False)
    assert not torch.equal(unseeded.forward(1, ones)[0], unseeded.forward(2, ones)[0]), "default: as torch draws"


def test_nf1b_recomputes_each_micro_batch_with_its_forwards_masks() -> None:
    """nf1b's backward runs p's kept inputs forward again: each micro-batch drawn as its own
    forward drew, so on unchanged weights its gradients are those of the kept graphs (gpipe's),
    and a batch norm's running statistics count each micro-batch once, as gpipe's do."""
    from hetpipe.draws import forward_draws

    def compute() -> StageCompute:
        torch.manual_seed(3)
        module = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4)).double()
        return StageCompute(module, SGD, loss="mse", device="cpu", track_updates=False, stash=False,
                            draws=forward_draws(7, 0, 1, "cpu"))

    xs = [torch.randn(3, 8, dtype=torch.float64) for _ in range(2)]
    grad = torch.randn(6, 4, dtype=torch.float64)
    kept, recomputed = compute(), compute()
    grad_in = []
    for m, (xm, gm) in enumerate(zip(xs, grad.split(3))):
        kept.forward_micro((1, m), xm, keep=True)
        grad_in.append(kept.backward_micro((1, m), gm)[0])
        recomputed.forward_micro((1, m), xm, keep=False)
    again = recomputed.backward_recompute(1, grad)
    assert again is not None and torch.allclose(again, torch.cat(grad_in), rtol=0, atol=1e-12)
    for a, b in zip(kept.take_summed(), recomputed.take_summed()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    for (name, a), b in zip(kept.module.named_buffers(), recomputed.module.buffers()):
        assert torch.equal(a, b), name


def test_an_evaluation_leaves_each_module_in_the_mode_training_runs_it_in() -> None:
    # A factory's model in eval mode, and one whose batch norm it froze: an evaluation (VW 0's
    # alone) switched them to train mode mid-run, where VW 1 and the reference trained on as made.
    whole = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    frozen = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    frozen[1].eval()
    for layers in (whole, frozen):
        modes = [m.training for m in layers.modules()]
        c = StageCompute(layers, SGD, loss="mse", device="cpu", track_updates=False, stash=False)
        c.evaluate(torch.ones(2, 4))
        assert [m.training for m in c.module.modules()] == modes
