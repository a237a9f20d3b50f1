"""A baseline worker process: `python -m baselines --spec SPEC.json --rank R` (started by the
launcher in baselines/common.py, one per rank; it exits when the launcher dies)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m baselines", description="HetPipe baseline worker (one rank)")
    ap.add_argument("--spec", required=True, help="the launcher's spec.json")
    ap.add_argument("--rank", type=int, required=True)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with open(ns.spec) as f:
        spec = json.load(f)
    from baselines import common
    from hetpipe import devices
    from hetpipe.errors import data_hint

    common.watch_parent()
    devices.set_threads()
    rank = ns.rank
    me = spec["ranks"][rank]
    print(f"{spec['mode']} rank {rank} of {spec['world_size']} on {me['label']} ({me['device']}), "
          f"backend {spec['backend']}", flush=True)
    try:
        if spec["mode"] == "ddp":
            from baselines.ddp import worker
        else:
            from baselines.pipeline import worker
        worker(spec, rank)
    except BaseException as exc:
        traceback.print_exc()
        hint = data_hint(exc)
        if hint:
            print(f"that is: {hint}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    print(f"{spec['mode']} rank {rank}: done", flush=True)
    sys.stdout.flush()
    os._exit(0)  # interpreter teardown of torch.distributed only adds seconds


if __name__ == "__main__":
    sys.exit(main())
