"""The job file's train section (DESIGN §8): steps, loss, optimizer, learning-rate schedule,
precision; and the learning rate each minibatch trains at. Pure: no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetpipe.validate import Section, fail, is_number

DTYPES = ("float32", "float64")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = ("sgd", "adam", "adamw")
ADAM_LIKE = ("adam", "adamw")   # their state: exp_avg, exp_avg_sq and a step count per parameter
DECAYS = ("constant", "linear", "cosine")
ADAMW_WEIGHT_DECAY = 0.01   # torch.optim.AdamW's: decoupled weight decay is what AdamW is chosen for
MAX_STEPS = 10**9


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    name: str = "sgd"
    lr: float = 0.05                 # the peak, where lr_schedule has a warm-up or a decay
    momentum: float = 0.0            # sgd's
    weight_decay: float = 0.0        # adamw's default is ADAMW_WEIGHT_DECAY (parse_train)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """A linear warm-up over warmup_steps to optimizer.lr, then a decay over the remaining steps
    towards min_lr (constant: none)."""
    warmup_steps: int = 0
    decay: str = "constant"
    min_lr: float = 0.0


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 100
    loss: str = "cross_entropy"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    dtype: str = "float32"           # the master weights' dtype (float64: the oracles)
    precision: str = "fp32"          # compute: fp32, bf16 or fp16 (autocast; master weights stay in dtype)
    seed: int = 0
    setup_timeout_s: float = 600.0   # how long the stages may take to load before the job fails
    stall_timeout_s: float = 30.0    # a process not answering, or no progress at all, this long: named
    checkpoint_every: int = 0        # waves between checkpoints a run can --resume from; 0: none
    max_grad_norm: float = 0.0       # clip each minibatch's gradients to this global L2 norm; 0: none


def learning_rate(train: TrainConfig, p: int) -> float:
    """The learning rate of a VW's minibatch p (1 to train.steps), as every trainer of the job
    steps it: the stages, the reference, the baselines. Warm-up: lr * p / warmup_steps. Then, with
    t = p - warmup_steps - 1 of the n = steps - warmup_steps steps left (0 <= t < n), linear:
    lr - (lr - min_lr) * t / n; cosine: min_lr + (lr - min_lr) * (1 + cos(pi * t / n)) / 2, as
    Hugging Face's schedulers give step t (the first step after warm-up trains at lr, none at min_lr)."""
    if not 1 <= p <= train.steps:
        raise ValueError(f"minibatch {p}: the schedule spans minibatches 1 to {train.steps}")
    lr, s = train.optimizer.lr, train.lr_schedule
    if p <= s.warmup_steps:
        return lr * (p / s.warmup_steps)   # exactly lr at the warm-up's end
    if s.decay == "constant":
        return lr
    progress = (p - s.warmup_steps - 1) / (train.steps - s.warmup_steps)
    if s.decay == "linear":
        return lr - (lr - s.min_lr) * progress
    return s.min_lr + (lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parse_train(t: Section) -> TrainConfig:
    t.check_known(("steps", "loss", "optimizer", "lr_schedule", "dtype", "precision", "seed", "setup_timeout_s",
                   "stall_timeout_s", "checkpoint_every", "max_grad_norm"))
    d = TrainConfig()
    steps = t.integer("steps", d.steps, minimum=1, maximum=MAX_STEPS)
    optimizer = _parse_optimizer(t.section("optimizer"))
    return TrainConfig(
        steps=steps, loss=t.choice("loss", d.loss, LOSSES), optimizer=optimizer,
        lr_schedule=_parse_lr_schedule(t.section("lr_schedule"), steps, optimizer.lr),
        dtype=t.choice("dtype", d.dtype, DTYPES), precision=t.choice("precision", d.precision, PRECISIONS),
        seed=t.integer("seed", d.seed, maximum=2**63 - 1),
        setup_timeout_s=t.number("setup_timeout_s", d.setup_timeout_s, minimum=1.0, maximum=86400.0),
        stall_timeout_s=t.number("stall_timeout_s", d.stall_timeout_s, minimum=1.0, maximum=86400.0),
        checkpoint_every=t.integer("checkpoint_every", d.checkpoint_every, maximum=MAX_STEPS),
        max_grad_norm=_max_grad_norm(t, d.max_grad_norm),
    )


MIN_EPS = 1e-30   # Adam's: smaller rounds to 0 in float32 (or past its normal range), and 0/0 is NaN
MIN_GRAD_NORM = 1e-6   # smaller, a clip coefficient could underflow to 0 and train nothing


def _max_grad_norm(t: Section, default: float) -> float:
    value = t.number("max_grad_norm", default)
    if 0 < value < MIN_GRAD_NORM:
        raise fail(t.path("max_grad_norm"), value, f"0 (no clipping) or at least {MIN_GRAD_NORM:g}")
    return value


def _parse_optimizer(o: Section) -> OptimizerConfig:
    o.check_known(("name", "lr", "momentum", "weight_decay", "betas", "eps"))
    d = OptimizerConfig()
    name = o.choice("name", d.name, OPTIMIZERS)
    momentum = o.number("momentum", d.momentum)
    if name != "sgd" and momentum:   # Adam's momentum is betas[0]: one silently ignored would mislead
        raise fail(o.path("momentum"), momentum, f"0 for {name} (its momentum is betas[0])")
    betas = o.get("betas", list(d.betas))
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)):
        raise fail(o.path("betas"), betas, "two numbers in [0, 1)")
    decay = ADAMW_WEIGHT_DECAY if name == "adamw" else d.weight_decay
    eps = o.number("eps", d.eps)
    if name in ADAM_LIKE and eps < MIN_EPS:   # Adam divides by sqrt(v) + eps: a gradient of 0 gives 0/0, NaN
        raise fail(o.path("eps"), eps, f"at least {MIN_EPS:g} for {name} (it divides by sqrt(v) + eps, and a "
                   "parameter whose gradient is 0 would step by 0/0)")
    return OptimizerConfig(name=name, lr=o.number("lr", d.lr), momentum=momentum,
                           weight_decay=o.number("weight_decay", decay), betas=(float(betas[0]), float(betas[1])),
                           eps=eps)


def _parse_lr_schedule(s: Section, steps: int, lr: float) -> LrSchedule:
    s.check_known(("warmup_steps", "decay", "min_lr"))
    d = LrSchedule()
    warmup, min_lr = s.get("warmup_steps", d.warmup_steps), s.get("min_lr", d.min_lr)
    if is_number(warmup) and warmup > steps:
        raise fail(s.path("warmup_steps"), warmup, f"at most train.steps ({steps})")
    if is_number(min_lr) and min_lr > lr:   # a decay that rises is a typo
        raise fail(s.path("min_lr"), min_lr, f"at most train.optimizer.lr ({lr:g})")
    return LrSchedule(warmup_steps=s.integer("warmup_steps", d.warmup_steps), decay=s.choice("decay", d.decay, DECAYS),
                      min_lr=s.number("min_lr", d.min_lr))
