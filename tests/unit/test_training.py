"""The train section's optimizer and learning-rate schedule: parsed with errors that name the key,
and learning_rate's values, checked against their closed forms over many schedules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.training import LrSchedule, OptimizerConfig, TrainConfig, learning_rate, parse_train
from hetpipe.validate import ConfigError, Section


def _parse(raw: object) -> TrainConfig:
    return parse_train(Section(raw, "train"))


def _train(steps: int, lr: float, **schedule: object) -> TrainConfig:
    return _parse({"steps": steps, "optimizer": {"name": "sgd", "lr": lr}, "lr_schedule": schedule})


def test_no_schedule_is_the_optimizers_lr_at_every_step() -> None:
    train = _parse({"steps": 5, "optimizer": {"lr": 0.3}})
    assert train.lr_schedule == LrSchedule()
    assert [learning_rate(train, p) for p in range(1, 6)] == [0.3] * 5


def test_warmup_then_cosine_by_hand() -> None:
    train = _train(10, 1.0, warmup_steps=2, decay="cosine", min_lr=0.0)
    got = [learning_rate(train, p) for p in range(1, 11)]
    # Warm-up 1/2, 2/2; then t = 0..7 of n = 8: (1 + cos(pi t / 8)) / 2.
    want = [0.5, 1.0] + [(1 + math.cos(math.pi * t / 8)) / 2 for t in range(8)]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[-1] > 0, "the last step still trains"


def test_the_warmup_ends_exactly_at_the_peak_and_the_schedule_covers_the_run_only() -> None:
    train = _train(10, 0.1, warmup_steps=3, decay="linear")
    assert learning_rate(train, 3) == 0.1 and learning_rate(train, 4) == 0.1   # 0.1 * 3 / 3 is 0.10000000000000002
    for p in (0, 11):
        with pytest.raises(ValueError, match=f"minibatch {p}: the schedule spans minibatches 1 to 10"):
            learning_rate(train, p)


def test_linear_by_hand() -> None:
    train = _train(5, 0.1, decay="linear", min_lr=0.02)
    got = [learning_rate(train, p) for p in range(1, 6)]
    assert got == pytest.approx([0.1, 0.084, 0.068, 0.052, 0.036], abs=1e-15)


@settings(max_examples=300, deadline=None)
@given(steps=st.integers(1, 500), warmup_share=st.floats(0, 1), decay=st.sampled_from(["constant", "linear", "cosine"]),
       lr=st.floats(1e-6, 10), min_share=st.floats(0, 1))
def test_every_schedule_warms_up_then_decays_within_its_bounds(steps: int, warmup_share: float, decay: str,
                                                               lr: float, min_share: float) -> None:
    warmup = int(steps * warmup_share)
    train = _train(steps, lr, warmup_steps=warmup, decay=decay, min_lr=lr * min_share)
    min_lr = train.lr_schedule.min_lr
    rates = [learning_rate(train, p) for p in range(1, steps + 1)]
    for p in range(1, warmup + 1):
        assert rates[p - 1] == pytest.approx(lr * p / warmup)
    after = rates[warmup:]
    if after:
        assert after[0] == pytest.approx(lr), "the first step after the warm-up trains at the peak"
    for a, b in zip(after, after[1:]):
        assert b <= a * (1 + 1e-12), "no schedule rises after its warm-up"
    for r in after:
        if decay == "constant":
            assert r == lr
        else:
            assert min_lr * (1 - 1e-12) <= r <= lr * (1 + 1e-12)
    if after and decay != "constant" and lr - min_lr > 1e-9 * lr:
        assert after[-1] > min_lr, "min_lr is the limit, not a step: every step trains"


def test_adamw_defaults_to_torchs_weight_decay_and_keeps_a_given_one() -> None:
    assert _parse({"optimizer": {"name": "adamw"}}).optimizer.weight_decay == 0.01
    assert _parse({"optimizer": {"name": "adamw", "weight_decay": 0}}).optimizer.weight_decay == 0
    assert _parse({"optimizer": {"name": "adam"}}).optimizer == OptimizerConfig(name="adam")


@pytest.mark.parametrize(("train", "names"), [
    ({"optimizer": {"name": "adam", "momentum": 0.9}}, ["train.optimizer.momentum", "0 for adam", "0.9"]),
    ({"optimizer": {"name": "lion"}}, ["train.optimizer.name", "sgd, adam, adamw", "'lion'"]),
    ({"steps": 10, "lr_schedule": {"warmup_steps": 11}}, ["train.lr_schedule.warmup_steps", "at most train.steps (10)", "11"]),
    ({"optimizer": {"lr": 0.1}, "lr_schedule": {"min_lr": 0.2}},
     ["train.lr_schedule.min_lr", "at most train.optimizer.lr (0.1)", "0.2"]),
    ({"lr_schedule": {"warmup_steps": -1}}, ["train.lr_schedule.warmup_steps", "an integer >= 0", "-1"]),
    ({"lr_schedule": {"min_lr": True}}, ["train.lr_schedule.min_lr", "a finite number", "True"]),
    ({"lr_schedule": {"decay": "exponential"}}, ["train.lr_schedule.decay", "constant, linear, cosine"]),
    ({"lr_schedule": {"warmup": 10}}, ["train.lr_schedule.warmup", "unknown key", "warmup_steps"]),
    ({"lr_schedule": [1, 2]}, ["train.lr_schedule", "a mapping"]),
])
def test_a_bad_optimizer_or_schedule_is_refused_by_name(train: dict, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(train)
    for name in names:
        assert name in str(info.value)
