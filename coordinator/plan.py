"""The planner (DESIGN §4): allocation policy, exact partition per VW, Nm, placement, prediction."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from hetpipe.catalog import gpu_type
from hetpipe.config import ConfigError, JobConfig
from hetpipe.network import Network, shard_node
from hetpipe.wsp import s_global
from hetpipe.zoo import model_shape
from coordinator.allocation import allocate
from coordinator.partition import (
    Gpu, Partition, PlanError, StageCut, max_nm, optimizer_kind, partition_vw, stage_memory,
)
from coordinator.profiler import ModelProfile, profile_model
from coordinator.simulator import SimStage, simulate

NM_LIMIT = 16
# Minibatches the simulator runs per VW to predict steady-state throughput.
SIM_STEPS = 64
# Loopback gRPC costs about this per stage-to-stage message in the emulated runtime, wake-up of
# the receiving compute thread included (bench/pipeline.py: 4.8 ms per hop); charged per send.
LOOPBACK_SEND_S = 0.004
# A push or pull on loopback: a round trip plus the bytes at what the shard path sustains (codec,
# gRPC, and for pushes the fsync'd push log). bench/ps_throughput.py on the 2-core development
# machine: a durable 5 MiB push takes 70 ms, a 5 MiB pull 30 ms; the sync traces of
# bench/prediction.py agree (pushes of 2.2 MB: 25-59 ms, unblocked pulls: 18 ms).
LOOPBACK_PS_CALL_S = 0.003
LOOPBACK_PUSH_BYTES_PER_S = 64 * 2**20
LOOPBACK_PULL_BYTES_PER_S = 100 * 2**20


def loopback_sync_seconds(nbytes: int) -> tuple[float, float]:
    """(push, pull reply) seconds for a stage with nbytes of parameters, shards on loopback. The
    shards are asked in parallel: one round trip, the bytes on one path."""
    return (LOOPBACK_PS_CALL_S + nbytes / LOOPBACK_PUSH_BYTES_PER_S,
            LOOPBACK_PS_CALL_S + nbytes / LOOPBACK_PULL_BYTES_PER_S)


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
    forward_seconds: float   # emulated task times the stage pads to (0 = no padding)
    backward_seconds: float
    memory_bytes: int = 0
    capacity_bytes: int = 0
    receive_seconds: float = 0.0
    # Emulated network (cluster.emulate.network): seconds each transfer is held (DESIGN §5).
    next_send_seconds: float = 0.0
    prev_send_seconds: float = 0.0
    push_seconds: float = 0.0
    pull_seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.gpu} (emulated)" if self.emulated else (self.device or self.gpu)


@dataclass(frozen=True, slots=True)
class Plan:
    virtual_workers: int
    stages_per_vw: int
    nm: int
    D: int
    shards: int
    stages: tuple[StagePlan, ...]
    key_shard: dict[str, int]  # parameter name -> owning shard
    policy: str = "ED"
    predicted_samples_per_second: float = 0.0
    predicted_wait_seconds: float = 0.0
    max_m: tuple[int, ...] = ()          # per VW: the largest Nm that fits its memory
    dp_only: dict[str, bool] = dataclasses.field(default_factory=dict)  # per GPU type: whole model fits?

    def vw_stages(self, vw: int) -> list[StagePlan]:
        return [s for s in self.stages if s.vw == vw]

    @property
    def emulated(self) -> bool:
        return any(s.emulated for s in self.stages)

    @property
    def s_global(self) -> int:
        return s_global(self.nm, self.D)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"vw": s.vw, "stage": s.stage, "node": s.node, "gpu": s.label, "layers": [s.layer_begin, s.layer_end]}
            for s in self.stages
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "virtual_workers": self.virtual_workers, "stages_per_vw": self.stages_per_vw,
            "nm": self.nm, "D": self.D, "s_global": self.s_global, "ps_shards": self.shards,
            "emulated": self.emulated, "predicted_samples_per_second": self.predicted_samples_per_second,
            "predicted_wait_seconds": self.predicted_wait_seconds, "max_m": list(self.max_m),
            "dp_only": self.dp_only,
            "stages": [{**dataclasses.asdict(s), "gpu": s.label} for s in self.stages],
        }


def cluster_gpus(job: JobConfig) -> list[Gpu]:
    """Every GPU of the cluster spec in order; without one, this machine's own devices."""
    if job.cluster is None:
        need = job.parallel.virtual_workers * job.parallel.stages_per_vw
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return [Gpu(f"local/{i}", "local", "cuda", torch.cuda.get_device_properties(i % n).total_memory)
                    for i in range(need)]
        return [Gpu(f"local/{i}", "local", "cpu", psutil.virtual_memory().total) for i in range(need)]
    gpus = []
    for node in job.cluster.nodes:
        index = 0
        for group in node.gpus:
            for _ in range(group.count):
                gpus.append(Gpu(f"{node.name}/{index}", node.name, group.type, gpu_type(group.type).memory_bytes))
                index += 1
    return gpus


