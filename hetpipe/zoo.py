"""The model zoo: factories like any user's (`model.name: mlp` is `model.factory: hetpipe.zoo:mlp`),
each called with model.args as keyword arguments and returning an nn.Sequential whose children
are the layers a pipeline is cut between. Initialisation lives in reset_parameters(), so that a
stage can build its own layers alone (hetpipe/models.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from hetpipe.validate import ConfigError


def _ints(key: str, value: object, *, length: int | None = None) -> list[int]:
    ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                   for v in value) and (not length or len(value) == length)
    if not ok:
        what = f"a list of {length} positive integers" if length else "a list of positive integers"
        raise ConfigError(f"model.args.{key}: expected {what}, got {value!r}")
    return [int(v) for v in value]  # type: ignore[union-attr,attr-defined]


def _positive(key: str, value: object, kind: type = int) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:  # type: ignore[operator]
        raise ConfigError(f"model.args.{key}: expected a positive {'number' if kind is float else 'integer'}, "
                          f"got {value!r}")
    return value  # type: ignore[return-value]


def mlp(*, in_features: int = 64, hidden: Sequence[int] = (256, 256), num_classes: int = 10) -> nn.Sequential:
    """Linear layers with ReLU between them; each Linear and each ReLU is one layer."""
    sizes = [_positive("in_features", in_features), *_ints("hidden", hidden), _positive("num_classes", num_classes)]
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(int(sizes[i]), int(sizes[i + 1])))
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


def resnet(*, in_shape: Sequence[int] = (1, 8, 8), widths: Sequence[int] = (16, 32), blocks_per_stage: int = 1,
           num_classes: int = 10) -> nn.Sequential:
    """Small ResNet-style CNN over flat inputs reshaped to (channels, height, width).

    GroupNorm rather than BatchNorm: no running statistics, so a stage's state is its weights.
    """
    shape, widths = _ints("in_shape", in_shape, length=3), _ints("widths", widths)
    blocks = int(_positive("blocks_per_stage", blocks_per_stage))
    layers: list[nn.Module] = [
        nn.Unflatten(1, tuple(shape)),
        nn.Sequential(nn.Conv2d(shape[0], widths[0], 3, 1, 1, bias=False),
                      nn.GroupNorm(min(8, widths[0]), widths[0]), nn.ReLU()),
    ]
    cin = widths[0]
    for i, width in enumerate(widths):
        for b in range(blocks):
            layers.append(BasicBlock(cin, width, 2 if (b == 0 and i > 0) else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, int(_positive("num_classes", num_classes)))]
    return nn.Sequential(*layers)


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, context: int, dim: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length, context = tokens.shape[1], self.position.num_embeddings
        if length > context:   # found at plan time too (on the meta device), not at minibatch 1
            raise ValueError(f"sequences of {length} tokens, but model.args.context is {context}")
        positions = torch.arange(length, device=tokens.device)
        return self.token(tokens) + self.position(positions)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention (PyTorch's scaled dot-product kernel)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def gpt(*, vocab: int = 64, context: int = 16, dim: int = 32, heads: int = 2, layers: int = 2) -> nn.Sequential:
    """Small GPT-style decoder: embedding, blocks, final norm + vocabulary head."""
    for key, value in (("vocab", vocab), ("context", context), ("dim", dim), ("heads", heads), ("layers", layers)):
        _positive(key, value)
    if dim % heads:
        raise ConfigError(f"model.args.heads: {heads} does not divide dim {dim}")
    parts: list[nn.Module] = [TokenEmbedding(vocab, context, dim)]
    parts += [Block(dim, heads) for _ in range(layers)]
    parts += [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))]
    return nn.Sequential(*parts)


class KaimingConv2d(nn.Conv2d):
    """A convolution initialised as torchvision's VGG and ResNet do: Kaiming normal (fan out, ReLU)."""

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class SmallLinear(nn.Linear):
    """A fully connected layer initialised as torchvision's VGG does: N(0, 0.01), zero bias."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, 0.01)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def _image(in_shape: Sequence[int], min_side: int) -> tuple[int, int, int]:
    shape = _ints("in_shape", in_shape, length=3)
    if min(shape[1:]) < min_side:
        raise ConfigError(f"model.args.in_shape: expected [channels, height, width] with height and width "
                          f">= {min_side}, got {list(in_shape)!r}")
    return shape[0], shape[1], shape[2]


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


# VGG-19 (configuration E of Simonyan & Zisserman): 16 convolutions, "M" = 2x2 max-pool.
VGG19_CONFIG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                                       512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def vgg19(*, in_shape: Sequence[int] = (3, 224, 224), width: float = 1.0, num_classes: int = 1000) -> nn.Sequential:
    """VGG-19 as torchvision builds it, without dropout (so that runs are deterministic).

    One layer per conv+ReLU, per max-pool and per FC(+ReLU): cutting between a conv and its ReLU
    never helps a pipeline (same activation size), and fewer layers keep the partitioner fast.
    At width 1.0 and the defaults it has torchvision's 143,667,240 parameters; `width` scales
    every channel count and the two hidden FC sizes, keeping the layer structure.
    """
    channels, height, width_px = _image(in_shape, 32)
    width = float(_positive("width", width, float))
    layers: list[nn.Module] = [nn.Unflatten(1, (channels, height, width_px))]
    cin = channels
    for item in VGG19_CONFIG:
        if item == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        cout = _scaled(int(item), width)
        layers.append(nn.Sequential(KaimingConv2d(cin, cout, 3, padding=1), nn.ReLU()))
        cin = cout
    hidden = _scaled(4096, width)
    # The adaptive pool makes the classifier's input 7x7 whatever the image size, as torchvision does.
    layers += [nn.AdaptiveAvgPool2d((7, 7)), nn.Flatten(),
               nn.Sequential(SmallLinear(cin * 7 * 7, hidden), nn.ReLU()), nn.Sequential(SmallLinear(hidden, hidden),
                                                                                        nn.ReLU()),
               SmallLinear(hidden, int(_positive("num_classes", num_classes)))]
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
        self.conv1 = KaimingConv2d(cin, planes, 1, bias=False)
        self.bn1 = _batch_norm(planes)
        self.conv2 = KaimingConv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = _batch_norm(planes)
        self.conv3 = KaimingConv2d(planes, cout, 1, bias=False)
        self.bn3 = _batch_norm(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(KaimingConv2d(cin, cout, 1, stride, bias=False), _batch_norm(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.downsample(x))


RESNET152_BLOCKS = (3, 8, 36, 3)


def resnet152(*, in_shape: Sequence[int] = (3, 224, 224), width: float = 1.0,
              num_classes: int = 1000) -> nn.Sequential:
    """ResNet-152 as torchvision builds it (v1.5 bottlenecks [3, 8, 36, 3], BatchNorm).

    Layers: the 7x7 stem (conv+BN+ReLU), its max-pool, each of the 50 bottleneck blocks, then
    avgpool, flatten and fc. At width 1.0 and the defaults it has torchvision's 60,192,808
    parameters; `width` scales every channel count. BatchNorm keeps no running statistics, so it
    normalises with the minibatch's statistics in eval mode too.
    """
    channels, height, width_px = _image(in_shape, 1)
    width = float(_positive("width", width, float))
    stem = _scaled(64, width)
    layers: list[nn.Module] = [
        nn.Unflatten(1, (channels, height, width_px)),
        nn.Sequential(KaimingConv2d(channels, stem, 7, 2, 3, bias=False), _batch_norm(stem), nn.ReLU()),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = stem
    for i, blocks in enumerate(RESNET152_BLOCKS):
        planes = _scaled(64 * 2**i, width)
        for b in range(blocks):
            layers.append(Bottleneck(cin, planes, 2 if (b == 0 and i > 0) else 1))
            cin = planes * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, int(_positive("num_classes", num_classes)))]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[..., nn.Sequential]] = {
    "mlp": mlp,
    "resnet": resnet,
    "gpt": gpt,
    "vgg19": vgg19,
    "resnet152": resnet152,
}
