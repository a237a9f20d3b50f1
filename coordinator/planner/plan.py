"""The planner (DESIGN §4): profile -> memory model -> allocation -> partition -> placement ->
simulate. `make_plan` tries each allocation policy (and Nm, for `nm: auto`) and keeps the plan
with the best simulated throughput."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hetpipe.config import ConfigError, JobConfig, ResolvedJob, resolve
from hetpipe.devices import local_devices
from hetpipe.errors import JobStopped
from hetpipe.network import Network
from hetpipe.wsp import s_global
from hetpipe import models
from coordinator.planner.allocation import allocate
from coordinator.planner.cache import default_cache_dir, model_key
from coordinator.planner.cluster import Gpu, PlanError, cluster_gpus, vw_signature
from coordinator.planner.costs import StageCosts
from coordinator.planner.memory import optimizer_kind, stage_memory
from coordinator.planner.partition import Partition, join_layers, max_nm, partition_vw, unjoin
from coordinator.planner.profile import ModelProfile, example_input, profile_model
from coordinator.planner.shapes import boundaries

# nm auto tries 1..this: past it, a deeper pipeline buys little and costs staleness and memory.
NM_AUTO_LIMIT = 16
# The memory bound on Nm that `hetpipe plan` reports is searched up to this.
NM_MEMORY_LIMIT = 1024


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
    predicted_forward_seconds: float    # what the prediction takes a task to last, padded or not
    predicted_backward_seconds: float
    memory_bytes: int = 0
    capacity_bytes: int = 0
    receive_seconds: float = 0.0
    # Emulated network (cluster.emulate.network): seconds each transfer is held (DESIGN §5).
    next_send_seconds: float = 0.0
    prev_send_seconds: float = 0.0
    push_seconds: float = 0.0
    pull_seconds: float = 0.0
    layer_names: str = ""    # first and last layer, e.g. "0.Linear-3.ReLU"

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
    max_m: tuple[int, ...] = ()          # per VW: the largest Nm that fits its memory (up to NM_MEMORY_LIMIT)
    dp_only: dict[str, bool] = dataclasses.field(default_factory=dict)  # per GPU type: whole model fits?
    warnings: tuple[str, ...] = ()

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
            "dp_only": self.dp_only, "warnings": list(self.warnings),
            "stages": [{**_renamed(dataclasses.asdict(s)), "gpu": s.label} for s in self.stages],
        }


def _renamed(stage: dict[str, Any]) -> dict[str, Any]:
    """A StagePlan's fields as --json names them: the emulated times a stage pads its tasks to."""
    return {{"forward_seconds": "pad_forward_seconds", "backward_seconds": "pad_backward_seconds"}.get(k, k): v
            for k, v in stage.items()}


def _joined(job: JobConfig, model: torch.nn.Sequential, cache_dir: str) -> list[tuple[int, tuple[int, ...], torch.dtype]]:
    """The layers (index > 0, their input's shape and dtype) that no stage may begin at: their
    input is not floating point (token ids, say), and no gradient flows back across such a
    boundary for the stage before it to run its backward on. The partitioner joins each to the
    layer before it."""
    # The zoo's layers pass floats on (a GPT's token ids enter its first layer, where no stage begins).
    if job.model.factory is None or job.parallel.stages_per_vw == 1:
        return []
    flows = boundaries(model, example_input(job, job.model.args, model), cache_dir=cache_dir,
                       model_key=model_key(job.model, job.base_dir, job.model.args, model))
    return [(i, shape, dtype) for i, (shape, dtype) in enumerate(flows[: len(model)])
            if i > 0 and not (dtype.is_floating_point or dtype.is_complex)]


def _joined_note(model: torch.nn.Sequential, joined: Sequence[tuple[int, tuple[int, ...], torch.dtype]],
                 starts: int) -> str:
    if not joined:
        return ""
    named = ", ".join(f"{layer_names(model, i, i + 1)} ({str(dtype).removeprefix('torch.')} {list(shape)})"
                      for i, shape, dtype in joined[:3])
    return (f", {starts} a stage can begin at: no stage begins at {named}{', ...' if len(joined) > 3 else ''}, "
            "whose input is not floating point, so no gradient flows back across it (use fewer stages)")


def layer_names(model: torch.nn.Sequential, begin: int, end: int) -> str:
    """"first-last" of layers [begin, end), each as index.ClassName."""
    names = [f"{i}.{type(model[i]).__name__}" for i in (begin, end - 1)]
    return names[0] if begin == end - 1 else "-".join(names)


