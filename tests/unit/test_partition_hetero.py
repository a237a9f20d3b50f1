"""coordinator/planner/partition.py (and memory.py) for heterogeneous virtual workers, against a brute-force oracle over
every order of the GPUs and every contiguous cut of the layers."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
from collections.abc import Sequence

import pytest

from coordinator.planner.cluster import Gpu, PlanError
from coordinator.planner.memory import in_flight, stage_memory
from coordinator.planner.partition import Partition, join_layers, max_nm, partition_vw, unjoin
from coordinator.planner.profile import LayerProfile, ModelProfile
from hetpipe.catalog import CATALOG, GiB
from hetpipe.network import Network

TYPES = ["titan-v", "titan-rtx", "rtx-2060", "quadro-p4000"]
OPT_STATE = {"sgd": 0, "sgd+momentum": 1, "adam": 2}
ERROR = re.compile(r"stage (\d+) on (\S+) \((\S+)\), layers \[(\d+), (\d+)\): needs [\d.]+ [KMGT]?i?B \((\d+) bytes\), "
                   r"has [\d.]+ [KMGT]?i?B \((\d+) bytes\)")


# ---- the oracle, written from the specification ------------------------------------------------

def spec_memory(p: ModelProfile, b: int, e: int, q: int, k: int, nm: int, optimizer: str) -> int:
    """weights + gradients + optimizer state + one stashed copy and one set of activations (input
    plus saved) per in-flight minibatch + the largest layer workspace; a frozen weight has no
    gradient, optimizer state or stashed copy."""
    m = in_flight(q, k, nm)
    params = trained = saved = 0
    for layer in p.layers[b:e]:
        params += layer.param_bytes
        trained += layer.param_bytes - layer.frozen_bytes
        saved += layer.saved_bytes
    x = p.input_bytes if b == 0 else p.layers[b - 1].output_bytes
    return params + (1 + OPT_STATE[optimizer] + m) * trained + m * (x + saved) + max(
        layer.workspace_bytes for layer in p.layers[b:e])


def link(nbytes: int, a: Gpu, b: Gpu, net: Network) -> float:
    gbs = net.intra_node_gbs if a.node == b.node else net.inter_node_gbs
    return net.latency_s + nbytes / (gbs * 1e9)


def spec_stage_seconds(p: ModelProfile, order: Sequence[Gpu], cuts: Sequence[tuple[int, int]], q: int,
                       net: Network) -> float:
    g = order[q]
    b, e = cuts[q]
    t = sum(layer.forward_seconds[g.type] for layer in p.layers[b:e])
    t += sum(layer.backward_seconds[g.type] for layer in p.layers[b:e])
    if q > 0:  # the activation from the previous GPU
        t += link(p.layers[b - 1].output_bytes, order[q - 1], g, net)
    if q < len(order) - 1:  # the gradient from the next GPU
        t += link(p.layers[e - 1].output_bytes, order[q + 1], g, net)
    return t


def all_cuts(n: int, k: int) -> list[list[tuple[int, int]]]:
    return [list(itertools.pairwise((0, *c, n))) for c in itertools.combinations(range(1, n), k - 1)]


def brute_force(p: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str, net: Network,
                joined: Sequence[int] = ()) -> float:
    """The best bottleneck over all GPU orders and cuts that fit in memory, no stage beginning at a
    layer in `joined` (inf if none fits)."""
    k, best = len(gpus), math.inf
    for order in itertools.permutations(gpus):
        for cuts in all_cuts(len(p.layers), k):
            if not any(b in joined for b, _ in cuts) and all(spec_memory(p, b, e, q, k, nm, optimizer) <= order[q].memory_bytes
                   for q, (b, e) in enumerate(cuts)):
                best = min(best, max(spec_stage_seconds(p, order, cuts, q, net) for q in range(k)))
    return best


# ---- random instances ----------------------------------------------------------------------------

def random_profile(rng: random.Random, n: int) -> ModelProfile:
    layers = []
    for i in range(n):
        flops = rng.choice([0.0, rng.uniform(1e9, 5e11), float(rng.randint(1, 4)) * 1e11])
        nbytes = rng.uniform(1e6, 5e8)
        fwd = {t: CATALOG[t].seconds(flops, nbytes) for t in TYPES}
        bwd = {t: CATALOG[t].seconds(2 * flops, 2 * nbytes) for t in TYPES}
        param_bytes = rng.choice([0, rng.randint(1, 600) << 20])
        layers.append(LayerProfile(
            index=i, forward_flops=flops, backward_flops=2 * flops,
            param_bytes=param_bytes, frozen_bytes=rng.choice([0, 0, param_bytes // 3, param_bytes]),
            output_bytes=rng.randint(1, 400) << 20,
            saved_bytes=rng.randint(0, 800) << 20,
            workspace_bytes=rng.randint(0, 300) << 20,
            forward_seconds=fwd, backward_seconds=bwd,
        ))
    return ModelProfile("random", 32, "float32", rng.randint(1, 100) << 20, tuple(layers))


def random_gpus(rng: random.Random, k: int) -> list[Gpu]:
    nodes = rng.sample(["n0", "n1", "n2"], rng.randint(1, 3))
    kinds = rng.sample(TYPES, rng.randint(1, 3))
    gpus = []
    for i in range(k):
        node = rng.choice(nodes)
        t = rng.choice(kinds)
        memory = rng.choice([CATALOG[t].memory_bytes, rng.randint(1, 12) * GiB // 2])
        gpus.append(Gpu(f"{node}/{i}", node, t, memory))
    return gpus


def check_plan(part: Partition, p: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str,
               net: Network) -> float:
    """The plan is valid and feasible; returns its bottleneck recomputed from the specification."""
    k, n = len(gpus), len(p.layers)
    assert len(part.stages) == k
    assert sorted(s.gpu.id for s in part.stages) == sorted(g.id for g in gpus), "every GPU once"
    assert part.stages[0].layer_begin == 0 and part.stages[-1].layer_end == n
    for s, t in itertools.pairwise(part.stages):
        assert s.layer_end == t.layer_begin
    order = [s.gpu for s in part.stages]
    cuts = [(s.layer_begin, s.layer_end) for s in part.stages]
    for q, s in enumerate(part.stages):
        assert s.layer_begin < s.layer_end, "every stage gets a layer"
        assert s.in_flight == in_flight(q, k, nm)
        assert s.memory_bytes == spec_memory(p, s.layer_begin, s.layer_end, q, k, nm, optimizer)
        assert s.memory_bytes <= s.gpu.memory_bytes, f"stage {q} does not fit"
        assert math.isclose(s.forward_seconds + s.backward_seconds + s.receive_seconds,
                            spec_stage_seconds(p, order, cuts, q, net), rel_tol=1e-12)
    return max(spec_stage_seconds(p, order, cuts, q, net) for q in range(k))


def check_error(err: PlanError, p: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str) -> None:
    match = ERROR.search(str(err))
    assert match, str(err)
    q, gpu_id, gpu_type, b, e, need, has = match.groups()
    gpu = next(g for g in gpus if g.id == gpu_id)
    assert gpu.type == gpu_type and int(has) == gpu.memory_bytes
    assert int(need) == spec_memory(p, int(b), int(e), int(q), len(gpus), nm, optimizer)
    assert int(need) > int(has)


def test_matches_brute_force_on_300_random_instances() -> None:
    rng = random.Random(4)
    feasible = infeasible = 0
    for case in range(300):
        n = rng.randint(1, 8)
        k = rng.randint(1, min(3, n))
        p = random_profile(rng, n)
        gpus = random_gpus(rng, k)
        nm = rng.randint(1, 4)
        optimizer = rng.choice(list(OPT_STATE))
        net = Network(latency_s=rng.choice([0.0, 20e-6]))
        best = brute_force(p, gpus, nm, optimizer, net)
        if best == math.inf:
            infeasible += 1
            with pytest.raises(PlanError) as info:
                partition_vw(p, gpus, nm, optimizer, net)
            check_error(info.value, p, gpus, nm, optimizer)
            continue
        feasible += 1
        part = partition_vw(p, gpus, nm, optimizer, net)
        got = check_plan(part, p, gpus, nm, optimizer, net)
        assert math.isclose(got, best, rel_tol=1e-12), (case, got, best)
        assert math.isclose(part.bottleneck_seconds, best, rel_tol=1e-12), (case, part.bottleneck_seconds, best)
        assert partition_vw(p, gpus, nm, optimizer, net) == part, "deterministic"
    assert feasible >= 100 and infeasible >= 30, (feasible, infeasible)



def test_joined_layers_partition_as_the_best_cut_that_begins_no_stage_at_them() -> None:
    """A layer no stage may begin at (its input is token ids) is joined to the one before it: the
    partition of the joined profile, as ranges of the model's layers, is the best of the cuts
    that begin no stage there, with the original profile's times and memory."""
    rng = random.Random(11)
    feasible = 0
    for case in range(150):
        n = rng.randint(2, 8)
        joined = sorted(rng.sample(range(1, n), rng.randint(1, n - 1)))
        p = random_profile(rng, n)
        solved = join_layers(p, joined)
        starts = tuple(i for i in range(n) if i not in joined)
        assert solved.starts == starts and len(solved.layers) == len(starts)
        k = rng.randint(1, min(3, len(starts)))
        gpus = random_gpus(rng, k)
        nm, optimizer, net = rng.randint(1, 4), rng.choice(list(OPT_STATE)), Network()
        best = brute_force(p, gpus, nm, optimizer, net, joined)
        if best == math.inf:
            with pytest.raises(PlanError) as info:
                partition_vw(solved, gpus, nm, optimizer, net)
            check_error(info.value, p, gpus, nm, optimizer)   # the model's layers, not the joined ones
            continue
        feasible += 1
        part = unjoin(partition_vw(solved, gpus, nm, optimizer, net), solved)
        assert not any(s.layer_begin in joined for s in part.stages), (case, joined, part)
        got = check_plan(part, p, gpus, nm, optimizer, net)
        assert math.isclose(got, best, rel_tol=1e-12), (case, got, best)
    assert feasible >= 50, feasible


