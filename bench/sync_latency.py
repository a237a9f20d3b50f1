"""Where a traced run's pushes and pulls (an elastic run's exchanges) spend their time: each phase's
median, 90th percentile and total, from the stages' sync traces (trace/sync/) and the shards'
(trace/ps/), over every VW.

    .venv/bin/python bench/sync_latency.py OUTPUT_DIR     # a run with output.trace: true

A wave's push and the pull that waits for it are one chain (the G2 wait): the phases below are its
links, in order. `bench/gpu.py --trace` prints this for each HetPipe run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

# (where, event, label, start field, end field): a phase of one push or pull, as its trace times it.
PHASES = [
    ("stage", "push", "push queued, waiting for the pusher", "queued", "start"),
    ("stage", "push", "push: to the host, to every shard, acknowledged", "start", "end"),
    ("shard", "push", "shard: push arriving (and logged)", "received", "arrived"),
    ("shard", "push", "shard: push scanned for NaN and overflow", "arrived", "scanned"),
    ("shard", "push", "shard: push waiting for the lock and its keys", "scanned", "start"),
    ("shard", "push", "shard: push under the lock", "start", "end"),
    ("shard", "push", "shard: push's sums added", "end", "added"),
    ("stage", "pull", "pull: sent until answered (its wait for c_global included)", "sent", "replied"),
    ("shard", "pull", "shard: pull waiting for c_global and for its keys' adds", "requested", "start"),
    ("shard", "pull", "shard: pull under the lock", "start", "end"),
    ("shard", "pull", "shard: pull's shared-memory slot written", "end", "written"),
    ("stage", "pull", "pull: its reply received (onto a GPU stage's GPU)", "answered", "replied"),
    ("stage", "pull", "pull answered, waiting for the compute thread's merge", "replied", "merged"),
    ("stage", "pull_wait", "a forward blocked on G2 (pull_wait)", "start", "end"),
    # parallel.sync elastic: an exchange instead of a push and a pull
    ("stage", "exchange", "exchange: sent until answered", "sent", "replied"),
    ("shard", "exchange", "shard: exchange arriving", "received", "arrived"),
    ("shard", "exchange", "shard: exchange waiting for the lock", "arrived", "start"),
    ("shard", "exchange", "shard: exchange under the lock", "start", "end"),
    ("stage", "exchange", "exchange answered, waiting for the compute thread's merge", "replied", "merged"),
]


def _rows(paths: Iterable[Path]) -> Iterator[dict]:
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def phases(out_dir: Path) -> list[tuple[str, list[float]]]:
    """Each phase's durations in seconds (an empty list where the trace has none of it)."""
    trace = out_dir / "trace"
    rows = {"stage": list(_rows(sorted((trace / "sync").glob("*.jsonl")))),
            "shard": list(_rows(sorted((trace / "ps").glob("*.jsonl"))))}
    return [(label, [r[end] - r[start] for r in rows[where] if r.get("event") == event and start in r and end in r])
            for where, event, label, start, end in PHASES]


def report(out_dir: Path) -> str:
    lines = [f"{'phase (all VWs, stages and shards)':60} {'count':>6} {'median ms':>10} {'p90 ms':>8} {'total s':>8}"]
    for label, seconds in phases(out_dir):
        if not seconds:
            continue
        ordered = sorted(seconds)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        lines.append(f"{label:60} {len(seconds):6d} {1e3 * statistics.median(seconds):10.1f} {1e3 * p90:8.1f} "
                     f"{sum(seconds):8.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="a traced run's output.dir")
    args = ap.parse_args()
    if not (args.out_dir / "trace" / "sync").is_dir():
        sys.exit(f"{args.out_dir}: no trace/sync/ (run the job with output.trace: true)")
    print(report(args.out_dir))


if __name__ == "__main__":
    main()
