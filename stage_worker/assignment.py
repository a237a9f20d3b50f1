"""A stage assignment, validated once into a frozen Setup: which stage this is, where its
neighbours and shards are, how it is paced, and what every tensor it receives must look like.
Everything here is checked without building the model: Assign answers at once, whatever its size."""

from __future__ import annotations

import math
from pathlib import Path
import re
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from hetpipe import devices
from hetpipe.catalog import CATALOG
from hetpipe.config import ConfigError, ResolvedJob
from hetpipe.errors import Rejected
from hetpipe.units import format_bytes
from hetpipe.v1 import stage_pb2
from hetpipe.wire import MAX_BUNDLE_BYTES, WireError, torch_dtype
from hetpipe.wsp import total_waves

# Emulated times and transfers are padded with sleeps: more than an hour per task is a mistake.
MAX_SECONDS = 3600.0
MAX_NDIM = 8
_DEVICE = re.compile(r"(cpu|cuda:[0-9]{1,3})?")
_MARK = re.compile(r"[0-9a-f]{0,64}")   # checkpoint_mark: a coordinator start's nonce
_SECONDS = ("forward_seconds", "backward_seconds", "next_send_seconds", "prev_send_seconds", "push_seconds",
            "pull_seconds")


def _invalid(message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    def check(self, what: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
        """Rejected (INVALID_ARGUMENT) unless a received tensor (or the header that announces it)
        is of this dtype and shape."""
        if dtype != self.dtype:
            raise _invalid(f"{what}: dtype {dtype}, expected {self.dtype}")
        if tuple(shape) != self.shape:
            raise _invalid(f"{what}: shape {list(shape)}, expected {list(self.shape)}")

    def split(self, parts: int) -> TensorSpec:
        """One of `parts` equal micro-batches of a minibatch's tensor (its first dimension split)."""
        return TensorSpec(self.dtype, (self.shape[0] // parts, *self.shape[1:]))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def check_output(self, stage: str, tensor: torch.Tensor) -> None:
        """RuntimeError unless the stage's own layers produced what the plan said they would."""
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"{stage}'s layers produce {tensor.dtype} {list(tensor.shape)}, the plan expected "
                               f"{self.dtype} {list(self.shape)}: the model does not match the assignment")


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
    key_shards: tuple[int, ...]  # the owning shard of each of this stage's parameters, in order
    trace_path: str
    profile_path: str           # output.profile's Chrome trace (and its table, .txt); "" = off
    forward_seconds: float      # emulation: each task is padded to these (0 = not at all)
    backward_seconds: float
    next_send_seconds: float    # emulated network: each transfer is held this long
    prev_send_seconds: float
    push_seconds: float
    pull_seconds: float
    memory_bytes: int
    capacity_bytes: int
    specs: Specs
    checkpoint_dir: str = ""    # where it saves its part of each checkpoint; "" = none
    checkpoint_mark: str = ""   # what it writes into its mark there: the coordinator's start's nonce
    resume_wave: int = 0        # the checkpoint it starts from (0: the beginning)
    next_shm: bool = False      # parallel.transport: the next stage shares this host (shared memory)
    prev_shm: bool = False
    ps_shm: tuple[bool, ...] = ()  # per shard; () = none shares it
    next_cuda_ipc: bool = False  # the next stage shares this host's memory and both are on GPUs
    prev_cuda_ipc: bool = False

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


def _spec(a: stage_pb2.StageAssignment, name: str, batch: int) -> TensorSpec:
    shape = _shape(f"{name}_shape", list(getattr(a, f"{name}_shape")))
    if shape[0] != batch:
        raise _invalid(f"{name}_shape {list(shape)}: one minibatch of data.batch_size {batch} rows")
    try:
        return TensorSpec(torch_dtype(getattr(a, f"{name}_dtype")), shape)
    except WireError as exc:
        raise _invalid(f"{name}_dtype: {exc}") from None


def _inside(field: str, path: str, root: Path | None) -> str:
    """path, a relative one taken from root; PERMISSION_DENIED unless it lies inside root,
    symbolic links followed: an assignment must not make a stage write anywhere else (truncate
    a file by naming it as the trace)."""
    if not path or root is None:
        return path
    try:
        resolved = (root / path).resolve()  # an absolute path stays itself
    except (ValueError, OSError) as exc:  # a NUL byte, a path too long
        raise _invalid(f"{field} {path[:200]!r}: {exc}") from None
    if not resolved.is_relative_to(root.resolve()):
        raise Rejected(grpc.StatusCode.PERMISSION_DENIED,
                       f"{field} {path[:200]!r} is outside this stage's output root {root} (--output-root)")
    return str(resolved)


def validate(a: stage_pb2.StageAssignment, output_root: Path | None = None) -> Setup:
    """The assignment as a Setup; Rejected (INVALID_ARGUMENT, or FAILED_PRECONDITION for a device
    this machine lacks, RESOURCE_EXHAUSTED for a minibatch larger than the stage's GPU,
    PERMISSION_DENIED for a path outside output_root) naming the first field that is wrong."""
    trace_path = _inside("trace_path", a.trace_path, output_root)
    profile_path = _inside("profile_path", a.profile_path, output_root)
    checkpoint_dir = _inside("checkpoint_dir", a.checkpoint_dir, output_root)
    try:
        job = ResolvedJob.from_json(a.job_json)
    except ConfigError as exc:
        raise _invalid(f"job_json: {exc}") from None
    k = job.parallel.stages_per_vw
    if a.num_stages != k or a.stage >= k:
        raise _invalid(f"stage {a.stage} of {a.num_stages}: the job has {k} stages per virtual worker")
    if a.vw >= job.parallel.virtual_workers:
        raise _invalid(f"vw {a.vw} but the job has {job.parallel.virtual_workers}")
    if a.resume_wave and (not a.checkpoint_dir or a.resume_wave >= total_waves(job.train.steps, job.nm)):
        raise _invalid(f"resume_wave {a.resume_wave}: expected a checkpoint_dir and a wave before the job's "
                       f"last ({total_waves(job.train.steps, job.nm)})")
    if not a.layer_begin < a.layer_end:
        raise _invalid(f"layers [{a.layer_begin}, {a.layer_end}): an empty range")
    for field in _SECONDS:
        value = getattr(a, field)
        if not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
            raise _invalid(f"{field}: {value}: expected a number of seconds in [0, {MAX_SECONDS:g}]")
    if (a.stage > 0) != bool(a.prev_address) or (a.stage < k - 1) != bool(a.next_address):
        raise _invalid(f"stage {a.stage} of {k}: needs prev_address exactly when it is not the first stage "
                       f"and next_address exactly when it is not the last")
    shards = job.parallel.started_shards
    if len(a.ps_addresses) != shards:
        # Without them a VW of several would train alone, its pushes never counted (the others'
        # pulls wait for them); with too few its keys go to shards that do not own them.
        raise _invalid(f"ps_addresses: {len(a.ps_addresses)} shard addresses, but the job has {shards} ps shards "
                       f"(parallel.ps_shards; none for a lone VW or a baseline mode)")
    if a.ps_shm and len(a.ps_shm) != len(a.ps_addresses):
        raise _invalid(f"ps_shm: {len(a.ps_shm)} flags for {len(a.ps_addresses)} shard addresses")
    if any(s >= len(a.ps_addresses) for s in a.key_shards) or (a.key_shards and not a.ps_addresses):
        raise _invalid(f"key_shards: shards {sorted(set(a.key_shards))[-3:]} for {len(a.ps_addresses)} shard addresses")
    if not _DEVICE.fullmatch(a.device):
        raise _invalid(f"device {a.device[:50]!r}: expected 'cpu', 'cuda:N' or empty (pick one)")
    try:
        device = devices.pick(a.device)
    except ValueError as exc:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
    if not a.emulated and a.gpu_type in CATALOG and device.kind != "cuda":
        # As `hetpipe run` refuses: its numbers would pass for that GPU's, labelled not emulated.
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                       f"the plan puts a real {a.gpu_type} at stage {a.stage} of vw {a.vw}, but this worker has no "
                       "CUDA device: start it where that GPU is (compose: the gpu profile), or emulate the cluster "
                       "(cluster.emulate)")
    # A real GPU is named as the hardware names itself; an emulated one as the plan does.
    label = a.device_label or device.name
    if device.kind == "cuda" and not a.emulated:
        label = f"{device.label} ({device.name}, {format_bytes(device.memory_bytes)})"
    return Setup(
        job=job, vw=a.vw, stage=a.stage, num_stages=k, layer_begin=a.layer_begin, layer_end=a.layer_end,
        device=device, label=label, gpu_type=a.gpu_type, emulated=a.emulated,
        prev_address=a.prev_address, next_address=a.next_address, ps_addresses=tuple(a.ps_addresses),
        key_shards=tuple(a.key_shards), trace_path=trace_path, profile_path=profile_path,
        **{field: float(getattr(a, field)) for field in _SECONDS},
        memory_bytes=a.memory_bytes, capacity_bytes=a.capacity_bytes,
        specs=_specs(a, job.data.batch_size), checkpoint_dir=checkpoint_dir,
        checkpoint_mark=_checked_mark(a.checkpoint_mark), resume_wave=a.resume_wave,
        next_shm=a.next_shm and bool(a.next_address), prev_shm=a.prev_shm and bool(a.prev_address),
        ps_shm=tuple(a.ps_shm),
        next_cuda_ipc=a.next_cuda_ipc and a.next_shm and bool(a.next_address),
        prev_cuda_ipc=a.prev_cuda_ipc and a.prev_shm and bool(a.prev_address),
    )


def _checked_mark(mark: str) -> str:
    if not _MARK.fullmatch(mark):
        raise _invalid(f"checkpoint_mark {mark[:80]!r}: expected at most 64 hex digits")
    return mark


def _specs(a: stage_pb2.StageAssignment, batch: int) -> Specs:
    data = _spec(a, "input", batch)  # one minibatch's x: stage 0's input, checked on every stage
    specs = Specs(activation=data if a.stage == 0 else _spec(a, "activation", batch),
                  output=_spec(a, "output", batch), target=_spec(a, "target", batch))
    _check_minibatch_bytes(a, {"input": data, "activation": specs.activation, "output": specs.output,
                               "target": specs.target})
    return specs


def _check_minibatch_bytes(a: stage_pb2.StageAssignment, specs: dict[str, TensorSpec]) -> None:
    """Rejected (RESOURCE_EXHAUSTED) when one minibatch's tensors would not fit the GPU the plan
    gave this stage (capacity_bytes), or pass the 16 GiB a tensor bundle may carry, whatever
    capacity_bytes claims."""
    # The planner fits nm minibatches' activations and the weights into capacity_bytes, so no plan
    # it makes comes near this bound: the 118M GPT of bench/gpu.py takes 0.3 GiB per minibatch at
    # batch 32, VGG19 at 224 x 224 and batch 32 at most 0.8 GiB, against a GPU of 6 GiB or more.
    distinct = {id(s): s for s in specs.values()}  # stage 0's activation is its input
    total = sum(s.nbytes for s in distinct.values())
    if total > min(a.capacity_bytes, MAX_BUNDLE_BYTES):
        name, largest = max(specs.items(), key=lambda item: item[1].nbytes)
        bound = (f"capacity_bytes {format_bytes(a.capacity_bytes)}" if a.capacity_bytes <= MAX_BUNDLE_BYTES
                 else f"the {format_bytes(MAX_BUNDLE_BYTES)} a tensor bundle may carry")
        raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{name}_shape {list(largest.shape)}: one minibatch's "
                       f"tensors take {format_bytes(total)}, more than {bound}")
