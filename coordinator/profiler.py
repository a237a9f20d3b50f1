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
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hetpipe import zoo
from hetpipe.catalog import CATALOG

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


# ---- meta-device structure -------------------------------------------------------------------------

class _Allocations:
    """Bytes of the storages created in one phase that are still alive, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.seen:
            return
        n = storage.nbytes()
        self.seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n


class _Meter(TorchDispatchMode):
    """Per operator: FLOPs and bytes read + written; and the storages each operator allocates.

    FLOPs use torch.utils.flop_counter's formulas (what FlopCounterMode counts: matmuls,
    convolutions, attention; 2 per multiply-add), and for every other operator one per element
    of its output or of its largest input, whichever is larger. FlopCounterMode itself is not used because it decomposes every other operator
    into primitives first, which makes ResNet-152 take tens of seconds on meta.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[float, int]] = []
        self.alloc = _Allocations()

    @property
    def flops(self) -> float:
        return math.fsum(f for f, _ in self.ops)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out  # metadata only: no data moves, nothing is allocated
        outputs = _tensors(out)
        if not outputs:
            return out
        inputs = _tensors((args, kwargs))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
        else:  # elementwise, reductions, copies: one per element of the larger side
            flops = float(max(sum(t.numel() for t in outputs if t.is_floating_point()),
                              max((t.numel() for t in inputs if t.is_floating_point()), default=0)))
        nbytes = sum(_nbytes(t) for t in {id(t): t for t in inputs + outputs}.values())
        self.ops.append((flops, nbytes))
        in_storages = {_storage_key(t) for t in inputs}
        for t in outputs:
            storage = t.untyped_storage()
            if storage._cdata not in in_storages:  # not in place: a new allocation
                self.alloc.add(storage)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _structure(name: str, args: Mapping[str, Any], batch_size: int, dtype: str) -> dict[str, Any]:
    """Runs every layer forward and backward on the meta device: no data, only shapes."""
    try:
        factory = zoo.MODELS[name]
    except KeyError:
        raise ValueError(f"model {name!r}: expected one of {', '.join(zoo.MODELS)}") from None
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = factory(args)
    model = model.to(device="meta", dtype=torch_dtype).train()
    x = example_input(name, args, model, batch_size, torch_dtype, "meta")
    input_bytes = _nbytes(x)
    layers = []
    seen: dict[Any, tuple[dict[str, Any], torch.Size, torch.dtype]] = {}
    for layer in model:
        # Deep models repeat identical layers (ResNet-152: 36 equal bottlenecks in a row), and
        # the meta kernels of some operators (batch norm) are slow Python decompositions.
        key = (_signature(layer), tuple(x.shape), x.dtype)
        if key in seen:
            layer_info, shape, out_dtype = seen[key]
            x = torch.empty(shape, dtype=out_dtype, device="meta")
        else:
            layer_info, x = _layer_structure(layer, x)
            seen[key] = (layer_info, x.shape, x.dtype)
        layers.append(dict(layer_info))
    return {"input_bytes": input_bytes, "layers": layers}


_PLAIN = (bool, int, float, str, tuple, type(None), torch.dtype, torch.Size)


def _signature(layer: nn.Module) -> Any:
    """What a layer computes: every submodule's class and plain attributes, and the shapes and
    dtypes of its parameters and buffers. Equal signatures on equal inputs give equal profiles."""
    parts = []
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items() if isinstance(v, _PLAIN)))
        parts.append((name, type(m).__module__, type(m).__qualname__, attrs))
    tensors: list[tuple[Any, ...]] = [(n, tuple(t.shape), t.dtype, t.requires_grad)
                                      for n, t in layer.named_parameters()]
    tensors += [(n, tuple(t.shape), t.dtype) for n, t in layer.named_buffers()]
    return tuple(parts), tuple(tensors)


def _layer_structure(layer: nn.Module, x: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    # Like the runtime (stage_worker/stage.py), a float input requires grad, so every layer
    # computes the gradient of its input, the first one included.
    x = x.detach().requires_grad_(x.is_floating_point())
    params = [p for p in layer.parameters() if p.requires_grad]
    param_storages = {_storage_key(p) for p in layer.parameters()}
    param_bytes = sum(_nbytes(t) for t in layer.state_dict().values())

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with _Meter() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"layer {type(layer).__name__} returned {type(y).__name__}, expected one tensor")
    forward_live_at_end = fwd.alloc.live
    inputs = ([x] if x.requires_grad else []) + params
    grad_out = torch.empty_like(y)
    with _Meter() as bwd:
        if y.requires_grad and inputs:
            torch.autograd.backward(y, grad_out, inputs=inputs)
    for p in params:
        p.grad = None

    in_key, out_key = _storage_key(x), _storage_key(y)
    # saved_bytes, per in-flight minibatch: the storages autograd keeps for this layer's
    # backward (not its parameters, which stashing counts, and not its input, which the layer
    # before counts as its output), plus the layer's own output unless it is a view of the input:
    # the output is kept either by the next layer's backward (it is that layer's input) or by the
    # stage's stash (the last layer of a stage). Stage 0's input is counted by the partitioner.
    kept = {k: n for k, n in saved.items() if k not in param_storages and k != in_key}
    if out_key != in_key:
        kept[out_key] = y.untyped_storage().nbytes()
    saved_bytes = sum(kept.values())
    # workspace_bytes: the largest transient while the layer runs. Forward: the peak of what its
    # operators allocated minus what is still alive at the end (output + saved). Backward: the
    # peak of what the backward allocated (input gradient and intermediates; parameter gradients
    # are left out because the partitioner counts them once for the whole stage), plus the
    # incoming output gradient.
    grad_param_bytes = sum(_nbytes(p) for p in params)
    workspace_bytes = max(
        fwd.alloc.peak - forward_live_at_end,
        (_nbytes(y) + max(0, bwd.alloc.peak - grad_param_bytes)) if inputs and y.requires_grad else 0,
    )
    info = {
        "forward_flops": fwd.flops,
        "backward_flops": bwd.flops,
        "param_bytes": param_bytes,
        "output_bytes": _nbytes(y),
        "saved_bytes": saved_bytes,
        "workspace_bytes": workspace_bytes,
        "forward_ops": fwd.ops,
        "backward_ops": bwd.ops,
    }
    return info, y.detach()


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
