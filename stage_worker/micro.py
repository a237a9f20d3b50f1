"""A stage's tasks under the micro-batch schedules (gpipe, 1f1b, nf1b): each minibatch is split
into parallel.microbatches equal parts along its first dimension; each micro-batch's loss is
weighted 1/microbatches, so p's summed gradient is that of the whole minibatch. gpipe and 1f1b
keep each micro-batch's graph for its own backward and step once all of p is back; nf1b keeps
only the inputs and runs p's one backward on the weights current then (stage_worker/stage.py)."""

from __future__ import annotations

import threading
import time

import torch

from hetpipe import data
from hetpipe.wsp import wave_of
from stage_worker import commit
from stage_worker.commit import Ran
from stage_worker.inbox import Inbox
from stage_worker.loaded import Loaded
from stage_worker.losses import Losses
from stage_worker.micro_schedule import MicroSchedule
from stage_worker.schedule import Task


class MicroTasks:
    """Runs one stage's micro-batch tasks; called by the compute thread only."""

    def __init__(self, inbox: Inbox, lock: threading.Condition, losses: Losses) -> None:
        self._inbox, self._lock, self._losses = inbox, lock, losses
        self._x: dict[int, list[torch.Tensor]] = {}   # stage 0: p's micro-batches of x
        self._y: dict[int, list[torch.Tensor]] = {}   # the last stage: of y
        self._loss: dict[int, torch.Tensor] = {}      # the last stage: p's loss so far
        self._scale: dict[int, float] = {}            # the last stage, fp16: p's loss scale

    @staticmethod
    def _schedule(s: Loaded) -> MicroSchedule:
        assert isinstance(s.schedule, MicroSchedule)
        return s.schedule

    def _part(self, s: Loaded, split: dict[int, list[torch.Tensor]], reader: data.Minibatches, which: int,
              p: int, m: int) -> torch.Tensor:
        """Micro-batch m of p's x (which 0) or y (1): read and split at m 1, dropped after the last."""
        if m == 1:
            split[p] = list(reader.next()[which].to(s.compute.device, non_blocking=True).chunk(self._schedule(s).micro))
        return split[p][m - 1] if m < self._schedule(s).micro else split.pop(p)[m - 1]

    def _input(self, s: Loaded, p: int, m: int) -> torch.Tensor:
        if s.inputs is None:
            with self._lock:
                return self._inbox.forward.pop((p, m))
        return self._part(s, self._x, s.inputs, 0, p, m)

    def _target(self, s: Loaded, p: int, m: int) -> torch.Tensor:
        assert s.targets is not None
        return self._part(s, self._y, s.targets, 1, p, m)

    def forward(self, s: Loaded, task: Task) -> Ran:
        p, m, sched = task.p, task.micro, self._schedule(s)
        x = self._input(s, p, m)
        start, min_clock = time.time(), s.sync.min_clock
        if s.setup.last:
            if m == 1 and s.scaling is not None and s.scaling.fp16:   # the verdicts <= p - 1 came with (p, 1)
                self._scale[p] = s.scaling.loss_scale.for_minibatch(p, s.job.nm, s.scaling.verdicts)
            scale = self._scale.get(p, 1.0)
            loss = s.compute.loss_micro((p, m), x, self._target(s, p, m), scale / sched.micro)
            self._loss[p] = self._loss.get(p, 0.0) + loss / sched.micro
            sends, version = [], s.compute.version
        else:
            out, version = s.compute.forward_micro((p, m), x, keep=sched.flushed)
            s.setup.specs.output.split(sched.micro).check_output(s.setup.name, out)
            sends = [commit.activation(s, p, version, out, micro=m)]
        if m == 1:
            s.observe.forward(p, version, s.sync.clock, min_clock)
        s.padder.pad(start, s.setup.forward_seconds / sched.micro)
        s.trace.micro(p, "fwd", m, start, time.time(), local_version=version, min_clock=min_clock)
        return Ran(sends)

    def backward(self, s: Loaded, task: Task) -> Ran:
        p, m, sched = task.p, task.micro, self._schedule(s)
        grad = None
        if not s.setup.last:
            with self._lock:
                grad = self._inbox.backward.pop((p, m))
        start, version = time.time(), s.compute.version
        if sched.flushed:
            grad_in, version = s.compute.backward_micro((p, m), grad)
            s.padder.pad(start, s.setup.backward_seconds / sched.micro)
        else:
            assert grad is not None
            grad_in = s.compute.backward_recompute(p, grad)
            s.padder.pad(start, s.setup.backward_seconds)
        s.trace.micro(p, "bwd", m, start, time.time())
        if s.scaling is None:
            return Ran(commit.gradient(s, p, version, grad_in, micro=m), then=lambda: self._end(s, task, version))
        # fp16 or train.max_grad_norm (gpipe, 1f1b): p's gradient here is whole once its last
        # backward here is done. That backward's gradient carries whether it overflowed and its
        # squared norm, with the later stages', to the previous stage; stage 0 decides, and the
        # verdict comes back with p + 1's first activation. Every gradient of p carries its scale.
        # An overflow is judged on the summed gradients alone: a gradient sent back that is not
        # finite makes the previous stage's so, or reaches a stage with nothing to train.
        scale = self._scale.get(p, 1.0) if s.setup.last else s.scaling.incoming[p].scale
        agreed = commit.Agreed(overflow=False, norm_sq=0.0)
        if sched.ends_minibatch(task):
            self._ended(s, p, version)
            later = None if s.setup.last else s.scaling.incoming.pop(p)
            self._scale.pop(p, None)
            agreed = commit.agreed_backward(s, p, s.compute.take_summed(), None, scale, later)
        return Ran(commit.gradient(s, p, version, grad_in, scale, agreed, micro=m))

    def forward_backward(self, s: Loaded, task: Task) -> Ran:
        """nf1b's last stage: the last micro-batch's forward, then p's one backward."""
        began = time.time()
        sends = self.forward(s, task).sends
        start = time.time()
        grad_in = s.compute.backward_losses(task.p)
        s.padder.pad(start, s.setup.backward_seconds)
        s.trace.micro(task.p, "bwd", 0, start, time.time())
        version = s.compute.version
        return Ran(sends + commit.gradient(s, task.p, version, grad_in), start - began,
                   then=lambda: self._end(s, task, version))

    def _end(self, s: Loaded, task: Task, version: int) -> None:
        """p's step once its last backward here is done (L3), and its wave's update (G1)."""
        if not self._schedule(s).ends_minibatch(task):
            return
        self._ended(s, task.p, version)
        commit.commit(s, task.p, s.compute.take_summed())

    def _ended(self, s: Loaded, p: int, version: int) -> None:
        """p's last backward here is done: its loss (the last stage) and its trace row."""
        if s.setup.last:
            with self._lock:
                self._losses.add(p, self._loss.pop(p))
        s.trace.backward(p, wave_of(p, s.job.nm), bwd_version=version)
