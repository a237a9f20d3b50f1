"""Drives one job over gRPC: assign the stages, wait for them to load, start, watch progress and
failures, run the final evaluation, and stream the final weights to output.dir. The driver never
holds the model: weights go from the stages and shards to the files one frame at a time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2_grpc

from hetpipe import data, models, outputs, rpc, weight_files
from hetpipe.config import JobConfig
from hetpipe.errors import JobFailed, StageLost
from hetpipe.optim import compute_dtype
from hetpipe.training import learning_rate
from hetpipe.v1 import ps_pb2, stage_pb2, wire_pb2
from hetpipe.wsp import shard_bound, total_waves
from coordinator.planner import Plan, StagePlan, cache, resolved_job
from coordinator.planner.shapes import boundaries
from coordinator import checkpoints
from coordinator.assignment import Assigner, check_eval_cuts
from coordinator.shard_watch import ShardWatch, shard_name
from coordinator.stall import StallWatch

log = logging.getLogger(__name__)
State = stage_pb2.StageStatus.State
FINAL_EVAL_TIMEOUT_S = 600.0
FINAL_POLL_S = 0.01   # the poll interval once every minibatch is through the last stages


@dataclass
class StageHandle:
    plan: StagePlan
    address: str
    channel: grpc.Channel
    stub: rpc.Stub
    last: stage_pb2.StageStatus = field(default_factory=stage_pb2.StageStatus)
    node: str = ""   # the host it registered from, when known
    host_id: str = ""  # hetpipe.shm.host_id() of its process, when known

    @property
    def name(self) -> str:
        return f"stage {self.plan.stage} of vw {self.plan.vw}"

    @property
    def at(self) -> str:
        """Where it runs, for messages: its address, and its node when known."""
        return f"{self.address} on node {self.node}" if self.node else self.address

    def progress(self) -> str:
        s = self.last
        return f"it had finished {s.forwards_done} forwards and {s.backwards_done} backwards"


@dataclass
class Progress:
    samples: int
    total: int
    loss: float | None   # the last stages' mean recent loss; None: none has trained in this run yet
    samples_per_second: float
    evicted: tuple[int, ...] = ()  # VWs that left the job


def trained_here(per_vw: Iterable[int], before: int) -> int:
    """Minibatches this run trained, from each VW's count of those trained in all: a run resumed
    from the checkpoint of wave W starts every VW at minibatch W·nm + 1 (before: W·nm), and an
    earlier run trained the ones before, in seconds that are not this run's."""
    return sum(max(n - before, 0) for n in per_vw)  # a VW that left before it reported counts 0