POOL = [Gpu("a/0", "a", "titan-v", 12 * GiB), Gpu("a/1", "a", "titan-v", 12 * GiB),
        Gpu("b/0", "b", "rtx-2060", 6 * GiB), Gpu("c/0", "c", "rtx-2060", 6 * GiB),
        Gpu("d/0", "d", "quadro-p4000", 8 * GiB),
        Gpu("e/0", "e", "titan-v", 12 * GiB), Gpu("e/1", "e", "rtx-2060", 6 * GiB),
        Gpu("f/0", "f", "titan-v", 12 * GiB), Gpu("f/1", "f", "rtx-2060", 6 * GiB)]


def test_matches_brute_force_with_repeated_gpus() -> None:
    # GPUs of one type on one node, lone GPUs of one type on different nodes, and nodes with the
    # same mix of GPUs: the partitioner treats those as interchangeable, brute force does not.
    rng = random.Random(7)
    for _ in range(25):
        n = rng.randint(5, 8)
        p = random_profile(rng, n)
        gpus = rng.sample(POOL, rng.randint(3, 5))
        nm = rng.randint(1, 3)
        net = Network()
        best = brute_force(p, gpus, nm, "sgd", net)
        if best == math.inf:
            with pytest.raises(PlanError) as info:
                partition_vw(p, gpus, nm, "sgd", net)
            check_error(info.value, p, gpus, nm, "sgd")
            continue
        part = partition_vw(p, gpus, nm, "sgd", net)
        assert math.isclose(check_plan(part, p, gpus, nm, "sgd", net), best, rel_tol=1e-12)


