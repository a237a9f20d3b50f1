"""Per-layer profile of a job's model: FLOPs, bytes, memory, and forward/backward time per device type.

FLOPs, bytes moved and memory come from running every layer forward and backward on the `meta`
device (meter.py: shapes only, no data, no real computation), so VGG-19 or a 1.3B-parameter GPT
profile in seconds on a CPU-only machine, and no model is ever materialised here. Times come from
a roofline per operator: a catalog GPU type's (`GpuType.seconds`), or for this machine's own
device ("cpu", "cuda") one calibrated by timing a matrix product and a copy on it.

Works for any model whose layers are the children of an nn.Sequential (hetpipe/models.py).
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetpipe import data, models
from hetpipe.catalog import CATALOG, EFFICIENCY, GpuType
from hetpipe.config import JobConfig
from hetpipe.devices import local_devices
from hetpipe.threads import THREADS_ENV, env_threads
from coordinator.planner import cache
from coordinator.planner.meter import model_structure

# Bump when what is measured or how changes: old cache files are then ignored.
PROFILE_VERSION = 4
MEASURED_TYPES = ("cpu", "cuda")
# A stage's kernels are launched from Python one operator at a time: a floor under every op.
OP_OVERHEAD_S = {"cpu": 5e-6, "cuda": 8e-6}


@dataclass(frozen=True, slots=True)
class LayerProfile:
    index: int
    forward_flops: float
    backward_flops: float        # ~2x forward for layers with weights, ~1x otherwise
    param_bytes: int             # parameters (state_dict bytes of the layer)
    output_bytes: int            # the activation it sends to the next layer, per minibatch
    saved_bytes: int             # activations kept for its backward, per in-flight minibatch
    workspace_bytes: int         # transient working memory while it runs
    forward_seconds: dict[str, float]   # derived, per device type name
    backward_seconds: dict[str, float]
    frozen_bytes: int = 0        # of param_bytes, the parameters that do not train (requires_grad False)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    model: str
    batch_size: int
    dtype: str
    input_bytes: int             # one minibatch of x (what stage 0 reads)
    layers: tuple[LayerProfile, ...]
    # Where each layer begins among the model's, when layers no stage may begin at were joined to
    # the one before (partition.join_layers); empty: layer i is the model's layer i.
    starts: tuple[int, ...] = ()
    model_layers: int = 0

    def model_range(self, begin: int, end: int) -> tuple[int, int]:
        """Layers [begin, end) of this profile as the model's layers."""
        if not self.starts:
            return begin, end
        return self.starts[begin], self.starts[end] if end < len(self.starts) else self.model_layers


def example_input(job: JobConfig, args: Mapping[str, Any], model: torch.nn.Sequential) -> tuple[tuple[int, ...], torch.dtype]:
    """One minibatch of input. A zoo model says what it takes (at these args, which may be
    cluster.emulate.model_args); a user's model takes what its data gives."""
    batch = job.data.batch_size
    first = model[0]
    if job.model.name == "gpt":
        return (batch, int(args.get("context", 16))), torch.long
    if job.model.name is not None and isinstance(first, torch.nn.Unflatten):
        return (batch, math.prod(first.unflattened_size)), getattr(torch, job.train.dtype)
    if job.model.name is not None and isinstance(first, torch.nn.Linear):
        return (batch, first.in_features), getattr(torch, job.train.dtype)
    return data.batch_shapes(job)[0]


def _compute_dtype(job: JobConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.train.precision, getattr(torch, job.train.dtype))


def profile_model(job: JobConfig, device_types: Sequence[str], *, args: Mapping[str, Any] | None = None,
                  cache_dir: str | os.PathLike[str] | None = None) -> ModelProfile:
    """Profiles the job's model (at `args` instead of model.args, if given) at the job's batch
    size for every type in device_types. With cache_dir, the meta-device structure is cached per
    (model, args, input, dtype, precision) and each local device's calibration per device, as JSON."""
    for t in device_types:
        if t not in CATALOG and t not in MEASURED_TYPES:
            raise ValueError(f"device type {t!r}: expected one of {', '.join([*MEASURED_TYPES, *CATALOG])}")
    args = dict(job.model.args if args is None else args)
    model = models.structure(job.model, job.base_dir, args, dtype=job.train.dtype)
    shape, in_dtype = example_input(job, args, model)
    dtype = _compute_dtype(job)
    model_key = cache.model_key(job.model, job.base_dir, args, model)
    key = {"version": PROFILE_VERSION, "model": model_key, "input": [list(shape), str(in_dtype)], "dtype": str(dtype)}
    folder = Path(cache_dir) if cache_dir is not None else None
    path = cache.entry(folder, job.model.name or "factory", key) if model_key else None
    structure = cache.load(path, key) if path else None
    # Under autocast: what the stage holds in train.dtype, taken before the meta pass casts the model.
    held = _held_bytes(model, dtype) if job.train.precision != "fp32" else None
    if structure is None:
        meta = model.to(device="meta", dtype=dtype if in_dtype.is_floating_point else None).train()
        x = torch.empty(shape, dtype=dtype if in_dtype.is_floating_point else in_dtype, device="meta")
        structure = model_structure(meta, x)
        if path:
            cache.store(path, {"key": key, **structure})
    half = job.train.precision != "fp32"
    rooflines = {t: CATALOG[t] if t in CATALOG else _calibrated(t, folder) for t in dict.fromkeys(device_types)}
    overhead = {t: OP_OVERHEAD_S.get(t, 0.0) for t in rooflines}
    layers = tuple(
        LayerProfile(
            index=i,
            forward_flops=float(layer["forward_flops"]),
            backward_flops=float(layer["backward_flops"]),
            param_bytes=held[i][0] if held else int(layer["param_bytes"]),
            output_bytes=int(layer["output_bytes"]),
            saved_bytes=int(layer["saved_bytes"]) + (held[i][2] if held else 0),
            workspace_bytes=int(layer["workspace_bytes"]),
            forward_seconds={t: _roofline(g, layer["forward_ops"], half, overhead[t]) for t, g in rooflines.items()},
            backward_seconds={t: _roofline(g, layer["backward_ops"], half, overhead[t]) for t, g in rooflines.items()},
            frozen_bytes=held[i][1] if held else int(layer["frozen_bytes"]),
        )
        for i, layer in enumerate(structure["layers"])
    )
    return ModelProfile(models.describe(job.model), job.data.batch_size, str(dtype).removeprefix("torch."),
                        int(structure["input_bytes"]), layers)


