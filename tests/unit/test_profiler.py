"""coordinator/planner/profile.py (and meter.py): FLOPs, bytes and times per layer, on the meta device, and its cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from coordinator.planner.meter import model_structure
from coordinator.planner.profile import ModelProfile, profile_model
from hetpipe import models
from hetpipe.catalog import CATALOG, EFFICIENCY, GiB, match
from hetpipe.config import ConfigError, parse_job

MLP = {"in_features": 8, "hidden": [16], "num_classes": 4}


def profile(name: str, args: dict[str, Any], batch: int, dtype: str, types: list[str], **kw: Any) -> ModelProfile:
    job = parse_job({"model": {"name": name, "args": args}, "data": {"batch_size": batch}, "train": {"dtype": dtype}})
    return profile_model(job, types, **kw)


def test_linear_flops_and_bytes_are_exact() -> None:
    p = profile("mlp", MLP, 5, "float32", ["titan-v"])
    linear, relu, head = p.layers
    assert [layer.index for layer in p.layers] == [0, 1, 2]
    assert p.input_bytes == 5 * 8 * 4
    assert linear.forward_flops == 2 * 5 * 8 * 16
    # Backward: grad input and grad weight (2 * B * in * out each) and the bias gradient (a sum
    # over the output gradient's elements).
    assert linear.backward_flops == 4 * 5 * 8 * 16 + 5 * 16
    assert linear.param_bytes == (8 * 16 + 16) * 4
    assert linear.output_bytes == 5 * 16 * 4
    # Linear keeps its input (counted as the layer before's output) and its weight (a parameter):
    # its own share is its output, which the ReLU keeps.
    assert linear.saved_bytes == 5 * 16 * 4
    assert relu.forward_flops == 5 * 16 and relu.param_bytes == 0
    assert relu.saved_bytes == 5 * 16 * 4
    assert head.forward_flops == 2 * 5 * 16 * 4 and head.output_bytes == 5 * 4 * 4
    doubled = profile("mlp", MLP, 5, "float64", ["titan-v"])
    assert doubled.input_bytes == 2 * p.input_bytes
    assert [d.param_bytes for d in doubled.layers] == [2 * s.param_bytes for s in p.layers]
    assert [d.forward_flops for d in doubled.layers] == [s.forward_flops for s in p.layers]


def test_a_frozen_parameter_is_counted_apart_for_the_memory_model() -> None:
    model = models.structure(parse_job({"model": {"name": "mlp", "args": MLP}}).model, ".")
    model[0].weight.requires_grad_(False)   # its bias trains
    layers = model_structure(model.train(), torch.empty(5, 8, device="meta"))["layers"]
    assert [layer["frozen_bytes"] for layer in layers] == [8 * 16 * 4, 0, 0]
    assert layers[0]["param_bytes"] == (8 * 16 + 16) * 4


def test_gpu_type_seconds_is_a_roofline() -> None:
    v = CATALOG["titan-v"]
    assert v.seconds(1e12, 0) == pytest.approx(1e12 / (v.tflops * 1e12 * EFFICIENCY))
    assert v.seconds(0, 1e9) == pytest.approx(1e9 / (v.bandwidth_gbs * 1e9))
    assert v.seconds(1e12, 1e9) == max(v.seconds(1e12, 0), v.seconds(0, 1e9))


def test_catalog_times_follow_tflops_on_a_compute_bound_layer() -> None:
    args = {"in_features": 1024, "hidden": [1024], "num_classes": 4}
    p = profile("mlp", args, 256, "float32", ["titan-v", "quadro-p4000", "rtx-2060"])
    layer = p.layers[0]  # a 256 x 1024 x 1024 matmul: compute-bound on every type
    v, q = layer.forward_seconds["titan-v"], layer.forward_seconds["quadro-p4000"]
    assert 0 < v < layer.forward_seconds["rtx-2060"] < q
    assert q / v == pytest.approx(CATALOG["titan-v"].tflops / CATALOG["quadro-p4000"].tflops)
    assert layer.backward_seconds["titan-v"] == pytest.approx(2 * v, rel=0.03)
    # The ReLU after it is memory-bound: bandwidth decides.
    relu = p.layers[1]
    ratio = relu.forward_seconds["quadro-p4000"] / relu.forward_seconds["titan-v"]
    assert ratio == pytest.approx(CATALOG["titan-v"].bandwidth_gbs / CATALOG["quadro-p4000"].bandwidth_gbs)


class _OnlyMeta(TorchDispatchMode):
    """Fails on any operator that computes on a tensor outside the meta device. (Allocating is
    not computing: a factory's parameters are allocated, untouched, then moved to meta.)"""

    ALLOCATE = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.ALLOCATE:
            return out
        leaves, _ = tree_flatten((args, kwargs, out))
        for t in (x for x in leaves if isinstance(x, torch.Tensor)):
            assert t.device.type == "meta", f"{func} ran on {t.device}"
        return out


def test_big_conv_model_is_profiled_on_meta_only() -> None:
    # Full VGG-19 at 224 x 224, batch 32: 1.26 TFLOP forward and GBs of activations, which this
    # CPU could not run in a unit test. Every operator must see meta tensors only.
    with _OnlyMeta():
        p = profile("vgg19", {"in_shape": [3, 224, 224], "num_classes": 1000}, 32, "float32", ["titan-v", "rtx-2060"])
    assert sum(layer.param_bytes for layer in p.layers) == 143_667_240 * 4  # torchvision's count
    forward = sum(layer.forward_flops for layer in p.layers)
    assert forward == pytest.approx(32 * 2 * 19.6e9, rel=0.02)  # 19.6 GMAC per image
    assert sum(layer.backward_flops for layer in p.layers) == pytest.approx(2 * forward, rel=0.02)
    assert p.input_bytes == 32 * 3 * 224 * 224 * 4
    assert p.layers[1].output_bytes == 32 * 64 * 224 * 224 * 4
    assert all(layer.forward_seconds["titan-v"] < layer.forward_seconds["rtx-2060"]
               for layer in p.layers if layer.forward_flops > 0)


@pytest.mark.parametrize(("name", "args"), [
    ("resnet", {"in_shape": [1, 8, 8], "widths": [8, 16], "blocks_per_stage": 2}),
    ("gpt", {"vocab": 32, "context": 8, "dim": 16, "heads": 2, "layers": 2}),
])
def test_other_zoo_models(name: str, args: dict[str, Any]) -> None:
    p = profile(name, args, 4, "float32", ["t4"])
    model = models.structure(parse_job({"model": {"name": name, "args": args}}).model, ".")
    assert len(p.layers) == len(model)
    for layer, module in zip(p.layers, model):
        assert layer.param_bytes == sum(t.numel() * t.element_size() for t in module.state_dict().values())
        if layer.param_bytes:  # a layer with weights computes: its roofline time is positive
            assert layer.forward_seconds["t4"] > 0 and layer.backward_seconds["t4"] > 0
    assert sum(layer.forward_flops for layer in p.layers) > 0


def test_cache_hit_returns_the_same_profile(tmp_path: Path) -> None:
    first = profile("mlp", MLP, 4, "float32", ["titan-v", "cpu"], cache_dir=tmp_path)
    assert first.layers[0].forward_seconds["cpu"] > 0
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2 and any(f.name.startswith("calibration-cpu") for f in files), files
    assert profile("mlp", MLP, 4, "float32", ["titan-v", "cpu"], cache_dir=tmp_path) == first
    # Mark both cache entries: a profile that carries the marks was read from the cache, not measured.
    for f in files:
        entry = json.loads(f.read_text())
        if f.name.startswith("calibration-cpu"):
            entry["flops"] /= 1000  # a CPU a thousand times slower
        else:
            entry["layers"][0]["param_bytes"] = 777
        f.write_text(json.dumps(entry))
    again = profile("mlp", MLP, 4, "float32", ["titan-v", "cpu"], cache_dir=tmp_path)
    assert again.layers[0].param_bytes == 777
    assert again.layers[0].forward_seconds["cpu"] > 3 * first.layers[0].forward_seconds["cpu"]
    # A catalog type not asked for before is derived from the cached FLOPs and bytes.
    assert profile("mlp", MLP, 4, "float32", ["a100-40gb"], cache_dir=tmp_path).layers[0].param_bytes == 777
    # Another batch size is another entry, measured afresh.
    assert profile("mlp", MLP, 8, "float32", ["titan-v"], cache_dir=tmp_path).layers[0].param_bytes != 777
    # An entry whose key does not match (a changed profile version) is ignored and replaced.
    for f in files:
        entry = json.loads(f.read_text())
        entry["key"]["version"] = -1
        f.write_text(json.dumps(entry))
    assert profile("mlp", MLP, 4, "float32", ["titan-v"], cache_dir=tmp_path).layers[0].param_bytes != 777


def test_another_machines_cpu_rates_in_a_shared_cache_are_not_taken(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A $HETPIPE_CACHE shared between hosts holds each one's CPU calibration: a host takes its own."""
    from coordinator.planner import profile as profiling

    profile("mlp", MLP, 4, "float32", ["cpu"], cache_dir=tmp_path)
    [calibration] = [f for f in tmp_path.iterdir() if f.name.startswith("calibration-cpu")]
    entry = json.loads(calibration.read_text())
    entry["flops"] /= 1000   # marked: taken from the cache, it would show
    calibration.write_text(json.dumps(entry))
    marked = profile("mlp", MLP, 4, "float32", ["cpu"], cache_dir=tmp_path).layers[0].forward_seconds["cpu"]
    monkeypatch.setattr(profiling, "_machine", lambda: "another-host/another CPU")
    own = profile("mlp", MLP, 4, "float32", ["cpu"], cache_dir=tmp_path).layers[0].forward_seconds["cpu"]
    assert own < marked / 3, "another host's rates were taken"


def test_rejects_unknown_device_types_and_models() -> None:
    with pytest.raises(ValueError, match="device type 'tpu'"):
        profile("mlp", MLP, 4, "float32", ["tpu"])
    with pytest.raises(ConfigError, match="model.name: expected one of mlp, resnet"):
        profile("alexnet", {}, 4, "float32", ["t4"])


def test_bf16_halves_the_bytes_and_uses_the_tensor_throughput() -> None:
    args = {"in_features": 1024, "hidden": [1024], "num_classes": 4}
    fp32 = profile("mlp", args, 256, "float32", ["h100-80gb"])
    job = parse_job({"model": {"name": "mlp", "args": args}, "data": {"batch_size": 256},
                     "train": {"precision": "bf16"}})
    bf16 = profile_model(job, ["h100-80gb"])
    assert bf16.layers[0].output_bytes * 2 == fp32.layers[0].output_bytes
    h100 = CATALOG["h100-80gb"]
    ratio = fp32.layers[0].forward_seconds["h100-80gb"] / bf16.layers[0].forward_seconds["h100-80gb"]
    assert ratio == pytest.approx(h100.tensor_tflops / h100.tflops, rel=0.05)


def test_bf16_keeps_the_weights_in_train_dtype_and_a_copy_per_minibatch_for_the_backward() -> None:
    """Under autocast a stage's weights, gradients, optimizer state and stashed copies stay float32
    (docs/design.md, Precision), and each forward keeps its Linear's bf16 weight for the backward:
    profiled in bf16 whole, a stage of 3 x 2048^2 Linears at nm 4 was planned at 198 MiB and held 447."""
    args = {"in_features": 1024, "hidden": [1024], "num_classes": 4}
    fp32 = profile("mlp", args, 256, "float32", ["h100-80gb"])
    bf16 = profile_model(parse_job({"model": {"name": "mlp", "args": args}, "data": {"batch_size": 256},
                                    "train": {"precision": "bf16"}}), ["h100-80gb"])
    assert [layer.param_bytes for layer in bf16.layers] == [layer.param_bytes for layer in fp32.layers]
    # What autocast really keeps for a Linear's backward, besides its input and its output.
    linear = torch.nn.Linear(1024, 1024)
    x = torch.randn(256, 1024, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = linear(x)
    for t in (x, y, *linear.parameters()):
        saved.pop(t.untyped_storage()._cdata, None)
    kept = sum(saved.values())
    assert kept >= 1024 * 1024 * 2, "the bf16 weight"
    copies = bf16.layers[0].saved_bytes - bf16.layers[0].output_bytes
    assert kept <= copies <= kept * 1.01, (kept, copies)
    assert fp32.layers[0].saved_bytes == fp32.layers[0].output_bytes   # no copies in float32


def test_real_devices_are_matched_to_the_catalog_by_name() -> None:
    assert match("NVIDIA H100 80GB HBM3", 80 * GiB) == "h100-80gb"
    assert match("NVIDIA A100-SXM4-80GB", 80 * GiB) == "a100-80gb"
    assert match("NVIDIA A100-PCIE-40GB", 40 * GiB) == "a100-40gb"
    assert match("NVIDIA L4", 24 * GiB) == "l4" and match("Tesla T4", 16 * GiB) == "t4"
    assert match("NVIDIA GeForce RTX 4090", 24 * GiB) == "rtx-4090"
    assert match("NVIDIA H200", 141 * GiB) == "h200"
    assert match("Some Future GPU", 1 * GiB) is None
