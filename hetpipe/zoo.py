"""Model zoo: every model is an nn.Sequential whose children are the partitionable layers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hetpipe.config import ConfigError


def _int_list(args: Mapping[str, Any], key: str, default: list[int]) -> list[int]:
    value = args.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, int) and v > 0 for v in value):
        raise ConfigError(f"model.args.{key}: expected a list of positive integers, got {value!r}")
    return value


def _pos_int(args: Mapping[str, Any], key: str, default: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model.args.{key}: expected a positive integer, got {value!r}")
    return value


def mlp(args: Mapping[str, Any]) -> nn.Sequential:
    """Linear layers with ReLU between them; each Linear and each ReLU is one layer."""
    sizes = [_pos_int(args, "in_features", 64), *_int_list(args, "hidden", [256, 256]),
             _pos_int(args, "num_classes", 10)]
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convs + identity or 1x1 projection shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(min(8, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(min(8, cout), cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


def resnet(args: Mapping[str, Any]) -> nn.Sequential:
    """Small ResNet-style CNN over flat inputs reshaped to (channels, height, width).

    GroupNorm rather than BatchNorm: no running statistics, so a stage's state is its weights.
    """
    in_shape = _int_list(args, "in_shape", [1, 8, 8])
    if len(in_shape) != 3:
        raise ConfigError(f"model.args.in_shape: expected [channels, height, width], got {in_shape!r}")
    widths = _int_list(args, "widths", [16, 32])
    blocks = _pos_int(args, "blocks_per_stage", 1)
    layers: list[nn.Module] = [
        nn.Unflatten(1, tuple(in_shape)),
        nn.Sequential(nn.Conv2d(in_shape[0], widths[0], 3, 1, 1, bias=False),
                      nn.GroupNorm(min(8, widths[0]), widths[0]), nn.ReLU()),
    ]
    cin = widths[0]
    for i, width in enumerate(widths):
        for b in range(blocks):
            layers.append(BasicBlock(cin, width, 2 if (b == 0 and i > 0) else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, _pos_int(args, "num_classes", 10))]
    return nn.Sequential(*layers)


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, context: int, dim: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + self.position(positions)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def gpt(args: Mapping[str, Any]) -> nn.Sequential:
    """Small GPT-style decoder: embedding, blocks, final norm + vocabulary head."""
    vocab = _pos_int(args, "vocab", 64)
    context = _pos_int(args, "context", 16)
    dim = _pos_int(args, "dim", 32)
    heads = _pos_int(args, "heads", 2)
    if dim % heads:
        raise ConfigError(f"model.args.heads: {heads} does not divide dim {dim}")
    layers: list[nn.Module] = [TokenEmbedding(vocab, context, dim)]
    layers += [Block(dim, heads) for _ in range(_pos_int(args, "layers", 2))]
    layers += [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[Mapping[str, Any]], nn.Sequential]] = {
    "mlp": mlp,
    "resnet": resnet,
    "gpt": gpt,
}


def build_model(name: str, args: Mapping[str, Any], *, seed: int, dtype: torch.dtype) -> nn.Sequential:
    """Builds a zoo model with a seeded initialisation, so every process gets the same w0."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(f"model.name: expected one of {', '.join(MODELS)}, got {name!r}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory(args)
    return model.to(dtype)


def takes_tokens(name: str) -> bool:
    """Whether the model's input is integer token ids rather than float features."""
    return name == "gpt"


def layer_keys(model: nn.Sequential, begin: int, end: int) -> list[str]:
    """state_dict keys of layers [begin, end), in layer order."""
    return [k for k in model.state_dict() if begin <= int(k.split(".", 1)[0]) < end]
