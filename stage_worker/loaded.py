"""What a stage holds once it has loaded its assignment: its own layers (built alone, or read
from its slice of model.init), its optimizer, its data readers, its evaluation, its sync."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hetpipe import data, datasets, draws, faults, model_init, models, outputs, weight_files
from hetpipe.draws import forward_draws
from hetpipe.loss_scale import LossScale, Verdicts
from hetpipe.parallelism import MICRO_SCHEDULES
from hetpipe.optim import compute_dtype, for_loss, score
from stage_worker import checkpoint, metrics
from stage_worker.assignment import Setup
from stage_worker.evaluation import Schedule, Totals
from stage_worker.links import Link
from stage_worker.scaling import Scaling
from stage_worker.micro_schedule import MicroSchedule
from stage_worker.schedule import StageSchedule
from stage_worker.stage import StageCompute
from stage_worker.sync import LocalSync, Sync, SyncCallbacks, SyncConfig
from stage_worker.profiling import StageProfile
from stage_worker.trace import MinibatchTrace
from stage_worker.elastic_sync import ElasticSync
from stage_worker.wsp_sync import WspSync


log = logging.getLogger(__name__)


class LoadError(Exception):
    """The assignment does not fit the model the stage built."""


class Evals:
    """VW 0's evaluations at this stage: when stage 0 runs them, the held-out minibatches
    (read by stage 0 and by the last stage), and the last stage's totals."""

    def __init__(self, setup: Setup) -> None:
        job = setup.job
        assert job.eval is not None
        self.job = job
        self.schedule = Schedule(job.eval.every, job.train.steps)
        # Every stage of VW 0 knows the held-out minibatches, to check what arrives; stage 0 reads
        # their inputs and the last stage their targets.
        held_out = datasets.held_out_set(job)
        assert held_out is not None, "the job parser requires held-out data for eval"
        self.dataset = held_out
        self.batches = data.eval_batches(job, held_out, job.eval.rows_read)
        self.totals = Totals(len(self.batches), job.train.loss == "cross_entropy")
        self.started: set[int] = set()
        self.going: tuple[int, int] | None = None   # stage 0: (evaluation, its next minibatch) part way through
        self._partly_run: dict[int, int] = {}   # evaluation -> its minibatches run here so far, until all are
        # Every evaluation minibatch run here: the driver's stall check counts it as progress, for
        # an evaluation moves no training counter.
        self.minibatches_run = 0

    def ran(self, k: int, minibatches: int) -> None:
        """This stage ran `minibatches` more of evaluation k's minibatches (stage 0: all at once)."""
        done = self._partly_run.pop(k, 0) + minibatches
        if done < len(self.batches):
            self._partly_run[k] = done

    @property
    def midway(self) -> bool:
        """An evaluation has run some of its minibatches here but not all: weights merged now
        (a pull, an elastic delta) would make it score two weight versions."""
        return bool(self._partly_run)

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.dataset is not None
        return data.read_rows(self.job, self.dataset, self.batches[i - 1], (draws.EVAL_DRAW, i))

    def score(self, k: int, i: int, out: torch.Tensor, *, trained: int, name: str) -> None:
        """The last stage: evaluation k's minibatch i came out as out; `trained` minibatches of VW 0
        had trained the weights it ran on."""
        y = self.read(i)[1].to(out.device)
        logits = for_loss(compute_dtype(self.job.train.precision), out)  # as training's loss reads it
        result = self.totals.add(k, score(self.job.train.loss, logits, y), rows=int(out.shape[0]),
                                 minibatches=trained, final=k == self.schedule.final_id, now=time.time())
        if result is not None:
            log.info("%s: evaluation %d after %d minibatches: loss %.4f, accuracy %.4f", name, k,
                     result.minibatches, result.loss, result.accuracy)


