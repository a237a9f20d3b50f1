"""Exact partitioning of a model's layers over a pipeline's stages.

`partition(costs, k)`: contiguous ranges over k identical stages, minimising the largest cost.
`partition_vw(...)`: a heterogeneous virtual worker (HetPipe §4, §7): the order of its GPUs and
the contiguous cut, minimising the bottleneck stage time under per-stage memory limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetpipe.network import Network

if TYPE_CHECKING:
    from coordinator.profiler import ModelProfile


def partition(costs: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Splits layers into k non-empty contiguous ranges [b, e) minimising the largest range cost.

    Dynamic programming over (layers used, stages used); ties prefer earlier cuts, so the
    result is deterministic.
    """
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: min max-cost of splitting the first i layers into j stages; cut[j][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for b in range(j - 1, i):
                value = max(best[j - 1][b], prefix[i] - prefix[b])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, b
    ranges: list[tuple[int, int]] = []
    end = n
    for j in range(k, 0, -1):
        begin = cut[j][end]
        ranges.append((begin, end))
        end = begin
    return ranges[::-1]


# ---- heterogeneous virtual workers (HetPipe §4, §7) ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Gpu:
    id: str        # "n0/1": node name / index on the node
    node: str
    type: str      # catalog name, or "cpu"/"cuda"
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class StageCut:
    gpu: Gpu
    layer_begin: int
    layer_end: int
    forward_seconds: float
    backward_seconds: float      # compute on that GPU
    receive_seconds: float       # activation in (forward) + gradient in (backward)
    memory_bytes: int
    in_flight: int

    @property
    def seconds(self) -> float:
        """The stage's time per minibatch: compute plus receive."""
        return self.forward_seconds + self.backward_seconds + self.receive_seconds


@dataclass(frozen=True, slots=True)
class Partition:
    stages: tuple[StageCut, ...]

    @property
    def bottleneck_seconds(self) -> float:
        """max over stages of forward + backward + receive: the pipeline's time per minibatch."""
        return max(s.seconds for s in self.stages)


class PlanError(ValueError):
    """No plan fits; the message names the stage, the device, and bytes needed vs available."""


# Optimizer state per parameter byte.
OPTIMIZER_STATE = {"sgd": 0, "sgd+momentum": 1, "momentum": 1, "adam": 2}


def optimizer_kind(name: str, momentum: float = 0.0) -> str:
    """The stage_memory optimizer name for a train.optimizer config (name, momentum)."""
    if name == "adam":
        return "adam"
    return "sgd+momentum" if momentum else "sgd"


def in_flight(stage: int, k: int, nm: int) -> int:
    """Minibatches whose activations stage `stage` (of k) holds at once: nm at every stage but the
    last, which holds one (its forward and backward are one task; a lone stage, k = 1, too).

    Not PipeDream's k - q: the runtime injects nm minibatches back to back (L1) and runs ready
    tasks FIFO (L4), so forwards run ahead of the returning gradients. An event simulation of
    those rules gives nm at every stage but the last for balanced pipelines and for pipelines
    with a slow last stage (k = 4, nm = 4: [4, 4, 4, 1]); only a slow first stage thins it out.
    """
    if not 0 <= stage < k:
        raise ValueError(f"stage {stage} outside 0..{k - 1}")
    if nm < 1:
        raise ValueError(f"nm must be >= 1, got {nm}")
    return 1 if stage == k - 1 else nm


def _optimizer_state(optimizer: str) -> int:
    try:
        return OPTIMIZER_STATE[optimizer]
    except KeyError:
        raise ValueError(f"optimizer: expected one of {', '.join(OPTIMIZER_STATE)}, got {optimizer!r}") from None


def stage_memory(profile: ModelProfile, begin: int, end: int, stage: int, k: int, nm: int,
                 optimizer: str) -> int:
    """Bytes stage `stage` of k needs for layers [begin, end) with nm minibatches in the pipeline.

    params P (the weights and their gradients: 2 P) + optimizer state (sgd 0, sgd+momentum 1 P,
    adam 2 P) + stashed weight versions (one copy per in-flight minibatch, at most: minibatches
    forwarded between two updates share one, stage_worker/stage.py) + in-flight activations
    (per minibatch: the stage's input and what its layers keep for backward) + workspace (the
    largest transient of one of its layers; layers run one at a time).
    Not counted: the runtime's WSP buffers (the wave's accumulated update, pulled weights).
    """
    layers = profile.layers
    if not 0 <= begin < end <= len(layers):
        raise ValueError(f"layers [{begin}, {end}) outside the model's {len(layers)} layers")
    m = in_flight(stage, k, nm)
    params = sum(layer.param_bytes for layer in layers[begin:end])
    inputs = profile.input_bytes if begin == 0 else layers[begin - 1].output_bytes
    activations = inputs + sum(layer.saved_bytes for layer in layers[begin:end])
    workspace = max(layer.workspace_bytes for layer in layers[begin:end])
    return params * (2 + _optimizer_state(optimizer)) + m * (params + activations) + workspace


def _memory_matrix(profile: ModelProfile, m: int, optimizer: str) -> np.ndarray:
    """stage_memory for every [b, e) with m minibatches in flight (0 where e <= b), exactly."""
    layers = profile.layers
    n = len(layers)
    param = np.array([0] + [layer.param_bytes for layer in layers], dtype=np.int64).cumsum()
    saved = np.array([0] + [layer.saved_bytes for layer in layers], dtype=np.int64).cumsum()
    inputs = np.array([profile.input_bytes] + [layer.output_bytes for layer in layers[:-1]], dtype=np.int64)
    work = np.array([layer.workspace_bytes for layer in layers], dtype=np.int64)
    out = np.zeros((n + 1, n + 1), dtype=np.int64)
    factor = 2 + _optimizer_state(optimizer) + m
    for b in range(n):
        p = param[b + 1:] - param[b]
        a = inputs[b] + saved[b + 1:] - saved[b]
        out[b, b + 1:] = p * factor + m * a + np.maximum.accumulate(work[b:])
    return out


def _layer_times(profile: ModelProfile, gpu_type: str) -> tuple[list[float], list[float]]:
    try:
        return ([layer.forward_seconds[gpu_type] for layer in profile.layers],
                [layer.backward_seconds[gpu_type] for layer in profile.layers])
    except KeyError:
        raise ValueError(f"the profile of {profile.model} has no times for GPU type {gpu_type!r}; "
                         f"profile it for that type") from None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB ({n} bytes)"


_INF = math.inf
# Where the next stage's GPU is, relative to the last formed stage's: on the same node, on
# another node, or nowhere (before the first stage / after the last).
_SAME, _OTHER, _NONE = 0, 1, 2

_Usage = tuple[tuple[int, ...], ...]          # per node (canonical order), GPUs used per kind
_State = tuple[_Usage, int, int]              # (usage, node of the last stage, where the next goes)


def partition_vw(profile: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str,
                 network: Network) -> Partition:
    """The best pipeline of a virtual worker: the order of its GPUs and a contiguous cut of the
    layers, every stage >= 1 layer, minimising the bottleneck (max over stages of forward +
    backward compute + receive time) subject to every stage fitting in its GPU's memory.

    Exact, by dynamic programming over (layers done; GPUs used, per node and kind; node of the
    last stage; whether the next stage is on that node). A kind is (type, memory). The stage's
    gradient-receive time depends on where the next stage is, so that is chosen when the stage
    is formed. A stage's position, hence its in-flight count and memory, is the number of GPUs
    used. GPUs of one kind on one node are interchangeable, and so are nodes with the same GPUs,
    which keeps the state space small. This assumes Network.seconds depends only on the bytes and
    on whether the two GPUs share a node (true of Network). Ties are broken deterministically.
    """
    return _Solver(profile, gpus, nm, optimizer, network).solve()


def max_nm(profile: ModelProfile, gpus: Sequence[Gpu], optimizer: str, network: Network,
           limit: int = 16) -> int:
    """Max_m: the largest nm <= limit for which some pipeline of these GPUs fits in memory
    (partition_vw succeeds), 0 if not even nm = 1 fits. Memory needs grow with nm."""
    try:
        solver = _Solver(profile, gpus, 1, optimizer, network, times=False)
    except PlanError:
        return 0  # more GPUs than layers
    lo, hi = 0, limit
    while lo < hi:  # invariant: lo fits (0 trivially), nothing above hi does
        mid = (lo + hi + 1) // 2
        solver.nm = mid
        if solver.memory_plan()[0] <= 1.0:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Cluster:
    """A VW's GPUs as kinds (type, memory) on nodes; nodes sorted so that equal ones are adjacent."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        self.kinds = sorted({(g.type, g.memory_bytes) for g in gpus})
        kind_of = {kind: i for i, kind in enumerate(self.kinds)}
        by_node: dict[str, list[Gpu]] = {}
        for g in gpus:
            by_node.setdefault(g.node, []).append(g)

        def composition(node: str) -> tuple[int, ...]:
            counts = [0] * len(self.kinds)
            for g in by_node[node]:
                counts[kind_of[(g.type, g.memory_bytes)]] += 1
            return tuple(counts)

        self.nodes = sorted(by_node, key=lambda node: (composition(node), node))
        self.composition = [composition(node) for node in self.nodes]
        self.free = [sum(c) for c in self.composition]
        # members[j][d]: the GPUs of kind d on node j, by id.
        self.members = [[sorted((g for g in by_node[node] if kind_of[(g.type, g.memory_bytes)] == d),
                                key=lambda g: g.id) for d in range(len(self.kinds))] for node in self.nodes]
        # Ranges of interchangeable nodes.
        self.groups: list[tuple[int, int]] = []
        for j, comp in enumerate(self.composition):
            if self.groups and self.composition[self.groups[-1][0]] == comp:
                self.groups[-1] = (self.groups[-1][0], j + 1)
            else:
                self.groups.append((j, j + 1))
        self.kind_gpus = [sorted((g for g in gpus if kind_of[(g.type, g.memory_bytes)] == d), key=lambda g: g.id)
                          for d in range(len(self.kinds))]

    def canonical(self, usage: _Usage, cur: int) -> tuple[_Usage, int, list[int]]:
        """Sorts interchangeable nodes by usage (the current node first among equals).
        Returns the usage, the current node's new position, and perm (new position -> old)."""
        perm: list[int] = []
        for a, z in self.groups:
            perm.extend(sorted(range(a, z), key=lambda j: (usage[j], j != cur, j)))
        return tuple(usage[j] for j in perm), (perm.index(cur) if cur >= 0 else -1), perm


class _Solver:
    def __init__(self, profile: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str,
                 network: Network, *, times: bool = True) -> None:
        self.profile, self.nm, self.optimizer, self.network = profile, nm, optimizer, network
        self.n, self.k = len(profile.layers), len(gpus)
        _optimizer_state(optimizer)
        if isinstance(nm, bool) or not isinstance(nm, int) or nm < 1:
            raise ValueError(f"nm must be an integer >= 1, got {nm!r}")
        if self.k == 0:
            raise PlanError("a virtual worker needs at least one GPU")
        ids = [g.id for g in gpus]
        if len(set(ids)) != len(ids):
            raise ValueError(f"GPU ids must be unique within a virtual worker, got {ids}")
        if self.k > self.n:
            raise PlanError(f"{self.k} GPUs but {profile.model} has {self.n} layers: every stage needs "
                            f"at least one layer")
        self.cluster = _Cluster(gpus)
        self._memory: dict[int, np.ndarray] = {}
        self._costs: dict[tuple[int, int, int, int], np.ndarray] = {}
        if times:
            self._compute: dict[str, np.ndarray] = {}
            for t, _ in self.cluster.kinds:
                if t not in self._compute:
                    fwd, bwd = _layer_times(profile, t)
                    self._compute[t] = self._range_sums([f + b for f, b in zip(fwd, bwd)])
            # Receive time at cut i (the output of layer i - 1), same node or not.
            a, b, c = Gpu("x/0", "x", "", 0), Gpu("x/1", "x", "", 0), Gpu("y/0", "y", "", 0)
            self._link = {edge: np.zeros(self.n + 1) for edge in (_SAME, _OTHER, _NONE)}
            for i in range(1, self.n):
                nbytes = profile.layers[i - 1].output_bytes
                self._link[_SAME][i] = network.seconds(nbytes, a, b)
                self._link[_OTHER][i] = network.seconds(nbytes, a, c)

    # -- tables --

    def _range_sums(self, per_layer: Sequence[float]) -> np.ndarray:
        """[b, e] -> sum of per_layer[b:e], added left to right (inf where e <= b)."""
        n = self.n
        out = np.full((n + 1, n + 1), _INF)
        values = np.asarray(per_layer, dtype=np.float64)
        for b in range(n):
            out[b, b + 1:] = np.cumsum(values[b:])
        return out

    def memory(self, q: int) -> np.ndarray:
        m = in_flight(q, self.k, self.nm)
        if m not in self._memory:
            self._memory[m] = _memory_matrix(self.profile, m, self.optimizer)
        return self._memory[m]

    def _shape(self, q: int) -> np.ndarray:
        """[b, e] -> [b, e) can be stage q: non-empty, stage 0 starts at 0, the last ends at n,
        and it leaves at least one layer to every other stage."""
        n, k = self.n, self.k
        b = np.arange(n + 1)[:, None]
        e = np.arange(n + 1)[None, :]
        return (e > b) & (b >= q) & (e <= n - (k - 1 - q)) & ((b == 0) == (q == 0)) & ((e == n) == (q == k - 1))

    def _cost(self, q: int, d: int, left: int, right: int) -> np.ndarray:
        """[b, e] -> time of stage q on kind d over [b, e) (inf if it is no valid stage or does
        not fit): compute + receive of the activation (left edge) and of the gradient (right)."""
        key = (q, d, left, right)
        if key not in self._costs:
            t, capacity = self.cluster.kinds[d]
            ok = self._shape(q) & (self.memory(q) <= capacity)
            cost = self._compute[t] + self._link[left][:, None] + self._link[right][None, :]
            self._costs[key] = np.where(ok, cost, _INF)
        return self._costs[key]

    # -- the DP --

    def solve(self) -> Partition:
        cl, n, k = self.cluster, self.n, self.k
        K, N = len(cl.kinds), len(cl.nodes)
        count = tuple(len(g) for g in cl.kind_gpus)
        # Bounds from the same problem without nodes (GPUs as kinds only). Upper: every receive
        # at the slower of the two link speeds; that plan is realisable on any nodes, and its
        # real bottleneck bounds the optimum. Lower, for every suffix of layers and multiset of
        # GPU kinds left: every receive at the faster speed. The search below drops every state
        # whose value, or value with the best possible rest, exceeds the upper bound.
        same, other = self._link[_SAME], self._link[_OTHER]
        plan = self._kinds_forward(np.maximum(same, other))
        if plan is None:
            raise self._memory_error()
        upper = self._build(*plan)
        suffix = self._kinds_suffix(np.minimum(same, other))
        if upper.bottleneck_seconds <= suffix[count][0] * (1 + 1e-13):
            return upper  # the bounds meet: it is optimal
        limit = upper.bottleneck_seconds * (1 + 1e-9)  # slack for the order of float additions
        start: _State = (tuple((0,) * K for _ in range(N)), -1, _NONE)
        first = np.full((1, n + 1), _INF)
        first[0, 0] = 0.0
        # Level q: the states after q stages, and values[q][s, i], the best bottleneck of stages
        # 0..q-1 with stage q-1 ending at i. back[q][s, i]: the candidate (transition) that
        # achieved it, described by moves[q][candidate] = (state before, kind, node position).
        keys: list[list[_State]] = [[start]]
        values: list[np.ndarray] = [first]
        back: list[np.ndarray] = [np.zeros((1, n + 1), dtype=np.int64)]
        moves: list[list[tuple[int, int, int]]] = [[]]
        for q in range(k):
            level_moves: list[tuple[int, int, int]] = []
            targets: dict[_State, int] = {}
            target_keys: list[_State] = []
            target_rest: list[np.ndarray] = []  # lower bound for the stages after the target
            batches: dict[tuple[int, int, int], tuple[list[int], list[int], list[int]]] = {}
            after: dict[tuple[_Usage, int, int], tuple[_Usage, int, list[int], np.ndarray]] = {}
            for s, (usage, cur, where) in enumerate(keys[q]):
                for j in self._next_nodes(usage, cur, where):
                    for d in range(K):
                        if usage[j][d] >= cl.composition[j][d]:
                            continue
                        step = after.get((usage, j, d))
                        if step is None:
                            row = list(usage)
                            row[j] = tuple(u + (1 if i == d else 0) for i, u in enumerate(usage[j]))
                            new_usage, new_cur, _ = cl.canonical(tuple(row), j)
                            left_over = tuple(c - sum(u[i] for u in new_usage) for i, c in enumerate(count))
                            step = after[(usage, j, d)] = (new_usage, new_cur,
                                                           self._next_wheres(new_usage, new_cur, q),
                                                           suffix[left_over])
                        new_usage, new_cur, wheres, rest_of_target = step
                        move = len(level_moves)
                        level_moves.append((s, d, j))
                        for right in wheres:
                            target = (new_usage, new_cur, right)
                            t = targets.get(target)
                            if t is None:
                                t = targets[target] = len(target_keys)
                                target_keys.append(target)
                                target_rest.append(rest_of_target)
                            rows, ts, ms = batches.setdefault((d, where, right), ([], [], []))
                            rows.append(s)
                            ts.append(t)
                            ms.append(move)
            # Every candidate's values, then the best candidate per target (the first on ties).
            cand_values, cand_targets, cand_moves = [], [], []
            rest = np.stack(target_rest) if target_rest else np.zeros((0, n + 1))
            for (d, left, right), (rows, ts, ms) in batches.items():
                unique, inverse = np.unique(np.asarray(rows), return_inverse=True)
                result = _min_max(values[q][unique], self._cost(q, d, left, right))[inverse]
                result[np.maximum(result, rest[ts]) > limit] = _INF
                keep = np.isfinite(result).any(axis=1)
                cand_values.append(result[keep])
                cand_targets.append(np.asarray(ts)[keep])
                cand_moves.append(np.asarray(ms)[keep])
            if not cand_values or not sum(len(t) for t in cand_targets):
                return upper  # everything else exceeds it (cannot happen: upper is a candidate)
            vals = np.concatenate(cand_values)
            tids = np.concatenate(cand_targets)
            mids = np.concatenate(cand_moves)
            order = np.lexsort((mids, tids))
            vals, tids, mids = vals[order], tids[order], mids[order]
            starts = np.flatnonzero(np.r_[True, tids[1:] != tids[:-1]])
            best = np.minimum.reduceat(vals, starts, axis=0)
            counts = np.diff(np.r_[starts, len(tids)])
            position = np.where(vals == np.repeat(best, counts, axis=0), np.arange(len(tids))[:, None], len(tids))
            winner = np.minimum.reduceat(position, starts, axis=0)
            keys.append([target_keys[t] for t in tids[starts]])
            values.append(best)
            back.append(mids[winner])
            moves.append(level_moves)

        finals = values[k][:, n]
        if not np.isfinite(finals).any():
            return upper
        s = int(np.argmin(finals))  # the first of the best final states
        # Walk back: (state before, kind, node position, begin, end) per stage.
        path = []
        e = n
        for q in range(k, 0, -1):
            prev, d, j = moves[q][int(back[q][s, e])]
            cost = self._cost(q - 1, d, keys[q - 1][prev][2], keys[q][s][2])[:, e]
            b = int(np.argmin(np.maximum(values[q - 1][prev], cost)))
            path.append((keys[q - 1][prev][0], d, j, b, e))
            s, e = prev, b
        path.reverse()
        # Forward again, following which real node each canonical position stands for.
        actual = list(range(N))
        used = [[0] * K for _ in range(N)]
        gpus, ranges = [], []
        for usage, d, j, b, e in path:
            node = actual[j]
            gpus.append(cl.members[node][d][used[node][d]])
            used[node][d] += 1
            ranges.append((b, e))
            row = list(usage)
            row[j] = tuple(u + (1 if i == d else 0) for i, u in enumerate(usage[j]))
            _, _, perm = cl.canonical(tuple(row), j)
            actual = [actual[p] for p in perm]
        best_plan = self._build(gpus, ranges)
        return best_plan if best_plan.bottleneck_seconds <= upper.bottleneck_seconds else upper

    def _next_nodes(self, usage: _Usage, cur: int, where: int) -> list[int]:
        """Candidate nodes for the next stage: one per set of interchangeable nodes."""
        cl = self.cluster
        if where == _SAME:
            return [cur]
        out = []
        for a, z in cl.groups:
            for j in range(a, z):
                if j == cur or sum(usage[j]) >= cl.free[j]:
                    continue
                if j > a and usage[j] == usage[j - 1] and j - 1 != cur:
                    continue  # same as node j - 1
                out.append(j)
        return out

    def _next_wheres(self, usage: _Usage, cur: int, q: int) -> list[int]:
        """Where stage q + 1 can go after stage q on node cur, with GPUs used as in usage."""
        if q == self.k - 1:
            return [_NONE]
        cl = self.cluster
        out = []
        if sum(usage[cur]) < cl.free[cur]:
            out.append(_SAME)
        if any(sum(usage[j]) < cl.free[j] for j in range(len(cl.nodes)) if j != cur):
            out.append(_OTHER)
        return out

    def _build(self, gpus: Sequence[Gpu], ranges: Sequence[tuple[int, int]]) -> Partition:
        k, layers = self.k, self.profile.layers
        cuts = []
        for q, (gpu, (b, e)) in enumerate(zip(gpus, ranges)):
            fwd, bwd = _layer_times(self.profile, gpu.type)
            receive = 0.0
            if q > 0:
                receive += self.network.seconds(layers[b - 1].output_bytes, gpus[q - 1], gpu)
            if q < k - 1:
                receive += self.network.seconds(layers[e - 1].output_bytes, gpus[q + 1], gpu)
            cuts.append(StageCut(
                gpu=gpu, layer_begin=b, layer_end=e,
                forward_seconds=sum(fwd[b:e]), backward_seconds=sum(bwd[b:e]), receive_seconds=receive,
                memory_bytes=stage_memory(self.profile, b, e, q, k, self.nm, self.optimizer),
                in_flight=in_flight(q, k, self.nm),
            ))
        return Partition(tuple(cuts))

    # -- GPUs as kinds only (nodes ignored): bounds, and memory --

    def _kinds_cost(self, q: int, d: int, edge: np.ndarray) -> np.ndarray:
        """Like _cost, with the receive times at cut i given by edge[i] on both sides."""
        t, capacity = self.cluster.kinds[d]
        ok = self._shape(q) & (self.memory(q) <= capacity)
        return np.where(ok, self._compute[t] + edge[:, None] + edge[None, :], _INF)

    def _kinds_forward(self, edge: np.ndarray) -> tuple[list[Gpu], list[tuple[int, int]]] | None:
        """The best plan over orders of kinds and cuts, receive times from edge (None if none
        fits), on the first GPUs of each kind by id."""
        cl, n, k = self.cluster, self.n, self.k
        K = len(cl.kinds)
        count = tuple(len(g) for g in cl.kind_gpus)
        first = np.full(n + 1, _INF)
        first[0] = 0.0
        levels: list[dict[tuple[int, ...], np.ndarray]] = [{(0,) * K: first}]
        kinds: list[dict[tuple[int, ...], np.ndarray]] = [{}]
        for q in range(k):
            new: dict[tuple[int, ...], np.ndarray] = {}
            new_kind: dict[tuple[int, ...], np.ndarray] = {}
            for d in range(K):
                Ms = [M for M in levels[q] if M[d] < count[d]]
                if not Ms:
                    continue
                best = _min_max(np.stack([levels[q][M] for M in Ms]), self._kinds_cost(q, d, edge))
                for M, row in zip(Ms, best):
                    key = tuple(m + (i == d) for i, m in enumerate(M))
                    if key not in new:
                        new[key], new_kind[key] = row, np.full(n + 1, d)
                    else:
                        better = row < new[key]
                        new[key] = np.where(better, row, new[key])
                        new_kind[key][better] = d
            levels.append(new)
            kinds.append(new_kind)
        if count not in levels[k] or not levels[k][count][n] < _INF:
            return None
        order, ranges = [], []
        M, e = count, n
        for q in range(k, 0, -1):
            d = int(kinds[q][M][e])
            M = tuple(m - (i == d) for i, m in enumerate(M))
            b = int(np.argmin(np.maximum(levels[q - 1][M], self._kinds_cost(q - 1, d, edge)[:, e])))
            order.append(d)
            ranges.append((b, e))
            e = b
        used = [0] * K
        gpus = []
        for d in reversed(order):
            gpus.append(cl.kind_gpus[d][used[d]])
            used[d] += 1
        return gpus, ranges[::-1]

    def _kinds_suffix(self, edge: np.ndarray) -> dict[tuple[int, ...], np.ndarray]:
        """rest[R][i]: the best bottleneck of the last |R| stages over layers [i, n) on the
        multiset R of kinds (counts per kind), receive times from edge."""
        cl, n, k = self.cluster, self.n, self.k
        K = len(cl.kinds)
        count = tuple(len(g) for g in cl.kind_gpus)
        end = np.full(n + 1, _INF)
        end[n] = 0.0
        level: dict[tuple[int, ...], np.ndarray] = {(0,) * K: end}
        out = dict(level)
        for q in range(k - 1, -1, -1):
            new: dict[tuple[int, ...], np.ndarray] = {}
            for d in range(K):
                Rs = [R for R in level if R[d] < count[d]]
                if not Rs:
                    continue
                # best[r, i] = min over e of max(cost[i, e], rest[r][e])
                best = _min_max(np.stack([level[R] for R in Rs]), self._kinds_cost(q, d, edge).T)
                for R, row in zip(Rs, best):
                    key = tuple(m + (i == d) for i, m in enumerate(R))
                    new[key] = np.minimum(new[key], row) if key in new else row
            level = new
            out.update(new)
        return out

    # -- memory only --

    def memory_plan(self) -> tuple[float, list[Gpu], list[tuple[int, int]]]:
        """The order and cut minimising the largest memory needed / capacity over the stages."""
        cl, n, k = self.cluster, self.n, self.k
        K = len(cl.kinds)
        count = tuple(len(g) for g in cl.kind_gpus)
        first = np.full(n + 1, _INF)
        first[0] = 0.0
        level: dict[tuple[int, ...], np.ndarray] = {(0,) * K: first}
        history: list[dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        for q in range(k):
            shape = self._shape(q)
            ratios = [np.where(shape, self.memory(q) / capacity, _INF) for _, capacity in cl.kinds]
            new: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
            for M, value in level.items():
                for d in range(K):
                    if M[d] >= count[d]:
                        continue
                    X = np.maximum(value[:, None], ratios[d])
                    argb = X.argmin(axis=0)
                    best = X[argb, np.arange(n + 1)]
                    key = tuple(m + (1 if i == d else 0) for i, m in enumerate(M))
                    if key not in new:
                        new[key] = (best, argb, np.full(n + 1, d))
                    else:
                        old_v, old_b, old_d = new[key]
                        better = best < old_v
                        old_v[better] = best[better]
                        old_b[better] = argb[better]
                        old_d[better] = d
            history.append(new)
            level = {key: v[0] for key, v in new.items()}
        worst = float(level[count][n])
        kinds, ranges = [], []
        M, e = count, n
        for q in range(k, 0, -1):
            _, back_b, back_d = history[q - 1][M]
            b, d = int(back_b[e]), int(back_d[e])
            kinds.append(d)
            ranges.append((b, e))
            M = tuple(m - (1 if i == d else 0) for i, m in enumerate(M))
            e = b
        used = [0] * K
        gpus = []
        for d in reversed(kinds):
            gpus.append(cl.kind_gpus[d][used[d]])
            used[d] += 1
        return worst, gpus, ranges[::-1]

    def _memory_error(self) -> PlanError:
        _, gpus, ranges = self.memory_plan()
        worst = None
        for q, (gpu, (b, e)) in enumerate(zip(gpus, ranges)):
            need = stage_memory(self.profile, b, e, q, self.k, self.nm, self.optimizer)
            if worst is None or need / gpu.memory_bytes > worst[0]:
                worst = (need / gpu.memory_bytes, q, gpu, b, e, need)
        assert worst is not None
        _, q, gpu, b, e, need = worst
        return PlanError(
            f"no pipeline of {self.k} GPU(s) fits {self.profile.model} in memory at nm={self.nm}; closest: "
            f"stage {q} on {gpu.id} ({gpu.type}), layers [{b}, {e}): needs {_gib(need)}, "
            f"has {_gib(gpu.memory_bytes)}"
        )


def _min_max(values: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """out[r, e] = min over b of max(values[r, b], cost[b, e])."""
    out = np.full((values.shape[0], cost.shape[1]), _INF)
    useful = np.flatnonzero(np.isfinite(values).any(axis=0) & np.isfinite(cost).any(axis=1))
    for b in useful:
        np.minimum(out, np.maximum(values[:, b, None], cost[b][None, :]), out=out)
    return out
