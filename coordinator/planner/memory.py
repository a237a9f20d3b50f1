"""The memory model of a stage (DESIGN §4): what a range of layers needs on its GPU at a given Nm."""

from __future__ import annotations

import numpy as np

from hetpipe.training import ADAM_LIKE
from coordinator.planner.profile import ModelProfile

# Optimizer state per parameter byte.
OPTIMIZER_STATE = {"sgd": 0, "sgd+momentum": 1, "momentum": 1, "adam": 2}


def optimizer_kind(name: str, momentum: float = 0.0) -> str:
    """The stage_memory optimizer name for a train.optimizer config (name, momentum)."""
    if name in ADAM_LIKE:   # the same state: two moments per parameter
        return "adam"
    return "sgd+momentum" if momentum else "sgd"


def in_flight(stage: int, k: int, nm: int) -> int:
    """Minibatches whose activations stage `stage` (of k) holds at once: nm at every stage but the
    last, which holds one (its forward and backward are one task; a lone stage, k = 1, too).

    Not PipeDream's k - q: the runtime injects nm minibatches back to back (L1) and runs ready
    tasks FIFO (L4), so forwards run ahead of the returning gradients. An event simulation of
    those rules gives nm at every stage but the last for balanced pipelines and for pipelines
    with a slow last stage (k = 4, nm = 4: [4, 4, 4, 1]); only a slow first stage thins it out.
    """
    if not 0 <= stage < k:
        raise ValueError(f"stage {stage} outside 0..{k - 1}")
    if nm < 1:
        raise ValueError(f"nm must be >= 1, got {nm}")
    return 1 if stage == k - 1 else nm


def optimizer_state(optimizer: str) -> int:
    try:
        return OPTIMIZER_STATE[optimizer]
    except KeyError:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZER_STATE)}, got {optimizer!r}") from None


def stage_memory(profile: ModelProfile, begin: int, end: int, stage: int, k: int, nm: int,
                 optimizer: str) -> int:
    """Bytes stage `stage` of k needs for layers [begin, end) with nm minibatches in the pipeline.

    params P (the weights and their gradients: 2 P) + optimizer state (sgd 0, sgd+momentum 1 P,
    adam 2 P) + stashed weight versions (one copy per in-flight minibatch, at most: minibatches
    forwarded between two updates share one, stage_worker/stage.py); a frozen parameter has no
    gradient, optimizer state or stashed copy + in-flight activations
    (per minibatch: the stage's input and what its layers keep for backward) + workspace (the
    largest transient of one of its layers; layers run one at a time).
    Not counted: the runtime's WSP buffers (the wave's accumulated update, pulled weights).
    """
    layers = profile.layers
    if not 0 <= begin < end <= len(layers):
        raise ValueError(f"layers [{begin}, {end}) outside the model's {len(layers)} layers")
    m = in_flight(stage, k, nm)
    params = sum(layer.param_bytes for layer in layers[begin:end])
    frozen = sum(layer.frozen_bytes for layer in layers[begin:end])
    inputs = profile.input_bytes if begin == 0 else layers[begin - 1].output_bytes
    activations = inputs + sum(layer.saved_bytes for layer in layers[begin:end])
    workspace = max(layer.workspace_bytes for layer in layers[begin:end])
    return (params * (2 + optimizer_state(optimizer)) + m * (params + activations) + workspace
            - frozen * (1 + optimizer_state(optimizer) + m))


def memory_matrix(profile: ModelProfile, m: int, optimizer: str) -> np.ndarray:
    """stage_memory for every [b, e) with m minibatches in flight (0 where e <= b), exactly."""
    layers = profile.layers
    n = len(layers)
    param = np.array([0] + [layer.param_bytes for layer in layers], dtype=np.int64).cumsum()
    frozen = np.array([0] + [layer.frozen_bytes for layer in layers], dtype=np.int64).cumsum()
    saved = np.array([0] + [layer.saved_bytes for layer in layers], dtype=np.int64).cumsum()
    inputs = np.array([profile.input_bytes] + [layer.output_bytes for layer in layers[:-1]], dtype=np.int64)
    work = np.array([layer.workspace_bytes for layer in layers], dtype=np.int64)
    out = np.zeros((n + 1, n + 1), dtype=np.int64)
    factor = 2 + optimizer_state(optimizer) + m
    for b in range(n):
        p = param[b + 1:] - param[b]
        f = frozen[b + 1:] - frozen[b]
        a = inputs[b] + saved[b + 1:] - saved[b]
        out[b, b + 1:] = p * factor - f * (factor - 1) + m * a + np.maximum.accumulate(work[b:])
    return out
