"""The `hetpipe` command line: plan, run, status, stop, compose, k8s, coordinator, worker."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from hetpipe import outputs, security
from hetpipe.config import ConfigError, JobConfig, check_coordinated, load_job
from hetpipe.errors import Interrupted, JobFailed, JobStopped, interrupt_reason
from launch import compose
from launch import k8s
from launch import processes
from launch import run_marker
from launch import worker
from launch.ending import EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_UNAVAILABLE, EXIT_USAGE, error as _error, warn
from launch.status import status as _status
from launch.interrupts import EXIT_INTERRUPTED, interrupted, interrupts_held, run_interrupts

# The planner, the local launcher and the remote client import torch (a second): the commands that
# plan or run import them when they run (interrupts_held), so that status, stop, trace, certs and --help
# start at once.
if TYPE_CHECKING:
    from coordinator.planner import Plan
    from coordinator.planner import projection

def _run(args: argparse.Namespace) -> int:
    if args.coordinator and (args.resume or args.fresh):  # accepted and ignored, either would mislead
        _error(f"--{'resume' if args.resume else 'fresh'}: a job run on a coordinator elsewhere keeps no checkpoints "
               "yet, to resume from or to delete")
        return EXIT_USAGE
    try:
        with run_interrupts():
            return _run_job(args)
    except KeyboardInterrupt as exc:  # here too if it came before or after the job's own handling
        # A job on a coordinator elsewhere: its workers are that cluster's, and stay.
        done = f"asked the coordinator at {args.coordinator} to stop the job" if args.coordinator else "stopped every process"
        note = "" if args.coordinator else _resume_note(args)
        print(f"hetpipe: {interrupt_reason(exc)}; {done}{'; ' + note if note else ''}", file=sys.stderr)   # one line
        return 128 + exc.signum if isinstance(exc, Interrupted) else EXIT_INTERRUPTED


def _resume_note(args: argparse.Namespace, job: JobConfig | None = None, resumed_from: int | None = None) -> str:
    """How an interrupted local run goes on: from its latest checkpoint, where it has one. job: the
    one the run loaded (None: read again, as an interrupt may come before it is); resumed_from: the
    wave a failed --resume started from. "" where that cannot be told, or a second Ctrl-C comes
    while it looks (the one line goes out without it)."""
    try:
        if job is None:
            job = load_job(args.config, args.set)
        if job.parallel.mode != "hetpipe":
            return ""
        wave = _latest_cut(job)
    except (ConfigError, KeyboardInterrupt):
        return ""
    if wave is None:   # what the run trained is lost: say so, and how the next keeps it
        return ("it left no checkpoint to go on from (train.checkpoint_every " +
                ("is 0" if not job.train.checkpoint_every else f"{job.train.checkpoint_every}: none reached yet") + ")")
    settings = "".join(f" --set {shlex.quote(setting)}" for setting in args.set)
    command = f"`hetpipe run {shlex.quote(args.config)}{settings} --resume`"
    if wave == resumed_from:   # a failure in loading that cut would come again: say it is the same one
        return f"{command} starts again from the checkpoint this run resumed from, after wave {wave} (it took none since)"
    return f"{command} goes on from its latest checkpoint, after wave {wave}"


def _latest_cut(job: JobConfig) -> int | None:
    from coordinator import checkpoints
    from hetpipe import outputs

    return checkpoints.latest(Path(job.resolve(job.output.dir)) / outputs.CHECKPOINTS)


def _run_job(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.config, args.set)
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE
    # Marked before the imports (a second): `hetpipe stop --job` finds the run from then on. Not a
    # baseline (ddp, torch-pipeline): it publishes no coordinator to stop it through.
    local = not args.coordinator and job.parallel.mode == "hetpipe"
    with run_marker.marked(Path(job.resolve(job.output.dir))) if local else nullcontext():
        if local:
            # The workers' fork server imports torch while this process does (seconds each): one
            # after the other, a local run's start took their sum.
            processes.warm_up()
        return _run_loaded(args, job)


def _run_loaded(args: argparse.Namespace, job: JobConfig) -> int:
    with interrupts_held():
        from coordinator.planner import PlanError
        from launch import remote
        from launch.local import run_local

    resumed_from = _latest_cut(job) if args.resume else None
    try:
        if args.coordinator:
            summary = remote.run_remote(job, args.coordinator, quiet=args.quiet, flags=security.from_namespace(args))
        else:
            summary = run_local(job, quiet=args.quiet, resume=args.resume, fresh=args.fresh,
                                flags=security.from_namespace(args))
    except (ConfigError, PlanError) as exc:
        _error(str(exc))
        return EXIT_USAGE
    except remote.CoordinatorUnreachable as exc:
        print(f"hetpipe: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (JobFailed, JobStopped) as exc:
        how = "failed" if isinstance(exc, JobFailed) else "stopped"
        print(f"hetpipe: job {how}: {exc}", file=sys.stderr)   # its last words name the log
        note = "" if args.coordinator else _resume_note(args, job, resumed_from)
        if note:
            print(f"hetpipe: {note}", file=sys.stderr)
        return EXIT_FAILED
    out = Path(job.resolve(job.output.dir))
    print(json.dumps({k: summary[k] for k in ("steps", "samples_per_second", "steady_samples_per_second",
                                              "final_loss", "eval_loss", "eval_accuracy") if k in summary}))
    loss = summary.get("final_loss")
    if not (isinstance(loss, (int, float)) and math.isfinite(loss)):
        # fp16 skips the steps whose gradients overflow, halving its loss scale, and ends the job only
        # at the smallest scale: a short run can end first, its last losses NaN.
        print("hetpipe: warning: the final loss is not a number: training diverged (under fp16, its last steps "
              "were skipped as their gradients overflowed); a smaller train.optimizer.lr may help", file=sys.stderr)
    weights = sorted(p.name for p in out.glob("model*.safetensors*"))
    traced = job.output.trace and job.parallel.mode == "hetpipe"   # the baselines write none
    extras = ["eval.jsonl"] * (out / "eval.jsonl").exists() + ["trace/"] * (traced and not args.coordinator)
    print(f"results: {out.resolve()}/ ({', '.join([*weights[:2], *(['...'] if len(weights) > 2 else []), 'summary.json', *extras])})")
    if traced and args.coordinator:
        print("trace: on each worker's host, in trace/ under its `hetpipe worker --output-root`")
    return 0


def _worker(args: argparse.Namespace) -> int:
    """`hetpipe worker`: this host's stage workers and shards, registered with a coordinator elsewhere."""
    try:
        return worker.serve(worker.config(args))
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE


