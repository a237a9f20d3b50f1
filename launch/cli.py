"""The `hetpipe` command line: plan, run, status, stop, compose, k8s, coordinator, worker."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import yaml

from hetpipe import outputs, rpc, security
from hetpipe.config import ConfigError, JobConfig, load_job
from hetpipe.errors import Interrupted, JobFailed, JobStopped, interrupt_reason
from hetpipe.outputs import ADDRESS_FILE, TOKEN_FILE, published_job_id, read_status
from hetpipe.v1 import coordinator_pb2, wire_pb2
from coordinator.config import DEFAULT_PORT
from coordinator.state import JobState
from launch import compose
from launch import k8s
from launch import worker
from launch.interrupts import EXIT_INTERRUPTED, interrupted, interrupts_held, run_interrupts

# The planner, the local launcher and the remote client import torch (a second): the commands that
# plan or run import them when they run (interrupts_held), so that status, stop, trace, certs and --help
# start at once.
if TYPE_CHECKING:
    from coordinator.planner import Plan
    from coordinator.planner import projection

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a reader that went away
TERMINAL = {s.name for s in JobState if s.is_terminal}   # the proto's names of the states a job ends in


def _error(message: str) -> None:
    print(f"hetpipe: error: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.coordinator and (args.resume or args.fresh):  # accepted and ignored, either would mislead
        _error(f"--{'resume' if args.resume else 'fresh'}: a job run on a coordinator elsewhere keeps no checkpoints "
               "yet, to resume from or to delete")
        return EXIT_USAGE
    try:
        with run_interrupts():
            return _run_job(args)
    except KeyboardInterrupt as exc:  # here too if it came before or after the job's own handling
        print(f"hetpipe: {interrupt_reason(exc)}; stopped every process", file=sys.stderr)
        return 128 + exc.signum if isinstance(exc, Interrupted) else EXIT_INTERRUPTED


def _run_job(args: argparse.Namespace) -> int:
    with interrupts_held():
        from coordinator.planner import PlanError
        from launch import remote
        from launch.local import run_local

    try:
        job = load_job(args.config, args.set)
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
    except JobFailed as exc:
        print(f"hetpipe: job failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except JobStopped as exc:
        print(f"hetpipe: job stopped: {exc}", file=sys.stderr)
        return EXIT_FAILED
    out = Path(job.resolve(job.output.dir))
    print(json.dumps({k: summary[k] for k in ("steps", "samples_per_second", "final_loss", "eval_loss",
                                              "eval_accuracy") if k in summary}))
    weights = sorted(p.name for p in out.glob("model*.safetensors*"))
    extras = ["eval.jsonl"] * (out / "eval.jsonl").exists() + ["trace/"] * (job.output.trace and not args.coordinator)
    print(f"results: {out}/ ({', '.join([*weights[:2], *(['...'] if len(weights) > 2 else []), 'summary.json', *extras])})")
    if job.output.trace and args.coordinator:
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
                   settings: list[str] | None = None) -> tuple[JobConfig, Plan] | int:
    """The job file (with --set's settings) and its plan (by make_plan unless plan is given), or
    EXIT_USAGE after one error line."""
    with interrupts_held():
        from coordinator.planner import PlanError, make_plan

    try:
        job = load_job(path, settings or [])
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
        print(f"hetpipe: warning: {warning}", file=sys.stderr)
    projected = _project(args.projection, inputs, job, plan) if inputs is not None else None
    if isinstance(projected, int):
        return projected
    out_dir = Path(job.resolve(job.output.dir))
    measured = (outputs.read_summary(out_dir) or {}).get("samples_per_second")
    summary_path = out_dir / outputs.SUMMARY_FILE
    if args.json:
        print(json.dumps({**plan.to_dict(), "measured_samples_per_second": measured,
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
    planned = _plan_or_usage(args.config)
    if isinstance(planned, int):
        return planned
    job, plan = planned
    out = Path(args.output) if args.output else None
    text = compose.render(job, plan, job_file=Path(args.config), compose_dir=out.parent if out else Path.cwd(),
                          root=Path(args.context) if args.context else compose.repository_root(),
                          out_name=out.name if out else "compose.yaml")
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        out.write_text(text)
    except OSError as exc:
        _error(f"cannot write {out}: {exc.strerror}")
        return EXIT_USAGE
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _k8s(args: argparse.Namespace) -> int:
    """Writes the Kubernetes manifests of the job's cluster spec and plan (launch/k8s.py)."""
    planned = _plan_or_usage(args.config)
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
        _error(f"cannot write {out}: {exc.strerror}")
        return EXIT_USAGE
    for path in written:
        print(f"wrote {path}")
    print(k8s.instructions(job, plan, out, files))
    return 0


def _ended(out_dir: Path, as_json: bool) -> int | None:
    """Reports how the last run into out_dir ended, from what it left there; None if it left nothing."""
    ending = read_status(out_dir)
    if ending is None:
        return None
    summary = outputs.read_summary(out_dir) if ending["state"] == "COMPLETED" else None
    if as_json:
        print(json.dumps({"job": {**ending, "summary": summary}, "workers": []}, indent=2))
    else:
        print(f"job: {ending['state']} (ended; no coordinator is running)"
              + (f": {ending['reason']}" if ending.get("reason") else ""))
        if summary is not None:
            print(f"result: {summary.get('samples_per_second', 0):.0f} samples/s, final loss "
                  f"{summary.get('final_loss', float('nan')):.4f} in {out_dir}")
    return EXIT_FAILED if ending["state"] == "FAILED" else 0


def _nothing_to_stop(name: str, state: str, reason: str) -> int:
    """`hetpipe stop` of a job that has ended: says so, rather than a status as if it stopped it.
    Exits 0: the job is not running, which is what the stop asked for."""
    print(f"job {name} already ended: {state.lower()}" + (f" ({reason})" if reason else "") + "; nothing to stop")
    return 0


def _left_behind(args: argparse.Namespace, out_dir: Path) -> int | None:
    """How the run of args.job ended, from what it left in out_dir (None if it left nothing):
    `status` reports it; `stop` has nothing to stop (with --json: the same report, exit 0)."""
    if args.command == "stop" and not args.json:
        ending = read_status(out_dir)
        return None if ending is None else _nothing_to_stop(args.job, ending["state"], ending.get("reason", ""))
    ended = _ended(out_dir, args.json)
    return ended if ended is None or args.command == "status" else 0


def _status(args: argparse.Namespace) -> int:
    """Prints the job and the workers; exits 0 unless the job failed or nothing can be reached.
    `stop` of a job that has already ended says so and exits 0."""
    out_dir: Path | None = None
    job_security: security.Security | None = None
    job_ref = coordinator_pb2.JobRef()  # the coordinator's current job, unless --job names one
    if args.coordinator:
        address = str(args.coordinator)
    elif args.job:
        try:
            job = load_job(args.job)
        except ConfigError as exc:
            _error(str(exc))
            return EXIT_USAGE
        out_dir, job_security = Path(job.resolve(job.output.dir)), job.security_files()
        path = out_dir / ADDRESS_FILE
        if not path.exists():
            ended = _left_behind(args, out_dir)
            if ended is None:
                _error(f"no coordinator address at {path}: is `hetpipe run {args.job}` running?")
                return EXIT_USAGE
            return ended
        address = path.read_text().strip()
        job_ref.job_id = published_job_id(out_dir)
    else:
        address = os.environ.get("HETPIPE_COORDINATOR", f"127.0.0.1:{DEFAULT_PORT}")
    # The flags, else the job's security section (which `hetpipe run` used), else the run's own token.
    credentials = security.from_namespace(args)
    if not (credentials.token_file or credentials.tls) and job_security is not None:
        credentials = job_security
    elif out_dir is not None and not credentials.token_file and (out_dir / TOKEN_FILE).exists():
        credentials = dataclasses.replace(credentials, token_file=str(out_dir / TOKEN_FILE))
    try:
        security.use(credentials, security.COORDINATOR, "cli")
    except security.SecurityError as exc:
        _error(str(exc))
        return EXIT_USAGE
    State = coordinator_pb2.JobStatus.State
    with rpc.channel(address) as channel:
        stub = rpc.Stub(channel, "Coordinator")
        try:
            job_status = stub.GetJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S)
            # StopJob answers an ended job as it ended, which cannot tell "stopped now" from "had
            # ended": only a job that has not ended is asked to stop.
            already_ended = args.command == "stop" and State.Name(job_status.state) in TERMINAL
            if args.command == "stop" and not already_ended:
                job_status = stub.StopJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S)
            workers = stub.ListWorkers(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)
        except grpc.RpcError as exc:
            # The run this file points at may have ended since: say how, from what it left.
            ended = _left_behind(args, out_dir) if out_dir is not None else None
            if ended is not None:
                return ended
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # its coordinator moved on to another job
                if args.command == "stop" and not args.json:   # not running: what the stop asked for
                    print(f"job {job_ref.job_id} of {args.job} already ended; nothing to stop (coordinator "
                          f"{address}: {exc.details()})")
                    return 0
                _error(f"the job of {args.job} has ended; coordinator {address}: {exc.details()}")
                return EXIT_FAILED
            print(f"hetpipe: coordinator {address} unreachable: {exc.code().name}: {exc.details()}", file=sys.stderr)
            if not (args.coordinator or args.job or os.environ.get("HETPIPE_COORDINATOR")):
                print(f"hetpipe: a local `hetpipe run JOB.yaml` is found with `hetpipe {args.command} --job JOB.yaml`",
                      file=sys.stderr)
            return EXIT_UNAVAILABLE
    if already_ended and not args.json:
        return _nothing_to_stop(job_status.job_id or address, State.Name(job_status.state), job_status.reason)
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"job": MessageToDict(job_status), "workers": MessageToDict(workers)}, indent=2))
    else:
        print(f"job: {State.Name(job_status.state)}" + (f" ({job_status.reason})" if job_status.reason else ""))
        if job_status.total_samples:
            print(f"progress: {job_status.samples}/{job_status.total_samples} samples, loss {job_status.loss:.4f}, "
                  f"{job_status.samples_per_second:.0f} samples/s{' (emulated GPUs)' if job_status.emulated else ''}")
        print(f"{'worker':<14}{'role':<14}{'address':<22}{'node':<10}{'alive':<7}assigned")
        for w in workers.workers:
            role = coordinator_pb2.WorkerInfo.Role.Name(w.info.role).lower()
            print(f"{w.worker_id:<14}{role:<14}{w.info.address:<22}{w.info.node:<10}"
                  f"{'yes' if w.alive else 'NO':<7}{w.assigned or '-'}")
    return EXIT_FAILED if job_status.state == State.FAILED and not already_ended else 0


def _certs(args: argparse.Namespace) -> int:
    from launch import certs

    try:
        written = certs.make(Path(args.dir), args.hosts, args.san, args.password_file)
    except OSError as exc:
        _error(f"cannot write {args.dir}: {exc.strerror}")
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
    except OSError as exc:
        _error(f"cannot write {args.output or Path(args.output_dir) / timeline.TRACE_FILE}: {exc.strerror}")
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
        security.add_flags(cmd)
        cmd.set_defaults(func=_status)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["coordinator"]:  # its own flags, parsed by coordinator.config
        return _coordinator(argv[1:])
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
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
