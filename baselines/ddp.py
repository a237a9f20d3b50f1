"""`parallel.mode: ddp`: Horovod-style synchronous allreduce data parallelism.

One worker process per device, on the devices where the whole model fits (the planner's memory
model, DESIGN §4: `stage_memory` of all layers as one stage with one minibatch in flight); the
others are reported and left out, as the paper does with the RTX 2060 for ResNet-152. Rank r
reads the minibatches of VW r of the §8 data order with N = the world size. Every step: forward
and backward on the rank's minibatch, allreduce-average of the gradients, optimizer step. With
emulated GPUs each step's computation is padded to the GPU type's time for the whole model, so
the slowest device paces the allreduce as on real hardware.

Since the gradients are averaged while HetPipe's shards sum the VWs' updates, ddp with learning
rate N*lr equals HetPipe with N VWs, Nm=1, D=0 and lr (plain SGD); with dropout too, since rank
r's forward of p draws its masks as VW r's lone stage does (hetpipe.draws).

A bf16 job whose ranks reduce over NCCL allreduces its gradients in bf16, through torch DDP's
`bf16_compress_hook` (`allreduce_hook`), as a torch DDP user of bf16 would register it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hetpipe.catalog import CATALOG
from hetpipe.config import ConfigError, JobConfig, with_overrides
from hetpipe.network import ring_allreduce_seconds
from hetpipe import faults, outputs, weight_files
from hetpipe.units import format_bytes
from baselines import common

# A DDP communication hook: (state, bucket) -> a future of the bucket's reduced gradients.
CommHook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class DdpRank:
    rank: int
    node: str
    gpu: str            # catalog type, or "cpu"/"cuda" for this machine's own devices
    label: str          # "titan-v (emulated)" or the real device
    device: str         # where it computes: "cpu" or "cuda:N"
    step_seconds: float  # emulated forward+backward time of the whole model (0: no padding)
    memory_bytes: int    # what the whole model needs (planner's memory model)
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class DdpDevices:
    ranks: tuple[DdpRank, ...]
    left_out: tuple[str, ...]   # one line per GPU type that cannot hold the model
    model_bytes: int
    layers: int
    emulated: bool
    allreduce_seconds: float = 0.0  # emulated network: one gradient allreduce (0 = not emulated)

    @property
    def backend(self) -> str:
        devices = [r.device for r in self.ranks]
        # nccl needs one distinct GPU per rank; otherwise gloo (CUDA tensors go through the CPU).
        if all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices):
            return "nccl"
        return "gloo"


def allreduce_hook(backend: str, precision: str) -> CommHook | None:
    """The DDP communication hook the gradients' allreduce goes through: torch's bf16_compress_hook
    for a bf16 job over NCCL (half the bytes of an fp32 allreduce; NCCL reduces bf16 natively),
    else None: a plain allreduce in the gradients' own dtype. Gloo stays plain (its sums run on the
    CPU, not on the GPU), and so does an fp32 job (fp16 is refused)."""
    if backend != "nccl" or precision != "bf16":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook


def allreduce_mean(flat: torch.Tensor, n: int, *, hook: CommHook | None = None,
                   through_cpu: bool = False) -> torch.Tensor:
    """The mean over the n ranks of every rank's flat gradients (flat itself, updated in place,
    unless it went through host memory)."""
    import torch.distributed as dist

    if hook is not None:
        # A one-tensor tuple is a bucket to torch's compress hooks (their functional path): the
        # hook divides by n, reduces in bf16 and copies the result back into flat.
        result: torch.Tensor = hook(None, (flat,)).wait()
        return result
    if through_cpu:
        host = flat.cpu()
        dist.all_reduce(host)
        flat = host.to(flat.device)
    else:
        dist.all_reduce(flat)
    flat /= n  # the average, as Horovod does
    return flat


def select_devices(job: JobConfig, *, cache_dir: str | None = None) -> DdpDevices:
    """The devices ddp trains on (one rank each) and the ones it leaves out, with the reason.

    With a cluster spec: every GPU of it, in order, where the whole model fits. Without one:
    parallel.virtual_workers workers on this machine's devices (cuda:N round robin, else the CPU).
    Raises ConfigError when no device can hold the model.
    """
    from coordinator.planner import cluster_gpus, default_cache_dir
    from coordinator.planner.cluster import Gpu
    from coordinator.planner.memory import optimizer_kind, stage_memory
    from coordinator.planner.profile import profile_model

    emulate = job.emulate
    cuda = torch.cuda.device_count()
    gpus: list[Gpu] = cluster_gpus(job, job.parallel.virtual_workers)
    types = sorted({g.type for g in gpus})
    # Emulated times are derived from the meta-device profile (cheap); without emulation only the
    # memory structure is needed, so no type is timed.
    timed = [t for t in types if t in CATALOG] if emulate is not None else []
    profile = profile_model(job, timed, args=job.emulated_model_args, cache_dir=cache_dir or default_cache_dir())
    layers = len(profile.layers)
    optimizer = optimizer_kind(job.train.optimizer.name, job.train.optimizer.momentum)
    need = stage_memory(profile, 0, layers, 0, 1, 1, optimizer)

    step: dict[str, float] = {}
    for t in types:
        if emulate is None or t not in CATALOG:
            step[t] = 0.0
        elif emulate.fixed_times:
            step[t] = emulate.forward_seconds + emulate.backward_seconds  # fixed task times (DESIGN §8)
        else:
            step[t] = sum(layer.forward_seconds[t] + layer.backward_seconds[t]
                          for layer in profile.layers) * emulate.time_scale

    ranks: list[DdpRank] = []
    refused: dict[str, list[Gpu]] = {}
    for g in gpus:
        if need > g.memory_bytes:
            refused.setdefault(g.type, []).append(g)
            continue
        r = len(ranks)
        device = f"cuda:{r % cuda}" if (g.type == "cuda" and cuda) else "cpu"
        emulated = emulate is not None and g.type in CATALOG
        ranks.append(DdpRank(r, g.node, g.type, f"{g.type} (emulated)" if emulated else device, device,
                             step[g.type], need, g.memory_bytes))
    left_out = tuple(
        f"{t} x{len(gs)}: the model needs {format_bytes(need)}, the GPU has {format_bytes(gs[0].memory_bytes)}: "
        "left out, as the paper does"
        for t, gs in refused.items()
    )
    if not ranks:
        raise ConfigError(
            f"parallel.mode ddp: no device can hold the whole {job.model.name} at batch {job.data.batch_size} "
            f"({format_bytes(need)} with a {optimizer} optimizer): " + "; ".join(left_out)
            + ". Data parallelism needs the whole model on every GPU; parallel.mode hetpipe splits it."
        )
    allreduce = 0.0
    if emulate is not None and emulate.network is not None:
        # A ring over the ranks: its slowest hop is between nodes as soon as it spans two.
        nodes = sorted({r.node for r in ranks})
        link = emulate.network.link(nodes[0], nodes[-1], emulate.time_scale)
        # The gradients in train.dtype; a bf16 job's in bf16, as bf16_compress_hook sends them over NCCL.
        itemsize = getattr(torch, job.train.dtype).itemsize
        grad_bytes = sum(layer.param_bytes for layer in profile.layers) * (
            torch.bfloat16.itemsize if job.train.precision == "bf16" else itemsize) // itemsize
        allreduce = ring_allreduce_seconds(grad_bytes, len(ranks), link)
    return DdpDevices(tuple(ranks), left_out, need, layers,
                      emulated=any(r.label.endswith("(emulated)") for r in ranks), allreduce_seconds=allreduce)


def run_ddp(job: JobConfig, *, quiet: bool = False, cache_dir: str | None = None) -> dict[str, Any]:
    """Trains job with allreduce data parallelism; writes model.safetensors and summary.json."""
    devices = select_devices(job, cache_dir=cache_dir)
    for line in devices.left_out:
        print(f"hetpipe: ddp: {line}", file=sys.stderr)
    out_dir = common.prepare_out_dir(job)
    n = len(devices.ranks)
    step = max(r.step_seconds * faults.from_env().slowdown(r.rank) for r in devices.ranks)
    names = [f"rank {r.rank} ({r.label} on {r.node})" for r in devices.ranks]
    hook = allreduce_hook(devices.backend, job.train.precision)
    spec = {"job_json": job.to_json(), "backend": devices.backend, "ranks": [asdict(r) for r in devices.ranks],
            "allreduce_seconds": devices.allreduce_seconds}
    group = common.WorkerGroup("ddp", out_dir, names, spec, common.timeout_for(step + devices.allreduce_seconds))
    common.run_group(group, total_steps=job.train.steps, samples_per_step=n * job.data.batch_size,
                     quiet=quiet, emulated=devices.emulated)
    results = [group.result(r) for r in range(n)]
    weight_files.write_from(out_dir, [group.work / "weights.safetensors"], job.output.max_shard_bytes)
    wall = results[0]["wall_seconds"]
    samples = job.train.steps * n * job.data.batch_size
    fields: dict[str, Any] = {
        "steps": job.train.steps,
        "samples_per_second": samples / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
        "final_loss": results[0]["final_loss"],
        "virtual_workers": n,
        "stages_per_vw": 1,
        "nm": 1,
        "D": 0,
        "emulated": devices.emulated,
        "wait_seconds": sum(r["wait_seconds"] for r in results),   # time in allreduce, all ranks
        "compute_seconds": sum(r["compute_seconds"] for r in results),
        "plan": [{"vw": r.rank, "stage": 0, "rank": r.rank, "node": r.node, "gpu": r.label, "device": r.device,
                  "layers": [0, devices.layers], "memory_bytes": r.memory_bytes,
                  "capacity_bytes": r.capacity_bytes} for r in devices.ranks],
        "left_out": list(devices.left_out),
        "backend": devices.backend,
        "allreduce_hook": hook.__name__ if hook is not None else None,
        "allreduce_seconds": devices.allreduce_seconds,
        **outputs.work_fields(job),
        **{k: v for k, v in results[0].items() if k.startswith("eval_")},
    }
    if "eval_loss" in results[0]:  # the final evaluation's line, as HetPipe's eval.jsonl ends
        outputs.append_evals(out_dir, [{
            "id": (job.train.steps - 1) // job.eval.every + 1 if job.eval and job.eval.every else 1,
            "final": True, "minibatches": job.train.steps, "samples": samples, "seconds": wall,
            "rows": results[0]["eval_rows"], "loss": results[0]["eval_loss"],
            "accuracy": results[0]["eval_accuracy"]}])
    return outputs.write_summary(out_dir, fields)


# ---- worker -----------------------------------------------------------------------------------


def worker(spec: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist

    from hetpipe import datasets, models
    from hetpipe.draws import forward_draws
    from hetpipe.optim import autocast, compute_dtype, compute_loss, for_loss, make_optimizer, step_at
    from hetpipe.reference import initial_model, minibatch

    job = JobConfig.from_json(spec["job_json"])
    n = int(spec["world_size"])
    order = with_overrides(job, parallel={"virtual_workers": n})  # rank r reads VW r's minibatches
    me = spec["ranks"][rank]
    device = torch.device(me["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = initial_model(job).to(device)
    dataset = datasets.training_set(job)
    params = [p for _, p in models.trainable(model)]
    buffers = list(model.buffers())
    optimizer = make_optimizer(params, job.train.optimizer)
    through_cpu = spec["backend"] == "gloo" and device.type == "cuda"
    hook = allreduce_hook(spec["backend"], job.train.precision)
    pad_s = float(me["step_seconds"])
    padder = faults.Padder(faults.from_env(), rank, (job.train.seed, "ddp"))
    padding = pad_s > 0 or padder.high > 0
    allreduce_s = float(spec.get("allreduce_seconds", 0.0))

    every = job.eval.every if job.eval is not None else 0
    out_dir = Path(spec["work_dir"]).parent  # common.WORK_DIR is under output.dir
    common.init_process_group(spec, rank)
    progress = common.Progress(spec["work_dir"], rank)
    losses: list[float] = []
    wait = compute = 0.0
    dtype = compute_dtype(job.train.precision)
    draws = forward_draws(job.train.seed, rank, 0, str(device))
    dist.barrier()
    start = time.monotonic()
    for p in range(1, job.train.steps + 1):
        started = time.time()
        for b in buffers:  # like torch DDP: every rank's forward uses rank 0's buffers (BatchNorm stats)
            dist.broadcast(b, 0)
        x, y = minibatch(order, dataset, p, rank)
        # Dropout's masks as HetPipe's VW `rank` draws them: each rank its own, the same every run.
        with draws((p,)), autocast(dtype, device.type):   # train.precision as the stages apply it; weights stay in train.dtype
            loss = compute_loss(job.train.loss, for_loss(dtype, model(x.to(device))), y.to(device))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(w) if g is None else g).reshape(-1) for w, g in zip(params, grads)])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compute += time.time() - started
        if padding:
            padder.pad(started, pad_s)
        waited = time.monotonic()
        flat = allreduce_mean(flat, n, hook=hook, through_cpu=through_cpu)
        if allreduce_s > 0:
            time.sleep(allreduce_s)  # the emulated network's ring on top of loopback's
        wait += time.monotonic() - waited
        offset = 0
        for w in params:
            w.grad = flat[offset : offset + w.numel()].view_as(w)
            offset += w.numel()
        if job.train.max_grad_norm:   # as DeepSpeed and torch DDP users clip: the averaged gradient
            torch.nn.utils.clip_grad_norm_(params, job.train.max_grad_norm)
        step_at(optimizer, job.train, p)
        losses.append(float(loss.detach()))
        progress.write(p, losses[-1], force=p == job.train.steps)
        if every and p % every == 0 and p < job.train.steps and rank == 0:
            # eval.every, as HetPipe's VW 0 does it: rank 0's weights (every rank's) after p steps;
            # the other ranks wait for it at the next allreduce.
            scored = common.evaluate(job, model, device)
            outputs.append_evals(out_dir, [{
                "id": p // every, "final": False, "minibatches": p, "samples": p * n * job.data.batch_size,
                "seconds": time.monotonic() - start, "rows": scored["eval_rows"], "loss": scored["eval_loss"],
                "accuracy": scored["eval_accuracy"]}])
    dist.barrier()
    wall = time.monotonic() - start
    # On the GPU under nccl, which has no CPU tensors; gloo takes CPU ones.
    recent = torch.tensor([common.recent_mean(losses)], dtype=torch.float64,
                          device=device if spec["backend"] == "nccl" else "cpu")
    dist.all_reduce(recent)
    result = {"wall_seconds": wall, "wait_seconds": wait, "compute_seconds": compute,
              "final_loss": float(recent) / n, "steps": job.train.steps}
    if rank == 0:
        common.save_weights(model, f"{spec['work_dir']}/weights.safetensors")
        result.update(common.evaluate(job, model, device))
    common.write_result(spec["work_dir"], rank, result)
    dist.barrier()  # rank 0's weights are on disk before any rank reports success
    dist.destroy_process_group()