def _canonical(group: Sequence[Gpu]) -> tuple[tuple[tuple[tuple[str, int], ...], ...], list[Gpu]]:
    """A VW's GPUs up to renaming: per node the sorted (type, memory) list, nodes sorted. Two VWs
    with the same signature have the same best partition; the list maps position to GPU."""
    nodes: dict[str, list[Gpu]] = {}
    for g in group:
        nodes.setdefault(g.node, []).append(g)
    ordered = sorted((sorted(gs, key=lambda g: (g.type, g.memory_bytes, g.id)) for gs in nodes.values()),
                     key=lambda gs: [(g.type, g.memory_bytes) for g in gs])
    signature = tuple(tuple((g.type, g.memory_bytes) for g in gs) for gs in ordered)
    return signature, [g for gs in ordered for g in gs]


class _Partitions:
    """partition_vw, once per distinct VW shape: ED's identical VWs cost one search, not N."""

    def __init__(self, profile: ModelProfile, optimizer: str, network: Network) -> None:
        self.profile, self.optimizer, self.network = profile, optimizer, network
        self._memo: dict[tuple[object, int], tuple[Partition, list[Gpu]]] = {}

    def __call__(self, group: Sequence[Gpu], nm: int) -> Partition:
        signature, order = _canonical(group)
        if (signature, nm) not in self._memo:
            self._memo[signature, nm] = (partition_vw(self.profile, order, nm, self.optimizer, self.network), order)
        part, first = self._memo[signature, nm]
        rename = dict(zip(first, order))
        return Partition(tuple(dataclasses.replace(c, gpu=rename[c.gpu]) for c in part.stages))


@dataclass(frozen=True, slots=True)
class _Transfers:
    """One stage's emulated network time per transfer (0 without an emulated network)."""

    next_send: float = 0.0
    prev_send: float = 0.0
    push: float = 0.0
    pull: float = 0.0


