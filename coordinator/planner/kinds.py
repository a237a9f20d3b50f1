"""The partition problem with GPUs as kinds only (nodes ignored): the tables every search reads,
bounds for the exact search in partition.py, and the plan that needs the least memory."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hetpipe.network import Network
from hetpipe.units import format_bytes
from coordinator.planner.cluster import Cluster, Gpu, PlanError
from coordinator.planner.memory import in_flight, memory_matrix, optimizer_state, stage_memory
from coordinator.planner.profile import ModelProfile

INF = math.inf
# Where the next stage's GPU is, relative to the last formed stage's: on the same node, on
# another node, or nowhere (before the first stage / after the last).
SAME, OTHER, NONE = 0, 1, 2


def layer_times(profile: ModelProfile, gpu_type: str) -> tuple[list[float], list[float]]:
    try:
        return ([layer.forward_seconds[gpu_type] for layer in profile.layers],
                [layer.backward_seconds[gpu_type] for layer in profile.layers])
    except KeyError:
        raise ValueError(f"the profile of {profile.model} has no times for GPU type {gpu_type!r}; "
                         f"profile it for that type") from None



class Tables:
    """Per-range tables of one virtual worker's problem: compute and receive times, memory, and
    which ranges can be which stage. `times=False` builds only what memory questions need."""

    def __init__(self, profile: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str,
                 network: Network, *, times: bool = True) -> None:
        self.profile, self.nm, self.optimizer, self.network = profile, nm, optimizer, network
        self.n, self.k = len(profile.layers), len(gpus)
        optimizer_state(optimizer)
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
        self.cluster = Cluster(gpus)
        self._memory: dict[int, np.ndarray] = {}
        self._costs: dict[tuple[int, int, int, int], np.ndarray] = {}
        if times:
            self._compute: dict[str, np.ndarray] = {}
            for t, _ in self.cluster.kinds:
                if t not in self._compute:
                    fwd, bwd = layer_times(profile, t)
                    self._compute[t] = self._range_sums([f + b for f, b in zip(fwd, bwd)])
            # Receive time at cut i (the output of layer i - 1), same node or not.
            a, b, c = Gpu("x/0", "x", "", 0), Gpu("x/1", "x", "", 0), Gpu("y/0", "y", "", 0)
            self._link = {edge: np.zeros(self.n + 1) for edge in (SAME, OTHER, NONE)}
            for i in range(1, self.n):
                nbytes = profile.layers[i - 1].output_bytes
                self._link[SAME][i] = network.seconds(nbytes, a, b)
                self._link[OTHER][i] = network.seconds(nbytes, a, c)

    # -- tables --

    def _range_sums(self, per_layer: Sequence[float]) -> np.ndarray:
        """[b, e] -> sum of per_layer[b:e], added left to right (inf where e <= b)."""
        n = self.n
        out = np.full((n + 1, n + 1), INF)
        values = np.asarray(per_layer, dtype=np.float64)
        for b in range(n):
            out[b, b + 1:] = np.cumsum(values[b:])
        return out

    def memory(self, q: int) -> np.ndarray:
        m = in_flight(q, self.k, self.nm)
        if m not in self._memory:
            self._memory[m] = memory_matrix(self.profile, m, self.optimizer)
        return self._memory[m]

    def shape(self, q: int) -> np.ndarray:
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
            ok = self.shape(q) & (self.memory(q) <= capacity)
            cost = self._compute[t] + self._link[left][:, None] + self._link[right][None, :]
            self._costs[key] = np.where(ok, cost, INF)
        return self._costs[key]

    # -- the DP --
    # -- GPUs as kinds only (nodes ignored): bounds, and memory --

    def kinds_cost(self, q: int, d: int, edge: np.ndarray) -> np.ndarray:
        """Like _cost, with the receive times at cut i given by edge[i] on both sides."""
        t, capacity = self.cluster.kinds[d]
        ok = self.shape(q) & (self.memory(q) <= capacity)
        return np.where(ok, self._compute[t] + edge[:, None] + edge[None, :], INF)

    def kinds_forward(self, edge: np.ndarray) -> tuple[list[Gpu], list[tuple[int, int]]] | None:
        """The best plan over orders of kinds and cuts, receive times from edge (None if none
        fits), on the first GPUs of each kind by id."""
        cl, n, k = self.cluster, self.n, self.k
        K = len(cl.kinds)
        count = tuple(len(g) for g in cl.kind_gpus)
        first = np.full(n + 1, INF)
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
                best = min_max(np.stack([levels[q][M] for M in Ms]), self.kinds_cost(q, d, edge))
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
        if count not in levels[k] or not levels[k][count][n] < INF:
            return None
        order, ranges = [], []
        M, e = count, n
        for q in range(k, 0, -1):
            d = int(kinds[q][M][e])
            M = tuple(m - (i == d) for i, m in enumerate(M))
            b = int(np.argmin(np.maximum(levels[q - 1][M], self.kinds_cost(q - 1, d, edge)[:, e])))
            order.append(d)
            ranges.append((b, e))
            e = b
        return _gpus_of(cl, order[::-1]), ranges[::-1]

    def kinds_suffix(self, edge: np.ndarray) -> dict[tuple[int, ...], np.ndarray]:
        """rest[R][i]: the best bottleneck of the last |R| stages over layers [i, n) on the
        multiset R of kinds (counts per kind), receive times from edge."""
        cl, n, k = self.cluster, self.n, self.k
        K = len(cl.kinds)
        count = tuple(len(g) for g in cl.kind_gpus)
        end = np.full(n + 1, INF)
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
                best = min_max(np.stack([level[R] for R in Rs]), self.kinds_cost(q, d, edge).T)
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
        first = np.full(n + 1, INF)
        first[0] = 0.0
        level: dict[tuple[int, ...], np.ndarray] = {(0,) * K: first}
        history: list[dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        for q in range(k):
            shape = self.shape(q)
            ratios = [np.where(shape, self.memory(q) / capacity, INF) for _, capacity in cl.kinds]
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
        return worst, _gpus_of(cl, kinds[::-1]), ranges[::-1]

    def memory_error(self) -> PlanError:
        _, gpus, ranges = self.memory_plan()
        worst = None
        for q, (gpu, (b, e)) in enumerate(zip(gpus, ranges)):
            need = stage_memory(self.profile, b, e, q, self.k, self.nm, self.optimizer)
            if worst is None or need / gpu.memory_bytes > worst[0]:
                worst = (need / gpu.memory_bytes, q, gpu, b, e, need)
        assert worst is not None
        _, q, gpu, b, e, need = worst
        b, e = self.profile.model_range(b, e)
        return PlanError(
            f"no pipeline of {self.k} GPU(s) fits {self.profile.model} in memory at nm={self.nm}; closest: "
            f"stage {q} on {gpu.id} ({gpu.type}), layers [{b}, {e}): needs {format_bytes(need)} ({need} bytes), "
            f"has {format_bytes(gpu.memory_bytes)} ({gpu.memory_bytes} bytes)"
        )


def min_max(values: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """out[r, e] = min over b of max(values[r, b], cost[b, e])."""
    out = np.full((values.shape[0], cost.shape[1]), INF)
    useful = np.flatnonzero(np.isfinite(values).any(axis=0) & np.isfinite(cost).any(axis=1))
    for b in useful:
        np.minimum(out, np.maximum(values[:, b, None], cost[b][None, :]), out=out)
    return out


def _gpus_of(cl: Cluster, kinds: list[int]) -> list[Gpu]:
    """The GPUs a pipeline of these kinds (stage order) uses: each kind's GPUs in their order."""
    used: dict[int, int] = {}
    gpus = []
    for d in kinds:
        gpus.append(cl.kind_gpus[d][used.get(d, 0)])
        used[d] = used.get(d, 0) + 1
    return gpus