class _Partitions:
    """partition_vw, once per distinct VW shape: ED's identical VWs cost one search, not N."""

    def __init__(self, profile: ModelProfile, optimizer: str, network: Network,
                 cancel: threading.Event | None = None) -> None:
        """profile: join_layers'; the partitions are of the model's layers."""
        self.profile, self.optimizer, self.network, self.cancel = profile, optimizer, network, cancel
        self._memo: dict[tuple[object, int], tuple[Partition, list[Gpu]]] = {}

    def __call__(self, group: Sequence[Gpu], nm: int) -> Partition:
        signature, order = vw_signature(group)
        if (signature, nm) not in self._memo:
            found = partition_vw(self.profile, order, nm, self.optimizer, self.network, self.cancel)
            self._memo[signature, nm] = (found, order)
        part, first = self._memo[signature, nm]
        rename = dict(zip(first, order))
        return unjoin(Partition(tuple(dataclasses.replace(c, gpu=rename[c.gpu]) for c in part.stages)), self.profile)


def _emulated_model(job: JobConfig, model: torch.nn.Sequential) -> torch.nn.Sequential:
    """The model the emulated costs are taken at; it may differ from the real one only in sizes."""
    if job.emulated_model_args == dict(job.model.args):
        return model
    emulated = models.structure(job.model, job.base_dir, job.emulated_model_args, dtype=job.train.dtype)
    names = [n for n, _ in model.named_parameters()]
    if len(emulated) != len(model) or [n for n, _ in emulated.named_parameters()] != names:
        raise ConfigError(
            f"cluster.emulate.model_args: {dict(job.cluster.emulate.model_args) if job.cluster and job.cluster.emulate else {}} "
            f"gives {len(emulated)} layers and {len(list(emulated.parameters()))} parameters, the model "
            f"{len(model)} and {len(names)}: the emulated model may differ only in sizes"
        )
    return emulated


@dataclass(frozen=True, slots=True)
class _Candidate:
    rate: float
    wait: float
    nm: int
    policy: str
    parts: list[Partition]
    max_m: list[int]


