"""A stage worker's live state: its inputs, the compute thread that runs its tasks, its links to
the neighbour stages, and its sync with the other virtual workers."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
import time

import grpc
import torch

from hetpipe import devices
from hetpipe.errors import Rejected, data_hint, worker_words
from hetpipe.v1 import stage_pb2
from hetpipe.wire import Bundle, Stream
from hetpipe.wsp import total_waves
from stage_worker import commit, lifecycle, metrics
from stage_worker.assignment import Setup, validate
from stage_worker.inbox import Inbox, Metas
from stage_worker.lifecycle import StageState
from stage_worker.commit import Ran, Send
from stage_worker.links import Link
from stage_worker.loaded import Loaded
from stage_worker.losses import Losses
from stage_worker.losses import read as losses_read
from stage_worker.micro import MicroTasks
from stage_worker.tasks import MinibatchTasks
from stage_worker.micro_schedule import MicroSchedule
from stage_worker.progress import Progress, SteadyWindow
from stage_worker.schedule import Task, TaskKind

log = logging.getLogger(__name__)



# A task or a read this long is named in Status's detail (a stall's report shows it).
DOING_SHOWN_S = 1.0


def _refused(state: StageState, what: str) -> Rejected:
    return Rejected(grpc.StatusCode.FAILED_PRECONDITION, f"{what} in state {state.name}")


def _where(task: Task | None, completed: int) -> str:
    """Where the compute thread was when it failed, for the stage's error."""
    if task is None:
        return f" between tasks, after {completed} minibatches"
    if task.kind == TaskKind.MERGE_FINAL:
        return " in the final merge of w_global"
    if task.kind == TaskKind.EVAL:
        return f" at evaluation {task.eval}, its minibatch {task.p}"
    return f" at minibatch {task.p}" + (f", micro-batch {task.micro}" if task.micro else "")


def _metas(stream: Stream) -> Metas:
    return [(dtype, tuple(shape)) for dtype, shape, _ in stream.specs]


