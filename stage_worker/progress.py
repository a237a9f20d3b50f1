"""What a stage reports: one consistent snapshot of its state and counters, read by the Status
RPC and by the metrics collector alike."""

from __future__ import annotations

from dataclasses import dataclass

from stage_worker.evaluation import EvalResult
from stage_worker.lifecycle import StageState


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    state: StageState
    error: str = ""
    failed_at: float = 0.0              # FAILED: when (time.time())
    detail: str = ""           # what a loading stage is doing
    # Who and where; empty before an assignment.
    vw: int = 0
    stage: int = 0
    device: str = ""           # where it computes: "cpu", "cuda:N"
    label: str = ""            # the plan's name for its GPU, e.g. "titan-v (emulated)"
    gpu_type: str = ""
    emulated: bool = False
    memory_used_bytes: float = 0.0
    memory_capacity_bytes: float = 0.0
    peak_rss_bytes: int = 0         # this process's peak resident memory
    device_peak_bytes: int = 0      # real GPU: peak allocated by torch
    # Counters.
    forwards_done: int = 0
    backwards_done: int = 0    # minibatches whose backward finished here
    samples: int = 0           # backwards_done x batch size
    local_version: int = 0
    in_flight: int = 0
    queue_depth: int = 0       # inputs received and waiting to run
    waiting: bool = False      # a forward is blocked on the clock bound, for a pull
    cut: int = 0               # the checkpoint (in waves) it saved and waits at; 0: none
    received: int = 0
    eval_minibatches: int = 0  # evaluation minibatches run here (Evals.minibatches_run)
    last_loss: float = float("nan")
    last_loss_minibatch: int = 0        # the minibatch last_loss is of (0: none yet)
    recent_loss: float = float("nan")   # last stage: mean over its last 10 minibatches
    diverged_minibatch: int = 0         # last stage: the first minibatch whose loss was NaN or Inf (0: none)
    diverged_loss: float = 0.0          # ... and that loss
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    idle_seconds: float = 0.0
    wait_seconds: float = 0.0           # forwards blocked on the clock bound (G2)
    wait_idle_seconds: float = 0.0      # the part of it with no other task to run
    sent_forward_bytes: int = 0
    sent_backward_bytes: int = 0
    socket_forward_bundles: int = 0    # of the activations sent, those over the next stage's link socket
    socket_backward_bundles: int = 0   # of the gradients, over the previous stage's
    shm_bytes: int = 0          # of those and of pushes and pulls, what went through shared memory
    cuda_ipc_bytes: int = 0     # of that, activations and gradients sent GPU to GPU (CUDA IPC)
    clock: int = 0
    min_clock: int = 0
    steady_minibatches: int = 0         # stepped here since this run's first wave (SteadyWindow)
    steady_seconds: float = 0.0         # ... and the seconds from then to DONE (or to now)
    evals: tuple[EvalResult, ...] = ()  # the last stage of VW 0: evaluations finished so far
    weights_digest: str = ""            # only when asked for: it reads every weight

    @property
    def compute_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds


class SteadyWindow:
    """A run's steady part at one stage: from the end of its first wave (nm minibatches stepped
    here in this run) to DONE, the last push answered. The first wave carries the one-time costs
    (kernel selection, the allocator's growth, the pipeline's fill) that a steady rate leaves out,
    as a plain loop timed after its warm-up does. No lock of its own: the runtime's guards it."""

    def __init__(self, nm: int, completed: int) -> None:
        self._nm, self._start = nm, completed      # completed: minibatches stepped before this run
        self._base = 0
        self._from: float | None = None
        self._end: float | None = None

    def stepped(self, completed: int, now: float) -> None:
        if self._from is None and completed - self._start >= self._nm:
            self._from, self._base = now, completed

    def done(self, now: float) -> None:
        if self._end is None:
            self._end = now

    def read(self, completed: int, now: float) -> tuple[int, float]:
        """Minibatches stepped in the window, and its seconds so far; (0, 0.0) before it opens."""
        if self._from is None:
            return 0, 0.0
        return completed - self._base, (self._end if self._end is not None else now) - self._from

