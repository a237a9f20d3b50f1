"""Planner prediction vs measurement: predicted samples/s from the simulator next to `hetpipe run`'s
measured samples/s, on emulated heterogeneous clusters, side by side in one run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emulated import median_ms  # noqa: E402

from launch.local import run_local  # noqa: E402
from coordinator.planner import Plan, make_plan
from coordinator.planner.costs import loopback_sync_seconds  # noqa: E402
from hetpipe.config import JobConfig, load_job  # noqa: E402
from hetpipe.models import structure  # noqa: E402

MLP = {"name": "mlp", "args": {"in_features": 64, "hidden": [512, 512, 512, 512, 512], "num_classes": 10}}

CONFIGS: dict[str, dict[str, Any]] = {
    "1 VW x 4 stages, 4 GPU types (VRGQ), nm 4": {
        "cluster": {"nodes": [{"name": f"n{i}", "gpus": [{"type": t, "count": 1}]}
                              for i, t in enumerate(["titan-v", "titan-rtx", "rtx-2060", "quadro-p4000"])]},
        "parallel": {"virtual_workers": 1, "stages_per_vw": 4, "nm": 4, "policy": "ED"},
    },
    "2 VWs x 2 stages, NP (VV | QQ straggler), nm 2, D 0": {
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 2}]},
                              {"name": "n1", "gpus": [{"type": "quadro-p4000", "count": 2}]}]},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "D": 0, "policy": "NP", "ps_shards": 2},
    },
    "2 VWs x 2 stages, ED (VG, VG), nm 3, D 1": {
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 2}]},
                              {"name": "n1", "gpus": [{"type": "rtx-2060", "count": 2}]}]},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 3, "D": 1, "policy": "ED", "ps_shards": 2},
    },
}


def job_file(root: Path, name: str, extra: dict[str, Any], steps: int, time_scale: float) -> Path:
    raw = {
        "model": MLP, "data": {"name": "digits", "batch_size": 32},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.01}},
        "output": {"dir": str(root / name), "trace": True}, **extra,
    }
    raw["cluster"] = {**extra["cluster"], "emulate": {"time_scale": time_scale}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def sync_costs(job: JobConfig, plan: Plan, out_dir: Path) -> str:
    """Measured push and blocked-pull-reply medians (the sync trace) beside what the simulator charged."""
    sync = out_dir / "trace" / "sync"
    if not sync.exists():
        return "one VW: no shards"
    size = {name: p.numel() * 4 for name, p in structure(job.model, job.base_dir).named_parameters()}
    events = {(sp.vw, sp.stage): [json.loads(line) for line in (sync / f"vw{sp.vw}_stage{sp.stage}.jsonl").open()]
              for sp in plan.stages}
    push, reply, model_push, model_pull = [], [], [], []
    for sp in plan.stages:
        nbytes = sum(n for key, n in size.items() if sp.layer_begin <= int(key.split(".")[0]) < sp.layer_end)
        mp, ml = loopback_sync_seconds(nbytes)
        model_push.append(mp + sp.push_seconds)
        model_pull.append(ml + sp.pull_seconds)
        mine = events[(sp.vw, sp.stage)]
        push += [e["end"] - e["start"] for e in mine if e["event"] == "push"]
        for e in mine:
            if e["event"] != "pull":
                continue
            # The pushes of wave min_clock-1 at this stage position: the last one unblocks the pull.
            ends = [x["end"] for (v, q), evs in events.items() if q == sp.stage for x in evs
                    if x["event"] == "push" and x["wave"] == e["min_clock"] - 1]
            if len(ends) == plan.virtual_workers and max(ends) > e["sent"]:
                reply.append(e["replied"] - max(ends))
    return (f"push {median_ms(push):.0f} ms (model {1e3 * statistics.median(model_push):.0f}), pull reply after "
            f"the unblocking push {median_ms(reply):.0f} ms (model {1e3 * statistics.median(model_pull):.0f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    # Stretches the catalog's (microsecond) times for this tiny MLP to tens of milliseconds, so
    # that the emulated devices, not this CPU, set the pace, as they would for a large model.
    ap.add_argument("--time-scale", type=float, default=4000.0)
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    args = ap.parse_args()
    steps = 30 if args.quick else args.steps
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; steps {steps}, "
          f"time_scale {args.time_scale}")
    print(f"{'configuration':<52}{'predicted':>11}{'measured':>11}{'pred/meas':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, extra) in enumerate(CONFIGS.items()):
            job = load_job(job_file(Path(tmp), f"c{i}", extra, steps, args.time_scale))
            plan = make_plan(job)
            measured = run_local(job, quiet=True)["samples_per_second"]
            predicted = plan.predicted_samples_per_second
            print(f"{label:<52}{predicted:>11.1f}{measured:>11.1f}{predicted / measured:>11.3f}")
            print(f"    medians: {sync_costs(job, plan, Path(tmp) / f'c{i}')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
