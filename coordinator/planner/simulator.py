"""Discrete-event simulator of N virtual workers' pipelines under WSP (DESIGN §3, §4).

Pure: a heapq event queue, no threads, no clocks. It reproduces the runtime's behaviour:

- One compute thread per stage (`stage_worker/runtime.py`). A task runs for its stage's
  forward or backward seconds; the last stage runs a minibatch's forward and backward as one
  task (L4). Tasks are chosen only when the stage is idle: among the ready ones (the next
  forward in p order, the next backward in p order), the earliest arrived (FIFO, L4).
- Stage 0 injects p once p-nm has finished its backward there (L1): the first nm at the start.
- Sends are asynchronous (`stage_worker/links.py`): one ordered sender per direction, so an
  activation (or gradient) waits for the previous send on that link, never for the compute.
- WSP (`stage_worker/wsp_sync.py`), only with more than one VW (one VW runs without shards,
  as `launch/local.py` starts it): the forward of p may start only when the c_global
  that the stage's weights are known to include is >= required_min_clock(p) =
  max(0, p//nm - 1 - D). When the stage finds that forward ready but not allowed, the wait
  starts and a pull is sent (one at a time); when it is allowed but the next wave's forwards
  will need more, a pull for that goes out early (`wsp.g2_decision`). The shard answers once
  c_global over the stage's keys reaches the pull's min_clock, with the c_global of that moment;
  the answer arrives pull_seconds later and is merged the next time the stage is between tasks,
  which ends the wait. Backwards keep running meanwhile. When a stage finishes the backward that closes a
  wave (its last minibatch, or the final partial wave) it queues that wave's push on its one
  pusher; a push takes push_seconds and raises the VW's clock for the stage's keys when it ends.
- A stage's keys: with equal k, stage q of every VW holds the same layers, so c_global for
  stage q is the min over VWs of their pushed clocks at stage q. VWs with different k are
  matched by the overlap of their fractional positions [q/k, (q+1)/k) (an approximation: the
  simulator does not know the layer cuts).

A VW finishes when its every stage has run every task and acknowledged every push (as the
runtime's stages reach DONE); the makespan is the last VW's finish.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetpipe.wsp import g2_decision, required_min_clock


@dataclass(frozen=True, slots=True)
class SimStage:
    forward_seconds: float
    backward_seconds: float
    send_seconds: float = 0.0    # activation to the next stage (and the gradient back)
    push_seconds: float | None = None   # this stage's push and pull reply; None = simulate()'s
    pull_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class SimResult:
    minibatches_per_second: float      # all VWs together: N * steps / makespan
    per_vw_minibatches_per_second: list[float]
    wait_seconds: list[float]          # per VW: time forwards were blocked on the clock bound, summed over stages
    makespan_seconds: float
    # With simulate(..., trace=True): one row per (vw, stage, p) with the runtime's trace fields
    # (DESIGN §8): vw, stage, p, wave, local_version, bwd_version, min_clock, fwd_start, fwd_end,
    # bwd_start, bwd_end (seconds from the start).
    trace: list[dict[str, float | int]] | None = field(default=None, compare=False, repr=False)


# Event kinds (the order breaks no ties: events at one time run in the order they were queued).
_TASK_END, _ARRIVE_FWD, _ARRIVE_BWD, _PUSH_DONE, _PULL_REPLY, _WAKE = range(6)
# Task kinds.
_F, _B, _FB = range(3)


def _check(vws: Sequence[Sequence[SimStage]], nm: int, D: int, steps: int, push: float, pull: float) -> None:
    if not vws:
        raise ValueError("vws: at least one virtual worker is needed")
    for v, stages in enumerate(vws):
        if not stages:
            raise ValueError(f"vws[{v}]: a virtual worker needs at least one stage")
        for q, stage in enumerate(stages):
            for name in ("forward_seconds", "backward_seconds", "send_seconds", "push_seconds", "pull_seconds"):
                x = getattr(stage, name)
                if x is None and name in ("push_seconds", "pull_seconds"):
                    continue
                if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
                    raise ValueError(f"vws[{v}][{q}].{name} = {x!r}: expected a finite number >= 0")
    if not (isinstance(nm, int) and nm >= 1):
        raise ValueError(f"nm = {nm!r}: expected an integer >= 1")
    if not (isinstance(D, int) and D >= 0):
        raise ValueError(f"D = {D!r}: expected an integer >= 0")
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps = {steps!r}: expected an integer >= 0")
    for name, x in (("push_seconds", push), ("pull_seconds", pull)):
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{name} = {x!r}: expected a finite number >= 0")


def overlapping(q: int, k: int, ku: int) -> range:
    """The stages j of a ku-stage VW whose share of the model, [j/ku, (j+1)/ku), meets stage q's
    of a k-stage VW, [q/k, (q+1)/k): they push and pull the same keys."""
    return range(q * ku // k, -(-(q + 1) * ku // k))


def simulate(vws: Sequence[Sequence[SimStage]], *, nm: int, D: int, steps: int,
             push_seconds: float = 0.0, pull_seconds: float = 0.0, trace: bool = False) -> SimResult:
    """Simulates `steps` minibatches per VW; see the module docstring for the semantics."""
    _check(vws, nm, D, steps, push_seconds, pull_seconds)
    n = len(vws)
    if steps == 0:
        return SimResult(0.0, [0.0] * n, [0.0] * n, 0.0, [] if trace else None)
    sync = n > 1

    # ---- flatten the stages: sid = offset[v] + q --------------------------------------------
    vw_of: list[int] = []
    q_of: list[int] = []
    k_of: list[int] = []
    offset: list[int] = []
    fwd_s: list[float] = []
    bwd_s: list[float] = []
    send_s: list[float] = []
    push_s: list[float] = []
    pull_s: list[float] = []
    for v, stages in enumerate(vws):
        offset.append(len(vw_of))
        for q, stage in enumerate(stages):
            vw_of.append(v)
            q_of.append(q)
            k_of.append(len(stages))
            fwd_s.append(float(stage.forward_seconds))
            bwd_s.append(float(stage.backward_seconds))
            send_s.append(float(stage.send_seconds))
            push_s.append(float(push_seconds if stage.push_seconds is None else stage.push_seconds))
            pull_s.append(float(pull_seconds if stage.pull_seconds is None else stage.pull_seconds))
    S = len(vw_of)
    first = [q_of[s] == 0 for s in range(S)]
    last = [q_of[s] == k_of[s] - 1 for s in range(S)]

    # A group = the stages whose keys have the same owners, so the same c_global: with equal k,
    # stage q of every VW. gdeps[g]: the stages whose pushes that c_global is the min over.
    grp = [0] * S
    gdeps: list[list[int]] = []
    rgroups: list[list[int]] = [[] for _ in range(S)]
    if sync:
        ids: dict[tuple[int, ...], int] = {}
        of_shape: dict[tuple[int, int], int] = {}   # (q, k) -> group: the key depends on nothing else
        for s in range(S):
            q, k = q_of[s], k_of[s]
            g = of_shape.get((q, k))
            if g is None:
                key = tuple(offset[u] + j for u, stages in enumerate(vws) for j in overlapping(q, k, len(stages)))
                g = ids.get(key)
                if g is None:
                    g = ids[key] = len(gdeps)
                    gdeps.append(list(key))
                    for d in key:
                        rgroups[d].append(g)
                of_shape[(q, k)] = g
            grp[s] = g
    cg = [0] * len(gdeps)                       # c_global of each group (the shards' view)
    at_min = [len(d) for d in gdeps]            # members whose clock is cg: the min moves when none is left
    waiters: list[list[int]] = [[] for _ in gdeps]  # stages whose pull the shards hold back

    # ---- per-stage state ----------------------------------------------------------------------
    size = steps + 1
    fseq = [[-1] * size for _ in range(S)]   # arrival sequence of p's activation (or injection)
    bseq = [[-1] * size for _ in range(S)]   # arrival sequence of p's gradient
    nf = [1] * S                             # next forward
    nb = [1] * S                             # next backward
    busy = [False] * S
    running_kind = [0] * S
    running_start = [0.0] * S
    link_next_free = [0.0] * S               # sender to the next stage
    link_prev_free = [0.0] * S               # sender to the previous stage
    push_free = [0.0] * S                    # the stage's one pusher
    clock = [0] * S                          # waves pushed and acknowledged (the shards' view)
    local_clock = [0] * S                    # waves completed here
    have = [0] * S                           # c_global the local weights are known to include
    pulling = [False] * S
    pending = [-1] * S                       # c_global of a pull reply not yet merged
    pull_need = [-1] * S                     # min_clock of a pull the shards hold back
    wait_start = [-1.0] * S                  # when the blocked forward began to wait (-1: none)
    wait_total = [0.0] * S
    finish = [0.0] * S
    rows: dict[tuple[int, int], dict[str, float | int]] = {}

    heap: list[tuple[float, int, int, int, int]] = []
    hpush = heapq.heappush
    hpop = heapq.heappop
    ev = 0      # event sequence: ties in time run in the order queued
    aseq = 0    # arrival sequence for FIFO among ready tasks

    # Stage 0 holds the first nm minibatches from the start (L1), and looks for work at time 0.
    for v in range(n):
        s0 = offset[v]
        row = fseq[s0]
        for p in range(1, min(nm, steps) + 1):
            row[p] = aseq
            aseq += 1
        hpush(heap, (0.0, ev, _WAKE, s0, 0))
        ev += 1

    while heap:
        now, _, kind, s, x = hpop(heap)
        if kind == _TASK_END:
            task, p = running_kind[s], x
            busy[s] = False
            if task == _F:
                nf[s] += 1
                t = link_next_free[s]
                t = (t if t > now else now) + send_s[s]
                link_next_free[s] = t
                hpush(heap, (t, ev, _ARRIVE_FWD, s + 1, p))
                ev += 1
            else:
                if task == _FB:
                    nf[s] += 1
                    if trace:
                        r = rows[(s, p)]
                        r["bwd_start"] = r["fwd_end"]
                        r["bwd_end"] = now
                elif trace:
                    r = rows[(s, p)]
                    r["bwd_start"] = running_start[s]
                    r["bwd_end"] = now
                nb[s] += 1
                if not first[s]:
                    t = link_prev_free[s]
                    t = (t if t > now else now) + send_s[s - 1]
                    link_prev_free[s] = t
                    hpush(heap, (t, ev, _ARRIVE_BWD, s - 1, p))
                    ev += 1
                elif p + nm <= steps:  # L1: finishing p lets p + nm in
                    fseq[s][p + nm] = aseq
                    aseq += 1
                if p % nm == 0 or p == steps:  # closes a wave: queue its push
                    local_clock[s] += 1
                    if sync:
                        t = push_free[s]
                        t = (t if t > now else now) + push_s[s]
                        push_free[s] = t
                        hpush(heap, (t, ev, _PUSH_DONE, s, (p - 1) // nm))
                        ev += 1
                if p == steps:
                    finish[s] = now
        elif kind == _ARRIVE_FWD:
            fseq[s][x] = aseq
            aseq += 1
            if busy[s]:
                continue
        elif kind == _ARRIVE_BWD:
            bseq[s][x] = aseq
            aseq += 1
            if busy[s]:
                continue
        elif kind == _PUSH_DONE:
            old = clock[s]
            clock[s] = x + 1
            if now > finish[s]:
                finish[s] = now
            for g in rgroups[s]:
                if cg[g] != old:
                    continue
                at_min[g] -= 1
                if at_min[g]:
                    continue
                c = min([clock[d] for d in gdeps[g]])
                at_min[g] = sum(1 for d in gdeps[g] if clock[d] == c)
                cg[g] = c
                ws = waiters[g]
                if ws:
                    keep = []
                    for w in ws:
                        if pull_need[w] <= c:
                            pull_need[w] = -1
                            hpush(heap, (now + pull_s[w], ev, _PULL_REPLY, w, c))
                            ev += 1
                        else:
                            keep.append(w)
                    waiters[g] = keep
            continue
        elif kind == _PULL_REPLY:
            pending[s] = x
            if busy[s]:
                continue
        else:  # _WAKE
            if busy[s]:
                continue

        # ---- the stage's compute thread is idle: merge a pull reply, pick the next task -------
        if sync and pending[s] >= 0:
            if pending[s] > have[s]:
                have[s] = pending[s]
            pending[s] = -1
            pulling[s] = False
            if wait_start[s] >= 0.0 and required_min_clock(nf[s], nm, D, steps) <= have[s]:
                wait_total[s] += now - wait_start[s]
                wait_start[s] = -1.0
        p = nf[s]
        fa = fseq[s][p] if p <= steps else -1
        if fa >= 0 and sync:
            # The runtime's own rule (WspSync.forward_allowed): wait if G2 does not allow p yet,
            # and pull for what it needs, or early for the next wave's forwards.
            decision = g2_decision(p, nm, D, steps, have[s])
            if not decision.allowed:
                fa = -1
                if wait_start[s] < 0.0:
                    wait_start[s] = now
            if decision.pull is not None and not pulling[s] and pending[s] < 0:   # one pull at a time
                pulling[s] = True
                g = grp[s]
                if cg[g] >= decision.pull:
                    hpush(heap, (now + pull_s[s], ev, _PULL_REPLY, s, cg[g]))
                    ev += 1
                else:
                    pull_need[s] = decision.pull
                    waiters[g].append(s)
        pb = nb[s]
        ba = bseq[s][pb] if pb <= steps else -1
        if fa >= 0 and (ba < 0 or fa < ba):
            if last[s]:
                task, dur = _FB, fwd_s[s] + bwd_s[s]
            else:
                task, dur = _F, fwd_s[s]
            if trace:
                rows[(s, p)] = {"vw": vw_of[s], "stage": q_of[s], "p": p, "wave": (p - 1) // nm,
                                "local_version": nb[s] - 1, "bwd_version": nb[s] - 1,
                                "min_clock": have[s] if sync else local_clock[s],
                                "fwd_start": now, "fwd_end": now + fwd_s[s]}
        elif ba >= 0:
            task, dur, p = _B, bwd_s[s], pb
        else:
            continue
        busy[s] = True
        running_kind[s] = task
        running_start[s] = now
        hpush(heap, (now + dur, ev, _TASK_END, s, p))
        ev += 1

    for s in range(S):  # every stage must have run everything; anything else is a simulator bug
        if nb[s] != steps + 1 or nf[s] != steps + 1:
            raise RuntimeError(f"simulator stalled at vw {vw_of[s]} stage {q_of[s]}: "
                               f"{nf[s] - 1} forwards and {nb[s] - 1} backwards of {steps}")

    vw_finish = [max(finish[offset[v]:offset[v] + len(vws[v])]) for v in range(n)]
    waits = [sum(wait_total[offset[v]:offset[v] + len(vws[v])]) for v in range(n)]
    makespan = max(vw_finish)
    per_vw = [steps / t if t > 0 else math.inf for t in vw_finish]
    total = n * steps / makespan if makespan > 0 else math.inf
    out_rows = None
    if trace:
        out_rows = [rows[key] for key in sorted(rows, key=lambda k: (vw_of[k[0]], q_of[k[0]], k[1]))]
    return SimResult(total, per_vw, waits, makespan, out_rows)
