"""Allocation policies (HetPipe §8.1): which GPUs form each virtual worker, under NP, ED or HD.

Every policy returns `virtual_workers` lists of exactly `stages_per_vw` distinct GPUs, each VW's
GPUs in cluster order (the partitioner chooses the pipeline order). GPUs left over stay idle.
A cluster that cannot satisfy the policy gets a ConfigError that says why. `auto` is not a
policy here: the planner tries these three and keeps the best predicted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Hashable, TypeVar

from hetpipe.catalog import CATALOG
from hetpipe.config import ConfigError
from coordinator.planner.cluster import Gpu

POLICIES = ("NP", "ED", "HD")
K = TypeVar("K", bound=Hashable)


def allocate(
    policy: str, gpus: Sequence[Gpu], virtual_workers: int, stages_per_vw: int, *,
    compute: Mapping[str, float] | None = None,
) -> list[list[Gpu]]:
    """The GPUs of each virtual worker under `policy`.

    NP: one node per VW. ED: every VW gets the same mix, spread over the nodes. HD: pairs of GPU
    types balanced in compute and memory (the paper's VVQQ, VVQQ, RRGG, RRGG). `compute` (HD
    only) rates each GPU type's speed, e.g. measured by the profiler; by default the catalog's
    TFLOPS (1.0 for types outside the catalog, such as "cpu").
    """
    n, k = virtual_workers, stages_per_vw
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"parallel.virtual_workers: expected an integer >= 1, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"parallel.stages_per_vw: expected an integer >= 1, got {k!r}")
    ids = [g.id for g in gpus]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"cluster: GPU ids must be unique, got duplicates {duplicates}")
    if len(gpus) < n * k:
        raise ConfigError(f"parallel: {n} virtual workers x {k} stages need {n * k} GPUs; "
                          f"the cluster has {len(gpus)}")
    if policy == "NP":
        return _node_partition(gpus, n, k)
    if policy == "ED":
        return _equal_distribution(gpus, n, k)
    if policy == "HD":
        return _hybrid_distribution(gpus, n, k, compute)
    raise ConfigError(f"parallel.policy: expected one of {', '.join(POLICIES)} ('auto' is resolved by the "
                      f"planner), got {policy!r}")


def _by_key(gpus: Sequence[Gpu], attribute: str) -> dict[str, list[Gpu]]:
    """GPUs grouped by node or type, groups and members in cluster order."""
    groups: dict[str, list[Gpu]] = {}
    for g in gpus:
        groups.setdefault(getattr(g, attribute), []).append(g)
    return groups


def _in_cluster_order(vw: list[Gpu], gpus: Sequence[Gpu]) -> list[Gpu]:
    position = {g.id: i for i, g in enumerate(gpus)}
    return sorted(vw, key=lambda g: position[g.id])


def _describe(groups: Mapping[str, list[Gpu]]) -> str:
    return ", ".join(f"{name}: {len(members)}" for name, members in groups.items())


# ---- NP -------------------------------------------------------------------------------------


def _node_partition(gpus: Sequence[Gpu], n: int, k: int) -> list[list[Gpu]]:
    """VW v is the first k GPUs of the v-th node (in cluster order) that has at least k GPUs.

    Communication within a VW stays inside a node; VWs differ as much as the nodes do.
    """
    nodes = _by_key(gpus, "node")
    eligible = [members for members in nodes.values() if len(members) >= k]
    if len(eligible) < n:
        raise ConfigError(f"parallel.policy: NP puts each virtual worker on one node, so {n} virtual workers "
                          f"x {k} stages need {n} nodes with >= {k} GPUs each; the cluster has {len(eligible)} "
                          f"(GPUs per node: {_describe(nodes)})")
    return [members[:k] for members in eligible[:n]]


# ---- ED -------------------------------------------------------------------------------------


def _spread(shares: Mapping[K, int], need: int) -> dict[K, int]:
    """Takes up to `need` units from the groups' shares one group at a time, in turn."""
    left, take = dict(shares), dict.fromkeys(shares, 0)
    while need > 0 and any(left.values()):
        for key in left:
            if need > 0 and left[key]:
                left[key] -= 1
                take[key] += 1
                need -= 1
    return take


