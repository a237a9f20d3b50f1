"""Test and benchmark fault injection, from the HETPIPE_FAULTS environment variable.

Never part of the job file: a user's job cannot slow itself down by accident. A launcher's
children inherit the variable, so one setting reaches every stage and baseline worker. JSON:
`{"task_delay": [low, high], "slow_vw": V, "slow_factor": F, "repeat_push": P,
"overflow": [[stage, minibatch], ...]}`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields

ENV = "HETPIPE_FAULTS"


@dataclass(frozen=True, slots=True)
class Faults:
    task_delay: tuple[float, float] = (0.0, 0.0)  # uniform random extra seconds per task
    slow_vw: int = -1           # this VW's (or baseline rank's) tasks take slow_factor times longer
    slow_factor: float = 1.0
    repeat_push: float = 0.0    # probability that a stage sends an acknowledged push again (a retry)
    overflow: tuple[tuple[int, int], ...] = ()  # fp16: (stage, p) whose gradients come out infinite

    def slowdown(self, vw: int) -> float:
        """How much longer every task of virtual worker (or rank) vw takes: the straggler rule."""
        return self.slow_factor if vw == self.slow_vw else 1.0


def from_env() -> Faults:
    """The faults HETPIPE_FAULTS asks for; none when it is unset. ValueError names a bad value."""
    text = os.environ.get(ENV, "")
    if not text:
        return Faults()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV}: not valid JSON ({exc})") from None
    known = {f.name for f in fields(Faults)}
    if not isinstance(raw, dict) or set(raw) - known:
        raise ValueError(f"{ENV}: expected an object with keys among {sorted(known)}, got {text!r}")
    low, high = raw.get("task_delay", (0.0, 0.0))
    faults = Faults(task_delay=(float(low), float(high)), slow_vw=int(raw.get("slow_vw", -1)),
                    slow_factor=float(raw.get("slow_factor", 1.0)), repeat_push=float(raw.get("repeat_push", 0.0)),
                    overflow=tuple((int(q), int(p)) for q, p in raw.get("overflow", ())))
    numbers = (low, high, faults.slow_factor, faults.repeat_push)
    if not (all(math.isfinite(x) for x in numbers) and 0 <= low <= high and faults.slow_factor >= 1
            and 0 <= faults.repeat_push <= 1):
        raise ValueError(f"{ENV}: task_delay needs 0 <= low <= high, slow_factor >= 1, repeat_push in [0, 1]; "
                         f"got {text!r}")
    return faults


def to_env(faults: Faults) -> dict[str, str]:
    """The environment entry that makes children inject faults (tests and benchmarks)."""
    return {ENV: json.dumps({"task_delay": list(faults.task_delay), "slow_vw": faults.slow_vw,
                             "slow_factor": faults.slow_factor, "repeat_push": faults.repeat_push,
                             "overflow": [list(o) for o in faults.overflow]})}


class Padder:
    """Holds the device until a task took its target seconds: the emulated GPU type's time
    (DESIGN §5), stretched for a straggler, plus injected jitter."""

    def __init__(self, faults: Faults, vw: int, seed: object) -> None:
        self.slowdown = faults.slowdown(vw)
        self.low, self.high = faults.task_delay
        self._jitter = random.Random(hash((seed, vw)))

    def pad(self, started: float, seconds: float) -> None:
        target = seconds * self.slowdown + (self._jitter.uniform(self.low, self.high) if self.high > 0 else 0.0)
        remaining = started + target - time.time()
        if remaining > 0:
            time.sleep(remaining)


@contextlib.contextmanager
def injected(faults: Faults) -> Iterator[None]:
    """Children started inside inject these faults (benchmarks that run jobs in-process)."""
    before = os.environ.get(ENV)
    os.environ.update(to_env(faults))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