class Loaded:
    def __init__(self, setup: Setup, *, on_failure: Callable[[str], None], wake: Callable[[], None],
                 next_forward: Callable[[], int], progress: Callable[[str], None]) -> None:
        job = self.job = setup.job
        self.setup = setup
        progress(f"building layers [{setup.layer_begin}, {setup.layer_end})")
        model = models.structure(job.model, job.base_dir, check_writes=False)   # planned: checked there
        if setup.layer_end > len(model):
            raise LoadError(f"layers [{setup.layer_begin}, {setup.layer_end}) but the model has {len(model)}")
        layers = models.build_layers(job, setup.layer_begin, setup.layer_end, model=model)
        if job.model.init is not None:
            progress("reading its slice of model.init")
            model_init.initialise(job, layers)
        # No update can come between a minibatch's forward and backward on the last stage (one
        # task) or at nm 1: those forwards run on the live weights, not on a stashed copy.
        # The micro-batch schedules run on the live weights: gpipe and 1f1b step between minibatches,
        # nf1b's backward recomputes on the weights current then.
        micro = job.parallel.schedule in MICRO_SCHEDULES
        self.compute = StageCompute(layers, job.train.optimizer, loss=job.train.loss, device=setup.device.name,
                                    track_updates=setup.synced, stash=not setup.last and job.nm > 1 and not micro,
                                    precision=job.train.precision,
                                    draws=forward_draws(job.train.seed, setup.vw, setup.stage, setup.device.name))
        if setup.synced and len(setup.key_shards) != len(self.compute.params):
            raise LoadError(f"key_shards: {len(setup.key_shards)} entries for {len(self.compute.params)} parameters")
        # A resumed job goes on after its checkpoint's cut; nothing was in flight there.
        start = setup.resume_wave * job.nm + 1
        self.cuts = checkpoint.Cuts(job.train.checkpoint_every if setup.checkpoint_dir else 0, job.nm, job.train.steps,
                                    saved=setup.resume_wave, continued=setup.resume_wave)
        self.schedule: StageSchedule | MicroSchedule = (
            MicroSchedule(schedule=job.parallel.schedule, stage=setup.stage, num_stages=setup.num_stages, nm=job.nm,
                          micro=job.parallel.microbatches, steps=job.train.steps, start=start) if micro else
            StageSchedule(stage=setup.stage, num_stages=setup.num_stages, nm=job.nm, steps=job.train.steps,
                          start=start))
        pin = setup.device.kind == "cuda"
        progress("opening its data")
        self.inputs = self.targets = None
        if setup.first or setup.last:
            train = datasets.training_set(job)
            if setup.first:
                self.inputs = data.Minibatches(job, train, setup.vw, steps=job.train.steps, pin=pin, start=start)
            if setup.last:
                self.targets = data.Minibatches(job, train, setup.vw, steps=job.train.steps, pin=pin, start=start)
        self.evals = Evals(setup) if job.eval is not None and setup.vw == 0 else None
        if self.evals is not None and start > 1 and self.evals.schedule.every:
            # Those before the cut ran in the first run; one right at the cut runs again.
            self.evals.schedule.done = min(self.evals.schedule.periodic, (start - 2) // self.evals.schedule.every)
        self.scaling: Scaling | None = None
        if job.train.precision == "fp16" or job.train.max_grad_norm:
            # A resumed job decides on from its cut (its loss scale comes back with the stage's state).
            before = start - 1
            self.scaling = Scaling(job.train.precision == "fp16", job.train.max_grad_norm,
                                   Verdicts(through=before, told=before, committed=before, relays=not setup.last),
                                   LossScale(through=before))
        # Tests: minibatches whose gradients come out infinite here (HETPIPE_FAULTS overflow).
        self.overflow_at = {p for q, p in faults.from_env().overflow if q == setup.stage}
        for written in (setup.trace_path, setup.profile_path):   # made here on a host that does not share the coordinator's
            if written:
                Path(written).parent.mkdir(parents=True, exist_ok=True)
        self.trace = MinibatchTrace(setup.trace_path, setup.vw, setup.stage)
        window = job.output.profile
        self.profile = StageProfile(setup.profile_path, setup.name, window.after, window.steps,
                                    cuda=setup.device.kind == "cuda") if setup.profile_path and window else None
        self.observe = metrics.observers(setup.vw, setup.stage)
        self.padder = faults.Padder(faults.from_env(), setup.vw, (job.train.seed, setup.stage))
        self.next: Link | None = None
        self.prev: Link | None = None
        self.sync: Sync = LocalSync()
        try:  # a load that fails from here on closes what it opened: the sync's channels and threads, the traces
            if setup.checkpoint_dir:   # where it will save its part of each cut: the coordinator checks it sees it
                try:
                    Path(setup.checkpoint_dir).mkdir(parents=True, exist_ok=True)
                    outputs.shared_mark_path(setup.checkpoint_dir, setup.vw, setup.stage,
                                            setup.checkpoint_mark).write_text(f"{setup.name}\n")
                except OSError as exc:
                    raise LoadError(f"checkpoint_dir {setup.checkpoint_dir}: {exc}") from None
            if setup.synced:
                self.sync = self._wsp(setup, on_failure, wake, next_forward)
            if setup.resume_wave:
                progress(f"restoring its state at the checkpoint of wave {setup.resume_wave}")
                path = outputs.stage_state_path(setup.checkpoint_dir, setup.resume_wave, setup.vw, setup.stage)
                try:
                    checkpoint.restore(self.compute, self.sync, checkpoint.load(path), self.scaling)
                except (OSError, ValueError, KeyError, RuntimeError) as exc:
                    raise LoadError(f"{path}: {exc}") from None
            elif setup.synced and setup.vw == 0:  # a resumed job's driver gives the shards the checkpoint's values
                progress("giving the parameter servers w0")
                self.sync.initialise(job.parallel.virtual_workers, [p.detach() for p in self.compute.params])
        except BaseException:
            self.close()
            raise

    def _wsp(self, setup: Setup, on_failure: Callable[[str], None], wake: Callable[[], None],
             next_forward: Callable[[], int]) -> WspSync:
        trace = Path(setup.trace_path) if setup.trace_path else None
        job = setup.job
        config = SyncConfig(
            vw=setup.vw, nm=job.nm, D=job.parallel.D, steps=job.train.steps, keys=tuple(self.compute.names),
            key_shards=setup.key_shards, addresses=setup.ps_addresses, push_hold_s=setup.push_seconds,
            pull_hold_s=setup.pull_seconds, trace_dir=str(trace.parent) if trace else "",
            trace_name=trace.name if trace else "", ledger=job.output.ledger,
            repeat_push=faults.from_env().repeat_push, seed=job.train.seed,
            sync=job.parallel.sync, quorum=job.parallel.sync_settings.quorum, alpha=job.parallel.sync_settings.alpha,
            period=job.parallel.sync_settings.period, shared_memory=setup.ps_shm,
            push_dtype="bfloat16" if job.train.precision == "bf16" else "",
        )
        callbacks = SyncCallbacks(on_failure=on_failure, wake=wake, next_forward=next_forward,
                                  observe_push=self.observe.push.observe, observe_pull=self.observe.pull.observe)
        # quorum is WSP at the stage (the shards close the rounds); elastic exchanges instead.
        return (ElasticSync if job.parallel.sync == "elastic" else WspSync)(config, callbacks, self.compute.params)

    def cut_state(self) -> dict[str, Any]:
        """What its part of a checkpoint holds, copied now (save_cut writes it)."""
        return checkpoint.capture(self.compute, self.sync, self.scaling)

    def save_cut(self, wave: int, state: dict[str, Any]) -> None:
        """Its part of the checkpoint after `wave`, cut_state() then; it then waits there until continued."""
        setup = self.setup
        path = weight_files.save_stage_state(setup.checkpoint_dir, wave, setup.vw, setup.stage, state)
        self.cuts.saved = wave
        log.info("stage %d of vw %d: checkpoint of wave %d saved to %s", setup.stage, setup.vw, wave, path)

    def forward_allowed(self, p: int) -> bool:
        """G2 (the sync), not past a periodic evaluation stage 0 has still to run, and not past a
        checkpoint the driver has not let it past."""
        if self.cuts.blocks(p):
            return False
        if self.evals is not None and self.setup.first and not self.evals.schedule.allows(p):
            return False
        return self.sync.forward_allowed(p)

    @property
    def reads_ahead(self) -> bool:
        """Whether read_ahead() would read anything."""
        return any(reader is not None and reader.unread for reader in (self.inputs, self.targets))

    def read_ahead(self) -> None:
        """The next minibatch's inputs and targets, where this stage reads them, read now
        (data.Minibatches.read_ahead)."""
        for reader in (self.inputs, self.targets):
            if reader is not None:
                reader.read_ahead()

    def close(self) -> None:
        for link in (self.next, self.prev):
            if link is not None:
                link.close()
        self.sync.close()
        self.trace.close()
        if self.profile is not None:
            self.profile.close(self.schedule.completed)
        for reader in (self.inputs, self.targets):
            if reader is not None:
                reader.close()
