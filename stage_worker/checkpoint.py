"""A stage's part of a checkpoint (train.checkpoint_every, DESIGN §3): at the cut after wave W,
once its backwards through wave W are done and its pushes through wave W acknowledged, the stage
saves its weights, optimizer state and WSP state, and its first forward of wave W + 1 waits
until the driver has the whole cut (every stage, every shard) and lets it go on. Nothing is in
flight at a cut, so a resumed job restarts the stage from these alone. Plain tensors and ints:
loaded with torch.load(weights_only=True)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetpipe.loss_scale import LossScale
from hetpipe.wsp import total_waves
from stage_worker.scaling import Scaling
from stage_worker.stage import StageCompute
from stage_worker.sync import Sync


@dataclass
class Cuts:
    """When this stage saves and waits, and how far the driver has let it go."""

    every: int          # waves between cuts; 0: none
    nm: int
    steps: int
    saved: int = 0      # the last cut saved (the stage waits there until continued)
    continued: int = 0  # the last cut the driver let it past

    def is_cut(self, wave: int) -> bool:
        return self.every > 0 and wave > 0 and wave % self.every == 0 and wave < total_waves(self.steps, self.nm)

    def blocks(self, p: int) -> bool:
        """The forward of p waits: the first of the wave after a cut not yet continued past."""
        wave, first = divmod(p - 1, self.nm)
        return first == 0 and self.is_cut(wave) and self.continued < wave

    @property
    def waiting_at(self) -> int:
        """The cut saved and not yet continued past; 0: none."""
        return self.saved if self.saved > self.continued else 0

    def due(self, completed: int, acked_waves: int) -> int | None:
        """The cut to save now: every backward through it done, every push through it acknowledged."""
        wave, rest = divmod(completed, self.nm)
        if rest == 0 and wave > self.saved and self.is_cut(wave) and acked_waves >= wave:
            return wave
        return None


def load(path: Path) -> dict[str, Any]:
    """The state a stage saved at a cut; ValueError for a file that is not one (its caller names it)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # never torch's words: for objects besides tensors they say to load with weights_only=False
        raise ValueError(f"damaged: not a stage's part of a cut that loads with weights_only ({type(exc).__name__}); "
                         "start again with --fresh, or put back a whole copy of the cut") from None
    if not isinstance(state, dict):
        raise ValueError("not a stage's part of a cut")
    return state


def capture(compute: StageCompute, sync: Sync, scaling: Scaling | None = None) -> dict[str, Any]:
    """The stage's state at a cut: weights and buffers, its own updates count, the optimizer's
    state, the WSP state, and fp16's loss scale (clipping keeps nothing: every coefficient
    through the cut is committed)."""
    opt = compute.optimizer
    return {
        "module": {k: v.detach().cpu().clone() for k, v in compute.module.state_dict().items()},
        "version": compute.version,
        "optimizer": {} if opt is None else {
            "momentum": [None if m is None else m.detach().cpu().clone() for m in opt.momentum],
            "exp_avg": [t.cpu().clone() for t in opt.exp_avg], "exp_avg_sq": [t.cpu().clone() for t in opt.exp_avg_sq],
            "steps": [t.clone() for t in opt.steps]},
        "sync": sync.state(),
        "loss_scale": None if scaling is None or not scaling.fp16 else scaling.loss_scale.state(scaling.verdicts),
    }


def restore(compute: StageCompute, sync: Sync, state: dict[str, Any], scaling: Scaling | None = None) -> None:
    """Puts a captured state back (ValueError naming what does not fit the stage's layers, or a
    file of another structure). A cut without a loss scale (one from an fp32 or bf16 run) starts
    fp16's afresh."""
    try:
        _restore(compute, sync, state, scaling)
    except KeyError as exc:
        raise ValueError(f"not a stage's part of a cut: it holds no {exc}") from None
    except (TypeError, AttributeError, IndexError) as exc:   # a loadable file of another structure
        raise ValueError(f"not a stage's part of a cut ({type(exc).__name__}: {exc})") from None


def _restore(compute: StageCompute, sync: Sync, state: dict[str, Any], scaling: Scaling | None) -> None:
    module = state["module"]
    own = compute.module.state_dict()
    if set(module) != set(own) or any(tuple(module[k].shape) != tuple(own[k].shape) for k in own):
        raise ValueError("the checkpoint holds other layers than this stage's (was the job changed?)")
    device = compute.device
    compute.module.load_state_dict({k: v.to(device) for k, v in module.items()})
    compute.version = int(state["version"])
    opt = compute.optimizer
    if opt is not None:
        saved = state["optimizer"]
        opt.momentum = [None if m is None else m.to(device) for m in saved["momentum"]]
        for name in ("exp_avg", "exp_avg_sq"):
            for target, value in zip(getattr(opt, name), saved[name]):
                target.copy_(value)
        for target, value in zip(opt.steps, saved["steps"]):
            target.copy_(value)
    sync.restore(state["sync"], device)
    if scaling is not None and scaling.fp16 and state.get("loss_scale"):
        scaling.loss_scale, skipped = LossScale.restored(state["loss_scale"])
        scaling.verdicts.skipped |= skipped