class StageRuntime:
    """Owns one stage. gRPC handler threads offer inputs; one compute thread runs tasks in order."""

    def __init__(self, output_root: Path | None = None) -> None:
        # Where an assignment's trace_path and checkpoint_dir may point; None: anywhere (tests
        # that drive a runtime in-process). A stage process always has one (--output-root).
        self.output_root = output_root
        self._cv = threading.Condition()
        self.state = StageState.IDLE
        self.error = ""
        self.failed_at = 0.0
        self.detail = ""              # what a loading stage is doing
        self._at_task: tuple[Task, float] | None = None   # the compute thread's task, since (time.monotonic)
        self._setup: Setup | None = None
        self._s: Loaded | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._inbox = Inbox()
        self._final: int | None = None  # the final evaluation's min_clock, once asked for
        self._final_merged = False
        self._losses = Losses()  # the last stage's: read (a device sync) when polled
        self._busy = False            # a schedule task is running (its input still counts as ready)
        self._stepping = 0            # 1 while a completed minibatch's step is still to come (Ran.then)
        self._idle_seconds = self._wait_idle_seconds = 0.0
        self._phase_seconds = {"forward": 0.0, "backward": 0.0}
        self._steady: SteadyWindow | None = None

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
            setup = self._setup = validate(a, self.output_root)
            self._to(StageState.LOADING)
        log.info("%s assigned layers [%d, %d) on %s", setup.name, setup.layer_begin, setup.layer_end, setup.device.name)
        threading.Thread(target=self._load, args=(setup,), name="loader", daemon=True).start()

    def _loading(self, detail: str) -> None:
        with self._cv:
            self.detail = detail

    def _load(self, setup: Setup) -> None:
        started = time.monotonic()
        try:
            devices.make_current(setup.device)   # the user's factory runs here
            loaded = Loaded(setup, on_failure=self.fail, wake=self.wake, next_forward=self._next_forward,
                            progress=self._loading)
        except Exception as exc:  # a model that does not build, or does not fit the assignment
            log.exception("%s could not load", setup.name)
            self.fail(f"loading failed: {type(exc).__name__}: {exc}")
            return
        with self._cv:
            if self.state != StageState.LOADING or self._stopping:  # stopped or failed meanwhile
                loaded.close()
                return
            self._s, self.detail = loaded, ""
            self._to(StageState.READY)
        metrics.bind(self.progress)
        log.info("%s loaded in %.1f s", setup.name, time.monotonic() - started)

    def _next_forward(self) -> int:
        assert self._s is not None
        return self._s.schedule.next_forward

    def start(self) -> None:
        with self._cv:
            if self.state != StageState.READY or self._s is None:
                raise _refused(self.state, "cannot start")
            if self._stopping:   # stop() closes what it finds: links made after it would outlive it
                raise _refused(self.state, "cannot start: the stage is stopping")
            s, setup = self._s, self._s.setup
            if not setup.last:
                s.next = Link(address=setup.next_address, method="Forward", hold_s=setup.next_send_seconds,
                              shared_memory=setup.next_shm, cuda_ipc=setup.next_cuda_ipc,
                              peer=f"stage {setup.stage + 1} of vw {setup.vw}", on_failure=self.fail)
            if not setup.first:
                s.prev = Link(address=setup.prev_address, method="Backward", hold_s=setup.prev_send_seconds,
                              shared_memory=setup.prev_shm, cuda_ipc=setup.prev_cuda_ipc,
                              peer=f"stage {setup.stage - 1} of vw {setup.vw}", on_failure=self.fail)
            self._to(StageState.RUNNING)
            self._thread = threading.Thread(target=self._loop, args=(s,), name="compute", daemon=True)
            self._thread.start()

    def continue_past_cut(self) -> int:
        """Lets the stage past the checkpoint it saved and waits at; returns its wave."""
        with self._cv:
            s = self._s
            if s is None or self.state != StageState.RUNNING or not s.cuts.waiting_at:
                raise _refused(self.state, "not waiting at a checkpoint")
            s.cuts.continued = s.cuts.saved
            self._cv.notify_all()
            return s.cuts.continued

    def evaluate(self, min_clock: int) -> None:
        """The final evaluation (VW 0, after the run): merge w_global at min_clock, then stage 0
        sends the held-out rows through."""
        with self._cv:
            s = self._s
            if s is None or s.evals is None:
                raise _refused(self.state, "evaluate: this stage has no evaluation to run")
            if self.state != StageState.DONE:
                raise _refused(self.state, "evaluate: the final evaluation follows the run")
            if self._final is not None:
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS, "the final evaluation was asked for already")
            last = total_waves(s.job.train.steps, s.job.nm)
            if min_clock > last:  # no shard would ever reach it: the merge would wait out its deadline
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"evaluate: min_clock {min_clock} is past the "
                                                                 f"job's last wave clock {last}")
            self._final = min_clock
            self._cv.notify_all()

    # ---- inputs from gRPC handlers ----------------------------------------------------------

    def _running(self, what: str) -> Loaded:
        if self.state not in (StageState.READY, StageState.RUNNING, StageState.DONE) or self._s is None:
            raise _refused(self.state, f"{what} refused: the stage is not running")
        return self._s

    @property
    def gpu(self) -> torch.device | None:
        """The GPU its inputs go to (received into pinned memory or by CUDA IPC); None on the CPU."""
        setup = self._setup
        return torch.device(setup.device.name) if setup is not None and setup.device.kind == "cuda" else None

    def check_forward(self, stream: Stream) -> None:
        """Refuses, from its header alone, an activation that offer_forward would refuse: called
        before anything is allocated for its tensors (on a GPU stage, pinned memory)."""
        with self._cv:
            self._inbox.check_forward(self._running("activation"), stream.header, _metas(stream),
                                      training=self.state != StageState.DONE)

    def check_backward(self, stream: Stream) -> None:
        """check_forward's twin for a gradient."""
        with self._cv:
            self._inbox.check_backward(self._running("gradient"), stream.header, _metas(stream),
                                       training=self.state != StageState.DONE)

    def offer_forward(self, bundle: Bundle) -> None:
        """Validates an activation from the previous stage and queues it."""
        with self._cv:
            self._inbox.offer_forward(self._running("activation"), bundle, training=self.state != StageState.DONE)
            self._cv.notify_all()

    def offer_backward(self, bundle: Bundle) -> None:
        """Validates a gradient from the next stage and queues it."""
        with self._cv:
            self._inbox.offer_backward(self._running("gradient"), bundle, training=self.state != StageState.DONE)
            self._cv.notify_all()

    # ---- the compute thread ------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        with self._cv:
            if not self.state.allows(StageState.FAILED):
                return
            self.error = f"{self._setup.name if self._setup else 'stage'}: {reason}"
            self.failed_at = time.time()
            self._to(StageState.FAILED)
        log.error(self.error)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _eval_task(self, s: Loaded) -> Task | None:
        """The evaluation work ready at this stage, if any (it goes before training work)."""
        if s.evals is None:
            return None
        if self._final is not None and not self._final_merged:
            return Task(TaskKind.MERGE_FINAL, 0)
        if s.setup.first:
            if s.evals.going is not None:   # the next minibatch of the evaluation it is part way through
                return Task(TaskKind.EVAL, s.evals.going[1], s.evals.going[0])
            if self._final is not None and s.evals.schedule.final_id not in s.evals.started:
                return Task(TaskKind.EVAL, 1, s.evals.schedule.final_id)
            k = s.evals.schedule.due(s.schedule.completed, s.schedule.in_flight)
            return Task(TaskKind.EVAL, 1, k) if k is not None else None
        if self._inbox.evals:
            k, p, _ = self._inbox.evals[0]
            if k == s.evals.schedule.final_id and not self._final_merged:
                # Stage 0 may be asked first and send the rows on before this stage is asked: the
                # final evaluation waits for this stage's own merge, or it would score other weights.
                return None
            return Task(TaskKind.EVAL, p, k)
        return None

    def _next_task(self, s: Loaded) -> Task | None:
        """Blocks until a task is ready; None when the stage is failed or stopping."""
        with self._cv:
            idle_since = time.monotonic()
            waiting = s.sync.waiting
            while True:
                if self._stopping or self.state not in (StageState.RUNNING, StageState.DONE):
                    return None
                now = time.monotonic()
                # Each idle interval is charged by the state it was spent in: idle while a forward
                # was blocked on the clock bound is the part of a wait that costs throughput.
                if waiting:
                    self._wait_idle_seconds += now - idle_since
                self._idle_seconds += now - idle_since
                idle_since = now
                # A pull merges in place: not under a kept graph, nor between two minibatches of one
                # evaluation (a later stage runs them one task each), which would score two versions.
                if not s.compute.holds_live_graph and not (s.evals is not None and s.evals.midway):
                    s.sync.apply_pending(s.compute)
                commit.commit_decided(s)
                wave = s.cuts.due(s.schedule.completed, s.sync.acked_waves)
                if wave is not None:
                    state = s.cut_state()
                    # Written and fsynced without the lock: Status (the driver's liveness check,
                    # 2 s deadlines) and the neighbours' inputs are answered meanwhile.
                    self._cv.release()
                    try:
                        s.save_cut(wave, state)
                    finally:
                        self._cv.acquire()
                    continue
                task = self._eval_task(s) or s.schedule.next_task(s.forward_allowed)
                waiting = s.sync.waiting
                if task is not None:
                    # An evaluation or the final merge is no input of the schedule's.
                    self._busy = task.kind not in (TaskKind.EVAL, TaskKind.MERGE_FINAL)
                    self._at_task = (task, time.monotonic())
                    return task
                committed = s.scaling is None or not s.scaling.waiting
                if self.state == StageState.RUNNING and s.schedule.done and committed and s.sync.finished():
                    self._to(StageState.DONE)  # stays up for the final evaluation, until stopped
                    if self._steady is not None:
                        self._steady.done(time.monotonic())
                if self.state == StageState.RUNNING and s.reads_ahead and not waiting:
                    # Waiting for a neighbour: the next minibatch's data is read now, without the
                    # lock, rather than at the start of its forward (an input may come meanwhile).
                    # Not while a forward waits for a pull: the pull's handling is then the
                    # critical path, and the read would take the interpreter from it.
                    self._cv.release()
                    try:
                        s.read_ahead()
                    finally:
                        self._cv.acquire()
                    idle_since = time.monotonic()   # reading is no idle time
                    continue
                self._cv.wait(0.5)

    def _loop(self, s: Loaded) -> None:
        task: Task | None = None
        kind = MicroTasks if isinstance(s.schedule, MicroSchedule) else MinibatchTasks
        tasks = kind(self._inbox, self._cv, self._losses)
        steady = SteadyWindow(s.job.nm, s.schedule.completed)
        with self._cv:
            self._steady = steady
        run = {TaskKind.FORWARD: tasks.forward, TaskKind.BACKWARD: tasks.backward,
               TaskKind.FORWARD_BACKWARD: tasks.forward_backward, TaskKind.EVAL: self._evaluate,
               TaskKind.MERGE_FINAL: self._merge_final}
        try:
            devices.make_current(s.setup.device)
            while True:
                task = None  # what fails in _next_task (a merge, a commit, a checkpoint) is no task's
                task = self._next_task(s)
                if task is None:
                    break
                if s.profile is not None:
                    s.profile.before(s.schedule.completed)
                started = time.monotonic()
                ran = run[task.kind](s, task)
                forward = ran.forward
                with self._cv:
                    self._busy = False
                    self._at_task = None
                    if task.kind in (TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.FORWARD_BACKWARD):
                        elapsed = time.monotonic() - started
                        forward = elapsed if task.kind == TaskKind.FORWARD else min(forward, elapsed)
                        self._phase_seconds["forward"] += forward
                        self._phase_seconds["backward"] += elapsed - forward
                        completed = s.schedule.completed
                        s.schedule.complete(task)
                        # Reported done once its step is too (Ran.then, after the sends below).
                        self._stepping = s.schedule.completed - completed if ran.then is not None else 0
                    self._cv.notify_all()
                # Only now may results leave: a neighbour reacting to them (stage 0 injecting
                # p + nm after this gradient) must find this task recorded as done.
                for link, message in ran.sends:
                    link.send(message)
                if ran.then is not None:
                    began = time.monotonic()
                    ran.then()
                    with self._cv:
                        self._phase_seconds["backward"] += time.monotonic() - began   # p's step is its backward's
                        self._stepping = 0
                with self._cv:
                    steady.stepped(s.schedule.completed, time.monotonic())
                if s.profile is not None:
                    s.profile.after_task(s.schedule.completed)
        except Exception as exc:  # any bug or device error fails the stage loudly, naming p
            with self._cv:
                stopping = self._stopping
            if stopping:   # stopped on purpose: what closing cut short is no failure
                log.info("%s stopped (%s: %s)", s.setup.name, type(exc).__name__, exc)
                return
            log.exception("%s crashed", s.setup.name)
            said = worker_words(str(exc), s.setup.job.base_dir).rstrip().removesuffix(".")   # torch's end with one, and a place follows
            hint = data_hint(exc)
            self.fail(f"{type(exc).__name__}: {said}{f' ({hint})' if hint else ''}{_where(task, s.schedule.completed)}")

    # ---- evaluation --------------------------------------------------------------------------

    def _merge_final(self, s: Loaded, task: Task) -> Ran:
        assert self._final is not None
        s.sync.pull_now(s.compute, self._final)
        with self._cv:
            self._final_merged = True
        return Ran([])

    def _evaluate(self, s: Loaded, task: Task) -> Ran:
        """Stage 0: reads held-out minibatch task.p and sends it on (the next one is its next
        task); a later stage runs the one that arrived; the last stage scores it."""
        assert s.evals is not None
        k = task.eval
        if s.setup.first:
            i = task.p
            if i == 1:
                s.evals.started.add(k)
                if k != s.evals.schedule.final_id:
                    s.evals.schedule.ran(k)
            s.evals.going = (k, i + 1) if i < len(s.evals.batches) else None
            inputs = [(i, s.evals.read(i)[0])]
        else:
            with self._cv:
                _, i, x = self._inbox.evals.popleft()
            inputs = [(i, x)]
        sends: list[Send] = []
        for i, x in inputs:
            out = s.compute.evaluate(x.to(s.compute.device))
            s.evals.minibatches_run += 1   # read by Status without the lock: one int, for the stall check
            if s.next is not None:
                sends.append(commit.activation(s, i, s.compute.version, out, k))
            else:
                final = k == s.evals.schedule.final_id
                s.evals.score(k, i, out, trained=s.job.train.steps if final else s.schedule.completed,
                              name=s.setup.name)
        s.evals.ran(k, len(inputs))
        return Ran(sends)

    # ---- queries and shutdown ----------------------------------------------------------------

    def progress(self, *, weights_digest: bool = False) -> Progress:
        """The stage's state and counters at one instant; with weights_digest, also a hash of its
        weights (reads them all, under the lock the compute thread needs: polls leave it out)."""
        with self._cv:
            losses = list(self._losses.recent)
            first_bad = self._losses.first_bad
        # Outside the lock: reading a loss on a GPU waits for the work queued before it.
        last_loss = float(losses[-1][1]) if losses else float("nan")
        recent_loss = float(torch.stack([loss for _, loss in losses]).mean()) if losses else float("nan")
        diverged_minibatch, diverged_loss = losses_read(first_bad)
        with self._cv:
            s = self._s
            if s is None:
                who = self._setup
                return Progress(state=self.state, error=self.error, failed_at=self.failed_at, detail=self.detail,
                                vw=who.vw if who else 0, stage=who.stage if who else 0,
                                device=who.device.name if who else "", label=who.label if who else "")
            setup, sched = s.setup, s.schedule
            links = (s.next, s.prev)
            done = sched.completed - self._stepping   # minibatches stepped here
            steady = self._steady.read(done, time.monotonic()) if self._steady is not None else (0, 0.0)
            used, capacity = metrics.device_memory(setup)
            return Progress(
                state=self.state, error=self.error, failed_at=self.failed_at, detail=self._doing(s, time.monotonic()),
                vw=setup.vw, stage=setup.stage, device=setup.device.name,
                label=setup.label, gpu_type=setup.gpu_type, emulated=setup.emulated, memory_used_bytes=used,
                memory_capacity_bytes=capacity, peak_rss_bytes=devices.peak_rss_bytes(),
                device_peak_bytes=0 if setup.emulated else devices.device_peak_bytes(setup.device),
                forwards_done=sched.next_forward - 1,
                backwards_done=done, samples=done * s.job.data.batch_size,
                local_version=s.compute.version, in_flight=sched.in_flight,
                queue_depth=max(0, sched.ready - (1 if self._busy else 0)), waiting=s.sync.waiting,
                cut=s.cuts.waiting_at,
                received=self._inbox.received,
                eval_minibatches=s.evals.minibatches_run if s.evals is not None else 0,
                last_loss=last_loss, recent_loss=recent_loss, last_loss_minibatch=losses[-1][0] if losses else 0,
                diverged_minibatch=diverged_minibatch, diverged_loss=diverged_loss,
                forward_seconds=self._phase_seconds["forward"], backward_seconds=self._phase_seconds["backward"],
                idle_seconds=self._idle_seconds, wait_seconds=s.sync.wait_seconds,
                wait_idle_seconds=self._wait_idle_seconds,
                sent_forward_bytes=links[0].bytes_sent if links[0] is not None else 0,
                sent_backward_bytes=links[1].bytes_sent if links[1] is not None else 0,
                socket_forward_bundles=links[0].socket_bundles if links[0] is not None else 0,
                socket_backward_bundles=links[1].socket_bundles if links[1] is not None else 0,
                shm_bytes=s.sync.shm_bytes + sum(link.shm_bytes for link in links if link is not None),
                cuda_ipc_bytes=sum(link.cuda_ipc_bytes for link in links if link is not None),
                clock=s.sync.clock, min_clock=s.sync.min_clock,
                steady_minibatches=steady[0], steady_seconds=steady[1],
                evals=tuple(s.evals.totals.results) if s.evals is not None else (),
                weights_digest=s.compute.digest() if weights_digest else "",
            )

    def _doing(self, s: Loaded, now: float) -> str:
        """What the compute thread has been at for over DOING_SHOWN_S (a stall's report names it):
        reading a minibatch from the dataset, or a task. Under the lock."""
        for reader, what in ((s.inputs, "inputs"), (s.targets, "targets")):
            reading = reader.reading if reader is not None else None   # in a task, or reading ahead
            if reading is not None and now - reading[1] > DOING_SHOWN_S:
                return f"reading minibatch {reading[0]}'s {what} from the dataset for {now - reading[1]:.0f}s"
        if self._at_task is None:
            return ""
        task, since = self._at_task
        if now - since <= DOING_SHOWN_S:
            return ""
        if task.kind == TaskKind.MERGE_FINAL:
            named = "the final merge"
        elif task.kind == TaskKind.EVAL:
            named = f"evaluation {task.eval}'s minibatch {task.p}"
        else:
            named = {TaskKind.FORWARD: "the forward", TaskKind.BACKWARD: "the backward",
                     TaskKind.FORWARD_BACKWARD: "the forward and backward"}[task.kind]
            named += f" of minibatch {task.p}" + (f", micro-batch {task.micro}" if task.micro else "")
        return f"running {named} for {now - since:.0f}s"

    def weights(self, keys: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        """The stage's state_dict entries (these keys; all by default), on the CPU."""
        # Each copy of a key named again would be sent again: 20000 copies of a 4 KiB weight's
        # name asked 400 times the request's bytes (of a large model's embedding, terabytes).
        twice = [k for k, n in Counter(keys or ()).items() if n > 1]
        if twice:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"keys named more than once: {twice[:5]}")
        with self._cv:
            if self._s is None:
                raise _refused(self.state, "no weights before the stage has loaded:")
            state = self._s.compute.state()
            if not keys:
                return state
            have = dict(state)
            unknown = [k for k in keys if k not in have]
            if unknown:
                raise Rejected(grpc.StatusCode.NOT_FOUND, f"keys not on {self._s.setup.name}: {unknown[:5]}")
            return [(k, have[k]) for k in keys]

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
            s = self._s
        if s is not None:   # the compute thread may wait in the final merge for w_global: not for 5 s
            s.sync.interrupt()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._s is not None:
            self._s.close()

