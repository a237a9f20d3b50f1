"""One stage's layers, local weights, stashed weight versions and optimizer (L2, L3)."""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental.symbolic_shapes  # noqa: F401  # see below
from torch import nn
from torch.func import functional_call

from hetpipe.buffers import raw_bytes
from hetpipe.draws import Draws, unseeded
from hetpipe.models import evaluating, trainable
from hetpipe.optim import StageOptimizer, autocast, compute_dtype, compute_loss, for_loss, squared_norm, to_compute
from hetpipe.training import OptimizerConfig


# torch.autograd.grad imports symbolic_shapes (with sympy: 0.4 s) on its first call with
# grad_outputs. Imported with this module, a stage pays it while loading, not inside its first
# backward, where it would hold up the whole pipeline.


Grads = list[torch.Tensor | None]  # one per parameter; None: the parameter took no part
@dataclass(slots=True)
class _Stashed:
    version: int
    leaves: dict[str, torch.Tensor]
    x: torch.Tensor
    out: torch.Tensor


class StageCompute:
    """Runs forward/backward for one stage with weight stashing; counts own updates as versions.

    stash=False where no update can come between a minibatch's forward and its backward (the
    last stage, whose forward and backward are one task, and any stage at nm = 1): the forward
    then runs on the live weights instead of a copy. precision bf16 computes under autocast
    with the weights (and the optimizer) in their own dtype, and sends activations and gradients
    in the compute dtype. draws: what each forward draws from (forward_draws; by default torch's
    generators as they are).
    """

    def __init__(
        self, layers: nn.Sequential, optimizer: OptimizerConfig, *, loss: str, device: str, track_updates: bool,
        stash: bool = True, precision: str = "fp32", draws: Draws = unseeded,
    ) -> None:
        self.module = layers.to(device)
        self.track_updates = track_updates  # WSP needs u_p = w_after - w_before; a lone VW does not
        self.stash = stash
        self.device = device
        self.loss_kind = loss
        self.compute_dtype = compute_dtype(precision)
        self._draws = draws
        self._device_type = torch.device(device).type
        # Frozen parameters (requires_grad False) are not among them: never stepped, pushed or pulled.
        self.names = [n for n, _ in trainable(self.module)]
        self.params: list[torch.Tensor] = [p for _, p in trainable(self.module)]
        # A stage may hold only parameter-free layers (a ReLU); it still counts versions.
        self.optimizer = StageOptimizer(self.params, optimizer) if self.params else None
        self.version = 0  # own minibatch updates applied so far
        self._stash: dict[int, _Stashed] = {}
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        # Micro-batch schedules: graphs kept for their own backward, keyed (p, micro), the inputs
        # kept for a backward that recomputes (nf1b), and the gradients summed over p's micro-batches.
        self._micro: dict[tuple[int, int], _Stashed] = {}
        self._inputs: dict[int, list[tuple[tuple[int, int], torch.Tensor]]] = {}
        self._summed: Grads | None = None

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        return autocast(self.compute_dtype, self._device_type)

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """What leaves the stage: floating tensors in the compute dtype."""
        return to_compute(self.compute_dtype, t)

    def _current_leaves(self) -> dict[str, torch.Tensor]:
        if not self.stash:
            return dict(zip(self.names, self.params))
        # Minibatches forwarded between two updates share one stashed copy of the weights.
        if self._snapshot is None or self._snapshot[0] != self.version:
            leaves = {n: p.detach().clone().requires_grad_(True) for n, p in zip(self.names, self.params)}
            self._snapshot = (self.version, leaves)
        return self._snapshot[1]

    def _call(self, leaves: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # The live weights need no substitution (functional_call costs a swap per parameter).
        return functional_call(self.module, leaves, (x,)) if self.stash else self.module(x)

    def forward(self, p: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """L2: runs p on the latest local weights and stashes them for p's backward."""
        leaves = self._current_leaves()
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with self._draws((p,)), self._autocast():
            out = self._wire(self._call(leaves, x))
        self._stash[p] = _Stashed(self.version, leaves, x, out)
        return out.detach(), self.version

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Forward only, on the live weights, in eval mode (dropout off, batch norm on its running
        statistics, which it leaves as they were): an evaluation of held-out rows. Each module
        goes back to its own mode after, the one training runs it in."""
        with evaluating(self.module), self._autocast():
            return self._wire(self.module(x))

    def backward(self, p: int, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, int, Grads]:
        """Backward of p on its stashed weights: (gradient to send back, the version p ran on, the
        weights' gradients). The step is commit()'s (L3)."""
        stashed = self._stash.pop(p)
        grad_in, grads = self._grads(stashed, stashed.out, grad_out)
        return grad_in, stashed.version, grads

    def forward_backward(
        self, p: int, x: torch.Tensor, target: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None, int, Grads, float]:
        """The last stage's single task: forward, loss (times scale: fp16's loss scale), backward.
        Returns the split time too, and the loss as a tensor: reading it would wait for the
        device at every minibatch."""
        leaves = self._current_leaves()
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with self._draws((p,)), self._autocast():
            out = self._call(leaves, x)
            loss = compute_loss(self.loss_kind, for_loss(self.compute_dtype, out), target)
        forward_end = time.time()
        stashed = _Stashed(self.version, leaves, x, loss * scale if scale != 1.0 else loss)
        grad_in, grads = self._grads(stashed, stashed.out, None)
        return loss.detach(), grad_in, stashed.version, grads, forward_end

    # ---- micro-batch schedules (gpipe, 1f1b, nf1b): always on the live weights ------------------

    @property
    def holds_live_graph(self) -> bool:
        """A graph on the live weights waits for its backward: they must not change in place
        (a pull's merge waits until it has run)."""
        return bool(self._micro) or (not self.stash and bool(self._stash))

    def _live(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.params))

    def forward_micro(self, unit: tuple[int, int], x: torch.Tensor, *, keep: bool) -> tuple[torch.Tensor, int]:
        """A micro-batch's forward on the live weights. keep: its graph waits for its own backward
        (gpipe, 1f1b); else only its input is kept, for a backward that recomputes (nf1b)."""
        if not keep:
            self._inputs.setdefault(unit[0], []).append((unit, x))
            with torch.no_grad(), self._draws(unit), self._autocast():
                return self._wire(self.module(x)), self.version
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with self._draws(unit), self._autocast():
            out = self._wire(self.module(x))
        self._micro[unit] = _Stashed(self.version, self._live(), x, out)
        return out.detach(), self.version

    def loss_micro(self, unit: tuple[int, int], x: torch.Tensor, target: torch.Tensor, weight: float) -> torch.Tensor:
        """The last stage: a micro-batch's forward and loss (times weight, 1/micro-batches); its
        graph waits for its backward. Returns the unweighted loss."""
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        with self._draws(unit), self._autocast():
            out = self.module(x)
            loss = compute_loss(self.loss_kind, for_loss(self.compute_dtype, out), target)
        self._micro[unit] = _Stashed(self.version, self._live(), x, loss * weight)
        return loss.detach()

    def backward_micro(self, unit: tuple[int, int], grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
        """A micro-batch's backward on the graph its forward kept; its weights' gradients are
        summed into p's. Returns (gradient to send back, the version it ran on)."""
        kept = self._micro.pop(unit)
        grad_in, grads = self._grads(kept, kept.out, grad_out)
        self._add(grads)
        return grad_in, kept.version

    def backward_losses(self, p: int) -> torch.Tensor | None:
        """nf1b's last stage: the backward of p's summed micro-batch losses, one task; returns
        the gradient of all of p's input (the micro-batches' in order)."""
        units = sorted(u for u in self._micro if u[0] == p)
        kept = [self._micro.pop(u) for u in units]
        total = torch.stack([k.out for k in kept]).sum()
        xs = [k.x for k in kept]
        wants_x = xs[0].requires_grad
        got = torch.autograd.grad(total, self.params + (xs if wants_x else []), allow_unused=True)
        self._add(list(got[: len(self.params)]))
        return self._wire(torch.cat(list(got[len(self.params):]))) if wants_x else None

    def backward_recompute(self, p: int, grad_out: torch.Tensor) -> torch.Tensor | None:
        """nf1b: p's backward on the weights current now, not those its forwards ran on (no weight
        stashing): each kept micro-batch input runs forward again, then all of them backward."""
        kept = self._inputs.pop(p)
        x = torch.cat([xi for _, xi in kept])
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        # Each micro-batch again on its own and seeded as its unit, as torch.utils.checkpoint
        # keeps the RNG state: its masks (and a batch norm's batch statistics) are its forward's.
        # The buffers (a batch norm's running statistics) counted each micro-batch once already.
        buffers = [b.clone() for b in self.module.buffers()]
        try:
            outs = []
            for (unit, _), xi in zip(kept, x.split([len(xi) for _, xi in kept])):
                with self._draws(unit), self._autocast():
                    outs.append(self._wire(self.module(xi)))
            out = torch.cat(outs)
            grad_in, grads = self._grads(_Stashed(self.version, self._live(), x, out), out, grad_out)
        finally:
            with torch.no_grad():   # after the backward, which reads the buffers the forward saved
                for b, before in zip(self.module.buffers(), buffers):
                    b.copy_(before)
        self._add(grads)
        return grad_in

    def _add(self, grads: Grads) -> None:
        if self._summed is None:
            self._summed = list(grads)
            return
        self._summed = [a if b is None else b if a is None else a + b for a, b in zip(self._summed, grads)]

    def take_summed(self) -> Grads:
        """The gradients summed over p's micro-batches, for its step; starts a new sum."""
        grads, self._summed = self._summed, None
        return grads if grads is not None else [None] * len(self.params)

    @staticmethod
    def finite(grads: Grads, grad_in: torch.Tensor | None) -> bool:
        """Whether every gradient of a minibatch is finite (a loss-scaled fp16 backward may overflow).
        Reads one flag from the device."""
        flags = [torch.isfinite(g).all() for g in (*grads, grad_in) if g is not None]
        return bool(torch.stack(flags).all()) if flags else True

    @torch.no_grad()
    def commit(self, grads: Grads, *, lr: float, scale: float = 1.0, clip: float = 1.0, skip: bool = False,
               into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """L3: the optimizer step with these gradients (divided by the loss scale, then multiplied
        by the clip coefficient, as GradScaler.unscale_ and clip_grad_norm_ do) at learning rate
        lr (training.learning_rate of the minibatch), a new version;
        skip: a version without a step (fp16: some stage's gradients of this minibatch overflowed).
        Returns the update u = w_after - w_before (empty unless tracked for WSP), written into
        `into` where given (buffers shaped as the parameters: Sync.spare_update)."""
        if skip:
            self.version += 1
            if not self.track_updates:
                return []
            return [b.zero_() for b in into] if into is not None else [torch.zeros_like(p) for p in self.params]
        if scale != 1.0:
            grads = [None if g is None else g.div_(scale) for g in grads]
        if clip != 1.0:
            grads = [None if g is None else g.mul_(clip) for g in grads]
        return self._step(grads, into, lr)

    @staticmethod
    def norm_sq(grads: Grads) -> float:
        """The squared L2 norm of all these gradients (clip_grad_norm_'s per-tensor norms, squared
        and summed in float64). Reads one number from the device."""
        return float(squared_norm(grads))

    def _grads(
        self, stashed: _Stashed, out: torch.Tensor, grad_out: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, Grads]:
        wants_x = stashed.x.requires_grad
        inputs = list(stashed.leaves.values()) + ([stashed.x] if wants_x else [])
        if not inputs or not out.requires_grad:
            return None, [None] * len(self.params)
        got = torch.autograd.grad(out, inputs, grad_outputs=grad_out, allow_unused=True)
        grads: Grads = list(got[: len(self.params)])
        grad_in = self._wire(got[-1]) if wants_x else None
        return grad_in, grads

    def _step(self, grads: Grads, into: list[torch.Tensor] | None, lr: float) -> list[torch.Tensor]:
        # One foreach kernel per pass over the weights on a GPU, where a loop launched one per
        # parameter: a small model's step there waits for its launches, not for its kernels.
        update: list[torch.Tensor] = []
        if self.optimizer is not None:
            full = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
            if self.track_updates:
                into = into if into is not None else [torch.empty_like(p) for p in self.params]
                update = self.optimizer.step_tracked(full, lr, into)
            else:
                self.optimizer.step(full, lr)
        self.version += 1
        return update

    @torch.no_grad()
    def add_to_weights(self, deltas: list[torch.Tensor]) -> None:
        """Adds deltas (one per parameter, in order) to the local weights; not a new version."""
        if self.params:
            torch._foreach_add_(self.params, [d.to(p.device, p.dtype) for p, d in zip(self.params, deltas)])
        self._snapshot = None

    @torch.no_grad()
    def overwrite(self, fill: Callable[[list[torch.Tensor]], None]) -> None:
        fill([p.detach() for p in self.params])
        self._snapshot = None

    @torch.no_grad()
    def set_weights(self, values: list[torch.Tensor]) -> None:
        for param, value in zip(self.params, values):
            param.copy_(value)
        self._snapshot = None

    def state(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, v.detach().cpu()) for k, v in self.module.state_dict().items()]

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, tensor in self.state():
            h.update(name.encode())
            h.update(raw_bytes(tensor))
        return h.hexdigest()

    @property
    def stashed_versions(self) -> int:
        return len({s.version for s in self._stash.values()})
