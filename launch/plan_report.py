"""What `hetpipe plan` prints: the plan's table, and Pal et al.'s DP-vs-hybrid projection."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hetpipe import outputs
from hetpipe.config import ConfigError, JobConfig, with_overrides
from hetpipe.units import format_bytes, format_seconds
from coordinator.planner import Plan, PlanError, make_plan
from coordinator.planner import projection
from coordinator.planner.cache import default_cache_dir
from coordinator.planner.memory import optimizer_kind, stage_memory
from coordinator.planner.plan import NM_MEMORY_LIMIT
from coordinator.planner.profile import profile_model


def planned_su_mp(job: JobConfig, plan: Plan) -> float:
    """SU^M for M = stages_per_vw: the plan's predicted samples/s per VW over a one-stage plan's
    (on the one GPU the planner picks). A HetPipe VW pipelines nm minibatches with stale weights,
    so this is an upper bound on the per-step speedup the paper means: staleness is not counted."""
    if plan.stages_per_vw < 2:
        raise ConfigError("su_mp: missing, and the job's plan has 1 stage per VW to take it from")
    try:
        single = make_plan(with_overrides(job, parallel={"virtual_workers": 1, "stages_per_vw": 1, "nm": 1}))
    except (ConfigError, PlanError) as exc:
        raise ConfigError(f"su_mp: missing, and the job has no one-stage plan to compare with ({exc})") from None
    return plan.predicted_samples_per_second / plan.virtual_workers / single.predicted_samples_per_second


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def measured(job: JobConfig, plan: Plan, summary: dict[str, Any]) -> float | None:
    """The samples/s of the run a summary.json holds, if that run had this plan's shape (its
    VWs, stages and their layers and GPUs, nm, D) and did the same work per step (model, batch
    size, precision, dtype, an emulated cluster's task times, schedule): another run's speed says
    nothing of this one."""
    ran = [(s.get("vw"), s.get("stage"), s.get("gpu"), s.get("layers")) for s in summary.get("plan") or []]
    planned = [(s.vw, s.stage, s.label, [s.layer_begin, s.layer_end]) for s in plan.stages]
    work = {"nm": plan.nm, "D": plan.D, **outputs.work_fields(job)}   # as summary.json records them
    same = ran == planned and {k: summary.get(k) for k in work} == work
    value = summary.get("samples_per_second")
    return float(value) if same and isinstance(value, (int, float)) else None


@dataclasses.dataclass(frozen=True, slots=True)
class HostMemory:
    """What a local run holds of this machine's memory, at least: its processes that compute on
    this machine's CPU (HetPipe's stages and shards, or ddp's ranks)."""

    need_bytes: int             # their tensors together
    holders: str                # who holds them: "its 2 stages computing on this machine's CPU ..."
    largest: str | None         # the one of them that needs the most (None: nothing computes here)
    largest_bytes: int
    emulated: bool              # they stand for emulated GPUs
    total_bytes: int            # this machine's memory, and what of it is available now
    available_bytes: int

    def describe(self) -> str:
        return (f"{self.holders} hold at least {format_bytes(self.need_bytes)} of memory (the largest, "
                f"{self.largest}, {format_bytes(self.largest_bytes)}); this machine has "
                f"{format_bytes(self.total_bytes)}, {format_bytes(self.available_bytes)} of it available")


def _real_model_bytes(job: JobConfig, begin: int, end: int | None, stage: int, stages: int, nm: int) -> int:
    """What the memory model says layers [begin, end) hold of the model that really computes
    (model.args, not cluster.emulate.model_args); end None: to the last layer."""
    profile = profile_model(job, (), args=job.model.args, cache_dir=default_cache_dir())
    optimizer = optimizer_kind(job.train.optimizer.name, job.train.optimizer.momentum)
    return stage_memory(profile, begin, len(profile.layers) if end is None else end, stage, stages, nm, optimizer)


def host_memory(job: JobConfig, plan: Plan) -> HostMemory:
    """The memory a local run of the plan holds on this machine: every stage that computes on
    the CPU (an emulated GPU's stage does: its capacity is only accounting, DESIGN §5) needs what
    the memory model says of the model that really computes, and the shards hold the trained
    weights once more. Each process's own Python and torch are not counted."""
    import psutil

    from hetpipe import models

    cpu = [s for s in plan.stages if s.device == "cpu"]
    needs: list[int] = []
    if cpu and job.emulated_model_args != dict(job.model.args):   # the plan's bytes are the emulated model's
        needs = [_real_model_bytes(job, s.layer_begin, s.layer_end, s.stage, len(plan.vw_stages(s.vw)), plan.nm)
                 for s in cpu]
    else:
        needs = [s.memory_bytes for s in cpu]
    weights = 0
    if cpu and job.parallel.started_shards:
        model = models.structure(job.model, job.base_dir, dtype=job.train.dtype)
        weights = sum(p.numel() * p.element_size() for _, p in models.trainable(model))
    memory = psutil.virtual_memory()
    top = max(range(len(cpu)), key=needs.__getitem__) if cpu else None
    emulated = any(s.emulated for s in cpu)
    holders = f"its {_count(len(cpu), 'stage')} computing on this machine's CPU{' (emulated GPUs)' if emulated else ''} " \
              "and its shards"
    largest = None
    if top is not None:
        s = cpu[top]
        largest = f"stage {s.stage} of vw {s.vw}, layers [{s.layer_begin}, {s.layer_end})"
    return HostMemory(sum(needs) + weights, holders, largest, needs[top] if top is not None else 0, emulated,
                      int(memory.total), int(memory.available))


def ddp_host_memory(job: JobConfig) -> HostMemory:
    """The memory `parallel.mode: ddp` holds on this machine: the whole model, its gradients and
    optimizer state on every rank that computes on the CPU (an emulated GPU's rank does)."""
    import psutil

    from baselines.ddp import select_devices

    devices = select_devices(job)
    cpu = [r for r in devices.ranks if r.device == "cpu"]
    need = 0
    if cpu:
        # select_devices sizes the emulated model, which the ranks' GPUs are checked against.
        need = _real_model_bytes(job, 0, None, 0, 1, 1) if job.emulated_model_args != dict(job.model.args) \
            else devices.model_bytes
    memory = psutil.virtual_memory()
    emulated = any(r.label.endswith("(emulated)") for r in cpu)
    holders = f"its {_count(len(cpu), 'rank')} computing on this machine's CPU{' (emulated GPUs)' if emulated else ''}, " \
              "each with the whole model,"
    return HostMemory(need * len(cpu), holders, "rank 0" if cpu else None, need, emulated,
                      int(memory.total), int(memory.available))


def ddp_layout(job: JobConfig) -> tuple[str, dict[str, Any]]:
    """What `parallel.mode: ddp` runs instead of the HetPipe plan: one rank per device, each with
    the whole model, the gradients averaged by allreduce; as text and as JSON."""
    from baselines.ddp import select_devices

    devices = select_devices(job)
    lines = [f"parallel.mode ddp: {_count(len(devices.ranks), 'rank')}, each the whole model ({devices.layers} layers, "
             f"{format_bytes(devices.model_bytes)}), gradients averaged by allreduce ({devices.backend}); no pipeline "
             "and no parameter servers" + (" (emulated GPUs)" if devices.emulated else "")]
    lines += [f"  rank {r.rank}  node {r.node}  {r.label}  {r.device}  needs {format_bytes(r.memory_bytes)} of "
              f"{format_bytes(r.capacity_bytes)}" for r in devices.ranks]
    lines += [f"  left out: {why}" for why in devices.left_out]
    host = ddp_host_memory(job)
    if host.largest is not None and host.need_bytes > host.available_bytes:
        refused = ": `hetpipe run` refuses it" if host.need_bytes > host.total_bytes else ""
        lines.append(f"note: a `hetpipe run` of it here: {host.describe()}{refused}")
    return "\n".join(lines), {"mode": "ddp", "backend": devices.backend, "layers": devices.layers,
                              "model_bytes": devices.model_bytes, "emulated": devices.emulated,
                              "ranks": [dataclasses.asdict(r) for r in devices.ranks], "left_out": list(devices.left_out)}


def plan_table(job: JobConfig, plan: Plan, measured: float | None, summary_path: Path) -> str:
    """The plan, a row per stage, and its predicted throughput beside a measured one (from
    summary_path) when a run has left one."""
    bound = min(plan.max_m)
    shards = job.parallel.started_shards
    lines = [
        f"policy {plan.policy}, {_count(plan.virtual_workers, 'virtual worker')} x {_count(plan.stages_per_vw, 'stage')}, "
        f"nm {plan.nm} (memory allows up to {bound}{'+' if bound >= NM_MEMORY_LIMIT else ''}), D {plan.D}, "
        f"s_global {plan.s_global} minibatches, "
        + (_count(shards, 'ps shard') if shards else "no ps shard (" + (
            "one VW" if plan.virtual_workers == 1 else f"mode {job.parallel.mode}") + ": parallel.ps_shards is not used)")
        + (" (emulated GPUs)" if plan.emulated else "") + _modes(job)
    ]
    network = job.emulate.network if job.emulate else None
    if network is not None:
        lines.append(f"emulated network: {network.intra_node_gbs:g} GB/s in a node, {network.inter_node_gbs:g} GB/s "
                     f"between nodes, {network.latency_s * 1e6:g} us latency; send and push are per transfer")
    times = ("forward", "backward", "receive") + (("send", "push") if network else ())
    header = f"{'vw':>3} {'stage':>5}  {'node':<8}{'gpu':<24}{'layers':<34}{'memory (need / have)':>24}"
    lines.append(header + "".join(f"{t:>10}" for t in times) + "   (times per minibatch)")
    for s in plan.stages:
        memory = f"{format_bytes(s.memory_bytes)} / {format_bytes(s.capacity_bytes)}"
        layers = f"[{s.layer_begin},{s.layer_end}) {s.layer_names}"
        values = [s.predicted_forward_seconds, s.predicted_backward_seconds, s.receive_seconds]
        if network:
            values += [s.next_send_seconds, s.push_seconds]
        lines.append(f"{s.vw:>3} {s.stage:>5}  {s.node:<8}{s.label:<24}{layers:<34}{memory:>24}"
                     + "".join(f"{format_seconds(v):>10}" for v in values))
    lines.append(f"max nm per vw (memory): {list(plan.max_m)}")
    line = f"predicted throughput: {plan.predicted_samples_per_second:.1f} samples/s"
    if measured is not None:
        ratio = plan.predicted_samples_per_second / measured if measured else float("nan")
        line += f"; measured {measured:.1f} samples/s in {summary_path} (predicted/measured {ratio:.2f})"
    lines.append(line)
    return "\n".join(lines + plan_notes(job, plan))


def _modes(job: JobConfig) -> str:
    """The schedule and the sync mode, where they are not HetPipe's own."""
    par, said = job.parallel, []
    if par.schedule != "hetpipe":
        said.append(f"schedule {par.schedule} ({par.microbatches} micro-batch{'es' if par.microbatches != 1 else ''})")
    if par.sync != "wsp" and par.virtual_workers > 1:
        args = ", ".join(f"{k}: {v}" for k, v in par.sync_args.items())
        said.append(f"sync {par.sync}" + (f" ({args})" if args else ""))
    return "".join(f", {s}" for s in said)


def plan_notes(job: JobConfig, plan: Plan) -> list[str]:
    """What the plan's table and numbers leave unsaid, for the text and for --json alike."""
    notes = []
    n = plan.virtual_workers
    if n > 1 and job.parallel.mode == "hetpipe" and job.parallel.sync in ("wsp", "quorum"):
        # Exact for SGD at D 0 and nm 1; Adam's steps are normalised, so no such factor holds for it.
        alike = (f", as far as one VW at {n} x train.optimizer.lr would (ddp averages its {n} ranks' gradients: "
                 f"its lr is {n} x this one)") if job.train.optimizer.name == "sgd" else ""
        notes.append(f"the shards add up the {n} VWs' updates: each wave moves w_global by every VW's step{alike}")
    for gpu, fits in sorted(plan.dp_only.items()):
        if not fits:
            notes.append(f"{gpu}: the whole model does not fit on one GPU; data parallelism alone cannot use it")
    if job.parallel.schedule != "hetpipe":  # the simulator models L1-L4, not the micro-batch schedules
        notes.append(f"the prediction is schedule hetpipe's at nm {plan.nm}: schedule {job.parallel.schedule} is not "
                     "simulated")
    processes = len(plan.stages) + job.parallel.started_shards
    cores = os.cpu_count() or 1
    if job.cluster is None and all(s.device == "cpu" for s in plan.stages) and processes > cores:
        notes.append(f"this machine's {_count(cores, 'CPU core')} run all {processes} processes: each stage's times "
                     "above are its own with the CPU to itself (its memory is its share of the machine's), so a run "
                     "here measures less than predicted")
    host = host_memory(job, plan) if job.parallel.mode == "hetpipe" else None   # a baseline's is its own
    if host is not None and host.largest is not None and host.need_bytes > host.available_bytes:
        refused = ": `hetpipe run` refuses it" if host.need_bytes > host.total_bytes else ""
        notes.append(f"a `hetpipe run` of this plan here: {host.describe()}{refused}")
    if job.parallel.mode == "torch-pipeline":
        notes.append(f"parallel.mode torch-pipeline runs vw 0's stages above as one torch.distributed.pipelining "
                     f"pipeline ({job.parallel.microbatches} micro-batches; no parameter servers); the prediction is "
                     "HetPipe's")
    return notes


def plan_json(job: JobConfig, plan: Plan) -> dict[str, Any]:
    """`hetpipe plan --json`: the plan, what the job runs it as, and the text's notes."""
    par = job.parallel
    return {**plan.to_dict(), "ps_shards": job.parallel.started_shards, "mode": par.mode, "schedule": par.schedule,
            "microbatches": par.microbatches, "sync": par.sync, "sync_args": dict(par.sync_args),
            "notes": plan_notes(job, plan)}


def projection_table(inputs: projection.Inputs, job: JobConfig,
                     plan: Plan) -> tuple[str, list[dict[str, object]]]:
    """The projection's table and its rows as JSON; ConfigError names what is wrong with inputs."""
    source = "su_mp from the projection file"
    if not inputs.su_mp:
        k = plan.stages_per_vw
        su = planned_su_mp(job, plan)
        inputs = dataclasses.replace(inputs, su_mp={k: su})
        source = (f"su_mp {k}: {su:.3f} from the plan's predicted throughput, {k}-stage VW over one stage "
                  f"(pipelined, staleness not counted)")
    rows = projection.project(inputs)
    lines = [f"projection (Pal et al. 2019, Eq. 3-6){' for ' + inputs.model if inputs.model else ''}: "
             f"mini-batch {inputs.mini_batch} per device; {source}",
             f"{'devices':>7} {'DP x MP':>9} {'DP-only SU':>11} {'hybrid SU':>10} {'hybrid/DP':>10}  recommendation"]
    for r in rows:
        lines.append(f"{r.devices:>7} {f'{r.n} x {r.m}':>9} {r.su_dp:>11.2f} {r.su_hybrid:>10.2f} {r.ratio:>10.3f}"
                     f"  {r.strategy}")
    table = [{"devices": r.devices, "n": r.n, "m": r.m, "su_dp": r.su_dp, "su_hybrid": r.su_hybrid,
              "ratio": r.ratio, "recommendation": r.strategy} for r in rows]
    return "\n".join(lines), table