def _coordinator(argv: list[str]) -> int:
    """`hetpipe coordinator`: `python -m coordinator` with jobs from other hosts written under
    --output-root (default ./runs)."""
    with interrupts_held():
        from coordinator.__main__ import main as coordinator_main

    given = any(a == "--output-root" or a.startswith("--output-root=") for a in argv)
    if not given and not os.environ.get("HETPIPE_OUTPUT_ROOT"):
        argv = [*argv, "--output-root", "runs"]
    return coordinator_main(argv)


def _plan_or_usage(path: str, plan: Callable[[JobConfig], Plan] | None = None,
                   settings: Sequence[str] = (), runner: str = "") -> tuple[JobConfig, Plan] | int:
    """The job file (with --set's settings) and its plan (by make_plan unless plan is given), or
    EXIT_USAGE after one error line. runner: the containers that run the job (check_coordinated)."""
    with interrupts_held():
        from coordinator.planner import PlanError, make_plan

    try:
        job = load_job(path, settings)
        if runner:
            check_coordinated(job, runner, containers=True, cuts=True)   # the coordinator's --job
        return job, (plan or make_plan)(job)
    except (ConfigError, PlanError) as exc:
        _error(str(exc))
        return EXIT_USAGE


def _plan(args: argparse.Namespace) -> int:
    """Prints the plan: VWs, GPUs, layer ranges, memory against capacity, predicted times."""
    with interrupts_held():
        from launch import plan_report
        from launch.local import preflight

    inputs = _read_projection(args.projection) if args.projection else None  # a bad file fails before planning
    if isinstance(inputs, int):
        return inputs
    planned = _plan_or_usage(args.config, preflight, args.set)  # refuses what `hetpipe run` would, before it starts
    if isinstance(planned, int):
        return planned
    job, plan = planned
    for warning in plan.warnings:
        warn(warning)
    if job.parallel.mode == "ddp":   # no HetPipe plan runs: say what does
        try:
            text, as_json = plan_report.ddp_layout(job)
        except ConfigError as exc:
            _error(str(exc))
            return EXIT_USAGE
        print(json.dumps(as_json, indent=2) if args.json else text)
        return 0
    projected = _project(args.projection, inputs, job, plan) if inputs is not None else None
    if isinstance(projected, int):
        return projected
    out_dir = Path(job.resolve(job.output.dir))
    measured = plan_report.measured(job, plan, outputs.read_summary(out_dir) or {})
    summary_path = out_dir / outputs.SUMMARY_FILE
    if args.json:
        print(json.dumps({**plan_report.plan_json(job, plan), "measured_samples_per_second": measured,
                          **({"projection": projected[1]} if projected else {})}, indent=2))
        return 0
    print(plan_report.plan_table(job, plan, measured, summary_path))
    if projected:
        print("\n" + projected[0])
    return 0


