"""A stage worker's live state: its inputs, the compute thread that runs its tasks, its links to
the neighbour stages, and its sync with the other virtual workers."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from hetpipe import data as datasets
from hetpipe import faults
from hetpipe.errors import Rejected
from hetpipe.v1 import stage_pb2, wire_pb2
from hetpipe.wire import Bundle
from hetpipe.wsp import closes_wave, wave_of
from hetpipe.zoo import build_model, stage_layers
from stage_worker import lifecycle, metrics
from stage_worker.assignment import Setup, TensorSpec, validate
from stage_worker.lifecycle import StageState
from stage_worker.links import Link, Outgoing
from stage_worker.progress import Progress
from stage_worker.schedule import Rejection, ScheduleError, StageSchedule, Task, TaskKind
from stage_worker.stage import StageCompute
from stage_worker.sync import LocalSync, Sync
from stage_worker.trace import MinibatchTrace
from stage_worker.wsp_sync import SyncCallbacks, SyncConfig, WspSync

log = logging.getLogger(__name__)

_SCHEDULE_CODES = {
    Rejection.UNKNOWN: grpc.StatusCode.INVALID_ARGUMENT,
    Rejection.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    Rejection.WINDOW: grpc.StatusCode.FAILED_PRECONDITION,
    Rejection.ORDER: grpc.StatusCode.FAILED_PRECONDITION,
    Rejection.NOT_ACCEPTED: grpc.StatusCode.FAILED_PRECONDITION,
}
Send = tuple[Link, Outgoing]


def _refused(state: StageState, what: str) -> Rejected:
    return Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"{what} in state {state.name}")


class LoadError(Exception):
    """The assignment does not fit the model the stage built."""


class _Assigned:
    """Everything a stage holds once loaded: built by the loading thread, read by the compute thread."""

    def __init__(self, setup: Setup, sync_for: Callable[[Setup, StageCompute, metrics.StageObservers], Sync]) -> None:
        job = self.job = setup.job
        self.setup = setup
        model = build_model(job.model.name, job.model.args, seed=job.train.seed, dtype=getattr(torch, job.train.dtype))
        if setup.layer_end > len(model):
            raise LoadError(f"layers [{setup.layer_begin}, {setup.layer_end}) but the model has {len(model)}")
        self.compute = StageCompute(stage_layers(model, setup.layer_begin, setup.layer_end), job.train.optimizer,
                                    loss=job.train.loss, device=setup.device.name, track_updates=setup.synced)
        del model
        if setup.synced and len(setup.key_shards) != len(self.compute.params):
            raise LoadError(f"key_shards: {len(setup.key_shards)} entries for {len(self.compute.params)} parameters")
        self.schedule = StageSchedule(stage=setup.stage, num_stages=setup.num_stages, nm=job.nm,
                                      steps=job.train.steps)
        self.dataset = datasets.load_dataset(job) if setup.first else None
        self.trace = MinibatchTrace(setup.trace_path, setup.vw, setup.stage)
        self.observe = metrics.observers(setup.vw, setup.stage)
        self.padder = faults.Padder(faults.from_env(), setup.vw, (job.train.seed, setup.stage))
        self.sync = sync_for(setup, self.compute, self.observe)
        self.next: Link | None = None
        self.prev: Link | None = None


class StageRuntime:
    """Owns one stage. gRPC handler threads offer inputs; one compute thread runs tasks in order."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.state = StageState.IDLE
        self.error = ""
        self.detail = ""              # what a loading stage is doing
        self._setup: Setup | None = None
        self._s: _Assigned | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._forward_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._backward_inputs: dict[int, torch.Tensor] = {}
        self._losses: deque[float] = deque(maxlen=10)
        self._last_loss = float("nan")
        self._received = 0
        self._busy = False            # a task is running (its input still counts as ready)
        self._idle_seconds = self._wait_idle_seconds = 0.0
        self._phase_seconds = {"forward": 0.0, "backward": 0.0}

    def _to(self, new: StageState) -> None:
        lifecycle.check(self.state, new)
        self.state = new
        self._cv.notify_all()

    @property
    def setup(self) -> Setup:
        if self._setup is None:
            raise _refused(self.state, "no assignment")
        return self._setup

    # ---- setup -------------------------------------------------------------------------------

    def assign(self, a: stage_pb2.StageAssignment) -> None:
        """Validates the assignment and starts loading it: Status says LOADING, then READY."""
        with self._cv:
            if self.state != StageState.IDLE:
                raise _refused(self.state, "stage already assigned")
            setup = self._setup = validate(a)
            self.detail = f"building layers [{setup.layer_begin}, {setup.layer_end})"
            self._to(StageState.LOADING)
        log.info("%s assigned layers [%d, %d) on %s", setup.name, setup.layer_begin, setup.layer_end, setup.device.name)
        threading.Thread(target=self._load, args=(setup,), name="loader", daemon=True).start()

    def _load(self, setup: Setup) -> None:
        started = time.monotonic()
        try:
            loaded = _Assigned(setup, self._sync_for)
        except Exception as exc:  # a model that does not build, or does not fit the assignment
            log.exception("%s could not load", setup.name)
            self.fail(f"loading failed: {type(exc).__name__}: {exc}")
            return
        with self._cv:
            if self.state != StageState.LOADING or self._stopping:  # stopped or failed meanwhile
                loaded.sync.close()
                return
            self._s, self.detail = loaded, ""
            self._to(StageState.READY)
        metrics.bind(self.progress)
        log.info("%s loaded in %.1f s", setup.name, time.monotonic() - started)

    def _sync_for(self, setup: Setup, compute: StageCompute, observe: metrics.StageObservers) -> Sync:
        if not setup.synced:
            return LocalSync()
        trace = Path(setup.trace_path) if setup.trace_path else None
        config = SyncConfig(
            vw=setup.vw, nm=setup.job.nm, D=setup.job.parallel.D, steps=setup.job.train.steps, keys=tuple(compute.names),
            key_shards=setup.key_shards, addresses=setup.ps_addresses, push_hold_s=setup.push_seconds,
            pull_hold_s=setup.pull_seconds, trace_dir=str(trace.parent) if trace else "",
            trace_name=trace.name if trace else "", repeat_push=faults.from_env().repeat_push,
            seed=setup.job.train.seed,
        )
        callbacks = SyncCallbacks(on_failure=self.fail, wake=self.wake, next_forward=self._next_forward,
                                  observe_push=observe.push.observe, observe_pull=observe.pull.observe)
        return WspSync(config, callbacks, compute.params)

    def _next_forward(self) -> int:
        assert self._s is not None
        return self._s.schedule.next_forward

    def load_weights(self, bundle: Bundle) -> None:
        with self._cv:
            if self.state != StageState.READY or self._s is None:
                raise _refused(self.state, "weights arrive once loaded and before Start, not")
            compute = self._s.compute
            expected = dict(compute.state())
            got = bundle.named()
            if set(got) != set(expected):
                missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"weights: missing keys {missing[:10]}, "
                               f"unexpected keys {extra[:10]}")
            for key, value in got.items():
                TensorSpec(expected[key].dtype, tuple(expected[key].shape)).check(f"weights[{key}]", value)
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"weights[{key}]: NaN or Inf")
            compute.module.load_state_dict(got)
            compute.set_weights([p.detach() for p in compute.params])

    def start(self) -> None:
        with self._cv:
            if self.state != StageState.READY or self._s is None:
                raise _refused(self.state, "cannot start")
            s, setup = self._s, self._s.setup
            if not setup.last:
                s.next = Link(address=setup.next_address, method="Forward", hold_s=setup.next_send_seconds,
                              peer=f"stage {setup.stage + 1} of vw {setup.vw}", on_failure=self.fail)
            if not setup.first:
                s.prev = Link(address=setup.prev_address, method="Backward", hold_s=setup.prev_send_seconds,
                              peer=f"stage {setup.stage - 1} of vw {setup.vw}", on_failure=self.fail)
            self._to(StageState.RUNNING)
            self._thread = threading.Thread(target=self._loop, args=(s,), name="compute", daemon=True)
            self._thread.start()

    # ---- inputs from gRPC handlers ----------------------------------------------------------

    def _check_input(self, bundle: Bundle, from_stage: int, what: str, names: tuple[str, ...]) -> tuple[_Assigned, int]:
        """The minibatch of a valid input from stage from_stage; Rejected naming what is wrong."""
        if self.state not in (StageState.READY, StageState.RUNNING) or self._s is None:
            raise _refused(self.state, f"{what} refused: the stage is not running")
        s = self._s
        if bundle.header.WhichOneof("header") != "minibatch":
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: first frame lacks the minibatch tag")
        tag = bundle.header.minibatch
        if tag.vw != s.setup.vw:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: tagged for vw {tag.vw}, but this is {s.setup.name}")
        if tag.stage != from_stage:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}: sent by stage {tag.stage}, expected stage {from_stage}")
        if len(bundle.tensors) != len(names):
            expected = f"{len(names)} tensor{'s' if len(names) > 1 else ''} ({', '.join(names)})"
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: expected {expected}, got {len(bundle.tensors)}")
        return s, int(tag.minibatch)

    def _accept(self, accept: Callable[[int], None], p: int) -> None:
        try:
            accept(p)
        except ScheduleError as exc:
            raise Rejected(_SCHEDULE_CODES[exc.reason], str(exc)) from None

    def offer_forward(self, bundle: Bundle) -> None:
        """Validates an activation (+ targets) from the previous stage and queues it."""
        with self._cv:
            if self._s is not None and self._s.setup.first:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "stage 0 reads its own data and takes no activations")
            s, p = self._check_input(bundle, self.setup.stage - 1, "activation", ("activation", "target"))
            (_, x), (_, y) = bundle.tensors
            s.setup.specs.activation.check("activation", x)
            s.setup.specs.target.check("target", y)
            self._accept(s.schedule.accept_forward, p)
            self._forward_inputs[p] = (x.to(s.compute.device), y.to(s.compute.device))
            self._received += 1
            self._cv.notify_all()

    def offer_backward(self, bundle: Bundle) -> None:
        """Validates a gradient from the next stage and queues it."""
        with self._cv:
            if self._s is not None and self._s.setup.last:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                               "the last stage computes the loss and takes no gradients")
            s, p = self._check_input(bundle, self.setup.stage + 1, "gradient", ("gradient",))
            grad = bundle.tensors[0][1]
            s.setup.specs.output.check("gradient", grad)
            self._accept(s.schedule.accept_backward, p)
            self._backward_inputs[p] = grad.to(s.compute.device)
            self._received += 1
            self._cv.notify_all()

    # ---- the compute thread ------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        with self._cv:
            if self.state.is_terminal or not self.state.allows(StageState.FAILED):
                return
            self.error = f"{self._setup.name if self._setup else 'stage'}: {reason}"
            self._to(StageState.FAILED)
        log.error(self.error)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _next_task(self, s: _Assigned) -> Task | None:
        """Blocks until a task is ready; None when the stage is finished, failed or stopping."""
        with self._cv:
            idle_since = time.monotonic()
            waiting = s.sync.waiting
            while True:
                if self._stopping or self.state != StageState.RUNNING:
                    return None
                now = time.monotonic()
                # Each idle interval is charged by the state it was spent in: idle while a forward
                # was blocked on the clock bound is the part of a wait that costs throughput.
                if waiting:
                    self._wait_idle_seconds += now - idle_since
                self._idle_seconds += now - idle_since
                idle_since = now
                s.sync.apply_pending(s.compute)
                task = s.schedule.next_task(s.sync.forward_allowed)
                waiting = s.sync.waiting
                if task is not None:
                    self._busy = True
                    return task
                if s.schedule.done and s.sync.finished():
                    self._to(StageState.DONE)
                    return None
                self._cv.wait(0.5)

    def _loop(self, s: _Assigned) -> None:
        task: Task | None = None
        run = {TaskKind.FORWARD: self._forward, TaskKind.BACKWARD: self._backward,
               TaskKind.FORWARD_BACKWARD: self._forward_backward}
        try:
            while (task := self._next_task(s)) is not None:
                started = time.monotonic()
                outgoing, forward = run[task.kind](s, task.p)
                with self._cv:
                    elapsed = time.monotonic() - started
                    forward = elapsed if task.kind == TaskKind.FORWARD else min(forward, elapsed)
                    self._phase_seconds["forward"] += forward
                    self._phase_seconds["backward"] += elapsed - forward
                    self._busy = False
                    s.schedule.complete(task)
                    if task.kind != TaskKind.FORWARD and closes_wave(task.p, s.job.nm, s.job.train.steps):
                        s.sync.on_wave_end(wave_of(task.p, s.job.nm))
                    self._cv.notify_all()
                # Only now may results leave: a neighbour reacting to them (stage 0 injecting
                # p + nm after this gradient) must find this task recorded as done.
                for link, message in outgoing:
                    link.send(message)
        except Exception as exc:  # any bug or device error fails the stage loudly, naming p
            log.exception("%s crashed", s.setup.name)
            where = f" at minibatch {task.p}" if task is not None else ""
            self.fail(f"{type(exc).__name__}: {exc}{where}")

    def _inputs(self, s: _Assigned, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        if s.dataset is not None:
            x, y = datasets.minibatch(s.dataset, p, s.setup.vw, s.job)
            return x.to(s.compute.device), y.to(s.compute.device)
        with self._cv:
            return self._forward_inputs.pop(p)

    def _tag(self, s: _Assigned, p: int, version: int) -> wire_pb2.MinibatchTag:
        return wire_pb2.MinibatchTag(vw=s.setup.vw, minibatch=p, weight_version=version, stage=s.setup.stage)

    def _forward(self, s: _Assigned, p: int) -> tuple[list[Send], float]:
        x, y = self._inputs(s, p)
        start = time.time()
        min_clock = s.sync.min_clock
        out, version = s.compute.forward(p, x)
        s.setup.specs.output.check_output(s.setup.name, out)
        s.observe.forward(p, version, s.sync.clock, min_clock)
        s.padder.pad(start, s.setup.forward_seconds)
        s.trace.forward(p, local_version=version, min_clock=min_clock, fwd_start=start, fwd_end=time.time())
        assert s.next is not None
        return [(s.next, Outgoing(self._tag(s, p, version), [("activation", out), ("target", y)]))], 0.0

    def _backward(self, s: _Assigned, p: int) -> tuple[list[Send], float]:
        with self._cv:
            grad = self._backward_inputs.pop(p)
        start = time.time()
        grad_in, version, update = s.compute.backward(p, grad)
        s.sync.after_update(p, update)
        s.padder.pad(start, s.setup.backward_seconds)
        s.trace.backward(p, wave_of(p, s.job.nm), bwd_version=version, bwd_start=start, bwd_end=time.time())
        return self._gradient(s, p, version, grad_in), 0.0

    def _gradient(self, s: _Assigned, p: int, version: int, grad_in: torch.Tensor | None) -> list[Send]:
        if s.prev is None:
            return []
        assert grad_in is not None
        return [(s.prev, Outgoing(self._tag(s, p, version), [("gradient", grad_in)]))]

    def _forward_backward(self, s: _Assigned, p: int) -> tuple[list[Send], float]:
        x, y = self._inputs(s, p)
        start = time.time()
        min_clock = s.sync.min_clock
        loss, grad_in, version, update, forward_end = s.compute.forward_backward(p, x, y)
        s.observe.forward(p, version, s.sync.clock, min_clock)
        s.sync.after_update(p, update)
        padded = s.setup.forward_seconds + s.setup.backward_seconds
        s.padder.pad(start, padded)
        end = time.time()
        # The forward's share of the task: measured, or (emulated) the padded time split as planned.
        forward = (end - start) * s.setup.forward_seconds / padded if padded > 0 else forward_end - start
        with self._cv:
            self._last_loss = loss
            self._losses.append(loss)
        s.trace.forward(p, local_version=version, min_clock=min_clock, fwd_start=start, fwd_end=forward_end)
        s.trace.backward(p, wave_of(p, s.job.nm), bwd_version=version, bwd_start=forward_end, bwd_end=end,
                         loss=loss)
        return self._gradient(s, p, version, grad_in), forward

    # ---- queries and shutdown ----------------------------------------------------------------

    def progress(self, *, weights_digest: bool = False) -> Progress:
        """The stage's state and counters at one instant; with weights_digest, also a hash of its
        weights (reads them all, under the lock the compute thread needs: polls leave it out)."""
        with self._cv:
            s = self._s
            if s is None:
                who = self._setup
                return Progress(state=self.state, error=self.error, detail=self.detail,
                                vw=who.vw if who else 0, stage=who.stage if who else 0,
                                device=who.device.name if who else "", label=who.label if who else "")
            setup, sched = s.setup, s.schedule
            links = (s.next, s.prev)
            used, capacity = metrics.device_memory(setup)
            return Progress(
                state=self.state, error=self.error, vw=setup.vw, stage=setup.stage, device=setup.device.name,
                label=setup.label, gpu_type=setup.gpu_type, emulated=setup.emulated, memory_used_bytes=used,
                memory_capacity_bytes=capacity, forwards_done=sched.next_forward - 1,
                backwards_done=sched.completed, samples=sched.completed * s.job.data.batch_size,
                local_version=s.compute.version, in_flight=sched.in_flight,
                queue_depth=sched.ready - (1 if self._busy else 0), received=self._received,
                last_loss=self._last_loss,
                recent_loss=sum(self._losses) / len(self._losses) if self._losses else float("nan"),
                forward_seconds=self._phase_seconds["forward"], backward_seconds=self._phase_seconds["backward"],
                idle_seconds=self._idle_seconds, wait_seconds=s.sync.wait_seconds,
                wait_idle_seconds=self._wait_idle_seconds,
                sent_forward_bytes=links[0].bytes_sent if links[0] is not None else 0,
                sent_backward_bytes=links[1].bytes_sent if links[1] is not None else 0,
                clock=s.sync.clock, min_clock=s.sync.min_clock,
                weights_digest=s.compute.digest() if weights_digest else "",
            )

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        with self._cv:
            if self._s is None:
                raise _refused(self.state, "no weights before Assign:")
            return self._s.compute.state()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        s = self._s
        if s is None:
            return
        for link in (s.next, s.prev):
            if link is not None:
                link.close()
        s.sync.close()
        s.trace.close()