def _equal_distribution(gpus: Sequence[Gpu], n: int, k: int) -> list[list[Gpu]]:
    """Every VW gets the same mix of GPU types, spread over as many nodes as possible.

    Each node deals its GPUs of each type out in equal shares, VW v taking the v-th consecutive
    block: c // n GPUs per VW from c GPUs of one type on one node. The k slots of a VW are filled one share unit at
    a time, visiting the nodes in turn, so that a VW spans the nodes evenly (on the paper's
    cluster: one V, R, G and Q each). Then every VW has the same GPUs of each node, which is
    what `local` placement relies on. If the node shares do not reach k, GPUs left on the nodes
    are pooled by type and dealt the same way, so that the type mix is still the same for all.
    """
    by_node = _by_key(gpus, "node")
    # The units dealt are a node's GPUs of one type (a node may hold several types), visited
    # round-robin over the nodes so that a VW spans as many nodes as possible.
    groups = [{(node, t): m for t, m in _by_key(members, "type").items()} for node, members in by_node.items()]
    order = [key for i in range(max(map(len, groups))) for g in groups for key in list(g)[i:i + 1]]
    members_of = {key: m for g in groups for key, m in g.items()}
    node_take = _spread({key: len(members_of[key]) // n for key in order}, k)
    vws: list[list[Gpu]] = [[] for _ in range(n)]
    leftover: list[Gpu] = []
    for key in order:
        members, take = members_of[key], node_take.get(key, 0)
        for v in range(n):
            vws[v] += members[v * take:(v + 1) * take]
        leftover += members[n * take:]
    filled = sum(node_take.values())
    if filled < k:
        by_type = _by_key(leftover, "type")
        type_take = _spread({t: len(m) // n for t, m in by_type.items()}, k - filled)
        for t, members in by_type.items():
            take = type_take.get(t, 0)
            for v in range(n):
                vws[v] += members[v * take:(v + 1) * take]
        filled += sum(type_take.values())
    if filled < k:
        types = _describe(_by_key(gpus, "type"))
        raise ConfigError(f"parallel.policy: ED gives every virtual worker the same mix of GPUs, but only {filled} "
                          f"of the {k} GPUs per virtual worker can be split evenly over {n} virtual workers "
                          f"(GPUs per node: {_describe(_by_key(gpus, 'node'))}; per type: {types}); "
                          f"use NP or HD, or fewer virtual workers")
    return [_in_cluster_order(vw, gpus) for vw in vws]


# ---- HD -------------------------------------------------------------------------------------


def _groupings(types: list[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to split the types into pairs and singles (each type in exactly one group)."""
    if not types:
        yield []
        return
    first, rest = types[0], types[1:]
    for j, partner in enumerate(rest):
        for groups in _groupings(rest[:j] + rest[j + 1:]):
            yield [(first, partner), *groups]
    for groups in _groupings(rest):
        yield [(first,), *groups]


def _hybrid_distribution(
    gpus: Sequence[Gpu], n: int, k: int, compute: Mapping[str, float] | None,
) -> list[list[Gpu]]:
    """VWs of two GPU types, k/2 of each, with the pairs balanced in compute and in memory.

    The rule: split the cluster's GPU types into groups of two (k/2 GPUs of each per VW) or,
    only where pairing is impossible (an odd number of types, a type too scarce to pair), one
    (k GPUs of it per VW). VWs are dealt to the groups in turn, as many as each group's GPUs
    allow. Among the splits that host all the VWs with the fewest single-type VW groups, pick
    the one whose worse-balanced resource is best balanced: minimise max(compute imbalance,
    memory imbalance), an imbalance being the largest over the smallest per-VW total among the
    groups that receive VWs. VWs are listed group by group, groups ordered by where their types
    first appear in the cluster. On the paper's cluster (catalog TFLOPS
    R > V > G > Q, memory R > V > Q > G) V+Q and R+G win: compute 20.2 vs 22.8 TFLOPS, memory
    20 vs 30 GB, against V+G / R+Q (21.4 vs 21.6 TFLOPS, but 18 vs 32 GB). Pairing by compute
    order alone would depend on how V and R are rated; they are within 10% of each other.
    """
    if k % 2:
        raise ConfigError(f"parallel.policy: HD gives each virtual worker k/2 GPUs of each of two types, so "
                          f"parallel.stages_per_vw must be even, got {k}")
    by_type = _by_key(gpus, "type")
    types = list(by_type)
    rating = {t: float((compute or {}).get(t, CATALOG[t].tflops if t in CATALOG else 1.0)) for t in types}
    memory = {t: float(min(g.memory_bytes for g in by_type[t])) for t in types}

    def vws_per_group(grouping: list[tuple[str, ...]]) -> list[int] | None:
        capacity = [min(len(by_type[t]) // (k // len(group)) for t in group) for group in grouping]
        if sum(capacity) < n:
            return None
        counts = [0] * len(grouping)
        dealt = 0
        while dealt < n:
            for i, cap in enumerate(capacity):
                if dealt < n and counts[i] < cap:
                    counts[i] += 1
                    dealt += 1
        return counts

    def imbalance(grouping: list[tuple[str, ...]], counts: list[int], value: Mapping[str, float]) -> float:
        totals = [k / len(group) * sum(value[t] for t in group)
                  for group, count in zip(grouping, counts, strict=True) if count]
        return max(totals) / min(totals) if min(totals) > 0 else float("inf")

    best: tuple[tuple[int, float, float], list[tuple[str, ...]], list[int]] | None = None
    for grouping in _groupings(types):
        counts = vws_per_group(grouping)
        if counts is None:
            continue
        c, m = imbalance(grouping, counts, rating), imbalance(grouping, counts, memory)
        singles = sum(1 for group, count in zip(grouping, counts, strict=True) if count and len(group) == 1)
        score = (singles, max(c, m), c + m)
        if best is None or score < best[0]:
            best = (score, grouping, counts)
    if best is None:
        raise ConfigError(f"parallel.policy: HD builds each virtual worker from {k // 2} GPUs of each of two types "
                          f"(or {k} of one type), but no grouping of the cluster's types has enough GPUs for {n} "
                          f"virtual workers (GPUs per type: {_describe(by_type)}); use NP or ED, or fewer "
                          f"virtual workers")
    _, grouping, counts = best
    first_seen = {t: i for i, t in enumerate(types)}
    order = sorted(range(len(grouping)), key=lambda i: min(first_seen[t] for t in grouping[i]))
    used = {t: 0 for t in types}
    vws: list[list[Gpu]] = []
    for i in order:
        per_type = k // len(grouping[i])
        for _ in range(counts[i]):
            vw: list[Gpu] = []
            for t in grouping[i]:
                vw += by_type[t][used[t]:used[t] + per_type]
                used[t] += per_type
            vws.append(_in_cluster_order(vw, gpus))
    return vws


__all__ = ["POLICIES", "allocate"]