def _read_projection(path: str) -> projection.Inputs | int:
    """The inputs of Pal et al.'s DP-vs-hybrid projection (coordinator/planner/projection.py)."""
    with interrupts_held():
        from coordinator.planner import projection

    try:
        return projection.parse_inputs(yaml.safe_load(Path(path).read_text()))
    except OSError as exc:
        _error(f"projection file {path}: cannot be read ({exc.strerror})")
    except yaml.YAMLError as exc:
        _error(f"projection file {path} is not valid YAML: {' '.join(str(exc).split())}")
    except ConfigError as exc:
        _error(f"projection file {path}: {exc}")
    return EXIT_USAGE


def _project(path: str, inputs: projection.Inputs, job: JobConfig,
             plan: Plan) -> tuple[str, list[dict[str, object]]] | int:
    """The projection table and its rows as JSON, or EXIT_USAGE after one error line."""
    with interrupts_held():
        from launch import plan_report

    try:
        return plan_report.projection_table(inputs, job, plan)
    except ConfigError as exc:
        _error(f"projection file {path}: {exc}")
        return EXIT_USAGE


def _compose(args: argparse.Namespace) -> int:
    """Writes the docker compose file of the job's cluster spec and plan (launch/compose.py)."""
    with interrupts_held():
        from launch.local import preflight

    # What `hetpipe run` refuses before it starts, refused before any container does.
    planned = _plan_or_usage(args.config, preflight, runner="a compose cluster")
    if isinstance(planned, int):
        return planned
    job, plan = planned
    if args.context and not (Path(args.context) / "docker" / "Dockerfile").is_file():
        _error(f"--context {args.context}: no docker/Dockerfile there: expected the root of a HetPipe source tree")
        return EXIT_USAGE
    out = Path(args.output) if args.output else None
    text = compose.render(job, plan, job_file=Path(args.config), compose_dir=out.parent if out else Path.cwd(),
                          root=Path(args.context) if args.context else compose.repository_root(),
                          out_name=out.name if out else "compose.yaml")
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        outputs.write_named(out, text)   # its folder made, as `hetpipe k8s -o` makes its own
    except OSError as exc:
        _error(f"cannot write {exc.filename or out}: {exc.strerror}")
        return EXIT_USAGE
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _k8s(args: argparse.Namespace) -> int:
    """Writes the Kubernetes manifests of the job's cluster spec and plan (launch/k8s.py)."""
    with interrupts_held():
        from launch.local import preflight

    planned = _plan_or_usage(args.config, preflight, runner="a Kubernetes deployment")
    if isinstance(planned, int):
        return planned
    job, plan = planned
    out = Path(args.output)
    try:
        files = k8s.render(job, plan, image=args.image, gpu_image=args.gpu_image, job_file=Path(args.config),
                           certs=Path(args.certs) if args.certs else None)
        written = k8s.write(files, out)
    except ConfigError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _error(f"cannot write {exc.filename or out}: {exc.strerror}")
        return EXIT_USAGE
    for path in written:
        print(f"wrote {path}")
    print(k8s.instructions(job, plan, out, files))
    return 0


