"""Exact partitioning of a heterogeneous virtual worker (HetPipe §4, §7): the order of its GPUs
and the contiguous cut of the model's layers that minimise the bottleneck stage time under
per-stage memory limits."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetpipe.errors import JobStopped
from hetpipe.network import Network
from coordinator.planner.cluster import Gpu, PlanError, Usage
from coordinator.planner.kinds import INF, NONE, OTHER, SAME, Tables, layer_times, min_max
from coordinator.planner.memory import in_flight, stage_memory
from coordinator.planner.profile import LayerProfile, ModelProfile

# The exact search's size: candidate stages weighed over all its levels. It grows about 4x with
# each node of another GPU mix a VW spans (10 such nodes: 1.8 million, 15 s; 11: 2 minutes;
# 14: hours); past this the VW is refused with a PlanError that says so.
MAX_CANDIDATES = 2_000_000


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

def join_layers(profile: ModelProfile, joined: Sequence[int]) -> ModelProfile:
    """The profile with each layer in `joined` (indices > 0, that no stage may begin at) made one
    with the layer before it; its `starts` say where each begins among the model's layers. Exact
    for the cost model: times, FLOPs and bytes add up, the workspace is the larger, and the output
    is the later layer's."""
    starts = tuple(i for i in range(len(profile.layers)) if i == 0 or i not in set(joined))
    layers: list[LayerProfile] = []
    for begin, end in zip(starts, (*starts[1:], len(profile.layers))):
        group = profile.layers[begin:end]
        layers.append(dataclasses.replace(
            group[0], index=len(layers),
            forward_flops=sum(g.forward_flops for g in group), backward_flops=sum(g.backward_flops for g in group),
            param_bytes=sum(g.param_bytes for g in group), frozen_bytes=sum(g.frozen_bytes for g in group),
            output_bytes=group[-1].output_bytes, saved_bytes=sum(g.saved_bytes for g in group),
            workspace_bytes=max(g.workspace_bytes for g in group),
            forward_seconds={t: sum(g.forward_seconds[t] for g in group) for t in group[0].forward_seconds},
            backward_seconds={t: sum(g.backward_seconds[t] for g in group) for t in group[0].backward_seconds}))
    return dataclasses.replace(profile, layers=tuple(layers), starts=starts, model_layers=len(profile.layers))


def unjoin(part: Partition, profile: ModelProfile) -> Partition:
    """A partition of join_layers' profile as ranges of the model's layers."""
    return Partition(tuple(dataclasses.replace(c, layer_begin=b, layer_end=e) for c in part.stages
                           for b, e in [profile.model_range(c.layer_begin, c.layer_end)]))


_State = tuple[Usage, int, int]              # (usage, node of the last stage, where the next goes)


def partition_vw(profile: ModelProfile, gpus: Sequence[Gpu], nm: int, optimizer: str,
                 network: Network, cancel: threading.Event | None = None) -> Partition:
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
    return _Solver(profile, gpus, nm, optimizer, network).solve(cancel)


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

class _Solver(Tables):
    """The exact search over (layers done; GPUs used, per node and kind; node of the last
    stage; where the next one goes), pruned by the kinds-only bounds of Tables."""

    # -- the DP --

    def solve(self, cancel: threading.Event | None = None) -> Partition:
        cl, n, k = self.cluster, self.n, self.k
        K, N = len(cl.kinds), len(cl.nodes)
        count = tuple(len(g) for g in cl.kind_gpus)
        # Bounds from the same problem without nodes (GPUs as kinds only). Upper: every receive
        # at the slower of the two link speeds; that plan is realisable on any nodes, and its
        # real bottleneck bounds the optimum. Lower, for every suffix of layers and multiset of
        # GPU kinds left: every receive at the faster speed. The search below drops every state
        # whose value, or value with the best possible rest, exceeds the upper bound.
        same, other = self._link[SAME], self._link[OTHER]
        plan = self.kinds_forward(np.maximum(same, other))
        if plan is None:
            raise self.memory_error()
        upper = self._build(*plan)
        suffix = self.kinds_suffix(np.minimum(same, other))
        if upper.bottleneck_seconds <= suffix[count][0] * (1 + 1e-13):
            return upper  # the bounds meet: it is optimal
        limit = upper.bottleneck_seconds * (1 + 1e-9)  # slack for the order of float additions
        start: _State = (tuple((0,) * K for _ in range(N)), -1, NONE)
        first = np.full((1, n + 1), INF)
        first[0, 0] = 0.0
        # Level q: the states after q stages, and values[q][s, i], the best bottleneck of stages
        # 0..q-1 with stage q-1 ending at i. back[q][s, i]: the candidate (transition) that
        # achieved it, described by moves[q][candidate] = (state before, kind, node position).
        keys: list[list[_State]] = [[start]]
        values: list[np.ndarray] = [first]
        back: list[np.ndarray] = [np.zeros((1, n + 1), dtype=np.int64)]
        moves: list[list[tuple[int, int, int]]] = [[]]
        weighed = 0
        for q in range(k):
            if cancel is not None and cancel.is_set():
                raise JobStopped("stopped by request while planning")
            level_moves: list[tuple[int, int, int]] = []
            targets: dict[_State, int] = {}
            target_keys: list[_State] = []
            target_rest: list[np.ndarray] = []  # lower bound for the stages after the target
            batches: dict[tuple[int, int, int], tuple[list[int], list[int], list[int]]] = {}
            after: dict[tuple[Usage, int, int], tuple[Usage, int, list[int], np.ndarray]] = {}
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
            weighed += sum(len(ts) for _, ts, _ in batches.values())
            if weighed > MAX_CANDIDATES:
                raise PlanError(
                    f"a virtual worker of {k} GPUs on {N} nodes ({len(cl.groups)} different GPU mixes) is too "
                    f"irregular to partition exactly: over {MAX_CANDIDATES} candidate stages; give it fewer "
                    f"nodes of different mixes (parallel.policy NP or HD, or fewer stages per VW)")
            # Every candidate's values, then the best candidate per target (the first on ties).
            cand_values, cand_targets, cand_moves = [], [], []
            rest = np.stack(target_rest) if target_rest else np.zeros((0, n + 1))
            for (d, left, right), (rows, ts, ms) in batches.items():
                unique, inverse = np.unique(np.asarray(rows), return_inverse=True)
                result = min_max(values[q][unique], self._cost(q, d, left, right))[inverse]
                result[np.maximum(result, rest[ts]) > limit] = INF
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

    def _next_nodes(self, usage: Usage, cur: int, where: int) -> list[int]:
        """Candidate nodes for the next stage: one per set of interchangeable nodes."""
        cl = self.cluster
        if where == SAME:
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

    def _next_wheres(self, usage: Usage, cur: int, q: int) -> list[int]:
        """Where stage q + 1 can go after stage q on node cur, with GPUs used as in usage."""
        if q == self.k - 1:
            return [NONE]
        cl = self.cluster
        out = []
        if sum(usage[cur]) < cl.free[cur]:
            out.append(SAME)
        if any(sum(usage[j]) < cl.free[j] for j in range(len(cl.nodes)) if j != cur):
            out.append(OTHER)
        return out

    def _build(self, gpus: Sequence[Gpu], ranges: Sequence[tuple[int, int]]) -> Partition:
        k, layers = self.k, self.profile.layers
        cuts = []
        for q, (gpu, (b, e)) in enumerate(zip(gpus, ranges)):
            fwd, bwd = layer_times(self.profile, gpu.type)
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
