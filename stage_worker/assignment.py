"""A stage assignment, validated once into a frozen Setup: which stage this is, where its
neighbours and shards are, how it is paced, and what every tensor it receives must look like."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import grpc
import torch
from torch import nn

from hetpipe import devices
from hetpipe.config import ConfigError, ResolvedJob
from hetpipe.errors import Rejected
from hetpipe.v1 import stage_pb2
from hetpipe.wire import WireError, torch_dtype
from hetpipe.zoo import layer_keys, model_shape, stage_layers

# Emulated times and transfers are padded with sleeps: more than an hour per task is a mistake.
MAX_SECONDS = 3600.0
MAX_NDIM = 8
_DEVICE = re.compile(r"^(cpu|cuda:\d{1,3})?$")
_SECONDS = ("forward_seconds", "backward_seconds", "next_send_seconds", "prev_send_seconds", "push_seconds",
            "pull_seconds")


def _invalid(message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    def check(self, what: str, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype:
            raise _invalid(f"{what}: dtype {tensor.dtype}, expected {self.dtype}")
        if tuple(tensor.shape) != self.shape:
            raise _invalid(f"{what}: shape {list(tensor.shape)}, expected {list(self.shape)}")


@dataclass(frozen=True, slots=True)
class Specs:
    """What this stage receives: activations (and targets) from the previous stage, gradients of
    its output from the next one. One minibatch each."""

    activation: TensorSpec     # the stage's input (stage 0: the data's x)
    output: TensorSpec         # what it sends on, and the shape of the gradient it gets back
    target: TensorSpec         # the minibatch's y


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    job: ResolvedJob
    vw: int
    stage: int
    num_stages: int
    layer_begin: int
    layer_end: int
    device: devices.Device
    label: str                  # what the plan calls the GPU, e.g. "titan-v (emulated)"
    gpu_type: str
    emulated: bool
    prev_address: str
    next_address: str
    ps_addresses: tuple[str, ...]
    keys: tuple[str, ...]       # this stage's parameters, in order
    key_shards: tuple[int, ...]
    trace_path: str
    forward_seconds: float      # emulation: each task is padded to these (0 = not at all)
    backward_seconds: float
    next_send_seconds: float    # emulated network: each transfer is held this long
    prev_send_seconds: float
    push_seconds: float
    pull_seconds: float
    memory_bytes: int
    capacity_bytes: int
    specs: Specs

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def name(self) -> str:
        return f"stage {self.stage} of vw {self.vw}"

    @property
    def synced(self) -> bool:
        """Whether the stage syncs with parameter servers (several VWs); a lone VW does not."""
        return bool(self.ps_addresses)


def _shape(field: str, dims: list[int]) -> tuple[int, ...]:
    if not dims or len(dims) > MAX_NDIM or any(d <= 0 for d in dims):
        raise _invalid(f"{field}: {dims}: expected 1 to {MAX_NDIM} dimensions, each > 0")
    return tuple(int(d) for d in dims)


def _specs(a: stage_pb2.StageAssignment, model: nn.Sequential, job: ResolvedJob) -> Specs:
    """Every tensor's shape, inferred by running the layers on the meta device: no memory is
    allocated, however large a shape the assignment names."""
    x_shape, y_shape = _shape("input_shape", list(a.input_shape)), _shape("target_shape", list(a.target_shape))
    batch = job.data.batch_size
    if x_shape[0] != batch or y_shape[0] != batch:
        raise _invalid(f"input_shape {list(x_shape)} and target_shape {list(y_shape)}: one minibatch of "
                       f"data.batch_size {batch} rows each")
    try:
        x_dtype, y_dtype = torch_dtype(a.input_dtype), torch_dtype(a.target_dtype)
    except WireError as exc:
        raise _invalid(f"input or target dtype: {exc}") from None
    x = torch.empty(x_shape, dtype=x_dtype, device="meta")
    try:
        with torch.no_grad():
            x = stage_layers(model, 0, a.layer_begin)(x)
            activation = TensorSpec(x.dtype, tuple(x.shape))
            x = stage_layers(model, a.layer_begin, a.layer_end)(x)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # a shape the model cannot take
        raise _invalid(f"input_shape {list(x_shape)} does not fit model {job.model.name}: "
                       f"{str(exc)[:300]}") from None
    return Specs(activation, TensorSpec(x.dtype, tuple(x.shape)), TensorSpec(y_dtype, y_shape))


def validate(a: stage_pb2.StageAssignment) -> Setup:
    """The assignment as a Setup; Rejected (INVALID_ARGUMENT, or FAILED_PRECONDITION for a device
    this machine lacks) naming the first field that is wrong."""
    try:
        job = ResolvedJob.from_json(a.job_json)
    except ConfigError as exc:
        raise _invalid(f"job_json: {exc}") from None
    k = job.parallel.stages_per_vw
    if a.num_stages != k or a.stage >= k:
        raise _invalid(f"stage {a.stage} of {a.num_stages}: the job has {k} stages per virtual worker")
    if a.vw >= job.parallel.virtual_workers:
        raise _invalid(f"vw {a.vw} but the job has {job.parallel.virtual_workers}")
    model = model_shape(job.model.name, job.model.args)
    if not a.layer_begin < a.layer_end <= len(model):
        raise _invalid(f"layers [{a.layer_begin}, {a.layer_end}) but the model has {len(model)}")
    for field in _SECONDS:
        value = getattr(a, field)
        if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
            raise _invalid(f"{field}: {value}: expected a number of seconds in [0, {MAX_SECONDS:g}]")
    if (a.stage > 0) != bool(a.prev_address) or (a.stage < k - 1) != bool(a.next_address):
        raise _invalid(f"stage {a.stage} of {k}: needs prev_address exactly when it is not the first stage "
                       f"and next_address exactly when it is not the last")
    params = {name for name, _ in model.named_parameters()}
    keys = tuple(key for key in layer_keys(model, a.layer_begin, a.layer_end) if key in params)
    if a.ps_addresses and (len(a.key_shards) != len(keys) or any(s >= len(a.ps_addresses) for s in a.key_shards)):
        raise _invalid(f"key_shards: {len(a.key_shards)} entries for {len(keys)} parameters over "
                       f"{len(a.ps_addresses)} shards")
    if not _DEVICE.match(a.device):
        raise _invalid(f"device {a.device[:50]!r}: expected 'cpu', 'cuda:N' or empty (pick one)")
    try:
        device = devices.pick(a.device)
    except ValueError as exc:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
    return Setup(
        job=job, vw=a.vw, stage=a.stage, num_stages=k, layer_begin=a.layer_begin, layer_end=a.layer_end,
        device=device, label=a.device_label or device.name, gpu_type=a.gpu_type, emulated=a.emulated,
        prev_address=a.prev_address, next_address=a.next_address, ps_addresses=tuple(a.ps_addresses),
        keys=keys, key_shards=tuple(a.key_shards), trace_path=a.trace_path,
        **{field: float(getattr(a, field)) for field in _SECONDS},
        memory_bytes=a.memory_bytes, capacity_bytes=a.capacity_bytes, specs=_specs(a, model, job),
    )
