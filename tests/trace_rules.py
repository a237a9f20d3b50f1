"""Checks of DESIGN §3's rules against the per-minibatch trace (DESIGN §6, §8).

Each check raises AssertionError naming the rule, the VW, the stage and the minibatch. Rows
are the parsed JSON lines of `trace/vw{v}_stage{q}.jsonl`. The checks are pure functions of
the rows so that tests can feed them hand-made traces that break one rule each.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

Row = dict[str, Any]
FIELDS = ("vw", "stage", "p", "wave", "local_version", "bwd_version", "min_clock",
          "fwd_start", "fwd_end", "bwd_start", "bwd_end")


def load_trace(trace_dir: Path) -> list[Row]:
    """Every row of every trace file, each tagged with the file it came from."""
    rows: list[Row] = []
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            row["_where"] = f"{path.name}:{n}"
            rows.append(row)
    return rows


def by_stage(rows: Iterable[Row]) -> dict[tuple[int, int], list[Row]]:
    """(vw, stage) -> rows sorted by p."""
    out: dict[tuple[int, int], list[Row]] = defaultdict(list)
    for r in rows:
        out[(r["vw"], r["stage"])].append(r)
    return {key: sorted(rs, key=lambda r: r["p"]) for key, rs in sorted(out.items())}


def _at(r: Row) -> str:
    return f"vw {r['vw']} stage {r['stage']} minibatch {r['p']}"


# ---- completeness -------------------------------------------------------------------------------


def check_complete(rows: list[Row], *, vws: int, stages: int, steps: int) -> None:
    """Exactly one row per (vw, stage, p) for p = 1..steps, each with every §8 field."""
    seen: dict[tuple[int, int, int], Row] = {}
    for r in rows:
        missing = [f for f in FIELDS if f not in r]
        assert not missing, f"trace row {r.get('_where', r)} lacks fields {missing}"
        key = (r["vw"], r["stage"], r["p"])
        assert key not in seen, f"trace: two rows for {_at(r)} ({seen[key].get('_where')}, {r.get('_where')})"
        seen[key] = r
    want = {(v, q, p) for v in range(vws) for q in range(stages) for p in range(1, steps + 1)}
    missing_keys, extra = sorted(want - set(seen)), sorted(set(seen) - want)
    assert not missing_keys, f"trace: no row for (vw, stage, p) {missing_keys[:10]} ({len(missing_keys)} missing)"
    assert not extra, f"trace: unexpected rows for (vw, stage, p) {extra[:10]}"


# ---- L2: versions and weight stashing ---------------------------------------------------------------


def check_versions(rows: list[Row], nm: int) -> None:
    """L2 + L3 at every stage.

    - the forward of p includes the updates of all minibatches <= p-nm: local_version >= p - nm;
    - it includes no update of p itself or later: local_version <= p - 1;
    - exactly: local_version = the number of this stage's backwards that ended before p's
      forward started (each backward is one local update, L3); with fp16, the number of
      minibatches committed (stepped or skipped on stage 0's verdict) before it started;
    - weight stashing: bwd_version == local_version;
    - wave = (p-1) // nm.
    """
    for (v, q), rs in by_stage(rows).items():
        bwd_ends = sorted(r.get("committed", r["bwd_end"]) for r in rs)
        for r in rs:
            p, lv = r["p"], r["local_version"]
            assert r["wave"] == (p - 1) // nm, f"{_at(r)}: wave {r['wave']}, expected {(p - 1) // nm} with nm={nm}"
            assert lv >= p - nm, (
                f"L2 violated at {_at(r)}: forward used local_version {lv}, missing updates of minibatches "
                f"<= p-nm = {p - nm} (nm={nm})"
            )
            assert lv <= p - 1, f"L2 violated at {_at(r)}: local_version {lv} includes minibatch {p} or later"
            done = sum(1 for t in bwd_ends if t <= r["fwd_start"])
            assert lv == done, (
                f"L2/L3 violated at {_at(r)}: local_version {lv}, but {done} backwards had finished at this "
                f"stage before the forward started"
            )
            assert r["bwd_version"] == lv, (
                f"weight stashing violated at {_at(r)}: forward used version {lv}, backward used {r['bwd_version']}"
            )


# ---- L4: order ----------------------------------------------------------------------------------


def check_order(rows: list[Row]) -> None:
    """L4 at every stage: forwards start in p order, backwards start in p order, each task's
    interval is well formed, and a stage runs one task at a time."""
    stages = by_stage(rows)
    last_stage = {v: max(s for (w, s) in stages if w == v) for (v, _) in stages}
    for (v, q), rs in stages.items():
        for r in rs:
            assert r["fwd_start"] <= r["fwd_end"] <= r["bwd_start"] <= r["bwd_end"], (
                f"{_at(r)}: times not in order fwd_start <= fwd_end <= bwd_start <= bwd_end: "
                f"{[r['fwd_start'], r['fwd_end'], r['bwd_start'], r['bwd_end']]}"
            )
        for a, b in zip(rs, rs[1:]):
            assert a["fwd_start"] < b["fwd_start"], (
                f"L4 violated at vw {v} stage {q}: forward of {b['p']} started before forward of {a['p']}"
            )
            assert a["bwd_start"] < b["bwd_start"], (
                f"L4 violated at vw {v} stage {q}: backward of {b['p']} started before backward of {a['p']}"
            )
        # One compute thread: the stage's task intervals never overlap. On the last stage F+B
        # of a minibatch is one task.
        last = q == last_stage[v]
        tasks = ([(r["fwd_start"], r["bwd_end"], f"F+B {r['p']}") for r in rs] if last else
                 [(r["fwd_start"], r["fwd_end"], f"F {r['p']}") for r in rs]
                 + [(r["bwd_start"], r["bwd_end"], f"B {r['p']}") for r in rs])
        tasks.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(tasks, tasks[1:]):
            assert e0 <= s1, f"vw {v} stage {q}: task {n1} started at {s1} while task {n0} ran until {e0}"


def neighbour_rows(rows: list[Row]) -> Iterator[tuple[int, Row, Row]]:
    """(q, r, n) for each minibatch both stage q and stage q+1 of a VW traced: r is q's row, n
    q+1's."""
    stages = by_stage(rows)
    for (v, q), rs in stages.items():
        nxt = {r["p"]: r for r in stages.get((v, q + 1), [])}
        for r in rs:
            if (n := nxt.get(r["p"])) is not None:
                yield q, r, n


def check_causality(rows: list[Row]) -> None:
    """Between neighbour stages: stage q+1 forwards p only after stage q's forward of p ended,
    and stage q's backward of p starts only after stage q+1's backward of p ended."""
    for q, r, n in neighbour_rows(rows):
        assert n["fwd_start"] >= r["fwd_end"], (
            f"{_at(n)}: forward started before stage {q} finished the forward that feeds it"
        )
        assert r["bwd_start"] >= n["bwd_end"], (
            f"{_at(r)}: backward started before stage {q + 1} finished the backward that feeds it"
        )


# ---- L1: at most nm in flight ---------------------------------------------------------------------


def max_in_flight(rs: list[Row]) -> int:
    """Largest number of minibatches whose [fwd_start, bwd_end) intervals overlap at one instant."""
    events = sorted([(r["fwd_start"], 1) for r in rs] + [(r["bwd_end"], -1) for r in rs])  # -1 sorts first
    depth = best = 0
    for _, delta in events:
        depth += delta
        best = max(best, depth)
    return best


def check_in_flight(rows: list[Row], nm: int) -> None:
    """L1. At stage 0, when p's forward starts, fewer than nm earlier minibatches are unfinished
    (so p-nm has completed). At every stage, at most nm [fwd_start, bwd_end) intervals overlap."""
    for (v, q), rs in by_stage(rows).items():
        if q == 0:
            for r in rs:
                t = r["fwd_start"]
                open_ = [o["p"] for o in rs if o["p"] < r["p"] and o["bwd_end"] > t]
                assert len(open_) < nm, (
                    f"L1 violated at {_at(r)}: injected while minibatches {open_} were still in flight (nm={nm})"
                )
        depth = max_in_flight(rs)
        assert depth <= nm, f"L1 violated at vw {v} stage {q}: {depth} minibatches in flight at once (nm={nm})"


# ---- G2: global staleness (WSP) ---------------------------------------------------------------------


def required_min_clock(p: int, nm: int, D: int) -> int:
    """DESIGN §3 G2, written out independently of the production helper."""
    return max(0, p // nm - 1 - D)


def check_min_clock(rows: list[Row], nm: int, D: int) -> None:
    """G2: the forward of p ran on weights known to include c_global >= floor(p/nm) - 1 - D."""
    for r in rows:
        need = required_min_clock(r["p"], nm, D)
        assert r["min_clock"] >= need, (
            f"G2 violated at {_at(r)}: min_clock {r['min_clock']} < {need} = floor(p/nm) - 1 - D (nm={nm}, D={D})"
        )


def load_shard_trace(trace_dir: Path) -> list[Row]:
    """Every event of every shard's trace (`trace/ps/shard{i}.jsonl`)."""
    return [json.loads(line) for path in sorted((Path(trace_dir) / "ps").glob("shard*.jsonl"))
            for line in path.read_text().splitlines()]


def check_min_clock_at_shards(rows: list[Row], shard_rows: list[Row], nm: int, D: int, vws: int) -> None:
    """G2 from the shards' own record, not the stage's min_clock: the forward of p may start only
    once every VW's pushes of clock floor(p/nm) - 2 - D were applied at every shard (pushed, then
    pulled, then merged, all before its fwd_start). A stage that ran ahead while reporting the
    min_clock it should have had passes check_min_clock, not this."""
    applied: dict[tuple[int, int], list[float]] = defaultdict(list)
    for e in shard_rows:
        if e["event"] == "push" and not e["duplicate"]:
            # A push's sums are added after its time under the lock where `added` is given.
            applied[(e["vw"], e["clock"])].append(e.get("added", e["end"]))
    for r in rows:
        need = required_min_clock(r["p"], nm, D)
        if need == 0:
            continue
        for v in range(vws):
            # Every wave's push reaches the same shards from the same stages: as many as wave 0's.
            times, expected = applied.get((v, need - 1), []), len(applied.get((v, 0), []))
            assert expected and len(times) == expected, (
                f"G2 at the shards, {_at(r)}: needs c_global {need}, but the shards applied {len(times)} of "
                f"vw {v}'s {expected} pushes of clock {need - 1}")
            assert max(times) <= r["fwd_start"], (
                f"G2 at the shards, {_at(r)}: its forward started at {r['fwd_start']:.6f}, before vw {v}'s push "
                f"of clock {need - 1} was applied at {max(times):.6f} (needs c_global {need})")


def check_local_rules(rows: list[Row], nm: int) -> None:
    """Every within-VW rule that the trace can show (L1, L2, L3 versions, L4, causality)."""
    check_order(rows)
    check_causality(rows)
    check_versions(rows, nm)
    check_in_flight(rows, nm)


def check_agreed_commits(rows: list[Row], *, vws: int, stages: int, steps: int, nm: int) -> None:
    """fp16 and max_grad_norm: every row there, the within-VW rules with commits as the updates,
    and a stage after the first commits p only once stage 0 has decided it, never before its own
    backward of p ended."""
    check_complete(rows, vws=vws, stages=stages, steps=steps)
    check_local_rules(rows, nm)
    for (v, q), rs in by_stage(rows).items():
        if q > 0:
            assert all(r["committed"] >= r["bwd_end"] for r in rs), f"vw {v} stage {q} committed before its backward"


def clip_coefficients(rows: list[Row]) -> dict[tuple[int, int], float]:
    """max_grad_norm: (vw, p) -> the clip coefficient every stage of the VW committed p with (one,
    or it fails)."""
    seen: dict[tuple[int, int], set[float]] = {}
    for r in rows:
        seen.setdefault((r["vw"], r["p"]), set()).add(r["clip"])
    assert all(len(c) == 1 for c in seen.values()), {k: c for k, c in seen.items() if len(c) > 1}
    return {key: c.pop() for key, c in seen.items()}


def check_conservation(job: Any, out: Path, ledgers: int, left: Iterable[int] = (), atol: float = 1e-9) -> None:
    """O3: the final model is w0 plus every acknowledged push exactly once, from each stage's
    ledger of what its shards acknowledged (trace/acked_vw*_stage*.pt). For a VW that left the
    job mid-push (`left`), each key may also hold the push in flight: applied, its ack lost.
    atol: float32 sums in another order differ in their last bits; a push is far larger."""
    import re

    import torch

    from hetpipe import weight_files
    from hetpipe.reference import initial_model

    final = weight_files.read_weights(out)
    expected = {k: v.clone() for k, v in initial_model(job).state_dict().items()}
    in_flight: dict[str, torch.Tensor] = {}
    paths = sorted((out / "trace").glob("acked_vw*_stage*.pt"))
    assert len(paths) == ledgers, f"{[p.name for p in paths]}: expected {ledgers} ledgers (does the job set output.ledger?)"
    for path in paths:
        record = torch.load(path, weights_only=True)
        assert not record["pending"] or int(re.findall(r"vw(\d+)", path.name)[0]) in set(left), (
            f"{path.name}: a push still in flight at the end")
        for key, delta in record["acked"].items():
            expected[key] += delta
        in_flight.update(record["pending"])
    for key in expected:
        if key in in_flight and not torch.allclose(final[key], expected[key], rtol=0, atol=atol):
            expected[key] += in_flight[key]
        torch.testing.assert_close(final[key], expected[key], rtol=0, atol=atol, msg=f"{key}: pushes lost or doubled")