def _certs(args: argparse.Namespace) -> int:
    from launch import certs

    try:
        written = certs.make(Path(args.dir), args.hosts, args.san, args.password_file)
    except ValueError as exc:   # a host, --san or password file it cannot write as asked
        _error(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _error(f"cannot write {exc.filename or args.dir}: {exc.strerror}")
        return EXIT_USAGE
    print("\n".join(str(p) for p in written))
    print("give each host ca.pem, its NAME.pem and NAME.key, and token: --tls-ca, --tls-cert, --tls-key, "
          "--token-file (keep ca.key off the cluster)", file=sys.stderr)
    return 0


def _trace(args: argparse.Namespace) -> int:
    """Writes a run's trace/ as Chrome trace-event JSON (hetpipe/timeline.py)."""
    from hetpipe import timeline

    try:
        path, count = timeline.export(args.output_dir, args.output)
    except timeline.TraceMissing as exc:
        _error(str(exc))
        return EXIT_USAGE
    except OSError as exc:   # reading a trace file, or writing the export
        out = Path(args.output or Path(args.output_dir) / timeline.TRACE_FILE)
        read = exc.filename is not None and Path(exc.filename) not in (out, out.with_name(out.name + ".tmp"))
        _error(f"cannot {'read' if read else 'write'} {exc.filename if read else out}: {exc.strerror}")
        return EXIT_USAGE
    print(f"wrote {path} ({count} events): open it in https://ui.perfetto.dev or chrome://tracing", file=sys.stderr)
    return 0


def _version() -> str:
    """The installed distribution's version, else the checkout's: a machine that runs the project from
    its checkout through PYTHONPATH (bench/gpu_kit.sh) has none installed."""
    try:
        return version("hetpipe")
    except PackageNotFoundError:
        import tomllib

        return str(tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
                   ["project"]["version"]) + " (not installed)"


def _add_set(command: argparse.ArgumentParser) -> None:
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="change one setting of the job file, e.g. --set train.optimizer.lr=0.001 (VALUE is "
                              "YAML: 0.001, [256, 256], null); repeatable, applied in order")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetpipe", description="HetPipe: train large models on heterogeneous GPUs")
    ap.add_argument("--version", action="version", version=f"hetpipe {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job file with local processes (or on a coordinator's workers: --coordinator)")
    run.add_argument("config", help="job YAML file")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_set(run)
    start = run.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="go on from the latest checkpoint in output.dir (train.checkpoint_every)")
    start.add_argument("--fresh", action="store_true",
                       help="start over, deleting an earlier run's checkpoints in output.dir (without --resume or "
                            "--fresh, a run refuses to)")
    run.add_argument("--coordinator", metavar="HOST:PORT",
                     help="run on the workers registered with this coordinator (`hetpipe coordinator`, `hetpipe "
                          "worker`) instead of local processes; the outputs come back to output.dir here")
    security.add_flags(run)  # unless the job has a security section; a local run without any makes a per-run token
    run.set_defaults(func=_run)
    sub.add_parser("coordinator", add_help=False,
                   help="serve the control plane on its own, for workers that join from any host "
                        "(`hetpipe coordinator --help`: the flags of `python -m coordinator`)")
    work = sub.add_parser("worker", help="this host's GPUs (or emulated ones) and shards join a coordinator")
    worker.add_flags(work)
    work.set_defaults(func=_worker)
    plan = sub.add_parser("plan", help="show the plan for a job file: VWs, GPUs, layers, memory, prediction")
    plan.add_argument("config", help="job YAML file")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    _add_set(plan)
    plan.add_argument("--projection", metavar="FILE",
                      help="also project DP alone vs N-way DP x M-way MP (Pal et al. 2019) from the measured "
                           "inputs in FILE, e.g. examples/projection-inception-v3.yaml")
    plan.set_defaults(func=_plan)
    comp = sub.add_parser("compose", help="write the docker compose file for a job's cluster and plan")
    comp.add_argument("config", help="job YAML file")
    comp.add_argument("-o", "--output", help="write here (paths in it are relative to its folder); "
                      "default: stdout, relative to the working folder")
    comp.add_argument("--context", help="repository root with docker/ (default: this source tree)")
    comp.set_defaults(func=_compose)
    kube = sub.add_parser("k8s", help="write Kubernetes manifests for a job's cluster and plan")
    kube.add_argument("config", help="job YAML file")
    kube.add_argument("-o", "--output", required=True, metavar="DIR", help="write the manifests into this folder")
    kube.add_argument("--image", default=compose.CPU_IMAGE,
                      help=f"image of the coordinator, the shards and emulated stages (default {compose.CPU_IMAGE})")
    kube.add_argument("--gpu-image", default=compose.GPU_IMAGE,
                      help=f"image of the stages on real GPUs (default {compose.GPU_IMAGE})")
    kube.add_argument("--certs", metavar="DIR", help="also write secrets.yaml from DIR's ca.pem, cluster.pem, "
                      "cluster.key and token (`hetpipe certs`)")
    kube.set_defaults(func=_k8s)
    trace = sub.add_parser("trace", help="a run's trace/ as a timeline for Perfetto or chrome://tracing")
    trace.add_argument("output_dir", metavar="OUTPUT_DIR", help="the job's output.dir (run with output.trace: true)")
    trace.add_argument("-o", "--output", help="write here (default: OUTPUT_DIR/trace.json)")
    trace.set_defaults(func=_trace)
    certs = sub.add_parser("certs", help="make a CA, a certificate per host and a cluster token (quick start)")
    certs.add_argument("dir", metavar="DIR", help="write the files here")
    certs.add_argument("hosts", metavar="NAME", nargs="+", help="a host name or IP address per certificate")
    certs.add_argument("--san", action="append", default=[], help="another name every certificate answers to")
    certs.add_argument("--password-file", action="append", default=[], metavar="NAME",
                       help="also write a random password into DIR/NAME (e.g. Grafana's admin password)")
    certs.set_defaults(func=_certs)
    for name, text in (("status", "show the job and the workers (or how the last run ended)"),
                       ("stop", "stop the running job, in whatever state it is")):
        cmd = sub.add_parser(name, help=text)
        where = cmd.add_mutually_exclusive_group()
        where.add_argument("--coordinator", help="coordinator host:port (default $HETPIPE_COORDINATOR or :50050)")
        where.add_argument("--job", help="the job file a local `hetpipe run` is running (or ran)")
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
        _add_set(cmd)   # with --job: the settings the run was given (its output.dir, its security)
        security.add_flags(cmd)
        cmd.set_defaults(func=_status)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["coordinator"]:  # its own flags, parsed by coordinator.config
        return _coordinator(argv[1:])
    try:   # from the parser on (it reads files: --version's text): a Ctrl-C is one line, never a traceback
        args = parser().parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        code: int = args.func(args)
        sys.stdout.flush()
    except KeyboardInterrupt:   # `hetpipe run` has stopped its processes already (_run)
        return interrupted()
    except BrokenPipeError:
        # The reader went away (`hetpipe status --json | head`): no traceback, and none at exit
        # when Python flushes stdout again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    from launch.ending import finish

    finish(main())
