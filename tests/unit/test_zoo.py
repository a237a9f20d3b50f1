"""The model zoo (hetpipe/zoo.py): the paper's VGG-19 and ResNet-152, and every model's contract."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hetpipe.config import ConfigError, parse_job
from hetpipe.models import build, layer_keys
from hetpipe.zoo import MODELS, Bottleneck

# Small arguments per model: a forward pass on the CPU takes milliseconds.
SMALL: dict[str, dict[str, Any]] = {
    "mlp": {"in_features": 12, "hidden": [16, 16], "num_classes": 5},
    "resnet": {"in_shape": [1, 8, 8], "widths": [8, 16], "num_classes": 5},
    "gpt": {"vocab": 11, "context": 6, "dim": 16, "heads": 2, "layers": 2},
    "vgg19": {"in_shape": [3, 32, 32], "width": 0.125, "num_classes": 5},
    "resnet152": {"in_shape": [3, 32, 32], "width": 0.125, "num_classes": 5},
}
BATCH = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny convolutions: intra-op threads only add contention (seconds on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_zoo_model_has_small_arguments_here() -> None:
    assert set(SMALL) == set(MODELS)


def meta_parameters(name: str, args: dict[str, Any]) -> tuple[nn.Sequential, int]:
    """Builds on the meta device: shapes without allocating 0.5 GB of weights."""
    with torch.device("meta"):
        model = MODELS[name](**args)
    return model, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "count"), [("vgg19", 143_667_240), ("resnet152", 60_192_808)])
def test_paper_models_have_torchvisions_parameter_counts(name: str, count: int) -> None:
    _, total = meta_parameters(name, {})
    assert total == count


def test_vgg19_layers() -> None:
    model, _ = meta_parameters("vgg19", {})
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 16 and all(c.kernel_size == (3, 3) for c in convs)
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 5
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [4096, 4096, 1000]
    assert not any(isinstance(m, nn.Dropout) for m in model.modules()), "no dropout: runs are deterministic"
    assert isinstance(model[0], nn.Unflatten)
    assert len(model) == 27  # unflatten, 16 conv+ReLU, 5 pools, avgpool, flatten, 3 FC


def test_resnet152_layers() -> None:
    model, _ = meta_parameters("resnet152", {})
    blocks = [m for m in model if isinstance(m, Bottleneck)]
    assert len(blocks) == 3 + 8 + 36 + 3, "each bottleneck is one partitionable layer"
    assert isinstance(model[0], nn.Unflatten)
    stem = model[1]
    assert isinstance(stem, nn.Sequential) and isinstance(stem[0], nn.Conv2d) and stem[0].kernel_size == (7, 7)
    assert isinstance(model[2], nn.MaxPool2d)
    assert isinstance(model[-1], nn.Linear) and model[-1].in_features == 2048 and model[-1].out_features == 1000
    assert len(model) == 56
    assert not list(model.buffers()), "BatchNorm keeps no running statistics: a stage's state is its weights"


@pytest.mark.parametrize("name", ["vgg19", "resnet152"])
def test_width_scales_channels_but_keeps_the_layers(name: str) -> None:
    full, full_count = meta_parameters(name, {})
    small, small_count = meta_parameters(name, SMALL[name])
    assert [type(m) for m in small] == [type(m) for m in full]
    assert small_count < full_count / 50


@pytest.mark.parametrize(
    ("name", "args", "key"),
    [
        ("vgg19", {"width": 0}, "width"),
        ("vgg19", {"in_shape": [3, 16, 16]}, "in_shape"),
        ("resnet152", {"in_shape": [3, 32]}, "in_shape"),
        ("resnet152", {"num_classes": 0}, "num_classes"),
    ],
)
def test_bad_arguments_name_the_key(name: str, args: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^model\.args\.{key}: expected"):
        MODELS[name](**args)


def build_model(name: str, args: dict[str, Any], seed: int) -> nn.Sequential:
    return build(parse_job({"model": {"name": name, "args": args}, "train": {"seed": seed}}))


def sample_input(name: str, args: dict[str, Any]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if name == "gpt":
        return torch.randint(0, args["vocab"], (BATCH, args["context"]), generator=gen)
    features = args["in_features"] if "in_features" in args else int(torch.tensor(args["in_shape"]).prod())
    return torch.randn(BATCH, features, generator=gen)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_shape(name: str) -> None:
    args = SMALL[name]
    model = build_model(name, args, seed=0)
    out = model(sample_input(name, args))
    if name == "gpt":
        assert out.shape == (BATCH, args["context"], args["vocab"])
    else:
        assert out.shape == (BATCH, args["num_classes"])
    assert torch.isfinite(out).all()


def test_a_gpt_refuses_sequences_longer_than_its_context_on_the_meta_device_too() -> None:
    """At plan time (the model on the meta device) as well: an embedding cannot check its indices
    there, and the first minibatch failed with torch's 'index out of range in self'."""
    args = SMALL["gpt"]
    tokens = torch.zeros(BATCH, args["context"] + 1, dtype=torch.int64)
    for device in ("cpu", "meta"):
        model = build_model("gpt", args, seed=0).to(device)
        with pytest.raises(ValueError, match=rf"sequences of {args['context'] + 1} tokens, but model.args.context is "
                                             rf"{args['context']}"):
            model(tokens.to(device))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_state_dict_keys_start_with_the_layer_index(name: str) -> None:
    model = build_model(name, SMALL[name], seed=0)
    keys = list(model.state_dict())
    layers = [int(k.split(".", 1)[0]) for k in keys]
    assert layers == sorted(layers), "keys come in layer order"
    assert set(layers) <= set(range(len(model)))
    # Every key belongs to exactly one layer range, so stages can split the model without loss.
    cut = len(model) // 2
    assert layer_keys(model, 0, cut) + layer_keys(model, cut, len(model)) == keys


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_model_is_deterministic_for_a_seed(name: str) -> None:
    args = SMALL[name]
    a = build_model(name, args, seed=7)
    b = build_model(name, args, seed=7)
    c = build_model(name, args, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point() and sa[k].numel() > 1)
    x = sample_input(name, args)
    assert torch.equal(a(x), b(x)), "same seed, same input: same output (no dropout or other randomness)"
