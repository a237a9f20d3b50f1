"""Drives one job over gRPC: assign stages, load w0, start, watch progress and failures, collect."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from hetpipe import data as datasets
from hetpipe import outputs, rpc, wire
from hetpipe.config import JobConfig
from hetpipe.errors import JobFailed
from hetpipe.reference import initial_model
from hetpipe.v1 import ps_pb2, stage_pb2, wire_pb2
from hetpipe.zoo import layer_keys, model_shape
from coordinator.planner import Plan, StagePlan, resolved_job
from coordinator.planner.shapes import TensorShape, boundaries

State = stage_pb2.StageStatus.State
STATUS_DEADLINE_S = 2.0


@dataclass
class StageHandle:
    plan: StagePlan
    address: str
    channel: grpc.Channel
    stub: rpc.Stub
    last: stage_pb2.StageStatus = field(default_factory=stage_pb2.StageStatus)

    @property
    def name(self) -> str:
        return f"stage {self.plan.stage} of vw {self.plan.vw}"

    def progress(self) -> str:
        s = self.last
        return f"it had finished {s.forwards_done} forwards and {s.backwards_done} backwards"


@dataclass
class Progress:
    samples: int
    total: int
    loss: float
    samples_per_second: float


class JobDriver:
    """Runs a planned job on stage workers (and shards) that are already serving."""

    def __init__(
        self, job: JobConfig, plan: Plan, stage_addresses: list[str], *,
        ps_addresses: list[str] | None = None,
        check_processes: Callable[[], None] = lambda: None,
    ) -> None:
        self.job = resolved_job(job, plan)
        self.plan = plan
        self.ps_addresses = ps_addresses or []
        self.check_processes = check_processes
        self.stages = []
        for sp, address in zip(plan.stages, stage_addresses):
            ch = rpc.channel(address)
            self.stages.append(StageHandle(sp, address, ch, rpc.Stub(ch, "Stage")))
        self.out_dir = Path(job.resolve(job.output.dir))
        self._ps_channels = [rpc.channel(a) for a in self.ps_addresses]
        self.shards = [rpc.Stub(ch, "ParameterServer") for ch in self._ps_channels]

    def close(self) -> None:
        for ch in [s.channel for s in self.stages] + self._ps_channels:
            ch.close()

    def _shard_keys(self, shard: int) -> list[str]:
        return [k for k, s in self.plan.key_shard.items() if s == shard and k in self.param_keys]

    # ---- setup ---------------------------------------------------------------------------

    def _assignment(self, h: StageHandle, x: torch.Tensor, y: torch.Tensor,
                    flows: list[TensorShape]) -> stage_pb2.StageAssignment:
        sp, k = h.plan, self.plan.stages_per_vw
        (act_shape, act_dtype), (out_shape, out_dtype) = flows[sp.layer_begin], flows[sp.layer_end]
        keys = [key for key in layer_keys(self.model, sp.layer_begin, sp.layer_end) if key in self.param_keys]
        vw_handles = [s for s in self.stages if s.plan.vw == sp.vw]
        trace = ""
        if self.job.output.trace:
            trace = str(self.out_dir / "trace" / f"vw{sp.vw}_stage{sp.stage}.jsonl")
        return stage_pb2.StageAssignment(
            vw=sp.vw, stage=sp.stage, num_stages=k, layer_begin=sp.layer_begin, layer_end=sp.layer_end,
            job_json=self.job.to_json(),
            prev_address=vw_handles[sp.stage - 1].address if sp.stage > 0 else "",
            next_address=vw_handles[sp.stage + 1].address if sp.stage < k - 1 else "",
            ps_addresses=self.ps_addresses, trace_path=trace,
            key_shards=[self.plan.key_shard[key] for key in keys] if self.ps_addresses else [],
            forward_seconds=sp.forward_seconds, backward_seconds=sp.backward_seconds,
            device=sp.device, device_label=sp.label,
            input_shape=list(x.shape), input_dtype=wire.wire_dtype(x.dtype),
            target_shape=list(y.shape), target_dtype=wire.wire_dtype(y.dtype),
            memory_bytes=sp.memory_bytes, capacity_bytes=sp.capacity_bytes, gpu_type=sp.gpu, emulated=sp.emulated,
            next_send_seconds=sp.next_send_seconds, prev_send_seconds=sp.prev_send_seconds,
            push_seconds=sp.push_seconds, pull_seconds=sp.pull_seconds,
            activation_shape=list(act_shape), activation_dtype=wire.wire_dtype(act_dtype),
            output_shape=list(out_shape), output_dtype=wire.wire_dtype(out_dtype),
        )

    def setup(self) -> None:
        """Assigns every stage, loads w0 into it and starts it."""
        if self.job.output.trace:
            (self.out_dir / "trace").mkdir(parents=True, exist_ok=True)
        model = self.model = initial_model(self.job)
        self.w0 = model.state_dict()
        self.param_keys = {name for name, _ in model.named_parameters()}
        for i, stub in enumerate(self.shards):
            # w_global starts at w0; the shards own the parameters, placed by the plan.
            tensors = [(key, self.w0[key]) for key in self._shard_keys(i)]
            if not tensors:
                continue  # more shards than parameter layers: this one idles
            try:
                tag = wire_pb2.InitTag(virtual_workers=self.plan.virtual_workers, shard=i)
                stub.Init(wire.encode(tensors, init=tag), timeout=rpc.DATA_DEADLINE_S)
            except grpc.RpcError as exc:
                self.check_processes()
                raise JobFailed(f"ps shard {i} at {self.ps_addresses[i]}: Init failed: {exc.code().name}: "
                                f"{exc.details()}") from None
        dataset = datasets.load_dataset(self.job)
        x, y = datasets.minibatch(dataset, 1, 0, self.job)
        flows = boundaries(model_shape(self.job.model.name, self.job.model.args), (tuple(x.shape), x.dtype))
        for h in self.stages:  # each answers at once and loads in the background
            self._call(h, "Assign", self._assignment(h, x, y, flows))
        self._wait_loaded()

        def load(h: StageHandle) -> None:
            keys = layer_keys(model, h.plan.layer_begin, h.plan.layer_end)
            self._call(h, "LoadWeights", wire.encode([(key, self.w0[key]) for key in keys]), deadline=rpc.DATA_DEADLINE_S)

        with ThreadPoolExecutor(max_workers=len(self.stages)) as pool:
            list(pool.map(load, self.stages))
        for h in self.stages:
            self._call(h, "Start", wire_pb2.Empty())

    def _wait_loaded(self, interval: float = 0.05) -> None:
        """Waits until every stage is READY, up to train.setup_timeout_s; JobFailed names a stage
        that failed to load, or the ones still loading when the time is up."""
        deadline = time.monotonic() + self.job.train.setup_timeout_s
        while True:
            loading = []
            for h in self.stages:
                h.last = self._call(h, "Status", stage_pb2.StatusRequest(), deadline=STATUS_DEADLINE_S)
                if h.last.state == State.FAILED:
                    raise JobFailed(h.last.error)
                if h.last.state == State.LOADING:
                    loading.append(h)
            if not loading:
                return
            if time.monotonic() > deadline:
                what = "; ".join(f"{h.name} at {h.address} ({h.last.detail or 'loading'})" for h in loading[:4])
                raise JobFailed(f"stages still loading after train.setup_timeout_s "
                                f"{self.job.train.setup_timeout_s:g}s: {what}")
            time.sleep(interval)

    def _call(self, h: StageHandle, method: str, request: Any, *, deadline: float = rpc.CONTROL_DEADLINE_S) -> Any:
        try:
            return getattr(h.stub, method)(request, timeout=deadline)
        except grpc.RpcError as exc:
            self.check_processes()
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # a killed peer's socket closes just before it is reaped
                time.sleep(0.2)
                self.check_processes()
            raise JobFailed(
                f"{h.name} at {h.address}: {method} failed: {exc.code().name}: {exc.details()} ({h.progress()})"
            ) from None

    # ---- running ---------------------------------------------------------------------------

    def poll(self) -> bool:
        """Refreshes every stage's status; True once all are done. Raises JobFailed."""
        self.check_processes()
        for h in self.stages:
            # Short: a frozen stage must not hold up the heartbeat check on the next poll.
            h.last = self._call(h, "Status", stage_pb2.StatusRequest(), deadline=STATUS_DEADLINE_S)
            if h.last.state == State.FAILED:
                raise JobFailed(f"{h.last.error} ({h.progress()})")
        return all(h.last.state == State.DONE for h in self.stages)

    def run(self, on_progress: Callable[[Progress], None] = lambda p: None, interval: float = 0.1) -> float:
        """Polls until done; returns the training wall time in seconds."""
        start = time.monotonic()
        total = self.job.train.steps * self.plan.virtual_workers * self.job.data.batch_size
        while not self.poll():
            on_progress(self._progress(start, total))
            time.sleep(interval)
        wall = time.monotonic() - start
        on_progress(self._progress(start, total))
        return wall

    def _last_stages(self) -> list[StageHandle]:
        return [h for h in self.stages if h.plan.stage == self.plan.stages_per_vw - 1]

    def _progress(self, start: float, total: int) -> Progress:
        samples = sum(h.last.backwards_done for h in self._last_stages()) * self.job.data.batch_size
        losses = [h.last.recent_loss for h in self._last_stages() if not math.isnan(h.last.recent_loss)]
        elapsed = max(time.monotonic() - start, 1e-9)
        return Progress(samples, total, sum(losses) / len(losses) if losses else float("nan"), samples / elapsed)

    # ---- results ---------------------------------------------------------------------------

    def fetch_weights(self) -> OrderedDict[str, torch.Tensor]:
        """The final model in layer order: w_global after every VW's last push (with shards),
        else the lone VW's local weights."""
        merged: dict[str, torch.Tensor] = {}
        for h in self.stages:
            if h.plan.vw != 0:
                continue
            try:
                bundle = wire.decode(h.stub.GetWeights(wire_pb2.Empty(), timeout=rpc.DATA_DEADLINE_S))
            except grpc.RpcError as exc:
                raise JobFailed(f"{h.name}: GetWeights failed: {exc.code().name}: {exc.details()}") from None
            merged.update(bundle.named())
        final_clock = math.ceil(self.job.train.steps / self.plan.nm)
        for i, stub in enumerate(self.shards):
            if not self._shard_keys(i):
                continue
            request = ps_pb2.PullRequest(vw=0, keys=self._shard_keys(i), min_clock=final_clock)
            try:
                merged.update(wire.decode(stub.Pull(request, timeout=rpc.DATA_DEADLINE_S)).named())
            except grpc.RpcError as exc:
                raise JobFailed(f"ps shard {i}: final Pull failed: {exc.code().name}: {exc.details()}") from None
        return OrderedDict((key, merged[key]) for key in self.w0)

    def shard_status(self) -> list[ps_pb2.ShardStatus]:
        return [stub.Status(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S) for stub in self.shards]

    def write_outputs(self, weights: OrderedDict[str, torch.Tensor], wall: float) -> dict[str, Any]:
        """model.pt and summary.json per DESIGN §8."""
        job, plan = self.job, self.plan
        samples = job.train.steps * plan.virtual_workers * job.data.batch_size
        losses = [h.last.recent_loss for h in self._last_stages()]
        fields: dict[str, Any] = {
            "steps": job.train.steps,
            "samples_per_second": samples / wall if wall > 0 else 0.0,
            "wall_seconds": wall,
            "final_loss": sum(losses) / len(losses),
            "virtual_workers": plan.virtual_workers,
            "stages_per_vw": plan.stages_per_vw,
            "nm": plan.nm,
            "D": plan.D,
            "emulated": plan.emulated,
            "wait_seconds": sum(h.last.wait_seconds for h in self.stages),
            "wait_idle_seconds": sum(h.last.wait_idle_seconds for h in self.stages),
            "idle_seconds": sum(h.last.idle_seconds for h in self.stages),
            "plan": plan.describe(),
            "mode": job.parallel.mode,
            "ps_shards": len(self.shards),
        }
        if self.shards:
            statuses = self.shard_status()
            fields["max_clock_distance"] = max(st.max_clock_distance for st in statuses)
            fields["pushes_applied"] = sum(st.pushes_applied for st in statuses)
        return outputs.write(job, weights, fields)