def make_plan(job: JobConfig, *, cache_dir: str | None = None, cancel: threading.Event | None = None) -> Plan:
    """The best plan for the job: allocation policy (or each, for `auto`), then for each VW the
    exact partition, Nm (`auto`: the smallest that reaches the best predicted throughput), and
    the placement of parameters on shards. Raises ConfigError or PlanError with the reason, and
    JobStopped soon after cancel is set (a large cluster's plan takes seconds)."""
    par = job.parallel
    n, k = par.virtual_workers, par.stages_per_vw
    gpus = cluster_gpus(job)
    types = sorted({g.type for g in gpus})
    cache_dir = cache_dir or default_cache_dir()
    profile = profile_model(job, types, args=job.emulated_model_args, cache_dir=cache_dir)
    model = models.structure(job.model, job.base_dir, dtype=job.train.dtype)
    joined = _joined(job, model, cache_dir)
    solved = join_layers(profile, [i for i, _, _ in joined])
    if k > len(solved.layers):
        raise ConfigError(f"parallel.stages_per_vw: {k} stages but model {profile.model} has {len(profile.layers)} "
                          f"layers{_joined_note(model, joined, len(solved.layers))}")
    optimizer = optimizer_kind(job.train.optimizer.name, job.train.optimizer.momentum)
    costs = StageCosts(job, profile, model, _emulated_model(job, model))
    # The partitioner weighs activation transfers by the emulated network, else the paper's.
    network = costs.network or Network()
    partitions = _Partitions(solved, optimizer, network, cancel)
    # Identical local devices: every policy is the same.
    policies = ["ED"] if job.cluster is None else ["NP", "ED", "HD"] if par.policy == "auto" else [par.policy]

    candidates: list[_Candidate] = []
    reasons: list[str] = []
    for policy in policies:
        if cancel is not None and cancel.is_set():
            raise JobStopped("stopped by request while planning")
        try:
            groups = allocate(policy, gpus, n, k)
        except ConfigError as exc:
            reasons.append(f"{policy}: {exc}")
            continue
        shapes = {vw_signature(g)[0]: g for g in groups}
        limit_of = {sig: max_nm(solved, g, optimizer, network, limit=NM_MEMORY_LIMIT) for sig, g in shapes.items()}
        limits = [limit_of[vw_signature(g)[0]] for g in groups]
        if isinstance(par.nm, int) and 0 < min(limits) < par.nm:
            vw = limits.index(min(limits))
            try:
                partition_vw(solved, groups[vw], par.nm, optimizer, network, cancel)
                detail = ""
            except PlanError as exc:
                detail = f" ({exc})"
            reasons.append(f"{policy}: parallel.nm {par.nm} does not fit: memory allows vw {vw} at most "
                           f"{min(limits)} minibatches in flight{detail}")
            continue
        # nm auto stops at train.steps: more are never in flight, and an nm past it is one the
        # plan would then warn of (its partition differs only by the memory of minibatches never run).
        nms = [par.nm] if isinstance(par.nm, int) else list(range(1, min(min(limits), NM_AUTO_LIMIT, job.train.steps) + 1))
        if min(limits) == 0:
            worst = limits.index(0)
            try:
                partition_vw(solved, groups[worst], 1, optimizer, network, cancel)
            except PlanError as exc:
                reasons.append(f"{policy}: vw {worst}: {exc}")
            continue
        for nm in nms:
            if cancel is not None and cancel.is_set():
                raise JobStopped("stopped by request while planning")
            try:
                parts = [partitions(g, nm) for g in groups]
            except PlanError as exc:
                reasons.append(f"{policy}, nm={nm}: {exc}")
                continue
            rate, wait = costs.predict(parts, nm)
            candidates.append(_Candidate(rate, wait, nm, policy, parts, limits))
    if not candidates:
        raise PlanError("no plan fits: " + "; ".join(reasons[:4]))
    # The smallest nm within 1% of the best throughput (a larger one must beat it by more to be
    # worth its memory and staleness), and at that nm the fastest policy.
    top = max(c.rate for c in candidates)
    best = min((c for c in candidates if c.rate * 1.01 >= top), key=lambda c: (c.nm, -c.rate))

    key_shard = costs.key_shard(best.parts)
    here = local_devices()
    stages = []
    for v, part in enumerate(best.parts):
        transfers = costs.transfers(part, key_shard)
        for q, cut in enumerate(part.stages):
            local = job.cluster is None
            if local:
                device = here[(v * k + q) % len(here)].name  # this machine's own devices, round robin
            elif job.emulate is not None:
                device = "cpu"  # emulation really computes on the CPU (DESIGN §5)
            else:
                device = ""  # a real GPU of that type on its own node: the worker picks its cuda device
            fwd, bwd = costs.task_seconds(cut)
            stages.append(StagePlan(
                v, q, cut.layer_begin, cut.layer_end, cut.gpu.node, cut.gpu.type, device,
                job.emulate is not None and not local, fwd, bwd, *costs.compute_seconds(cut), cut.memory_bytes, cut.gpu.memory_bytes,
                cut.receive_seconds * costs.scale, transfers[q].next_send, transfers[q].prev_send,
                transfers[q].push, transfers[q].pull, layer_names(model, cut.layer_begin, cut.layer_end),
            ))
    whole = stage_memory(profile, 0, len(profile.layers), 0, 1, 1, optimizer)
    warnings = []
    if best.nm > job.train.steps:
        warnings.append(f"parallel.nm {best.nm} > train.steps {job.train.steps}: at most {job.train.steps} "
                        f"minibatches are ever in flight")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen and job.model.init is None:   # frozen at a random draw is rarely what a fine-tune meant
        warnings.append(f"model: {', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''} frozen, and no model.init: "
                        "they stay as their layers' reset_parameters() draw them (a factory's own values, such as "
                        "from_pretrained's, are not kept); give their values as model.init")
    return Plan(
        virtual_workers=n, stages_per_vw=k, nm=best.nm, D=par.D, shards=par.ps_shards, stages=tuple(stages),
        key_shard=key_shard, policy=best.policy,
        predicted_samples_per_second=best.rate, predicted_wait_seconds=best.wait, max_m=tuple(best.max_m),
        dp_only={t: whole <= next(g.memory_bytes for g in gpus if g.type == t) for t in types},
        warnings=tuple(warnings),
    )


def resolved_job(job: JobConfig, plan: Plan) -> ResolvedJob:
    """The job with the plan's choices (nm) filled in, as the stages receive it."""
    return resolve(job, plan.nm)
