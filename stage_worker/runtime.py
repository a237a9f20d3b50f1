"""A stage worker's live state: inputs, the compute thread, links to neighbours, and the trace."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import grpc
import torch

from hetpipe import data as datasets
from hetpipe.config import ConfigError, JobConfig
from hetpipe.rpc import Rejected
from hetpipe.v1 import stage_pb2, wire_pb2
from hetpipe.wire import Bundle, torch_dtype
from hetpipe.wsp import closes_wave, wave_of
from hetpipe.zoo import build_model, stage_layers
from stage_worker import metrics
from stage_worker.links import Link, Outgoing
from stage_worker.schedule import Rejection, ScheduleError, StageSchedule, Task, TaskKind
from stage_worker.stage import StageCompute
from stage_worker.sync import LocalSync, Sync

log = logging.getLogger(__name__)
State = stage_pb2.StageStatus.State

_SCHEDULE_CODES = {
    Rejection.UNKNOWN: grpc.StatusCode.INVALID_ARGUMENT,
    Rejection.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Rejection.WINDOW: grpc.StatusCode.FAILED_PRECONDITION,
    Rejection.ORDER: grpc.StatusCode.FAILED_PRECONDITION,
    Rejection.NOT_ACCEPTED: grpc.StatusCode.FAILED_PRECONDITION,
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    def check(self, what: str, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: dtype {tensor.dtype}, expected {self.dtype}")
        if tuple(tensor.shape) != self.shape:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"{what}: shape {list(tensor.shape)}, expected {list(self.shape)}"
            )


def pick_device(requested: str) -> str:
    if requested:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"device {requested}: no CUDA device here")
        return requested
    return "cuda:0" if torch.cuda.is_available() else "cpu"


class StageRuntime:
    """Owns one stage. gRPC handler threads offer inputs; one compute thread runs tasks in order."""

    def __init__(self, *, make_sync: Callable[[StageRuntime], Sync] | None = None) -> None:
        self._cv = threading.Condition()
        self.state = State.IDLE
        self.error = ""
        self._make_sync = make_sync
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- setup -------------------------------------------------------------------------------

    def assign(self, a: stage_pb2.StageAssignment) -> None:
        with self._cv:
            if self.state != State.IDLE:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"stage already assigned ({State.Name(self.state)})")
            try:
                job = JobConfig.from_json(a.job_json)
            except ConfigError as exc:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"job_json: {exc}") from None
            if not isinstance(job.parallel.nm, int):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "job_json: parallel.nm must be resolved to an integer")
            if not (a.stage < a.num_stages and a.layer_begin < a.layer_end):
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"stage {a.stage} of {a.num_stages} with layers [{a.layer_begin}, {a.layer_end})",
                )
            if a.vw >= job.parallel.virtual_workers:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"vw {a.vw} but the job has {job.parallel.virtual_workers}")
            self.job, self.a = job, a
            self.vw, self.stage, self.num_stages = a.vw, a.stage, a.num_stages
            self.first, self.last = a.stage == 0, a.stage == a.num_stages - 1
            self.name = f"stage {a.stage} of vw {a.vw}"
            self.device = pick_device(a.device)
            dtype = getattr(torch, job.train.dtype)
            model = build_model(job.model.name, job.model.args, seed=job.train.seed, dtype=dtype)
            if a.layer_end > len(model):
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT, f"layers [{a.layer_begin}, {a.layer_end}) but the model has {len(model)}"
                )
            self._shape_specs(a, model)
            for field in ("next_send_seconds", "prev_send_seconds", "push_seconds", "pull_seconds"):
                value = getattr(a, field)
                if not (math.isfinite(value) and value >= 0):
                    raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {value}: expected a finite number >= 0")
            tracks = len(a.ps_addresses) > 0
            self.compute = StageCompute(
                stage_layers(model, a.layer_begin, a.layer_end), job.train.optimizer, loss=job.train.loss,
                device=self.device, track_updates=tracks,
            )
            self.schedule = StageSchedule(stage=a.stage, num_stages=a.num_stages, nm=job.nm, steps=job.train.steps)
            self.dataset = datasets.load_dataset(job) if self.first else None
            self._forward_inputs: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
            self._backward_inputs: dict[int, torch.Tensor] = {}
            self._trace_rows: dict[int, dict[str, float | int]] = {}
            self._trace: IO[str] | None = open(a.trace_path, "w") if a.trace_path else None
            self._losses: deque[float] = deque(maxlen=10)
            self.last_loss = float("nan")
            self.received = 0
            self.idle_seconds = self.compute_seconds = self.wait_idle_seconds = 0.0
            self.phase_seconds = {"forward": 0.0, "backward": 0.0}  # compute_seconds by phase
            self._busy = False            # a task is running (its input still counts as ready)
            self._fb_forward_seconds = 0.0  # the forward part of the last FORWARD_BACKWARD task
            self.observe = metrics.observers(a.vw, a.stage)
            slow = job.faults.slow_factor if job.faults.slow_vw == a.vw else 1.0
            self._pad_forward, self._pad_backward = a.forward_seconds * slow, a.backward_seconds * slow
            self._jitter = random.Random(hash((job.train.seed, a.vw, a.stage)))
            self.sync: Sync = self._make_sync(self) if (self._make_sync and tracks) else LocalSync()
            self.state = State.ASSIGNED
            metrics.bind(self)
        log.info("%s assigned layers [%d, %d) on %s", self.name, a.layer_begin, a.layer_end, self.device)

    def _shape_specs(self, a: stage_pb2.StageAssignment, model: torch.nn.Sequential) -> None:
        """Infers the exact shape of every tensor this stage will receive, to validate inputs.

        One minibatch's x and y come from the assignment: only stage 0 holds the data itself.
        """
        x = torch.zeros(list(a.input_shape), dtype=torch_dtype(a.input_dtype))
        y = torch.zeros(list(a.target_shape), dtype=torch_dtype(a.target_dtype))
        try:
            with torch.no_grad():
                x = stage_layers(model, 0, a.layer_begin)(x)
                self.in_spec = TensorSpec(x.dtype, tuple(x.shape))
                x = stage_layers(model, a.layer_begin, a.layer_end)(x)
        except RuntimeError as exc:  # e.g. an input_shape that the model's first layer cannot take
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input_shape {list(a.input_shape)} does not fit model {self.job.model.name}: {exc}",
            ) from None
        self.out_spec = TensorSpec(x.dtype, tuple(x.shape))
        self.target_spec = None if self.first else TensorSpec(y.dtype, tuple(y.shape))

    def load_weights(self, bundle: Bundle) -> None:
        with self._cv:
            if self.state != State.ASSIGNED:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"weights arrive after Assign and before Start, not in {State.Name(self.state)}")
            expected = dict(self.compute.state())
            got = bundle.named()
            if set(got) != set(expected):
                missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"weights: missing keys {missing}, unexpected keys {extra}")
            for key, value in got.items():
                TensorSpec(expected[key].dtype, tuple(expected[key].shape)).check(f"weights[{key}]", value)
            self.compute.module.load_state_dict(got)
            self.compute.set_weights([p.detach() for p in self.compute.params])

    def start(self) -> None:
        with self._cv:
            if self.state != State.ASSIGNED:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"cannot start in state {State.Name(self.state)}")
            a = self.a
            self._next = (
                None if self.last else Link(address=a.next_address, method="Forward", hold_s=a.next_send_seconds,
                                            peer=f"stage {self.stage + 1} of vw {self.vw}", on_failure=self.fail)
            )
            self._prev = (
                None if self.first else Link(address=a.prev_address, method="Backward", hold_s=a.prev_send_seconds,
                                             peer=f"stage {self.stage - 1} of vw {self.vw}", on_failure=self.fail)
            )
            self.state = State.RUNNING
            self._thread = threading.Thread(target=self._loop, name="compute", daemon=True)
            self._thread.start()

    # ---- inputs from gRPC handlers ----------------------------------------------------------

    def _check_tag(self, bundle: Bundle, from_stage: int, what: str) -> int:
        if bundle.header.WhichOneof("header") != "minibatch":
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: first frame lacks the minibatch tag")
        tag = bundle.header.minibatch
        if tag.vw != self.vw:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: tagged for vw {tag.vw}, but this is {self.name}")
        if tag.stage != from_stage:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"{what}: sent by stage {tag.stage}, expected stage {from_stage}"
            )
        return int(tag.minibatch)

    def _require_running(self) -> None:
        if self.state not in (State.RUNNING, State.ASSIGNED):
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"stage is {State.Name(self.state)}, not running")

    def offer_forward(self, bundle: Bundle) -> None:
        """Validates an activation (+ targets) from the previous stage and queues it."""
        with self._cv:
            self._require_running()
            if self.first:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "stage 0 reads its own data and takes no activations")
            p = self._check_tag(bundle, self.stage - 1, "activation")
            if len(bundle.tensors) != 2:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"activation: expected 2 tensors (activation, target), got {len(bundle.tensors)}")
            (_, x), (_, y) = bundle.tensors
            self.in_spec.check("activation", x)
            assert self.target_spec is not None
            self.target_spec.check("target", y)
            try:
                self.schedule.accept_forward(p)
            except ScheduleError as exc:
                raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None
            self._forward_inputs[p] = (x.to(self.device), y.to(self.device), int(bundle.header.minibatch.weight_version))
            self.received += 1
            self._cv.notify_all()

    def offer_backward(self, bundle: Bundle) -> None:
        """Validates a gradient from the next stage and queues it."""
        with self._cv:
            self._require_running()
            if self.last:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "the last stage computes the loss and takes no gradients")
            p = self._check_tag(bundle, self.stage + 1, "gradient")
            if len(bundle.tensors) != 1:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"gradient: expected 1 tensor, got {len(bundle.tensors)}")
            grad = bundle.tensors[0][1]
            self.out_spec.check("gradient", grad)
            try:
                self.schedule.accept_backward(p)
            except ScheduleError as exc:
                raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None
            self._backward_inputs[p] = grad.to(self.device)
            self.received += 1
            self._cv.notify_all()

    # ---- the compute thread ------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        with self._cv:
            if self.state in (State.FAILED, State.DONE):
                return
            self.error = f"{self.name}: {reason}"
            self.state = State.FAILED
            self._cv.notify_all()
        log.error(self.error)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _next_task(self) -> Task | None:
        """Blocks until a task is ready; None when the stage is finished, failed or stopping."""
        with self._cv:
            idle_since = time.monotonic()
            waiting = self.sync.waiting
            while True:
                if self._stopping or self.state != State.RUNNING:
                    return None
                now = time.monotonic()
                # Each idle interval is charged by the state it was spent in: idle while a forward
                # was blocked on the clock bound is the part of a wait that costs throughput.
                if waiting:
                    self.wait_idle_seconds += now - idle_since
                self.idle_seconds += now - idle_since
                idle_since = now
                self.sync.apply_pending(self.compute)
                task = self.schedule.next_task(self.sync.forward_allowed)
                waiting = self.sync.waiting
                if task is not None:
                    self._busy = True
                    return task
                if self.schedule.done:
                    if self.sync.finished():
                        self.state = State.DONE
                        self._cv.notify_all()
                        return None
                self._cv.wait(0.5)

    def _loop(self) -> None:
        task: Task | None = None
        try:
            while (task := self._next_task()) is not None:
                started = time.monotonic()
                if task.kind == TaskKind.FORWARD:
                    outgoing = self._forward(task.p)
                elif task.kind == TaskKind.BACKWARD:
                    outgoing = self._backward(task.p)
                else:
                    outgoing = self._forward_backward(task.p)
                with self._cv:
                    elapsed = time.monotonic() - started
                    self.compute_seconds += elapsed
                    if task.kind == TaskKind.FORWARD_BACKWARD:
                        forward = min(self._fb_forward_seconds, elapsed)
                    else:
                        forward = elapsed if task.kind == TaskKind.FORWARD else 0.0
                    self.phase_seconds["forward"] += forward
                    self.phase_seconds["backward"] += elapsed - forward
                    self._busy = False
                    self.schedule.complete(task)
                    if task.kind != TaskKind.FORWARD and closes_wave(task.p, self.job.nm, self.job.train.steps):
                        self.sync.on_wave_end(wave_of(task.p, self.job.nm))
                    self._cv.notify_all()
                # Only now may results leave: a neighbour reacting to them (stage 0 injecting
                # p + nm after this gradient) must find this task recorded as done.
                for link, message in outgoing:
                    link.send(message)
        except Exception as exc:  # any bug or device error fails the stage loudly, naming p
            log.exception("%s crashed", self.name)
            where = f" at minibatch {task.p}" if task is not None else ""
            self.fail(f"{type(exc).__name__}: {exc}{where}")

    def _pad(self, started: float, seconds: float) -> None:
        """Emulation and fault injection: hold the device until the task took its target time."""
        lo, hi = self.job.faults.task_delay
        target = seconds + (self._jitter.uniform(lo, hi) if hi > 0 else 0.0)
        remaining = started + target - time.time()
        if remaining > 0:
            time.sleep(remaining)

    def _inputs(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first:
            assert self.dataset is not None
            x, y = datasets.minibatch(self.dataset, p, self.vw, self.job)
            return x.to(self.device), y.to(self.device)
        with self._cv:
            x, y, _ = self._forward_inputs.pop(p)
        return x, y

    def _tag(self, p: int, version: int) -> wire_pb2.MinibatchTag:
        return wire_pb2.MinibatchTag(vw=self.vw, minibatch=p, weight_version=version, stage=self.stage)

    def _forward(self, p: int) -> list[tuple[Link, Outgoing]]:
        x, y = self._inputs(p)
        start = time.time()
        min_clock = self.sync.min_clock
        out, version = self.compute.forward(p, x)
        self.observe.forward(p, version, self.sync.clock, min_clock)
        self._pad(start, self._pad_forward)
        self._trace_rows[p] = {"local_version": version, "min_clock": min_clock,
                               "fwd_start": start, "fwd_end": time.time()}
        assert self._next is not None
        return [(self._next, Outgoing(self._tag(p, version), [("activation", out), ("target", y)]))]

    def _backward(self, p: int) -> list[tuple[Link, Outgoing]]:
        with self._cv:
            grad = self._backward_inputs.pop(p)
        start = time.time()
        grad_in, version, update = self.compute.backward(p, grad)
        self.sync.after_update(p, update)
        self._pad(start, self._pad_backward)
        row = self._trace_rows.pop(p)
        row.update(bwd_version=version, bwd_start=start, bwd_end=time.time())
        self._write_trace(p, row)
        return self._gradient(p, version, grad_in)

    def _gradient(self, p: int, version: int, grad_in: torch.Tensor | None) -> list[tuple[Link, Outgoing]]:
        if self._prev is None:
            return []
        assert grad_in is not None
        return [(self._prev, Outgoing(self._tag(p, version), [("gradient", grad_in)]))]

    def _forward_backward(self, p: int) -> list[tuple[Link, Outgoing]]:
        x, y = self._inputs(p)
        start = time.time()
        min_clock = self.sync.min_clock
        loss, grad_in, version, update, forward_end = self.compute.forward_backward(p, x, y)
        self.observe.forward(p, version, self.sync.clock, min_clock)
        self.sync.after_update(p, update)
        self._pad(start, self._pad_forward + self._pad_backward)
        end = time.time()
        # The forward's share of the task: measured, or (emulated) the padded time split as planned.
        padded = self._pad_forward + self._pad_backward
        fwd = (end - start) * self._pad_forward / padded if padded > 0 else forward_end - start
        self._fb_forward_seconds = fwd
        with self._cv:
            self.last_loss = loss
            self._losses.append(loss)
        self._write_trace(p, {"local_version": version, "min_clock": min_clock, "fwd_start": start,
                              "fwd_end": forward_end, "bwd_version": version, "bwd_start": forward_end,
                              "bwd_end": end, "loss": loss})
        return self._gradient(p, version, grad_in)

    def _write_trace(self, p: int, row: dict[str, float | int]) -> None:
        if self._trace is None:
            return
        line = {"vw": self.vw, "stage": self.stage, "p": p, "wave": wave_of(p, self.job.nm), **row}
        self._trace.write(json.dumps(line) + "\n")
        self._trace.flush()

    # ---- queries and shutdown ----------------------------------------------------------------

    def status(self, *, weights_digest: bool = False) -> stage_pb2.StageStatus:
        """The stage's progress; with weights_digest, also a hash of its weights (reads them all,
        under the lock the compute thread needs: the job driver's frequent polls leave it out)."""
        with self._cv:
            s = stage_pb2.StageStatus(state=self.state, error=self.error)
            if self.state == State.IDLE:
                return s
            s.vw, s.stage, s.device = self.vw, self.stage, self.a.device_label or self.device
            s.forwards_done = self.schedule.next_forward - 1
            s.backwards_done = self.schedule.completed
            s.local_version = self.compute.version
            s.in_flight = self.schedule.in_flight
            s.received = self.received
            s.last_loss = self.last_loss
            s.recent_loss = sum(self._losses) / len(self._losses) if self._losses else float("nan")
            s.wait_seconds = self.sync.wait_seconds
            s.wait_idle_seconds = self.wait_idle_seconds
            s.idle_seconds = self.idle_seconds
            s.compute_seconds = self.compute_seconds
            s.clock = self.sync.clock
            s.min_clock = self.sync.min_clock
            if weights_digest:
                s.weights_digest = self.compute.digest()
            return s

    def metrics_snapshot(self) -> metrics.Snapshot | None:
        """What the metrics collector reads at scrape time: counters only, no digest and no copies."""
        with self._cv:
            if self.state == State.IDLE:
                return None
            sched = self.schedule
            links = getattr(self, "_next", None), getattr(self, "_prev", None)
            return metrics.Snapshot(
                samples=sched.completed * self.job.data.batch_size,
                forward_seconds=self.phase_seconds["forward"],
                backward_seconds=self.phase_seconds["backward"],
                idle_seconds=self.idle_seconds,
                queue_depth=sched.ready - (1 if self._busy else 0),
                in_flight=sched.in_flight,
                sent_forward_bytes=links[0].bytes_sent if links[0] is not None else 0,
                sent_backward_bytes=links[1].bytes_sent if links[1] is not None else 0,
                pull_wait_seconds=self.sync.wait_seconds, pull_wait_idle_seconds=self.wait_idle_seconds,
                local_clock=self.sync.clock, min_clock=self.sync.min_clock,
                loss=sum(self._losses) / len(self._losses) if self.last and self._losses else None,
            )

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        with self._cv:
            if self.state == State.IDLE:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "no weights before Assign")
            return self.compute.state()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for link in (getattr(self, "_next", None), getattr(self, "_prev", None)):
            if link is not None:
                link.close()
        if getattr(self, "sync", None) is not None:
            self.sync.close()
        if getattr(self, "_trace", None) is not None:
            assert self._trace is not None
            self._trace.close()
            self._trace = None