class _SyncCosts:
    """What moving data costs a stage: the emulated network's time (`transfers`, from the link
    bandwidth and latency and the emulated model's bytes), and what the simulator charges on top
    for loopback gRPC itself (the real model's bytes)."""

    def __init__(self, job: JobConfig, profile: ModelProfile, model: torch.nn.Sequential,
                 emulated_model: torch.nn.Sequential) -> None:
        self.job, self.profile, self.model = job, profile, model
        emulate = job.cluster.emulate if job.cluster else None
        self.network = emulate.network if emulate else None
        self.scale = _time_scale(job)
        self.nodes = [n.name for n in job.cluster.nodes] if job.cluster else []
        itemsize = getattr(torch, job.train.dtype).itemsize
        self.real_bytes = {name: p.numel() * itemsize for name, p in model.named_parameters()}
        self.emulated_bytes = {name: p.numel() * itemsize for name, p in emulated_model.named_parameters()}
        # Parameter names per layer, once: every candidate plan asks for every stage's bytes.
        self.layer_params: list[list[str]] = [[] for _ in range(len(model))]
        for name in self.real_bytes:
            self.layer_params[int(name.split(".", 1)[0])].append(name)

    def _per_shard(self, cut: StageCut, key_shard: dict[str, int], sizes: dict[str, int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for layer in range(cut.layer_begin, cut.layer_end):
            for key in self.layer_params[layer]:
                out[key_shard[key]] = out.get(key_shard[key], 0) + sizes[key]
        return out

    def transfers(self, part: Partition, key_shard: dict[str, int]) -> list[_Transfers]:
        """Per stage of a VW: the emulated network's time for each kind of transfer. A stage's
        traffic to all shards shares its one network interface, so its per-shard times add up."""
        net, cuts = self.network, part.stages
        if net is None:
            return [_Transfers()] * len(cuts)
        shards = [shard_node(i, self.nodes) for i in range(self.job.parallel.ps_shards)]
        layers = self.profile.layers
        out = []
        for q, cut in enumerate(cuts):
            node = cut.gpu.node
            nxt = net.link(node, cuts[q + 1].gpu.node, self.scale).seconds(layers[cut.layer_end - 1].output_bytes) \
                if q + 1 < len(cuts) else 0.0
            prv = net.link(node, cuts[q - 1].gpu.node, self.scale).seconds(layers[cut.layer_begin - 1].output_bytes) \
                if q > 0 else 0.0
            ps = sum(net.link(node, shards[i], self.scale).seconds(n)
                     for i, n in self._per_shard(cut, key_shard, self.emulated_bytes).items())
            synced = self.job.parallel.virtual_workers > 1  # a lone VW runs without shards
            out.append(_Transfers(nxt, prv, ps if synced else 0.0, ps if synced else 0.0))
        return out

    def key_shard(self, parts: Sequence[Partition]) -> dict[str, int]:
        # Shard s runs on node s (mod nodes), so `local` gives stage q the shard on stage q's node.
        home = [self.nodes.index(c.gpu.node) if c.gpu.node in self.nodes else q for q, c in enumerate(parts[0].stages)]
        return place_keys(self.model, [(c.layer_begin, c.layer_end) for c in parts[0].stages],
                          self.job.parallel.ps_shards, self.job.parallel.placement, home)

    def stages(self, parts: Sequence[Partition]) -> list[list[SimStage]]:
        """The simulator's stages, times as the runtime pads them (scaled), transfers included."""
        key_shard = self.key_shard(parts)
        vws = []
        for part in parts:
            stages = []
            for cut, emulated in zip(part.stages, self.transfers(part, key_shard)):
                push, pull = loopback_sync_seconds(sum(self._per_shard(cut, key_shard, self.real_bytes).values()))
                stages.append(SimStage(cut.forward_seconds * self.scale, cut.backward_seconds * self.scale,
                                       LOOPBACK_SEND_S + emulated.next_send, push_seconds=push + emulated.push,
                                       pull_seconds=pull + emulated.pull))
            vws.append(stages)
        return vws


def _simulated(parts: Sequence[Partition], nm: int, job: JobConfig, costs: _SyncCosts) -> tuple[float, float]:
    """Predicted samples/s and total wait (seconds over all VWs) for the runtime's padded times."""
    steps = min(job.train.steps, SIM_STEPS)
    sim = simulate(costs.stages(parts), nm=nm, D=job.parallel.D, steps=steps)
    return sim.minibatches_per_second * job.data.batch_size, sum(sim.wait_seconds)


def _emulated_model(job: JobConfig, model: torch.nn.Sequential) -> torch.nn.Sequential:
    """The model the emulated costs are taken at; it may differ from the real one only in sizes."""
    if job.emulated_model_args == dict(job.model.args):
        return model
    emulated = model_shape(job.model.name, job.emulated_model_args)
    names = [n for n, _ in model.named_parameters()]
    if len(emulated) != len(model) or [n for n, _ in emulated.named_parameters()] != names:
        raise ConfigError(
            f"cluster.emulate.model_args: {dict(job.cluster.emulate.model_args) if job.cluster and job.cluster.emulate else {}} "
            f"gives {len(emulated)} layers and {len(list(emulated.parameters()))} parameters, the model "
            f"{len(model)} and {len(names)}: the emulated model may differ only in sizes"
        )
    return emulated


def _time_scale(job: JobConfig) -> float:
    return job.cluster.emulate.time_scale if job.cluster and job.cluster.emulate else 1.0


def default_cache_dir() -> str:
    """Profiles are cached across runs: measuring a model's layers on this machine takes seconds."""
    return os.environ.get("HETPIPE_CACHE", str(Path.home() / ".cache" / "hetpipe" / "profiles"))


def make_plan(job: JobConfig, *, cache_dir: str | None = None) -> Plan:
    """The best plan for the job: allocation policy (or each, for `auto`), then for each VW the
    exact partition, Nm (`auto`: the smallest that reaches the best predicted throughput), and
    the placement of parameters on shards. Raises ConfigError or PlanError with the reason."""
    par = job.parallel
    n, k = par.virtual_workers, par.stages_per_vw
    gpus = cluster_gpus(job)
    if len(gpus) < n * k:
        raise ConfigError(f"parallel: {n} virtual workers x {k} stages need {n * k} GPUs, the cluster has {len(gpus)}")
    types = sorted({g.type for g in gpus})
    profile = profile_model(job.model.name, job.emulated_model_args, job.data.batch_size, job.train.dtype, types,
                            cache_dir=cache_dir or default_cache_dir())
    if k > len(profile.layers):
        raise ConfigError(f"parallel.stages_per_vw: {k} stages but model {job.model.name} has "
                          f"{len(profile.layers)} layers")
    optimizer = optimizer_kind(job.train.optimizer.name, job.train.optimizer.momentum)
    emulated = job.cluster is not None and job.cluster.emulate is not None
    scale = _time_scale(job)
    model = model_shape(job.model.name, job.model.args)
    costs = _SyncCosts(job, profile, model, _emulated_model(job, model))
    # The partitioner weighs activation transfers by the emulated network, else the paper's.
    network = costs.network or Network()
    partitions = _Partitions(profile, optimizer, network)
    if job.cluster is None:
        policies = ["ED"]  # identical local devices: every policy is the same
    else:
        policies = ["NP", "ED", "HD"] if par.policy == "auto" else [par.policy]

    best: tuple[float, int, str, list[Partition], list[list[Gpu]], list[int], float] | None = None
    reasons: list[str] = []
    for policy in policies:
        try:
            groups = allocate(policy, gpus, n, k)
        except ConfigError as exc:
            reasons.append(f"{policy}: {exc}")
            continue
        shapes = {_canonical(g)[0]: g for g in groups}
        limit_of = {sig: max_nm(profile, g, optimizer, network, limit=NM_LIMIT) for sig, g in shapes.items()}
        limits = [limit_of[_canonical(g)[0]] for g in groups]
        nms = [par.nm] if isinstance(par.nm, int) else list(range(1, min(limits) + 1))
        if not nms:
            worst = limits.index(0)
            try:
                partition_vw(profile, groups[worst], 1, optimizer, network)
            except PlanError as exc:
                reasons.append(f"{policy}: vw {worst}: {exc}")
            continue
        for nm in nms:
            try:
                parts = [partitions(g, nm) for g in groups]
            except PlanError as exc:
                reasons.append(f"{policy}, nm={nm}: {exc}")
                continue
            rate, wait = _simulated(parts, nm, job, costs)
            # nm auto: a larger nm must beat the best so far by 1% to be worth its memory and staleness.
            if best is None or rate > best[0] * 1.01:
                best = (rate, nm, policy, parts, groups, limits, wait)
    if best is None:
        raise PlanError("no plan fits: " + "; ".join(reasons[:4]))
    rate, nm, policy, parts, groups, limits, wait = best

    cuda = torch.cuda.device_count()
    stages = []
    key_shard = costs.key_shard(parts)
    for v, part in enumerate(parts):
        transfers = costs.transfers(part, key_shard)
        for q, cut in enumerate(part.stages):
            local = cut.gpu.type in ("cpu", "cuda")
            if cut.gpu.type == "cuda" and cuda:
                device = f"cuda:{(v * k + q) % cuda}"
            elif local or emulated:
                device = "cpu"  # emulation really computes on the CPU (DESIGN §5)
            else:
                device = ""  # a real GPU of that type on its own node: the worker picks its cuda device
            fwd, bwd = (cut.forward_seconds * scale, cut.backward_seconds * scale) if emulated else (0.0, 0.0)
            if emulated and job.cluster and job.cluster.emulate and (
                    job.cluster.emulate.forward_seconds or job.cluster.emulate.backward_seconds):
                fwd, bwd = job.cluster.emulate.forward_seconds, job.cluster.emulate.backward_seconds
            stages.append(StagePlan(
                v, q, cut.layer_begin, cut.layer_end, cut.gpu.node, cut.gpu.type, device, emulated and not local,
                fwd, bwd, cut.memory_bytes, cut.gpu.memory_bytes, cut.receive_seconds * scale,
                transfers[q].next_send, transfers[q].prev_send, transfers[q].push, transfers[q].pull,
            ))
    whole = stage_memory(profile, 0, len(profile.layers), 0, 1, 1, optimizer)
    return Plan(
        virtual_workers=n, stages_per_vw=k, nm=nm, D=par.D, shards=par.ps_shards, stages=tuple(stages),
        key_shard=key_shard, policy=policy,
        predicted_samples_per_second=rate, predicted_wait_seconds=wait, max_m=tuple(limits),
        dp_only={t: whole <= next(g.memory_bytes for g in gpus if g.type == t) for t in types},
    )


def place_keys(model: torch.nn.Sequential, ranges: list[tuple[int, int]], shards: int, placement: str,
               home: Sequence[int] | None = None) -> dict[str, int]:
    """Owning shard of every parameter. `default`: layers with parameters round-robin over the
    shards; `local`: stage q's layers on shard home[q] (mod S), the shard on stage q's node, so
    that with ED, where stage q of every VW sits on the same node, pushes stay inside nodes."""
    keys = [name for name, _ in model.named_parameters()]
    layer_of = {key: int(key.split(".", 1)[0]) for key in keys}
    if placement == "local":
        home = list(home) if home is not None else list(range(len(ranges)))
        return {key: home[next(q for q, (b, e) in enumerate(ranges) if b <= layer_of[key] < e)] % shards
                for key in keys}
    layers = sorted(set(layer_of.values()))
    return {key: layers.index(layer_of[key]) % shards for key in keys}


def resolved_job(job: JobConfig, plan: Plan) -> JobConfig:
    """The job with the plan's choices (nm) filled in, as the stages receive it."""
    return dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, nm=plan.nm))
