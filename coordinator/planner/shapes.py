"""What flows between the layers of a model: each layer's input shape and dtype, and the model's
output, from one shape-only (meta device) pass. Stages are told these; they never run the meta path."""

from __future__ import annotations

import torch
from torch import nn

TensorShape = tuple[tuple[int, ...], torch.dtype]


def boundaries(model: nn.Sequential, x: TensorShape) -> list[TensorShape]:
    """[input of layer 0, input of layer 1, ..., output of the last layer] for a minibatch x."""
    value = torch.empty(x[0], dtype=x[1], device="meta")
    out = [x]
    with torch.no_grad():
        for layer in model.to("meta"):
            value = layer(value)
            out.append((tuple(value.shape), value.dtype))
    return out
