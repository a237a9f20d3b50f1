"""The `hetpipe` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from hetpipe.config import ConfigError, load_job

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _run(args: argparse.Namespace) -> int:
    from coordinator.driver import JobFailed
    from coordinator.local import run_local

    try:
        job = load_job(args.config)
        summary = run_local(job, quiet=args.quiet)
    except ConfigError as exc:
        print(f"hetpipe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except JobFailed as exc:
        print(f"hetpipe: job failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("hetpipe: interrupted; stopped every process", file=sys.stderr)
        return EXIT_INTERRUPTED
    out = Path(job.resolve(job.output.dir))
    print(json.dumps({k: summary[k] for k in ("steps", "samples_per_second", "final_loss", "accuracy")
                      if k in summary}))
    print(f"results: {out}/ (model.pt, summary.json{', trace/' if job.output.trace else ''})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetpipe", description="HetPipe: train large models on heterogeneous GPUs")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job file with local processes")
    run.add_argument("config", help="job YAML file")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=_run)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
