"""A stage's tasks under HetPipe's own schedule: one task per minibatch (forward, backward, or
both at the last stage), the model's weights stepped by its commit (stage_worker/commit.py)."""

from __future__ import annotations

import threading
import time

from hetpipe.wsp import wave_of
from stage_worker import commit
from stage_worker.commit import Ran
from stage_worker.inbox import Inbox
from stage_worker.loaded import Loaded
from stage_worker.losses import Losses
from stage_worker.schedule import Task


class MinibatchTasks:
    """Runs one stage's minibatch tasks; called by the compute thread only (MicroTasks' twin)."""

    def __init__(self, inbox: Inbox, lock: threading.Condition, losses: Losses) -> None:
        self._inbox, self._lock, self._losses = inbox, lock, losses

    def forward(self, s: Loaded, task: Task) -> Ran:
        p = task.p
        if s.inputs is not None:
            x = s.inputs.next()[0].to(s.compute.device, non_blocking=True)
        else:
            with self._lock:
                x = self._inbox.forward.pop(p)
        start = time.time()
        min_clock = s.sync.min_clock
        out, version = s.compute.forward(p, x)
        s.setup.specs.output.check_output(s.setup.name, out)
        s.observe.forward(p, version, s.sync.clock, min_clock)
        s.padder.pad(start, s.setup.forward_seconds)
        s.trace.forward(p, local_version=version, min_clock=min_clock, fwd_start=start, fwd_end=time.time())
        return Ran([commit.activation(s, p, version, out)])

    def backward(self, s: Loaded, task: Task) -> Ran:
        p = task.p
        with self._lock:
            grad = self._inbox.backward.pop(p)
        start = time.time()
        grad_in, version, grads = s.compute.backward(p, grad)
        s.padder.pad(start, s.setup.backward_seconds)
        s.trace.backward(p, wave_of(p, s.job.nm), bwd_version=version, bwd_start=start, bwd_end=time.time())
        if s.scaling is None:
            return Ran(commit.gradient(s, p, version, grad_in), then=lambda: commit.commit(s, p, grads))
        later = s.scaling.incoming.pop(p)
        agreed = commit.agreed_backward(s, p, grads, grad_in, later.scale, later)
        return Ran(commit.gradient(s, p, version, grad_in, later.scale, agreed))

    def forward_backward(self, s: Loaded, task: Task) -> Ran:
        p = task.p
        if s.inputs is not None:  # a lone stage reads its inputs too
            x = s.inputs.next()[0].to(s.compute.device, non_blocking=True)
        else:
            with self._lock:
                x = self._inbox.forward.pop(p)
        assert s.targets is not None
        y = s.targets.next()[1].to(s.compute.device, non_blocking=True)
        start = time.time()
        min_clock = s.sync.min_clock
        scale = 1.0
        if s.scaling is not None and s.scaling.fp16:  # the verdicts <= p - nm came with p's activation (or were made here)
            scale = s.scaling.loss_scale.for_minibatch(p, s.job.nm, s.scaling.verdicts)
        loss, grad_in, version, grads, forward_end = s.compute.forward_backward(p, x, y, scale)
        s.observe.forward(p, version, s.sync.clock, min_clock)
        padded = s.setup.forward_seconds + s.setup.backward_seconds
        s.padder.pad(start, padded)
        end = time.time()
        # The forward's share of the task: measured, or (emulated) the padded time split as planned.
        forward = (end - start) * s.setup.forward_seconds / padded if padded > 0 else forward_end - start
        with self._lock:
            self._losses.add(p, loss)
        # The trace splits the task where the forward's share ends (emulated: the planned share).
        s.trace.forward(p, local_version=version, min_clock=min_clock, fwd_start=start, fwd_end=start + forward)
        if s.trace.enabled:
            s.trace.backward(p, wave_of(p, s.job.nm), bwd_version=version, bwd_start=start + forward, bwd_end=end,
                             loss=float(loss))
        if s.scaling is None:
            return Ran(commit.gradient(s, p, version, grad_in), forward, then=lambda: commit.commit(s, p, grads))
        agreed = commit.agreed_backward(s, p, grads, grad_in, scale, None)
        return Ran(commit.gradient(s, p, version, grad_in, scale, agreed), forward)
