"""Turns a job into a plan: which device, layers, emulated task times and shards each stage gets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from hetpipe import data as datasets
from hetpipe.catalog import gpu_type
from hetpipe.config import ConfigError, JobConfig
from hetpipe.zoo import build_model
from coordinator.partition import partition


@dataclass(frozen=True, slots=True)
class StagePlan:
    vw: int
    stage: int
    layer_begin: int
    layer_end: int
    node: str
    gpu: str              # catalog type, or "cpu"/"cuda" for the machine's own devices
    device: str           # where it really computes: "cpu" or "cuda:N"
    emulated: bool
    forward_seconds: float
    backward_seconds: float

    @property
    def label(self) -> str:
        return f"{self.gpu} (emulated)" if self.emulated else self.device


@dataclass(frozen=True, slots=True)
class Plan:
    virtual_workers: int
    stages_per_vw: int
    nm: int
    D: int
    shards: int
    stages: tuple[StagePlan, ...]
    key_shard: dict[str, int]  # state_dict key -> owning shard

    def vw_stages(self, vw: int) -> list[StagePlan]:
        return [s for s in self.stages if s.vw == vw]

    @property
    def emulated(self) -> bool:
        return any(s.emulated for s in self.stages)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"vw": s.vw, "stage": s.stage, "node": s.node, "gpu": s.label, "layers": [s.layer_begin, s.layer_end]}
            for s in self.stages
        ]


def layer_flops(job: JobConfig, model: torch.nn.Sequential, sample: torch.Tensor) -> list[float]:
    """Forward FLOPs of each layer at the job's batch size (elementwise layers cost their size)."""
    flops: list[float] = []
    x = sample
    with torch.no_grad():
        for layer in model:
            with FlopCounterMode(display=False) as counter:
                y = layer(x)
            flops.append(float(counter.get_total_flops()) + float(y.numel()))
            x = y
    return flops


def probe_batch(job: JobConfig) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = datasets.load_dataset(job)
    return datasets.minibatch(dataset, 1, 0, job)


def _devices(job: JobConfig) -> list[tuple[str, str, bool]]:
    """(node, gpu type, emulated) for every GPU in cluster order; the local machine if no cluster."""
    if job.cluster is None:
        need = job.parallel.virtual_workers * job.parallel.stages_per_vw
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        return [("local", kind, False)] * need
    emulated = job.cluster.emulate is not None
    out = []
    for node in job.cluster.nodes:
        for group in node.gpus:
            gpu_type(group.type)
            out += [(node.name, group.type, emulated)] * group.count
    return out


def make_plan(job: JobConfig) -> Plan:
    par = job.parallel
    n, k = par.virtual_workers, par.stages_per_vw
    model = build_model(job.model.name, job.model.args, seed=job.train.seed, dtype=getattr(torch, job.train.dtype))
    if k > len(model):
        raise ConfigError(f"parallel.stages_per_vw: {k} stages but model {job.model.name} has {len(model)} layers")
    devices = _devices(job)
    if len(devices) < n * k:
        raise ConfigError(
            f"parallel: {n} virtual workers x {k} stages need {n * k} GPUs, the cluster has {len(devices)}"
        )
    x, _ = probe_batch(job)
    flops = layer_flops(job, model, x)
    ranges = partition(flops, k)
    emulate = job.cluster.emulate if job.cluster else None
    cuda_count = torch.cuda.device_count()
    stages = []
    for v in range(n):
        for q, (b, e) in enumerate(ranges):
            node, gpu, emulated = devices[v * k + q]
            index = v * k + q
            device = f"cuda:{index % cuda_count}" if (gpu == "cuda" and cuda_count) else "cpu"
            fwd = bwd = 0.0
            if emulate is not None:
                if emulate.forward_seconds or emulate.backward_seconds:
                    fwd, bwd = emulate.forward_seconds, emulate.backward_seconds
                else:
                    seconds = sum(flops[b:e]) / (gpu_type(gpu).tflops * 1e12) * emulate.time_scale
                    fwd, bwd = seconds, 2 * seconds  # backward costs about twice the forward
            stages.append(StagePlan(v, q, b, e, node, gpu, device, emulated, fwd, bwd))
    nm = par.nm if isinstance(par.nm, int) else k
    key_shard = place_keys(model, ranges, par.ps_shards, par.placement)
    return Plan(n, k, nm, par.D, par.ps_shards, tuple(stages), key_shard)


def place_keys(model: torch.nn.Sequential, ranges: list[tuple[int, int]], shards: int, placement: str) -> dict[str, int]:
    """Owning shard of every parameter. `default`: layers with parameters round-robin over the
    shards; `local`: stage q's layers on shard q (mod S), the shard co-located with that stage."""
    keys = [name for name, _ in model.named_parameters()]
    layer_of = {key: int(key.split(".", 1)[0]) for key in keys}
    if placement == "local":
        return {key: next(q for q, (b, e) in enumerate(ranges) if b <= layer_of[key] < e) % shards for key in keys}
    layers = sorted(set(layer_of.values()))
    return {key: layers.index(layer_of[key]) % shards for key in keys}


def resolved_job(job: JobConfig, plan: Plan) -> JobConfig:
    """The job with the plan's choices (nm) filled in, as the stages receive it."""
    return dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, nm=plan.nm))
