"""Planner time for clusters of 16, 64 and 256 GPUs of 4 types (target: 256 GPUs in under 30 s)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.planner import make_plan  # noqa: E402
from hetpipe.config import parse_job  # noqa: E402

TYPES = ["titan-v", "titan-rtx", "rtx-2060", "quadro-p4000"]


def job(gpus: int, policy: str, model: str) -> dict[str, object]:
    nodes = [{"name": f"n{i}", "gpus": [{"type": TYPES[i % 4], "count": 4}]} for i in range(gpus // 4)]
    return {
        "cluster": {"nodes": nodes, "emulate": {"time_scale": 1.0}},
        "model": {"name": model, "args": {}},
        "data": {"name": "synthetic", "batch_size": 32},
        "parallel": {"virtual_workers": gpus // 4, "stages_per_vw": 4, "policy": policy, "nm": "auto", "D": 0},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="resnet152")
    ap.add_argument("--policies", default="ED,NP,HD,auto")
    ap.add_argument("--quick", action="store_true", help="16 and 64 GPUs only")
    args = ap.parse_args()
    sizes = [16, 64] if args.quick else [16, 64, 256]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; model {args.model}, batch 32, k=4, nm auto")
    print(f"{'GPUs':>6}{'policy':>8}{'seconds':>10}{'chosen':>8}{'nm':>5}{'pred samples/s':>16}")
    with tempfile.TemporaryDirectory() as cache:
        make_plan(parse_job(job(16, "ED", args.model)), cache_dir=cache)  # profile once: every row reuses it
        for gpus in sizes:
            for policy in args.policies.split(","):
                start = time.perf_counter()
                plan = make_plan(parse_job(job(gpus, policy, args.model)), cache_dir=cache)
                took = time.perf_counter() - start
                print(f"{gpus:>6}{policy:>8}{took:>10.2f}{plan.policy:>8}{plan.nm:>5}"
                      f"{plan.predicted_samples_per_second:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