def test_matches_brute_force_on_two_identical_mixed_nodes() -> None:
    # Two nodes with the same GPUs (a TITAN V and an RTX 2060 each) and slow links, so that which
    # node each stage is on matters: the partitioner merges the nodes' symmetric states.
    rng = random.Random(11)
    gpus = [g for g in POOL if g.node in ("e", "f")]
    for _ in range(60):
        p = random_profile(rng, rng.randint(4, 7))
        net = Network(intra_node_gbs=rng.choice([0.5, 7.875]), inter_node_gbs=rng.choice([0.1, 5.6]))
        best = brute_force(p, gpus, 1, "sgd", net)
        if best == math.inf:
            with pytest.raises(PlanError):
                partition_vw(p, gpus, 1, "sgd", net)
            continue
        part = partition_vw(p, gpus, 1, "sgd", net)
        assert math.isclose(check_plan(part, p, gpus, 1, "sgd", net), best, rel_tol=1e-12)


def uniform_profile(n: int, *, params: int = 0, saved: int = 0, out: int = 1 << 20,
                    seconds: dict[str, float] | None = None) -> ModelProfile:
    times = seconds or {t: 1.0 for t in TYPES}
    layers = tuple(LayerProfile(i, 1.0, 2.0, params, out, saved, 0, dict(times), {t: 2 * v for t, v in times.items()})
                   for i in range(n))
    return ModelProfile("uniform", 32, "float32", out, layers)


