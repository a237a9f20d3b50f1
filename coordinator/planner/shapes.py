"""What flows between the layers of a model: each layer's input shape and dtype, and the model's
output, from one shape-only (meta device) pass. Stages are told these; they never run the meta path."""

from __future__ import annotations

import torch
from torch import nn

TensorShape = tuple[tuple[int, ...], torch.dtype]


def boundaries(model: nn.Sequential, x: TensorShape, compute: torch.dtype | None = None) -> list[TensorShape]:
    """[input of layer 0, input of layer 1, ..., output of the last layer] for a minibatch x.
    With a compute dtype (train.precision), what layers produce in floating point is in it: that is
    what stages send (the input x is data, read by stage 0 itself)."""
    value = torch.empty(x[0], dtype=x[1], device="meta")
    out = [x]
    with torch.no_grad():
        for layer in model.to("meta"):
            value = layer(value)
            dtype = compute if compute is not None and value.is_floating_point() else value.dtype
            out.append((tuple(value.shape), dtype))
    return out
