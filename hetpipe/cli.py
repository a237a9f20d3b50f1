"""The `hetpipe` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from hetpipe.config import ConfigError, load_job

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE
EXIT_INTERRUPTED = 130


def _run(args: argparse.Namespace) -> int:
    from coordinator.driver import JobFailed, JobStopped
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
    except JobStopped as exc:
        print(f"hetpipe: job stopped: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("hetpipe: interrupted; stopped every process", file=sys.stderr)
        return EXIT_INTERRUPTED
    out = Path(job.resolve(job.output.dir))
    print(json.dumps({k: summary[k] for k in ("steps", "samples_per_second", "final_loss", "accuracy")
                      if k in summary}))
    print(f"results: {out}/ (model.pt, summary.json{', trace/' if job.output.trace else ''})")
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _plan(args: argparse.Namespace) -> int:
    """Prints the plan: VWs, GPUs, layer ranges, memory against capacity, predicted times."""
    from coordinator.partition import PlanError
    from coordinator.plan import make_plan

    try:
        job = load_job(args.config)
        plan = make_plan(job)
    except (ConfigError, PlanError) as exc:
        print(f"hetpipe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    measured = None
    summary_path = Path(job.resolve(job.output.dir)) / "summary.json"
    if summary_path.exists():
        measured = json.loads(summary_path.read_text()).get("samples_per_second")
    if args.json:
        print(json.dumps({**plan.to_dict(), "measured_samples_per_second": measured}, indent=2))
        return 0
    emulated = " (emulated GPUs)" if plan.emulated else ""
    print(f"policy {plan.policy}, {plan.virtual_workers} virtual workers x {plan.stages_per_vw} stages, "
          f"nm {plan.nm}, D {plan.D}, s_global {plan.s_global}, {plan.shards} ps shards{emulated}")
    network = job.cluster.emulate.network if job.cluster and job.cluster.emulate else None
    if network is not None:
        print(f"emulated network: {network.intra_node_gbs:g} GB/s in a node, {network.inter_node_gbs:g} GB/s between "
              f"nodes, {network.latency_s * 1e6:g} us latency; send s and push s are per transfer, time-scaled")
    print(f"{'vw':>3} {'stage':>5}  {'node':<8}{'gpu':<26}{'layers':<10}{'memory GiB':>16}  {'fwd s':>8} {'bwd s':>8} {'recv s':>8}"
          + (f" {'send s':>8} {'push s':>8}" if network else ""))
    for s in plan.stages:
        memory = f"{_gib(s.memory_bytes)}/{_gib(s.capacity_bytes)}"
        print(f"{s.vw:>3} {s.stage:>5}  {s.node:<8}{s.label:<26}{f'[{s.layer_begin},{s.layer_end})':<10}"
              f"{memory:>16}  {s.forward_seconds:>8.4f} {s.backward_seconds:>8.4f} {s.receive_seconds:>8.4f}"
              + (f" {s.next_send_seconds:>8.4f} {s.push_seconds:>8.4f}" if network else ""))
    print(f"max Nm per vw (memory): {list(plan.max_m)}")
    for gpu, fits in sorted(plan.dp_only.items()):
        if not fits:
            print(f"{gpu}: the whole model does not fit on one GPU; data parallelism alone cannot use it")
    line = f"predicted throughput: {plan.predicted_samples_per_second:.1f} samples/s"
    if measured is not None:
        ratio = plan.predicted_samples_per_second / measured if measured else float("nan")
        line += f"; measured {measured:.1f} samples/s in {summary_path} (predicted/measured {ratio:.2f})"
    print(line)
    return 0


def _compose(args: argparse.Namespace) -> int:
    """Writes the docker compose file of the job's cluster spec and plan (coordinator/compose.py)."""
    from coordinator.compose import render, repository_root
    from coordinator.partition import PlanError
    from coordinator.plan import make_plan

    try:
        job = load_job(args.config)
        plan = make_plan(job)
    except (ConfigError, PlanError) as exc:
        print(f"hetpipe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.output) if args.output else None
    text = render(job, plan, job_file=Path(args.config), compose_dir=out.parent if out else Path.cwd(),
                  root=Path(args.context) if args.context else repository_root(),
                  out_name=out.name if out else "compose.yaml")
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        out.write_text(text)
    except OSError as exc:
        print(f"hetpipe: error: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _coordinator_address(args: argparse.Namespace) -> str:
    from coordinator.config import DEFAULT_PORT

    if args.coordinator:
        return str(args.coordinator)
    if args.job:
        job = load_job(args.job)
        path = Path(job.resolve(job.output.dir)) / "coordinator.address"
        if not path.exists():
            raise ConfigError(f"no coordinator address at {path}: is `hetpipe run {args.job}` running?")
        return path.read_text().strip()
    return os.environ.get("HETPIPE_COORDINATOR", f"127.0.0.1:{DEFAULT_PORT}")


def _status(args: argparse.Namespace) -> int:
    """Prints the job and the workers; exits 0 unless the job failed or the coordinator is unreachable."""
    import grpc

    from hetpipe import rpc
    from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, wire_pb2

    try:
        address = _coordinator_address(args)
    except ConfigError as exc:
        print(f"hetpipe: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    State = coordinator_pb2.JobStatus.State
    with rpc.channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            if args.command == "stop":
                job = stub.StopJob(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)
            else:
                job = stub.GetJob(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)
            workers = stub.ListWorkers(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)
        except grpc.RpcError as exc:
            print(f"hetpipe: coordinator {address} unreachable: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"job": MessageToDict(job), "workers": MessageToDict(workers)}, indent=2))
    else:
        print(f"job: {State.Name(job.state)}" + (f" ({job.reason})" if job.reason else ""))
        if job.total_samples:
            print(f"progress: {job.samples}/{job.total_samples} samples, loss {job.loss:.4f}, "
                  f"{job.samples_per_second:.0f} samples/s{' (emulated GPUs)' if job.emulated else ''}")
        print(f"{'worker':<14}{'role':<14}{'address':<22}{'node':<10}{'alive':<7}assigned")
        for w in workers.workers:
            role = coordinator_pb2.WorkerInfo.Role.Name(w.info.role).lower()
            print(f"{w.worker_id:<14}{role:<14}{w.info.address:<22}{w.info.node:<10}"
                  f"{'yes' if w.alive else 'NO':<7}{w.assigned or '-'}")
    return EXIT_FAILED if job.state == State.FAILED else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetpipe", description="HetPipe: train large models on heterogeneous GPUs")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job file with local processes")
    run.add_argument("config", help="job YAML file")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=_run)
    plan = sub.add_parser("plan", help="show the plan for a job file: VWs, GPUs, layers, memory, prediction")
    plan.add_argument("config", help="job YAML file")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.set_defaults(func=_plan)
    compose = sub.add_parser("compose", help="write the docker compose file for a job's cluster and plan")
    compose.add_argument("config", help="job YAML file")
    compose.add_argument("-o", "--output", help="write here (paths in it are relative to its folder); "
                         "default: stdout, relative to the working folder")
    compose.add_argument("--context", help="repository root with docker/ (default: this source tree)")
    compose.set_defaults(func=_compose)
    for name, text in (("status", "show the job and the workers"), ("stop", "stop the running job")):
        cmd = sub.add_parser(name, help=text)
        where = cmd.add_mutually_exclusive_group()
        where.add_argument("--coordinator", help="coordinator host:port (default $HETPIPE_COORDINATOR or :50050)")
        where.add_argument("--job", help="the job file a local `hetpipe run` is running")
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
        cmd.set_defaults(func=_status)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