def test_faster_gpu_gets_more_layers() -> None:
    p = uniform_profile(12, seconds={"titan-v": 1.0, "quadro-p4000": 3.0})
    gpus = [Gpu("n1/0", "n1", "quadro-p4000", 8 * GiB), Gpu("n0/0", "n0", "titan-v", 12 * GiB)]
    part = partition_vw(p, gpus, 1, "sgd", Network())
    sizes = {s.gpu.type: s.layer_end - s.layer_begin for s in part.stages}
    assert sizes == {"titan-v": 9, "quadro-p4000": 3}


def test_memory_puts_the_small_gpu_last() -> None:
    # Stage 0 holds nm minibatches of activations, the last stage one: with nm = 4 only the
    # order (big, small) fits, although the small GPU is listed first.
    p = uniform_profile(4, saved=1 * GiB)
    gpus = [Gpu("n0/0", "n0", "rtx-2060", 3 * GiB), Gpu("n0/1", "n0", "titan-rtx", 24 * GiB)]
    part = partition_vw(p, gpus, 4, "sgd", Network())
    assert [s.gpu.id for s in part.stages] == ["n0/1", "n0/0"]
    assert [s.in_flight for s in part.stages] == [4, 1]


def test_infeasible_names_stage_device_and_bytes() -> None:
    p = uniform_profile(3, params=3 * GiB)
    gpus = [Gpu("n3/0", "n3", "rtx-2060", 6 * GiB)]
    with pytest.raises(PlanError, match=r"stage 0 on n3/0 \(rtx-2060\), layers \[0, 3\): needs 27\.00 GiB "
                                        r"\(28992077824 bytes\), has 6\.00 GiB \(6442450944 bytes\)") as info:
        partition_vw(p, gpus, 1, "sgd", Network())
    assert isinstance(info.value, ValueError)
    with pytest.raises(PlanError, match="every stage needs at least one layer"):
        partition_vw(uniform_profile(2), [Gpu(f"n0/{i}", "n0", "titan-v", GiB) for i in range(3)], 1, "sgd",
                     Network())


