"""Model zoo: every model is an nn.Sequential whose children are the partitionable layers."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

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


def _pos_number(args: Mapping[str, Any], key: str, default: float) -> float:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"model.args.{key}: expected a positive number, got {value!r}")
    return float(value)


def _image_shape(args: Mapping[str, Any], min_side: int) -> tuple[int, int, int]:
    in_shape = _int_list(args, "in_shape", [3, 224, 224])
    if len(in_shape) != 3 or min(in_shape[1:]) < min_side:
        raise ConfigError(f"model.args.in_shape: expected [channels, height, width] with height and width "
                          f">= {min_side}, got {in_shape!r}")
    return in_shape[0], in_shape[1], in_shape[2]


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


def _kaiming(weight: torch.Tensor) -> None:
    # Shape-only (meta) builds skip it: normal_ on meta tensors first imports torch._dynamo (seconds).
    if not weight.is_meta:
        nn.init.kaiming_normal_(weight, mode="fan_out", nonlinearity="relu")


# VGG-19 (configuration E of Simonyan & Zisserman): 16 convolutions, "M" = 2x2 max-pool.
VGG19_CONFIG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                                       512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def vgg19(args: Mapping[str, Any]) -> nn.Sequential:
    """VGG-19 as torchvision builds it, without dropout (so that runs are deterministic).

    One layer per conv+ReLU, per max-pool and per FC(+ReLU): cutting between a conv and its ReLU
    never helps a pipeline (same activation size), and fewer layers keep the partitioner fast.
    At width 1.0 and the defaults it has torchvision's 143,667,240 parameters; `width` scales
    every channel count and the two hidden FC sizes, keeping the layer structure.
    """
    channels, height, width_px = _image_shape(args, 32)
    width = _pos_number(args, "width", 1.0)
    num_classes = _pos_int(args, "num_classes", 1000)
    layers: list[nn.Module] = [nn.Unflatten(1, (channels, height, width_px))]
    cin = channels
    for item in VGG19_CONFIG:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        cout = _scaled(int(item), width)
        conv = nn.Conv2d(cin, cout, 3, padding=1)
        _kaiming(conv.weight)
        assert conv.bias is not None
        nn.init.zeros_(conv.bias)
        layers.append(nn.Sequential(conv, nn.ReLU()))
        cin = cout
    hidden = _scaled(4096, width)
    fcs = [nn.Linear(cin * 7 * 7, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, num_classes)]
    for fc in fcs:
        if not fc.weight.is_meta:
            nn.init.normal_(fc.weight, 0.0, 0.01)
        nn.init.zeros_(fc.bias)
    # The adaptive pool makes the classifier's input 7x7 whatever the image size, as torchvision does.
    layers += [nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(),
               nn.Sequential(fcs[0], nn.ReLU()), nn.Sequential(fcs[1], nn.ReLU()), fcs[2]]
    return nn.Sequential(*layers)


def _batch_norm(channels: int) -> nn.BatchNorm2d:
    # No running statistics: a stage's whole state is its parameters, which the shards own
    # (the parameter count is the same as torchvision's BatchNorm2d).
    return nn.BatchNorm2d(channels, track_running_stats=False)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = _batch_norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = _batch_norm(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = _batch_norm(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _batch_norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.downsample(x))


RESNET152_BLOCKS = (3, 8, 36, 3)


def resnet152(args: Mapping[str, Any]) -> nn.Sequential:
    """ResNet-152 as torchvision builds it (v1.5 bottlenecks [3, 8, 36, 3], BatchNorm).

    Layers: the 7x7 stem (conv+BN+ReLU), its max-pool, each of the 50 bottleneck blocks, then
    avgpool, flatten and fc. At width 1.0 and the defaults it has torchvision's 60,192,808
    parameters; `width` scales every channel count. BatchNorm keeps no running statistics, so it
    normalises with the minibatch's statistics in eval mode too.
    """
    channels, height, width_px = _image_shape(args, 1)
    width = _pos_number(args, "width", 1.0)
    num_classes = _pos_int(args, "num_classes", 1000)
    stem = _scaled(64, width)
    layers: list[nn.Module] = [
        nn.Unflatten(1, (channels, height, width_px)),
        nn.Sequential(nn.Conv2d(channels, stem, 7, 2, 3, bias=False), _batch_norm(stem), nn.ReLU()),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = stem
    for i, blocks in enumerate(RESNET152_BLOCKS):
        planes = _scaled(64 * 2**i, width)
        for b in range(blocks):
            layers.append(Bottleneck(cin, planes, 2 if (b == 0 and i > 0) else 1))
            cin = planes * Bottleneck.expansion
    for module in layers:
        for m in module.modules():
            if isinstance(m, nn.Conv2d):
                _kaiming(m.weight)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[Mapping[str, Any]], nn.Sequential]] = {
    "mlp": mlp,
    "resnet": resnet,
    "gpt": gpt,
    "vgg19": vgg19,
    "resnet152": resnet152,
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


def model_shape(name: str, args: Mapping[str, Any]) -> nn.Sequential:
    """The model on the meta device: names and shapes only, no memory, no initialisation cost."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(f"model.name: expected one of {', '.join(MODELS)}, got {name!r}") from None
    with torch.device("meta"):
        return factory(args)


def takes_tokens(name: str) -> bool:
    """Whether the model's input is integer token ids rather than float features."""
    return name == "gpt"


def stage_layers(model: nn.Sequential, begin: int, end: int) -> nn.Sequential:
    """Layers [begin, end) as a Sequential that keeps the full model's state_dict key names."""
    return cast(nn.Sequential, model[begin:end])


def layer_keys(model: nn.Sequential, begin: int, end: int) -> list[str]:
    """state_dict keys of layers [begin, end), in layer order."""
    return [k for k in model.state_dict() if begin <= int(k.split(".", 1)[0]) < end]