class JobDriver:
    """Runs a planned job on stage workers (and shards) that are already serving."""

    def __init__(
        self, job: JobConfig, plan: Plan, stage_addresses: list[str], *,
        ps_addresses: list[str] | None = None,
        check_processes: Callable[[], None] = lambda: None,
        resume_wave: int = 0,
        nodes: list[str] | None = None,
        trace_dir: str | None = None,
        host_ids: list[str] | None = None,
        ps_host_ids: list[str] | None = None,
    ) -> None:
        """nodes: each stage worker's host, for messages. trace_dir: where the stages write their
        trace (default output.dir/trace; a job from another host: relative, on each stage's host).
        host_ids, ps_host_ids: each stage's and shard's shm.host_id(), for parallel.transport
        (unknown: gRPC only)."""
        self.job = resolved_job(job, plan)
        self.plan = plan
        self.ps_addresses = ps_addresses or []
        self.ps_host_ids = ps_host_ids or [""] * len(self.ps_addresses)
        self.check_processes = check_processes
        # A shard that stopped answering (index, address, why): True once it is being restarted
        # (a local launcher kills it); False fails the job.
        self.restart_hung_shard: Callable[[int, str, str], bool] = lambda index, address, why: False
        self.stopping = threading.Event()   # set when the job is stopped: waits for a shard's return end
        self.stages = []
        unknown = [""] * len(stage_addresses)
        for sp, address, node, host in zip(plan.stages, stage_addresses, nodes or unknown, host_ids or unknown):
            ch = rpc.channel(address)
            self.stages.append(StageHandle(sp, address, ch, rpc.Stub(ch, "Stage"), node=node, host_id=host))
        self.out_dir = Path(job.resolve(job.output.dir))
        self.trace_dir = Path(trace_dir) if trace_dir is not None else self.out_dir / "trace"
        self._ps_channels = [rpc.channel(a) for a in self.ps_addresses]
        self.shards = [rpc.Stub(ch, "ParameterServer") for ch in self._ps_channels]
        self.watch = StallWatch(self.job.train.stall_timeout_s, time.monotonic())
        self._watch_lock = threading.Lock()   # the shard watch's thread feeds self.watch too
        self._shard_watch = ShardWatch([health_pb2_grpc.HealthStub(ch) for ch in self._ps_channels], self.watch,
                                       self._watch_lock, self._shard_silent)
        self._restart_shards = False   # not while the stages load: they give the shards w0 then
        self.silent_shard = ""   # why the job fails: a shard that stopped answering
        self.resume_wave = resume_wave
        checkpointing = self.job.train.checkpoint_every > 0 or resume_wave > 0
        self.checkpoint_dir = self.out_dir / outputs.CHECKPOINTS if checkpointing else None
        self.checkpoints: checkpoints.Checkpoints | None = None  # made in setup, where the model is known
        self.evals: dict[int, stage_pb2.EvalResult] = {}
        # --resume: the interrupted run's evaluations up to the cut, which eval.jsonl keeps. One
        # right at the cut runs again (VW 0's stages cannot tell), on the restored w_global, not
        # the weights the first run scored: its first row stays.
        # By minibatches, not id: an id counts eval.every's, which a resume may change.
        self._kept_evals = {row["minibatches"] for row in outputs.evals_through(
            self.out_dir, resume_wave * self.plan.nm)} if resume_wave else set()
        self.evicted: list[dict[str, Any]] = []  # VWs that left (parallel.on_vw_failure: continue)
        self.started = time.time()
        self.seconds_before = 0.0   # --resume: the training seconds of the runs before, up to the cut

    def stop_watching(self) -> None:
        """No more shard restarts or verdicts: the job has ended (its workers are being stopped)."""
        self._shard_watch.close()

    def close(self) -> None:
        self._shard_watch.close()
        for ch in [s.channel for s in self.stages] + self._ps_channels:
            ch.close()

    def _shard_silent(self, index: int, seconds: float) -> bool:
        """The shard watch found shard index silent: True once it is being restarted; else the job
        fails, and every call waiting on the shard ends now (its channel closed) instead of at its
        deadline."""
        address = self.ps_addresses[index]
        why = f"not responding: no answer to health checks for {seconds:.0f}s"
        if self._restart_shards and self.restart_hung_shard(index, address, why):
            return True
        loading = "" if self._restart_shards else " (while the stages loaded)"
        self.silent_shard = f"{shard_name(index)} at {address} {why}{loading}"
        self._ps_channels[index].close()
        return False

    def check_shards(self) -> None:
        """JobFailed once the shard watch has found a shard that stopped answering."""
        if self.silent_shard:
            raise JobFailed(self.silent_shard)

    # ---- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Assigns every stage (each loads its own layers, and VW 0's give the shards w0), waits
        until all have loaded, and starts them."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if (self.job.output.trace or self.job.output.profile) and self.trace_dir.parent == self.out_dir:  # not a folder on the stages' hosts
            self.trace_dir.mkdir(exist_ok=True)
        self.model = models.structure(self.job.model, self.job.base_dir, dtype=self.job.train.dtype)   # meta: names and shapes only
        self.batch = data.batch_shapes(self.job)
        model_key = cache.model_key(self.job.model, self.job.base_dir, self.job.model.args, self.model)
        flows = boundaries(self.model, self.batch[0], compute_dtype(self.job.train.precision),
                           cache_dir=cache.default_cache_dir(), model_key=model_key)
        check_eval_cuts(self.job, self.plan, self.model, self.batch, flows, model_key)
        if self.checkpoint_dir is not None:
            self.checkpoints = checkpoints.Checkpoints(
                self.checkpoint_dir, self.shards, self.plan.key_shard,
                weight_files.entries(self.model, getattr(torch, self.job.train.dtype)),
                checkpoints.job_shape(self.job, self.plan, len(self.shards)),
                bound=shard_bound(self.job.parallel.sync, self.job.parallel.D), closing=self.stopping,
                job_record=checkpoints.job_record(self.job))
        self._shard_watch.start()
        if self.checkpoints is not None:
            self.checkpoints.prepare()
        assigner = Assigner(self.job, self.plan, self.model, self.batch, flows, self.ps_addresses, self.ps_host_ids,
                            self.trace_dir, self.checkpoint_dir,
                            self.checkpoints.mark if self.checkpoints is not None else "", self.resume_wave)
        for h in self.stages:  # each answers at once and loads in the background
            self.call(h, "Assign", assigner.assignment(h, self.stages))
        if self.checkpoints is not None and self.resume_wave:  # VW 0's stages give w0 only on a fresh start
            self.seconds_before = self.checkpoints.restore_shards(self.resume_wave)
        self._wait_loaded()
        if self.checkpoints is not None:
            self._check_shared(self.checkpoints)
        self._restart_shards = True
        self.started = time.time()
        for h in self.stages:
            self.call(h, "Start", wire_pb2.Empty())

    def _check_shared(self, cuts: checkpoints.Checkpoints) -> None:
        """JobFailed naming the stages whose hosts do not share the checkpoints folder: found at
        the start, not at the first cut, perhaps hours in."""
        unshared = set(cuts.unshared())
        hosts = [h for h in self.stages if (h.plan.vw, h.plan.stage) in unshared]
        if hosts:
            what = "; ".join(f"{h.name} at {h.at}" for h in hosts[:4]) + ("; ..." if len(hosts) > 4 else "")
            raise JobFailed(f"train.checkpoint_every {self.job.train.checkpoint_every}: the checkpoints folder "
                            f"{cuts.folder} on this coordinator's host is not shared with {what}, whose part of "
                            "each cut would be saved where no resume finds it: share output.dir with the stages' "
                            "hosts (compose's volume runs, k8s's claim), or train.checkpoint_every 0")

    def _wait_loaded(self, interval: float = 0.05) -> None:
        """Waits until every stage is READY, up to train.setup_timeout_s; JobFailed names a stage
        that failed to load, or the ones still loading when the time is up. A stop, or a worker
        gone, ends the wait at once (check_processes): a large model's load takes minutes."""
        deadline = time.monotonic() + self.job.train.setup_timeout_s
        while True:
            self.check_processes()
            self.check_shards()
            loading = []
            for h in self.stages:
                # A stage busy loading (torch's import, a large model's build) may miss a Status
                # deadline: the job fails only once it has been silent for train.stall_timeout_s.
                if not self._ask_status(h):
                    loading.append(h)
                    continue
                if h.last.state == State.FAILED:
                    raise JobFailed(f"{h.last.error} (at {h.at})" if h.node else h.last.error)
                if h.last.state == State.LOADING:
                    loading.append(h)
            if not loading:
                return
            self._name_the_silent(loading=True)
            if time.monotonic() > deadline:
                what = "; ".join(f"{h.name} at {h.at} ({h.last.detail or 'loading'})" for h in loading[:4])
                raise JobFailed(f"stages still loading after train.setup_timeout_s "
                                f"{self.job.train.setup_timeout_s:g}s: {what}")
            time.sleep(interval)

    def call(self, h: StageHandle, method: str, request: Any, *, deadline: float = rpc.CONTROL_DEADLINE_S) -> Any:
        try:
            return getattr(h.stub, method)(request, timeout=deadline)
        except grpc.RpcError as exc:
            self._failed(h, method, exc)

    def _failed(self, h: StageHandle, method: str, exc: grpc.RpcError) -> Any:
        """Raises JobFailed for a call to h that failed: the process's death if it died."""
        self.check_dead(exc.code())
        raise StageLost(h.plan.vw, f"{h.name} at {h.at}: {method} failed: {exc.code().name}: "
                                   f"{exc.details()} ({h.progress()})") from None

    def check_dead(self, code: grpc.StatusCode) -> None:
        """After a call that failed with code: JobFailed naming a process that died (the launcher's
        report: its pid, how it died, how far it got), rather than gRPC's words for its socket."""
        self.check_processes()
        if code == grpc.StatusCode.UNAVAILABLE:  # a killed peer's socket closes just before it is reaped
            time.sleep(0.2)
            self.check_processes()

    # ---- running ---------------------------------------------------------------------------

    @property
    def lead_vw(self) -> int:
        """The VW that evaluates and gives the weights the shards do not hold: VW 0 unless it left."""
        return min(h.plan.vw for h in self.stages)

    def poll(self) -> bool:
        """Refreshes every stage's status; True once all are done. Raises JobFailed, also for a
        stage that has not answered for train.stall_timeout_s, unless its VW may leave the job."""
        while True:
            try:
                return self._poll()
            except StageLost as lost:
                self._evict(lost)

    def _evict(self, lost: StageLost) -> None:
        """parallel.on_vw_failure continue: VW lost.vw leaves, and the shards stop waiting for it
        (its acknowledged pushes stay in w_global). Re-raises lost where the job cannot go on."""
        live = sorted({h.plan.vw for h in self.stages})
        if self.job.parallel.on_vw_failure != "continue" or not self.shards or len(live) < 2 or lost.vw not in live:
            raise lost
        if lost.vw == 0 and self.job.eval is not None:
            raise JobFailed(f"{lost} (vw 0 runs the evaluations: the job cannot go on without it)") from None
        gone = [h for h in self.stages if h.plan.vw == lost.vw]
        self.stages = [h for h in self.stages if h.plan.vw != lost.vw]
        with self._watch_lock:   # a silent one among them would keep the no-progress check off for good
            for h in gone:
                self.watch.answered(h.name)
        for h in gone:  # the rest of its pipeline: nothing more to do
            try:
                h.stub.Stop(wire_pb2.Empty(), timeout=rpc.STATUS_DEADLINE_S)
            except grpc.RpcError:
                pass
        owning = set(self.plan.key_shard.values())
        for i, stub in enumerate(self.shards):
            if i not in owning:   # it owns no key: never initialised, it holds no clock to wait on
                continue
            request = ps_pb2.EvictRequest(vw=lost.vw)
            try:  # through a shard restart: the eviction is durable once acknowledged
                rpc.retrying(lambda: stub.Evict(request, timeout=rpc.CONTROL_DEADLINE_S), give_up_s=60.0)
            except grpc.RpcError as exc:
                raise JobFailed(f"{lost}; evicting vw {lost.vw} failed at ps shard {i}: "
                                f"{exc.code().name}: {exc.details()}") from None
        minibatches = max(h.last.backwards_done for h in gone)
        self.evicted.append({"vw": lost.vw, "seconds": self._seconds(time.time()), "minibatches": minibatches,
                             "reason": str(lost)})
        log.warning("vw %d left the job after %d minibatches (%s); %d virtual workers train on",
                    lost.vw, minibatches, lost, len(live) - 1)
        if self.checkpoints is not None and len(self.evicted) == 1:   # _take_cut takes none from here on
            log.warning("no more checkpoints are taken (a run without a VW cannot be resumed); the latest stays "
                        "the one before vw %d left", lost.vw)

    def _ask_status(self, h: StageHandle) -> bool:
        """h.last from its Status; False where the call ran out of time (the watch counts h
        silent from then). Any other failure fails the job, naming h."""
        try:
            # Short: a frozen stage must not hold up the heartbeat check on the next poll.
            h.last = h.stub.Status(stage_pb2.StatusRequest(), timeout=rpc.STATUS_DEADLINE_S)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self._failed(h, "Status", exc)
            with self._watch_lock:
                self.watch.unanswered(h.name, time.monotonic())
            return False
        with self._watch_lock:
            self.watch.answered(h.name)
        return True

    def _poll(self) -> bool:
        self.check_processes()
        answered = [h for h in self.stages if self._ask_status(h)]
        self._check_diverged()   # before the failures: a shard refusing a NaN update is the symptom
        failed = [h for h in self.stages if h.last.state == State.FAILED]
        if failed:
            # The first to fail is the cause: its neighbours then fail to send to it, or to hear from it.
            h = min(failed, key=lambda h: h.last.failed_at)
            raise StageLost(h.plan.vw, f"{h.last.error} ({f'at {h.at}; ' if h.node else ''}{h.progress()})")
        self.check_shards()
        self._name_the_silent()
        # The evaluations first: one that ran before a cut is in eval.jsonl before the cut's manifest,
        # which a --resume trusts (the stages do not run it again).
        self._collect_evals()
        self._take_cut(answered)
        return all(h.last.state == State.DONE for h in self.stages)

    def _check_diverged(self) -> None:
        """JobFailed once a last stage's loss is NaN or Inf: training has diverged, and every
        minibatch after it is wasted (in fp32 and bf16; fp16's loss scaling skips such steps)."""
        if self.job.train.precision == "fp16":
            return
        for h in self.last_stages():
            if h.last.diverged_minibatch:   # the first such minibatch, however many came after it
                p, peak = h.last.diverged_minibatch, self.job.train.optimizer.lr
                rate = learning_rate(self.job.train, p)
                lr = f"train.optimizer.lr is {peak:g}" if rate == peak else \
                    f"its learning rate is {rate:g}, of train.optimizer.lr {peak:g} and train.lr_schedule"
                raise JobFailed(f"training diverged: the loss of vw {h.plan.vw} is {h.last.diverged_loss} at minibatch "
                                f"{p} ({lr}; a smaller one, or a look at the data, may help; {h.name} at {h.at})")

    def _seconds(self, at: float) -> float:
        """Training seconds at time `at`: since this run started, after those of the runs it resumed
        from (up to their cut), so that eval.jsonl's rows count on across a --resume."""
        return self.seconds_before + at - self.started

    def _take_cut(self, answered: list[StageHandle]) -> None:
        """Once every stage waits at the same checkpoint, its shard part, then on they go. A stage
        that answered this poll still waiting at the cut taken missed its Continue (its VW left
        meanwhile, failing the loop): it gets it now, or it would wait there for good."""
        if self.checkpoints is None:
            return
        waves = {h.last.cut for h in self.stages}
        if len(waves) == 1 and (wave := waves.pop()) > self.checkpoints.taken:
            if self.evicted:
                # A run cannot go on without a VW yet: such a cut would replace the last one a
                # --resume can go on from. The stages go on all the same.
                self.checkpoints.skip(wave)
            else:
                self.checkpoints.take(wave, self.lead_vw, [], self._seconds(time.time()))
                log.info("checkpoint of wave %d in %s", wave, self.checkpoint_dir)
            with self._watch_lock:   # saving the parts and streaming the shards' values moved no counter
                self.watch.paused(time.monotonic())
        taken = self.checkpoints.taken
        for h in answered:
            if taken and h.last.cut == taken and h in self.stages:
                self.call(h, "Continue", wire_pb2.Empty())

    def _name_the_silent(self, *, loading: bool = False) -> None:
        """A stage silent for train.stall_timeout_s (silent shards are the shard watch's)."""
        with self._watch_lock:
            silent = self.watch.not_responding(time.monotonic())
        for who, seconds in silent:
            h = next((h for h in self.stages if h.name == who), None)
            if h is not None:
                doing, done = (" while it loads", "") if loading else ("", f"; {h.progress()}")
                raise StageLost(h.plan.vw, f"{h.name} at {h.at} not responding{doing}: no answer to Status for "
                                f"{seconds:.0f}s (train.stall_timeout_s{done})")

    def _check_progress(self) -> None:
        """Fails a job that stopped moving although every process answers: a stage stuck inside
        its own work, named with what waits for it."""
        now = time.monotonic()
        with self._watch_lock:
            self.watch.progress(tuple((h.last.forwards_done, h.last.backwards_done, h.last.clock, h.last.received,
                                       h.last.eval_minibatches)
                                      for h in self.stages), now)
            seconds = self.watch.stalled_for(now)
        if seconds is None:
            return
        waiting = "; ".join(
            f"{h.name}: {h.last.queue_depth} inputs waiting to run, {h.last.in_flight} in flight"
            + (", blocked on a pull (clock bound)" if h.last.waiting else "") + (f", {h.last.detail}" if h.last.detail else "")
            for h in self.stages if h.last.state != State.DONE)
        raise JobFailed(f"no progress for {seconds:.0f}s (train.stall_timeout_s) although every stage and "
                        f"shard answers: {waiting}")

    def run(self, on_progress: Callable[[Progress], None] = lambda p: None, interval: float = 0.1) -> float:
        """Polls until done; returns the training wall time in seconds."""
        start = time.monotonic()
        while not self.poll():
            self._check_progress()
            progress = self._progress(start)
            on_progress(progress)
            # Once every minibatch is through the last stages, only the pipeline's drain and the
            # last pushes are left: look often, for the run ends when its last stage is seen DONE.
            time.sleep(interval if progress.samples < progress.total else min(interval, FINAL_POLL_S))
        wall = time.monotonic() - start
        on_progress(self._progress(start))
        return wall

    def minibatches(self) -> tuple[int, int]:
        """Minibatches trained so far, and in all, by every VW (those that left: until they left)."""
        left = sum(e["minibatches"] for e in self.evicted)
        live = len(self.last_stages())
        return sum(h.last.backwards_done for h in self.last_stages()) + left, self.job.train.steps * live + left

    def trained_here(self) -> int:
        """Minibatches this run has trained (after --resume, less the checkpoint's)."""
        per_vw = [h.last.backwards_done for h in self.last_stages()] + [e["minibatches"] for e in self.evicted]
        return trained_here(per_vw, self.resume_wave * self.plan.nm)

    def last_stages(self) -> list[StageHandle]:
        return [h for h in self.stages if h.plan.stage == self.plan.stages_per_vw - 1]

    def _progress(self, start: float) -> Progress:
        samples, total = (n * self.job.data.batch_size for n in self.minibatches())
        # The last stages that have trained in this run: a NaN loss of theirs is one (fp16 skipping
        # steps), not the NaN a stage reports before its first minibatch.
        done = self.resume_wave * self.plan.nm
        losses = [h.last.recent_loss for h in self.last_stages() if h.last.backwards_done > done]
        elapsed = max(time.monotonic() - start, 1e-9)
        rate = self.trained_here() * self.job.data.batch_size / elapsed   # this run's samples in this run's time
        return Progress(samples, total, sum(losses) / len(losses) if losses else None, rate,
                        tuple(e["vw"] for e in self.evicted))

    # ---- evaluation --------------------------------------------------------------------------

    def _collect_evals(self) -> None:
        """Appends VW 0's finished evaluations to eval.jsonl (each once)."""
        scorer = next(h for h in self.last_stages() if h.plan.vw == self.lead_vw)
        new = [e for e in scorer.last.evals if e.id not in self.evals]
        if not new:
            return
        for e in new:
            self.evals[e.id] = e
        new = [e for e in new if e.final or e.minibatches not in self._kept_evals]
        if not new:
            return
        live, batch = len({h.plan.vw for h in self.stages}), self.job.data.batch_size

        def samples(minibatches: int) -> int:   # a VW that left trained its own count, not VW 0's
            return (minibatches * live + sum(min(x["minibatches"], minibatches) for x in self.evicted)) * batch

        outputs.append_evals(self.out_dir, [{
            "id": e.id, "final": e.final, "minibatches": e.minibatches, "samples": samples(e.minibatches),
            "seconds": self._seconds(e.time), "rows": e.rows, "loss": e.loss,
            "accuracy": e.accuracy if self.job.train.loss == "cross_entropy" else None,
        } for e in new])

    def final_evaluation(self) -> stage_pb2.EvalResult | None:
        """Evaluates the final model (w_global after every VW's last push) on VW 0's stages."""
        if self.job.eval is None:
            return None
        clock = total_waves(self.job.train.steps, self.plan.nm) if self.ps_addresses else 0
        for h in self.stages:
            if h.plan.vw == self.lead_vw:
                self.call(h, "Evaluate", stage_pb2.EvalRequest(min_clock=clock))
        deadline, run = time.monotonic() + FINAL_EVAL_TIMEOUT_S, -1
        while not any(e.final for e in self.evals.values()):
            # A large held-out set takes as long as it takes, while its minibatches move on: a
            # deadline on the whole failed such a job before its weights were written.
            now_run = sum(h.last.eval_minibatches for h in self.stages if h.plan.vw == self.lead_vw)
            if now_run != run:
                deadline, run = time.monotonic() + FINAL_EVAL_TIMEOUT_S, now_run
            if time.monotonic() > deadline:
                raise JobFailed(f"the final evaluation made no progress for {FINAL_EVAL_TIMEOUT_S:g}s")
            time.sleep(0.05)
            self.poll()
        return next(e for e in self.evals.values() if e.final)

