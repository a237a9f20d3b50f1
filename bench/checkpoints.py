"""What checkpoints cost: one job run side by side without them and with train.checkpoint_every
at a few values (each cut drains the pipeline, saves every stage and streams every shard), and
how long a --resume takes to get going. Samples/s and the ratio to the run without.

    python bench/checkpoints.py [--steps 120] [--every 4 16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpipe import outputs  # noqa: E402
from hetpipe.config import load_job  # noqa: E402
from launch.local import run_local  # noqa: E402


def _job(folder: Path, steps: int, every: int) -> Path:
    raw = {
        "model": {"name": "mlp", "args": {"in_features": 64, "hidden": [256, 256, 256], "num_classes": 10}},
        "data": {"name": "digits", "batch_size": 32},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.5},
                  "checkpoint_every": every},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 2, "D": 0, "ps_shards": 2},
        "output": {"dir": str(folder / f"out{every}")},
    }
    path = folder / f"job{every}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, nargs="+", default=[4, 16])
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hetpipe-ckpt-"))
    try:
        print(f"{'checkpoint_every':>16} {'samples/s':>10} {'ratio':>6} {'cut size (MB)':>14}")
        base = None
        for every in [0, *args.every]:
            job = load_job(_job(folder, args.steps, every))
            summary = run_local(job, quiet=True)
            rate = summary["samples_per_second"]
            base = base or rate
            cuts = list((folder / f"out{every}" / outputs.CHECKPOINTS).glob("cut*"))
            size = sum(f.stat().st_size for c in cuts for f in c.rglob("*") if f.is_file()) / 1e6
            print(f"{every:>16} {rate:>10.0f} {rate / base:>6.2f} {size:>14.2f}")
        job = load_job(_job(folder, args.steps, args.every[0]))
        started = time.perf_counter()
        run_local(job, quiet=True, resume=True)
        print(f"--resume from the last cut of checkpoint_every {args.every[0]}, to the end: "
              f"{time.perf_counter() - started:.1f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