def test_max_nm() -> None:
    p = uniform_profile(4, saved=1 * GiB)
    gpus = [Gpu("n0/0", "n0", "titan-v", 12 * GiB), Gpu("n0/1", "n0", "titan-v", 12 * GiB)]
    nm = max_nm(p, gpus, "sgd", Network())
    assert 1 <= nm < 16
    partition_vw(p, gpus, nm, "sgd", Network())
    with pytest.raises(PlanError):
        partition_vw(p, gpus, nm + 1, "sgd", Network())
    assert max_nm(p, gpus, "sgd", Network(), limit=2) == 2
    assert max_nm(uniform_profile(2, params=20 * GiB), gpus, "sgd", Network()) == 0


def test_in_flight_nm_at_stage_0_and_one_at_the_last() -> None:
    for k in range(1, 9):
        for nm in range(1, 12):
            got = [in_flight(q, k, nm) for q in range(k)]
            assert got[-1] == 1
            if k > 1:
                assert got[0] == nm
            assert all(a >= b for a, b in itertools.pairwise(got)), "non-increasing along the pipeline"
    # Under L1 + FIFO the first minibatches go down the pipeline back to back, so every stage but
    # the last holds nm (not PipeDream's k - q).
    assert [in_flight(q, 4, 4) for q in range(4)] == [4, 4, 4, 1]
    assert [in_flight(q, 4, 2) for q in range(4)] == [2, 2, 2, 1]
    assert in_flight(0, 1, 5) == 1  # a lone stage runs forward and backward as one task
    with pytest.raises(ValueError):
        in_flight(4, 4, 2)


def test_stage_memory_composition() -> None:
    p = ModelProfile("m", 32, "float32", 100, (
        LayerProfile(0, 0, 0, 1000, 10, 20, 5, {}, {}),
        LayerProfile(1, 0, 0, 3000, 30, 40, 7, {}, {}),
    ))
    # params 4000; stage 1 of 2 (the last): 1 in flight; activations: input 10 + saved 40.
    assert stage_memory(p, 1, 2, 1, 2, 4, "sgd") == 2 * 3000 + 1 * (3000 + 10 + 40) + 7
    assert stage_memory(p, 1, 2, 1, 2, 4, "sgd+momentum") == 3 * 3000 + 1 * (3000 + 10 + 40) + 7
    assert stage_memory(p, 1, 2, 1, 2, 4, "adam") == 4 * 3000 + 1 * (3000 + 10 + 40) + 7
    # Stage 0 of 2 with nm = 4: 4 in flight, input is the minibatch (100 bytes).
    assert stage_memory(p, 0, 2, 0, 2, 4, "sgd") == 2 * 4000 + 4 * (4000 + 100 + 20 + 40) + 7
    assert stage_memory(p, 0, 2, 0, 2, 4, "adam") - stage_memory(p, 0, 2, 0, 2, 4, "sgd") == 2 * 4000
    # Layer 1's 3000 bytes frozen: held once, with no gradient, Adam moments or stashed copies.
    frozen = ModelProfile("m", 32, "float32", 100, (p.layers[0], dataclasses.replace(p.layers[1], frozen_bytes=3000)))
    assert stage_memory(frozen, 0, 2, 0, 2, 4, "adam") == 3000 + 4 * 1000 + 4 * 1000 + 4 * (100 + 20 + 40) + 7
    with pytest.raises(ValueError, match="optimizer"):
        stage_memory(p, 0, 2, 0, 2, 4, "lbfgs")


def test_network_intra_vs_inter_node() -> None:
    net = Network()
    a, b, c = Gpu("n0/0", "n0", "titan-v", GiB), Gpu("n0/1", "n0", "titan-v", GiB), Gpu("n1/0", "n1", "t4", GiB)
    intra, inter = net.seconds(10**9, a, b), net.seconds(10**9, a, c)
    assert intra == pytest.approx(20e-6 + 1 / (15.75 * 0.5))
    assert inter == pytest.approx(20e-6 + 1 / (7.0 * 0.8))
    assert inter > intra
    assert net.seconds(0, a, c) == 0.0
    assert Network(latency_s=0.0).seconds(5 * 10**8, a, b) == pytest.approx(0.5 / (15.75 * 0.5))
