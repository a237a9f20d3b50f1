"""What a job draws at random, seeded per draw from train.seed, so that a run repeats whatever
its timing: a factory's data (an augmentation, read at stage 0 and at the last stage alike) and a
stage's forward (dropout's masks)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from hetpipe.config import JobConfig
from hetpipe.models import GLOBAL_STATE

# A draw names what is read: training minibatch (TRAIN_DRAW, vw, p), evaluation minibatch
# (EVAL_DRAW, i), (CHECK_DRAW,) the item a factory's dataset is checked by, or (BUILD_DRAW,) the factory's
# call itself; or what a stage's forward draws, dropout's masks (FORWARD_DRAW, vw, stage, p[, micro]).
TRAIN_DRAW, EVAL_DRAW, CHECK_DRAW, BUILD_DRAW, FORWARD_DRAW = 0, 1, 2, 3, 4


def entropy(seed: int, draw: Sequence[int]) -> int:
    """The seed of one draw: a hash of train.seed and the draw, independent of every other's."""
    return int(np.random.SeedSequence([seed & (2**63 - 1), *draw]).generate_state(2, np.uint64)[0])


def draws_at_random(job: JobConfig) -> bool:
    """Whether the job's data comes from a factory (the user's code, which may draw at random: an
    augmentation); the built-in datasets are arrays, read as they are."""
    return job.data.factory is not None or job.data.eval_factory is not None


@contextlib.contextmanager
def seeded(seed: int, draw: tuple[int, ...]) -> Iterator[None]:
    """torch's (CPU), numpy's and Python's global generators seeded for this draw, then put back.
    Not torch.manual_seed, which reseeds the GPUs' generators too, and put nothing back there: a
    stage's dropout on a GPU would restart from the draw's seed every minibatch. Under the lock
    that layers' seeded initialisation holds (models.GLOBAL_STATE): two stages of one process."""
    seeded = entropy(seed, draw)
    with GLOBAL_STATE:
        state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        torch.default_generator.manual_seed(seeded)
        np.random.seed(seeded % 2**32)
        random.seed(seeded)
        try:
            yield
        finally:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])


def drawing(job: JobConfig, draw: tuple[int, ...] | None) -> contextlib.AbstractContextManager[None]:
    """_seeded for this draw where the job's data may draw at random, else nothing."""
    return seeded(job.train.seed, draw) if draw is not None and draws_at_random(job) else contextlib.nullcontext()


# What a forward draws from: a context per unit of work ((p,) or (p, micro)).
Draws = Callable[[tuple[int, ...]], contextlib.AbstractContextManager[None]]


def forward_draws(seed: int, vw: int, stage: int, device: str) -> Draws:
    """What a stage's forward of a unit ((p,), or (p, micro) in a micro-batch schedule) draws
    from, dropout's masks: torch's generator on its device, seeded for (train.seed, vw, stage,
    unit). A run then repeats whatever its timing, and a resumed one goes on as the uninterrupted
    one would have; ddp's rank r draws as VW r's lone stage does. Held under GLOBAL_STATE: a
    factory's data draws from torch's CPU generator in a reader thread (seeded), which would
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
