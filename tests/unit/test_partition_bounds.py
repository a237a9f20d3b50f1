"""partition_vw on a VW spread over many nodes of different GPU mixes: the exact search grows about
4x a node, so it is bounded (a PlanError saying why) and it ends soon after a stop."""

from __future__ import annotations

import itertools
import threading

import pytest

from coordinator.planner import partition
from coordinator.planner.cluster import Gpu, PlanError
from coordinator.planner.partition import partition_vw
from coordinator.planner.profile import LayerProfile, ModelProfile
from hetpipe.catalog import CATALOG
from hetpipe.errors import JobStopped
from hetpipe.network import Network

TYPES = ["titan-v", "titan-rtx", "rtx-2060", "quadro-p4000", "t4"]


def irregular(nodes: int) -> tuple[ModelProfile, list[Gpu]]:
    """nodes nodes, each with its own mix of one or two types; activations large enough that
    where the stages sit matters."""
    mixes = [c for r in (1, 2) for c in itertools.combinations(TYPES, r)][:nodes]
    gpus = [Gpu(f"n{j}/{i}", f"n{j}", t, CATALOG[t].memory_bytes) for j, mix in enumerate(mixes) for i, t in enumerate(mix)]
    layers = []
    for i in range(2 * len(gpus)):
        flops = 1e10 * (1 + (i * 7919) % 10)
        layers.append(LayerProfile(i, flops, 2 * flops, 1 << 20, (50 + (i * 104729) % 350) << 20, 1 << 20, 0,
                                   {t: CATALOG[t].seconds(flops, 1e6) for t in TYPES},
                                   {t: CATALOG[t].seconds(2 * flops, 2e6) for t in TYPES}))
    return ModelProfile("m", 32, "float32", 1 << 20, tuple(layers)), gpus


def test_an_irregular_vw_is_refused_not_searched_for_hours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(partition, "MAX_CANDIDATES", 20_000, raising=False)
    profile, gpus = irregular(9)   # about 340 000 candidates: 3 s unbounded
    with pytest.raises(PlanError, match=r"on 9 nodes .* too irregular"):
        partition_vw(profile, gpus, 2, "sgd", Network())


def test_a_stop_ends_the_search() -> None:
    profile, gpus = irregular(9)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(JobStopped, match="while planning"):
        partition_vw(profile, gpus, 2, "sgd", Network(), cancel=cancel)
