"""What one model costs, measured on the meta device: FLOPs and bytes per operator, memory that
each layer keeps for its backward and uses while it runs. Shapes only: no data, no real compute."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

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


def model_structure(model: nn.Sequential, x: torch.Tensor) -> dict[str, Any]:
    """Runs every layer of a meta-device model forward and backward from the meta input x:
    per layer FLOPs, operators (flops, bytes), parameter, output, saved and workspace bytes."""
    input_bytes = _nbytes(x)
    layers = []
    seen: dict[Any, tuple[dict[str, Any], torch.Size, torch.dtype]] = {}
    for layer in model:
        # Deep models repeat identical layers (ResNet-152: 36 equal bottlenecks in a row), and
        # the meta kernels of some operators (batch norm) are slow Python decompositions.
        key = (signature(layer), tuple(x.shape), x.dtype)
        if key in seen:
            layer_info, shape, out_dtype = seen[key]
            x = torch.empty(shape, dtype=out_dtype, device="meta")
        else:
            layer_info, x = _layer_structure(layer, x)
            seen[key] = (layer_info, x.shape, x.dtype)
        layers.append(dict(layer_info))
    return {"input_bytes": input_bytes, "layers": layers}


_PLAIN = (bool, int, float, str, tuple, type(None), torch.dtype, torch.Size)


def signature(layer: nn.Module) -> Any:
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
        "frozen_bytes": sum(_nbytes(p) for p in layer.parameters() if not p.requires_grad),
        "output_bytes": _nbytes(y),
        "saved_bytes": saved_bytes,
        "workspace_bytes": workspace_bytes,
        "forward_ops": fwd.ops,
        "backward_ops": bwd.ops,
    }
    return info, y.detach()
