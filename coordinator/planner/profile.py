"""Per-layer profile of a zoo model: FLOPs, bytes, memory and forward/backward time per device type.

FLOPs, bytes moved and memory come from running every layer forward and backward on the `meta`
device (shapes only, no data, no real computation), so VGG-19 or ResNet-152 at 224x224 and batch
32 profile in seconds on a CPU-only machine. Times for a catalog GPU type are derived from those
numbers with the catalog's roofline (`GpuType.seconds`), operator by operator; "cpu" and "cuda"
are measured by timing each layer on real tensors (meant for small models).

Works for any model whose layers are the children of an nn.Sequential (hetpipe/zoo.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetpipe import zoo
from hetpipe.catalog import CATALOG
from coordinator.planner.meter import model_structure

# Bump when what is measured or how changes: old cache files are then ignored.
PROFILE_VERSION = 1
MEASURED_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class LayerProfile:
    index: int
    forward_flops: float
    backward_flops: float        # ~2x forward for layers with weights, ~1x otherwise
    param_bytes: int             # parameters (state_dict bytes of the layer)
    output_bytes: int            # the activation it sends to the next layer, per minibatch
    saved_bytes: int             # activations kept for its backward, per in-flight minibatch
    workspace_bytes: int         # transient working memory while it runs
    forward_seconds: dict[str, float]   # measured or derived, per device type name
    backward_seconds: dict[str, float]


@dataclass(frozen=True, slots=True)
class ModelProfile:
    model: str
    batch_size: int
    dtype: str
    input_bytes: int             # one minibatch of x (what stage 0 reads)
    layers: tuple[LayerProfile, ...]


def profile_model(
    name: str,
    args: Mapping[str, Any],
    batch_size: int,
    dtype: str,
    device_types: Sequence[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> ModelProfile:
    """Profiles zoo model `name` at `batch_size` for every type in device_types.

    Catalog types are derived from the meta-device FLOPs and bytes; "cpu"/"cuda" are measured.
    With cache_dir, the device-independent part is cached per (model, args, batch, dtype) and
    measured times per (model, args, batch, dtype, device type), as JSON.
    """
    dtype = _dtype_name(dtype)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    for t in device_types:
        if t not in CATALOG and t not in MEASURED_TYPES:
            raise ValueError(f"device type {t!r}: expected one of {', '.join([*MEASURED_TYPES, *CATALOG])}")
        if t == "cuda" and not torch.cuda.is_available():
            raise ValueError("device type 'cuda': no CUDA device on this machine")
    key = {"version": PROFILE_VERSION, "model": name, "args": _jsonable(args), "batch_size": batch_size,
           "dtype": dtype}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else None

    structure = _load(cache / f"{name}-{digest}.json", key) if cache else None
    if structure is None:
        structure = _structure(name, args, batch_size, dtype)
        if cache:
            _store(cache / f"{name}-{digest}.json", {"key": key, **structure})

    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    for t in dict.fromkeys(device_types):
        if t in MEASURED_TYPES:
            path = cache / f"{name}-{digest}-{t}.json" if cache else None
            measured = _load(path, {**key, "device": t}) if path else None
            if measured is None:
                fwd, bwd = _measure(name, args, batch_size, dtype, t)
                measured = {"forward_seconds": fwd, "backward_seconds": bwd}
                if path:
                    _store(path, {"key": {**key, "device": t}, **measured})
            forward[t], backward[t] = measured["forward_seconds"], measured["backward_seconds"]
        else:
            gpu = CATALOG[t]
            forward[t] = [_roofline(gpu, layer["forward_ops"]) for layer in structure["layers"]]
            backward[t] = [_roofline(gpu, layer["backward_ops"]) for layer in structure["layers"]]

    layers = tuple(
        LayerProfile(
            index=i,
            forward_flops=float(layer["forward_flops"]),
            backward_flops=float(layer["backward_flops"]),
            param_bytes=int(layer["param_bytes"]),
            output_bytes=int(layer["output_bytes"]),
            saved_bytes=int(layer["saved_bytes"]),
            workspace_bytes=int(layer["workspace_bytes"]),
            forward_seconds={t: float(forward[t][i]) for t in forward},
            backward_seconds={t: float(backward[t][i]) for t in backward},
        )
        for i, layer in enumerate(structure["layers"])
    )
    return ModelProfile(name, batch_size, dtype, int(structure["input_bytes"]), layers)


def _structure(name: str, args: Mapping[str, Any], batch_size: int, dtype: str) -> dict[str, Any]:
    try:
        factory = zoo.MODELS[name]
    except KeyError:
        raise ValueError(f"model {name!r}: expected one of {', '.join(zoo.MODELS)}") from None
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = factory(args)
    model = model.to(device="meta", dtype=torch_dtype).train()
    return model_structure(model, example_input(name, args, model, batch_size, torch_dtype, "meta"))


def _roofline(gpu: Any, ops: Sequence[Sequence[float]]) -> float:
    # Operator by operator: a convolution is compute-bound and the ReLU after it memory-bound,
    # which one max() over the whole layer would hide.
    return math.fsum(gpu.seconds(flops, nbytes) for flops, nbytes in ops)


# ---- example inputs ------------------------------------------------------------------------------

def example_input(name: str, args: Mapping[str, Any], model: nn.Sequential, batch_size: int,
                  dtype: torch.dtype, device: str | torch.device, *, real: bool = False) -> torch.Tensor:
    """One minibatch of model input, shaped as hetpipe/data.py feeds it (flat features or tokens).

    On meta (real=False) only the shape matters; real=True fills it with random values.
    """
    if zoo.takes_tokens(name):
        first = model[0]
        position = getattr(first, "position", None)
        context = int(args.get("context", position.num_embeddings if isinstance(position, nn.Embedding) else 16))
        vocab = int(args.get("vocab", 64))
        if real:
            return torch.randint(0, vocab, (batch_size, context), device=device)
        return torch.empty((batch_size, context), dtype=torch.long, device=device)
    first = model[0]
    shape: tuple[int, ...]
    if isinstance(first, nn.Unflatten):
        shape = (batch_size, math.prod(first.unflattened_size))
    elif isinstance(first, nn.Linear):
        shape = (batch_size, first.in_features)
    elif "in_shape" in args:
        shape = (batch_size, *(int(v) for v in args["in_shape"]))
    elif "in_features" in args:
        shape = (batch_size, int(args["in_features"]))
    else:
        raise ValueError(f"model {name}: cannot tell its input shape (no in_shape or in_features)")
    if real:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ---- measured device types -------------------------------------------------------------------------

def _measure(name: str, args: Mapping[str, Any], batch_size: int, dtype: str, device_type: str,
             reps: int = 3) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of every layer on real tensors (after one warm-up)."""
    device = "cuda:0" if device_type == "cuda" else "cpu"
    torch_dtype = getattr(torch, dtype)
    model = zoo.build_model(name, args, seed=0, dtype=torch_dtype).to(device).train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x = example_input(name, args, model, batch_size, torch_dtype, device, real=True)
    forward: list[float] = []
    backward: list[float] = []
    for layer in model:
        fwd_times, bwd_times = [], []
        y = x
        for rep in range(reps + 1):
            xin = x.detach().requires_grad_(x.is_floating_point())
            _sync(device)
            t0 = time.perf_counter()
            y = layer(xin)
            _sync(device)
            t1 = time.perf_counter()
            inputs = ([xin] if xin.requires_grad else []) + [p for p in layer.parameters() if p.requires_grad]
            grad_out = torch.ones_like(y)
            _sync(device)
            t2 = time.perf_counter()
            if y.requires_grad and inputs:
                torch.autograd.grad(y, inputs, grad_out)
            _sync(device)
            t3 = time.perf_counter()
            if rep:  # the first run warms caches and allocators up
                fwd_times.append(t1 - t0)
                bwd_times.append(t3 - t2)
        forward.append(statistics.median(fwd_times))
        backward.append(statistics.median(bwd_times))
        x = y.detach()
    return forward, backward


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---- cache -------------------------------------------------------------------------------------------

def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype name such as float32, got {dtype!r}")
    return str(dtype)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _load(path: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key)):
        return None
    return data


def _store(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
