"""What each stage is told at setup (its StageAssignment): its layers, its neighbours and shards and
how to reach them, the shapes that cross its cuts, and where it writes. Built from the planned job;
no calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hetpipe import data, models, shm, wire
from hetpipe.config import ConfigError, JobConfig
from hetpipe.errors import JobFailed
from hetpipe.optim import compute_dtype
from hetpipe.v1 import stage_pb2
from coordinator.planner import Plan, StagePlan, cache
from coordinator.planner.shapes import TensorShape, boundaries


class Stage(Protocol):
    """What an assignment needs of a stage (the driver's StageHandle)."""

    plan: StagePlan
    address: str
    host_id: str   # hetpipe.shm.host_id() of its process; "" where unknown

    @property
    def name(self) -> str: ...

    @property
    def at(self) -> str: ...


@dataclass(frozen=True)
class Assigner:
    """The job-wide part of every stage's assignment. batch: the training minibatch's (x, y)
    shapes; flows: the tensor crossing each layer boundary (planner.shapes.boundaries)."""

    job: JobConfig
    plan: Plan
    model: Any
    batch: tuple[TensorShape, TensorShape]
    flows: list[TensorShape]
    ps_addresses: list[str]
    ps_host_ids: list[str]
    trace_dir: Path
    checkpoint_dir: Path | None
    checkpoint_mark: str
    resume_wave: int

    def assignment(self, h: Stage, stages: Sequence[Stage]) -> stage_pb2.StageAssignment:
        """h's assignment; stages: every stage of the job (h's neighbours among them)."""
        sp, k = h.plan, self.plan.stages_per_vw
        (x_shape, x_dtype), (y_shape, y_dtype) = self.batch
        (act_shape, act_dtype), (out_shape, out_dtype) = self.flows[sp.layer_begin], self.flows[sp.layer_end]
        vw_handles = [s for s in stages if s.plan.vw == sp.vw]
        keys = models.parameter_keys(self.model, sp.layer_begin, sp.layer_end)
        trace = str(self.trace_dir / f"vw{sp.vw}_stage{sp.stage}.jsonl") if self.job.output.trace else ""
        profile = str(self.trace_dir / f"profile_vw{sp.vw}_stage{sp.stage}.json") if self.job.output.profile else ""
        prev, next_ = (vw_handles[sp.stage + d] if 0 <= sp.stage + d < k else None for d in (-1, 1))
        return stage_pb2.StageAssignment(
            vw=sp.vw, stage=sp.stage, num_stages=k, layer_begin=sp.layer_begin, layer_end=sp.layer_end,
            job_json=self.job.to_json(),
            prev_address=prev.address if prev is not None else "",
            next_address=next_.address if next_ is not None else "",
            ps_addresses=self.ps_addresses, trace_path=trace, profile_path=profile,
            key_shards=[self.plan.key_shard[key] for key in keys] if self.ps_addresses else [],
            forward_seconds=sp.forward_seconds, backward_seconds=sp.backward_seconds,
            device=sp.device, device_label=sp.label,
            input_shape=list(x_shape), input_dtype=wire.wire_dtype(x_dtype),
            target_shape=list(y_shape), target_dtype=wire.wire_dtype(y_dtype),
            memory_bytes=sp.memory_bytes, capacity_bytes=sp.capacity_bytes, gpu_type=sp.gpu, emulated=sp.emulated,
            next_send_seconds=sp.next_send_seconds, prev_send_seconds=sp.prev_send_seconds,
            push_seconds=sp.push_seconds, pull_seconds=sp.pull_seconds,
            activation_shape=list(act_shape), activation_dtype=wire.wire_dtype(act_dtype),
            output_shape=list(out_shape), output_dtype=wire.wire_dtype(out_dtype),
            checkpoint_dir=str(self.checkpoint_dir or ""), resume_wave=self.resume_wave,
            checkpoint_mark=self.checkpoint_mark,
            prev_shm=prev is not None and self._shared(h, prev.host_id, prev.name),
            next_shm=next_ is not None and self._shared(h, next_.host_id, next_.name),
            # Shared memory between two GPU stages is CUDA IPC (Setup keeps it only with *_shm).
            prev_cuda_ipc=prev is not None and _on_gpus(h, prev), next_cuda_ipc=next_ is not None and _on_gpus(h, next_),
            ps_shm=[self._shared(h, host, f"ps shard {i} at {address}")
                    for i, (host, address) in enumerate(zip(self.ps_host_ids, self.ps_addresses))],
        )

    def _shared(self, h: Stage, host_id: str, other: str) -> bool:
        """Whether h sends to `other` (a stage or a shard, at host_id) through shared memory."""
        try:
            return shm.shared(self.job.parallel.transport, h.host_id, host_id)
        except ValueError as exc:
            raise JobFailed(f"parallel.transport is shm, but {h.name} at {h.at} and {other} cannot use it: {exc} "
                            f"(transport auto uses shared memory where it can, gRPC elsewhere)") from None


def check_eval_cuts(job: JobConfig, plan: Plan, model: Any, batch: tuple[TensorShape, TensorShape],
                    flows: list[TensorShape], model_key: dict[str, Any] | None) -> None:
    """ConfigError where data.eval_factory's rows would cross a cut of the plan in another shape
    than the training rows, for which the stages are planned: the run trained to the end and
    failed at its first evaluation. Rows of another shape that are the same at every cut (a
    sequence pooled before the first) evaluate as planned."""
    held_out = data.eval_batch_shapes(job)
    if held_out is None or held_out[0][0] == batch[0][0]:
        return
    evals = boundaries(model, held_out[0], compute_dtype(job.train.precision),
                       cache_dir=cache.default_cache_dir(), model_key=model_key)
    for cut in sorted({sp.layer_begin for sp in plan.stages if sp.stage > 0}):
        if evals[cut][0] != flows[cut][0]:
            raise ConfigError(
                f"data.eval_factory: {job.data.eval_factory}: minibatches of x {list(held_out[0][0])} reach "
                f"the planned cut before layer {cut} as {list(evals[cut][0])}, where the training data's "
                f"{list(batch[0][0])} reach it as {list(flows[cut][0])}: the stages are planned for the "
                "training rows; give the held-out rows their shape")


def _on_gpus(*stages: Stage) -> bool:
    return all(s.plan.device.startswith("cuda") for s in stages)
