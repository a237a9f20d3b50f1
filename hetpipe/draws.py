"""What a stage's forward draws from (dropout's masks): torch's generator, seeded per unit of work
from the job's seed, so that a run repeats whatever its timing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from hetpipe.data import FORWARD_DRAW, entropy
from hetpipe.models import GLOBAL_STATE

# What a forward draws from: a context per unit of work ((p,) or (p, micro)).
Draws = Callable[[tuple[int, ...]], contextlib.AbstractContextManager[None]]


def forward_draws(seed: int, vw: int, stage: int, device: str) -> Draws:
    """What a stage's forward of a unit ((p,), or (p, micro) in a micro-batch schedule) draws
    from, dropout's masks: torch's generator on its device, seeded for (train.seed, vw, stage,
    unit). A run then repeats whatever its timing, and a resumed one goes on as the uninterrupted
    one would have; ddp's rank r draws as VW r's lone stage does. Held under GLOBAL_STATE: a
    factory's data draws from torch's CPU generator in a reader thread (data._seeded), which would
    otherwise swap it mid-forward."""
    where = torch.device(device)

    @contextlib.contextmanager
    def seeded(unit: tuple[int, ...]) -> Iterator[None]:
        value = entropy(seed, (FORWARD_DRAW, vw, stage, *unit))
        with GLOBAL_STATE:
            torch.default_generator.manual_seed(value)
            if where.type == "cuda":
                torch.cuda.default_generators[torch.cuda.current_device() if where.index is None else where.index
                                              ].manual_seed(value)
            yield

    return seeded


def unseeded(unit: tuple[int, ...]) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()
