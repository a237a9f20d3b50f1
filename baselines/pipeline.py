"""`parallel.mode: torch-pipeline`: one pipeline of parallel.stages_per_vw stages run by
torch.distributed.pipelining (PipelineStage with ScheduleGPipe, or Schedule1F1B with
`parallel.schedule: 1f1b`), one process per stage.

The layer split and the devices are the planner's for VW 0 (`make_plan(job)`), so the baseline
runs the same partition HetPipe would. The one pipeline reads the whole §8 data stream (as one
VW). Each minibatch is split into `parallel.microbatches` equal micro-batches; the loss of each is
its mean and torch scales the gradients by 1/microbatches, so the update is the minibatch's. With
emulated GPUs every micro-batch's forward and backward on a stage are padded to the stage's
emulated time divided by the number of micro-batches.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from hetpipe.config import ConfigError, JobConfig, with_overrides
from hetpipe import faults, models, outputs, weight_files
from hetpipe.loss_scale import clip_coefficient
from hetpipe.optim import autocast, squared_norm, to_compute
from baselines import common

SCHEDULE_NAMES = {"hetpipe": "gpipe", "gpipe": "gpipe", "1f1b": "1f1b"}  # unset (hetpipe) means GPipe


def pipeline_plan(job: JobConfig, *, cache_dir: str | None = None) -> tuple[str, list[Any]]:
    """(schedule, VW 0's StagePlans); ConfigError for what torch's schedules cannot run."""
    from coordinator.planner import PlanError, make_plan

    schedule = SCHEDULE_NAMES[job.parallel.schedule]
    k = job.parallel.stages_per_vw
    try:
        plan = make_plan(job, cache_dir=cache_dir)
    except PlanError as exc:
        raise ConfigError(f"parallel: {exc}") from None
    stages = plan.vw_stages(0)
    if len(stages) != k:
        raise ConfigError(f"parallel.mode torch-pipeline: the plan has {len(stages)} stages, not {k}")
    return schedule, stages


def backend_for(devices: list[str]) -> str:
    """nccl when every stage has a GPU of its own; otherwise gloo, with boundaries staged through
    host memory (gloo sends CPU tensors only; nccl cannot pair two ranks on one GPU)."""
    distinct = len(set(devices)) == len(devices)
    return "nccl" if distinct and all(d.startswith("cuda") for d in devices) else "gloo"


def run_pipeline(job: JobConfig, *, quiet: bool = False, cache_dir: str | None = None) -> dict[str, Any]:
    """Trains job as one torch.distributed.pipelining pipeline; writes model.safetensors and summary.json."""
    schedule, stages = pipeline_plan(job, cache_dir=cache_dir)
    out_dir = common.prepare_out_dir(job)
    k = len(stages)
    slow = faults.from_env().slowdown(0)  # one pipeline: VW 0
    devices = [s.device for s in stages]
    backend = backend_for(devices)
    ranks = [{"rank": q, "node": s.node, "gpu": s.gpu, "label": s.label, "device": s.device,
              "layers": [s.layer_begin, s.layer_end], "forward_seconds": s.forward_seconds,
              "backward_seconds": s.backward_seconds} for q, s in enumerate(stages)]
    spec = {"job_json": job.to_json(), "backend": backend, "ranks": ranks, "schedule": schedule}
    names = [f"rank {q} (stage {q}, layers [{s.layer_begin}, {s.layer_end}), {s.label} on {s.node})"
             for q, s in enumerate(stages)]
    step = sum(s.forward_seconds + s.backward_seconds for s in stages) * slow
    group = common.WorkerGroup("torch-pipeline", out_dir, names, spec, common.timeout_for(step))
    emulated = any(s.emulated for s in stages)
    common.run_group(group, total_steps=job.train.steps, samples_per_step=job.data.batch_size, quiet=quiet,
                     emulated=emulated)
    results = [group.result(q) for q in range(k)]
    weight_files.write_from(out_dir, [group.work / f"stage{q}.safetensors" for q in range(k)], job.output.max_shard_bytes)
    wall = results[0]["wall_seconds"]
    fields: dict[str, Any] = {
        "steps": job.train.steps,
        "samples_per_second": job.train.steps * job.data.batch_size / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        "final_loss": results[-1]["final_loss"],
        "virtual_workers": 1,
        "stages_per_vw": k,
        "nm": 1,
        "D": 0,
        "emulated": emulated,
        "wait_seconds": 0.0,  # no parameter server: nothing is pulled
        "idle_seconds": sum(max(0.0, r["wall_seconds"] - r["busy_seconds"]) for r in results),
        "compute_seconds": sum(r["busy_seconds"] for r in results),
        "plan": [{"vw": 0, "stage": q, "node": s.node, "gpu": s.label, "device": s.device,
                  "layers": [s.layer_begin, s.layer_end]} for q, s in enumerate(stages)],
        **outputs.work_fields(job),
        "schedule": schedule,   # torch's name for it
        "backend": backend,
    }
    return outputs.write_summary(out_dir, fields)


# ---- worker -----------------------------------------------------------------------------------


class _BackwardStart(torch.autograd.Function):
    """Identity on the stage's output; its backward marks when the stage's backward begins."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, owner: _Timed) -> torch.Tensor:  # type: ignore[override]
        ctx.owner = owner
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.owner.backward_started()
        return grad, None


class _Timed(nn.Module):
    """The stage's layers, timed per micro-batch and padded to emulated times (0: no padding).
    The backward ends when every parameter of the stage has its gradient of this backward.
    Inputs move to the compute device; outputs to the io device the pipeline sends from (the host,
    with gloo), except the last stage's, which the loss reads where it was computed."""

    def __init__(self, layers: nn.Sequential, forward_s: float, backward_s: float, padder: faults.Padder,
                 compute: torch.device, io: torch.device | None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layers = layers
        self.compute, self.io = compute, io
        self.dtype = dtype   # train.precision's compute dtype (None: train.dtype throughout)
        self.forward_s, self.backward_s, self.padder = forward_s, backward_s, padder
        self.busy = 0.0
        self._bwd_started = 0.0
        self._params = [p for _, p in models.trainable(layers)]
        self._padding = forward_s > 0 or backward_s > 0 or padder.high > 0
        if self._params:
            torch.autograd.graph.register_multi_grad_hook(self._params, self._backward_done, mode="all")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        started = time.time()
        with autocast(self.dtype, self.compute.type):   # as HetPipe's stages, boundary included
            out = to_compute(self.dtype, self.layers(x.to(self.compute)))
        if self.io is not None:
            out = out.to(self.io)
        if self._padding:
            self.padder.pad(started, self.forward_s)
        self.busy += time.time() - started
        return _BackwardStart.apply(out, self) if out.requires_grad else out

    def backward_started(self) -> None:
        self._bwd_started = time.time()
        if not self._params:  # nothing marks the end: pad here
            self._backward_done(())

    def _backward_done(self, grads: Any) -> None:
        if self._padding:
            self.padder.pad(self._bwd_started, self.backward_s)
        self.busy += time.time() - self._bwd_started


def _clip(params: list[nn.Parameter], max_norm: float, device: torch.device) -> None:
    """train.max_grad_norm over the whole pipeline, as HetPipe's stages agree on it: every rank's
    squared gradient norm summed by an allreduce, then clip_grad_norm_'s coefficient (Megatron
    clips its pipeline stages the same way). A rank without weights adds 0."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    norm_sq = squared_norm(grads).to(device)
    dist.all_reduce(norm_sq)
    coefficient = clip_coefficient(float(norm_sq), max_norm)
    if coefficient != 1.0 and grads:
        torch._foreach_mul_(grads, coefficient)


def worker(spec: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hetpipe import datasets, model_init
    from hetpipe.optim import compute_dtype, compute_loss, for_loss, make_optimizer, step_at
    from hetpipe.reference import minibatch

    job = JobConfig.from_json(spec["job_json"])
    k = int(spec["world_size"])
    m = job.parallel.microbatches
    me = spec["ranks"][rank]
    device = torch.device(me["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    io = device if spec["backend"] == "nccl" else torch.device("cpu")
    begin, end = me["layers"]
    layers = models.build_layers(job, begin, end, device=str(device))
    if job.model.init is not None:
        model_init.initialise(job, layers)
    params = [p for _, p in models.trainable(layers)]
    optimizer = make_optimizer(params, job.train.optimizer) if params else None
    first, last = rank == 0, rank == k - 1
    dtype = compute_dtype(job.train.precision)
    timed = _Timed(layers, float(me["forward_seconds"]) / m, float(me["backward_seconds"]) / m,
                   faults.Padder(faults.from_env(), 0, (job.train.seed, "torch-pipeline", rank)),
                   device, None if last or io == device else io, dtype)
    order = with_overrides(job, parallel={"virtual_workers": 1})  # one pipeline reads the whole stream
    dataset = datasets.training_set(job) if (first or last) else None

    common.init_process_group(spec, rank)
    stage = PipelineStage(timed, rank, k, io)
    kind = job.train.loss

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return compute_loss(kind, for_loss(dtype, output), target)

    schedule_type = Schedule1F1B if spec["schedule"] == "1f1b" else ScheduleGPipe
    schedule = schedule_type(stage, m, loss_fn=loss_fn, scale_grads=True)
    progress = common.Progress(spec["work_dir"], rank)
    step_losses: list[float] = []
    dist.barrier()
    start = time.monotonic()
    for p in range(1, job.train.steps + 1):
        x = y = None
        if dataset is not None:
            x, y = minibatch(order, dataset, p, 0)
            x, y = x.to(io), y.to(device)
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if job.train.max_grad_norm:
            _clip(params, job.train.max_grad_norm, io)
        if optimizer is not None:
            step_at(optimizer, job.train, p)
        if last:
            step_losses.append(sum(float(v.detach()) for v in losses) / len(losses))
        progress.write(p, step_losses[-1] if step_losses else float("nan"), force=p == job.train.steps)
    dist.barrier()
    wall = time.monotonic() - start
    common.save_weights(layers, f"{spec['work_dir']}/stage{rank}.safetensors")
    common.write_result(spec["work_dir"], rank, {
        "wall_seconds": wall, "busy_seconds": timed.busy, "steps": job.train.steps,
        "final_loss": common.recent_mean(step_losses) if last else float("nan"),
    })
    dist.barrier()
    dist.destroy_process_group()
