"""What flows between the layers of a model: each layer's input shape and dtype, and the model's
output, from one shape-only (meta device) pass. Stages are told these; they never run the meta path."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from coordinator.planner import cache
from hetpipe.errors import first_line, meta_hint
from hetpipe.validate import ConfigError

TensorShape = tuple[tuple[int, ...], torch.dtype]
SHAPES_VERSION = 1   # bump when what boundaries finds changes: kept entries are then passed over
aten = torch.ops.aten
# Products whose CPU and CUDA kernels take operands of one dtype only.
_ONE_DTYPE = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution}


class _NumbersOfOneKind(TorchDispatchMode):
    """The meta device multiplies integers by floats, where CPU and CUDA kernels refuse to: uint8
    pixels or int64 values into a Linear or a Conv2d passed a shape-only pass and failed once
    training ran. (Floats of two widths are no error here: the meta model is in float32, and a
    stage builds its layers in train.dtype.)"""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in _ONE_DTYPE:
            tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
            if len({t.is_floating_point() or t.is_complex() for t in tensors}) > 1:
                dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
                raise RuntimeError(f"{func.overloadpacket.__name__} of {' and '.join(dtypes)} operands: "
                                   "its kernels take one dtype")
        return func(*args, **(kwargs or {}))


def boundaries(model: nn.Sequential, x: TensorShape, compute: torch.dtype | None = None, *,
               strict: bool = False, cache_dir: str | None = None,
               model_key: Mapping[str, Any] | None = None) -> list[TensorShape]:
    """[input of layer 0, input of layer 1, ..., output of the last layer] for a minibatch x.
    With a compute dtype (train.precision), what layers produce in floating point is in it: that is
    what stages send (the input x is data, read by stage 0 itself). strict: refuses, as the real
    kernels do, a matrix product or convolution of integers with floats (a dispatch mode: the first
    in a process costs its imports, so only where the data is checked). With cache_dir and the
    model's cache.model_key, kept there across runs: the first shape-only pass in a process imports
    torch's meta kernels and its compiler, 1.7 s of a CPU, each time `hetpipe run` starts."""
    key = {"version": SHAPES_VERSION, "model": model_key, "x": _named(x), "compute": str(compute), "strict": strict}
    path = cache.entry(cache_dir, "shapes", key) if model_key else None
    model.to("meta")   # its buffers too, hit or miss: the factory made them in memory
    kept = _flows(cache.load(path, key)) if path else None
    if kept is not None:
        return kept
    flows = _boundaries(model, x, compute, strict)
    if path:
        cache.store(path, {"key": key, "flows": [_named(f) for f in flows]})
    return flows


def _named(flow: TensorShape) -> list[Any]:
    return [list(flow[0]), str(flow[1]).removeprefix("torch.")]


def _flows(kept: dict[str, Any] | None) -> list[TensorShape] | None:
    """A kept entry's flows, or None where it has none that read as shapes and dtypes."""
    try:
        flows = [(tuple(int(n) for n in shape), getattr(torch, dtype)) for shape, dtype in kept["flows"]]  # type: ignore[index]
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    return flows if all(isinstance(d, torch.dtype) for _, d in flows) else None


def _boundaries(model: nn.Sequential, x: TensorShape, compute: torch.dtype | None, strict: bool) -> list[TensorShape]:
    value = torch.empty(x[0], dtype=x[1], device="meta")
    out = [x]
    with torch.no_grad(), _NumbersOfOneKind() if strict else contextlib.nullcontext():
        for i, layer in enumerate(model):
            try:
                value = layer(value)
            except Exception as exc:
                if i == 0:   # what it takes is the data's: the caller names the data
                    raise
                # A layer that cannot take the one before it: the model's own fault, not the data's.
                raise ConfigError(f"model: layer {i} ({type(layer).__name__}) does not take the output of layer {i - 1} "
                                  f"({type(model[i - 1]).__name__}), {str(value.dtype).removeprefix('torch.')} "
                                  f"{list(value.shape)}: {type(exc).__name__}: {first_line(exc)}{meta_hint(exc)}") from None
            if not isinstance(value, torch.Tensor):   # what would a stage send on?
                raise ConfigError(f"model: layer {i} ({type(layer).__name__}) returns a {type(value).__name__}, not a "
                                  "tensor: each layer of the nn.Sequential must return one tensor, the next layer's "
                                  "input (wrap a layer that returns more in one that picks what goes on)")
            dtype = compute if compute is not None and value.is_floating_point() else value.dtype
            out.append((tuple(value.shape), dtype))
    return out