# Modules whose weights autocast casts to the compute dtype for a matrix product or convolution,
# keeping the copy for the backward.
_CAST = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.modules.conv._ConvNd, torch.nn.MultiheadAttention,
         torch.nn.RNNBase)


def _held_bytes(model: torch.nn.Sequential, compute: torch.dtype) -> list[tuple[int, int, int]]:
    """Per layer, as a stage under autocast to `compute` (train.precision bf16, fp16) holds it:
    (state_dict bytes, frozen parameter bytes) in the model's own dtype, train.dtype, where its
    weights, their gradients, the optimizer state and the stashed copies stay (the meta pass runs
    in the compute dtype); and the bytes of the weights autocast casts to the compute dtype, a copy
    per minibatch in flight, kept for the backward."""
    out = []
    for layer in model:
        cast = sum(p.numel() * compute.itemsize for m in layer.modules() if isinstance(m, _CAST)
                   for p in m.parameters(recurse=False) if p.is_floating_point() and p.dtype != compute)
        out.append((sum(t.numel() * t.element_size() for t in layer.state_dict().values()),
                    sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad), cast))
    return out


def _roofline(gpu: GpuType, ops: Sequence[Sequence[float]], half: bool, overhead: float) -> float:
    # Operator by operator: a convolution is compute-bound and the ReLU after it memory-bound,
    # which one max() over the whole layer would hide.
    return math.fsum(gpu.seconds(flops, nbytes, half=half) + overhead for flops, nbytes in ops)


# ---- this machine's own devices: a roofline calibrated on them --------------------------------------

def _calibrated(kind: str, folder: Path | None) -> GpuType:
    """The roofline of this machine's CPU (at the thread count a stage uses) or first CUDA
    device: a catalog entry where the device's name is known, else timed here and cached."""
    device = next(d for d in local_devices() if d.kind == kind) if kind == "cuda" else None
    if device is not None:
        from hetpipe.catalog import match

        known = match(device.label, device.memory_bytes)
        if known is not None:
            return CATALOG[known]
    threads = env_threads(THREADS_ENV) or 1
    # The machine too: a $HETPIPE_CACHE shared between hosts (NFS, a mounted volume) holds each one's rates.
    key = {"version": PROFILE_VERSION, "device": kind, "label": device.label if device else "cpu", "threads": threads,
           "machine": _machine(), "torch": torch.__version__}
    path = cache.entry(folder, f"calibration-{kind}", key)
    stored = cache.load(path, key) if path else None
    if stored is None:
        stored = {"key": key, **_time_device("cuda:0" if kind == "cuda" else "cpu", threads)}
        if path:
            cache.store(path, stored)
    # GpuType.seconds divides by EFFICIENCY: undo it, the rates are what a kernel achieved here.
    return GpuType(kind, kind, stored["flops"] * EFFICIENCY / 1e12, device.memory_bytes if device else 0,
                   stored["bytes"] / 1e9, 0, stored["half_flops"] * EFFICIENCY / 1e12)


def _machine() -> str:
    """This host's name and CPU model."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:   # not Linux
        pass
    return f"{platform.node()}/{model or platform.processor()}"


def _time_device(device: str, threads: int) -> dict[str, float]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def best(fn: Any, reps: int = 5) -> float:
            fn()
            times = []
            for _ in range(reps):
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                fn()
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            return min(times)

        n = 1024 if device.startswith("cuda") else 256
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        ha, hb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        src = torch.empty(4 << 20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return {"flops": 2 * n**3 / best(lambda: a @ b), "half_flops": 2 * n**3 / best(lambda: ha @ hb),
                "bytes": 2 * src.numel() / best(lambda: dst.copy_(src))}
    finally:
        torch.set_num_threads(before)
