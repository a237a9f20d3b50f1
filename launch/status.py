"""`hetpipe status` and `hetpipe stop`: a job and its workers from its coordinator, or, once a
local run has ended, how it ended from what it left in its output.dir."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any
from pathlib import Path

import grpc

from hetpipe import outputs, reach, rpc, security
from hetpipe.config import ConfigError, load_job
from hetpipe.outputs import ADDRESS_FILE, TOKEN_FILE, published_job_id, read_status
from hetpipe.v1 import coordinator_pb2, wire_pb2
from coordinator.config import DEFAULT_PORT
from coordinator.state import JobState
from launch import run_marker
from launch.ending import EXIT_FAILED, EXIT_UNAVAILABLE, EXIT_USAGE, error

TERMINAL = {s.name for s in JobState if s.is_terminal}   # the proto's names of the states a job ends in


def plain(message: Any) -> dict[str, Any]:
    """A message as `--json` gives it: every field by its proto name, numbers as numbers (protobuf's
    JSON writes 64-bit ones as strings; one not finite as null), enums by name. (No map fields:
    none of these has one.)"""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        repeated = field.is_repeated
        out[field.name] = [_one(field, v) for v in value] if repeated else _one(field, value)
    return out


def _one(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        return plain(value)
    if field.enum_type is not None:   # a number this client does not know (a newer coordinator's) stays one
        named = field.enum_type.values_by_number.get(value)
        return named.name if named is not None else value
    if isinstance(value, float) and not math.isfinite(value):
        return None   # strict JSON has no Infinity (a diverged loss) nor NaN
    return value


def job_json(status: Any) -> dict[str, Any]:
    """A JobStatus as `--json` gives it (plain()), its plan and summary as objects, not JSON text:
    the keys of a running job's and of one ended before (state, reason, summary) alike."""
    out = plain(status)
    for name in ("plan", "summary"):
        text = out.pop(f"{name}_json")
        out[name] = json.loads(text) if text else None
    return out


def _ended(out_dir: Path, as_json: bool) -> int | None:
    """Reports how the last run into out_dir ended, from what it left there; None if it left nothing."""
    ending = read_status(out_dir)
    if ending is None:
        return None
    summary = outputs.read_summary(out_dir) if ending["state"] == "COMPLETED" else None
    if as_json:
        print(json.dumps({"job": {**ending, "summary": summary}, "workers": []}, indent=2))
    else:
        # When: a run stopped before it started (Ctrl-C while planning, a refusal) leaves the last one's.
        finished = ending.get("finished")
        when = ""
        if isinstance(finished, (int, float)) and not isinstance(finished, bool) and math.isfinite(finished) and finished > 0:
            when = " " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(finished))
        print(f"job: {ending['state']} (ended{when}; no coordinator is running)"
              + (f": {ending['reason']}" if ending.get("reason") else ""))
        if summary is not None:
            rate, loss = summary.get("samples_per_second"), summary.get("final_loss")
            print(f"result: {_number(rate, '.0f')} samples/s, final loss {_number(loss, '.4f')} in {out_dir}")
    return EXIT_FAILED if ending["state"] == "FAILED" else 0


def _number(value: object, spec: str) -> str:
    """value formatted, or "n/a": summary.json writes a NaN or missing number as null."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


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


START_WAIT_S = 300.0   # how long `hetpipe stop` waits for a starting run's coordinator
STOP_WAIT_S = 30.0     # and for a stopped job to end (its stages stop within seconds)


def _stopped(args: argparse.Namespace, stub: rpc.Stub, job_ref: coordinator_pb2.JobRef,
             job_status: coordinator_pb2.JobStatus, out_dir: Path | None) -> int:
    """`hetpipe stop`'s answer: StopJob answers at once, the job still running, so this waits (up
    to STOP_WAIT_S) for the end the stop asked for. A local run's coordinator ends with its job:
    then how it ended is in status.json."""
    state = coordinator_pb2.JobStatus.State
    deadline = time.monotonic() + STOP_WAIT_S
    while state.Name(job_status.state) not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            job_status = stub.GetJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S)
        except grpc.RpcError:
            # The run writes status.json after its coordinator has gone: read it once the run has.
            while out_dir is not None and run_marker.live_run(out_dir) is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            ending = read_status(out_dir) if out_dir is not None else None
            if ending is not None:
                job_status = coordinator_pb2.JobStatus(state=state.Value(ending["state"]), reason=ending.get("reason", ""),
                                                       job_id=job_status.job_id)
            break
    name = state.Name(job_status.state)
    if args.json:
        print(json.dumps({"job": job_json(job_status), "workers": []}, indent=2))
    elif name in TERMINAL:
        print(f"job: {name}" + (f" ({job_status.reason})" if job_status.reason else ""))
    else:
        print(f"job: STOPPING (asked to stop; still {name} after {STOP_WAIT_S:.0f}s)")
    return 0


def _starting(args: argparse.Namespace, run: run_marker.Run) -> int:
    """`hetpipe status` of a run whose coordinator is not up yet."""
    if args.json:
        print(json.dumps({"job": {"state": "STARTING", "pid": run.pid}, "workers": []}, indent=2))
    else:
        print(f"job: STARTING (`hetpipe run` pid {run.pid}: its coordinator is not up yet)")
    return 0


def _published(path: Path, run: run_marker.Run) -> bool:
    """run's coordinator address is at path: written since run started (a file from before is an
    earlier run's, which a kill -9 left behind: this run removes it once it has planned)."""
    try:
        return path.stat().st_mtime >= run.created
    except FileNotFoundError:
        return False


def _wait_for_address(job: str, out_dir: Path, run: run_marker.Run) -> bool:
    """`hetpipe stop` of a run still starting: waits until it publishes its coordinator's address
    (True: it is stopped there), ends, or START_WAIT_S pass."""
    print(f"hetpipe: the run of {job} (pid {run.pid}) is starting; stopping it once its coordinator is up",
          file=sys.stderr)
    deadline = time.monotonic() + START_WAIT_S
    path = out_dir / ADDRESS_FILE
    while not _published(path, run) and run_marker.live_run(out_dir) == run and time.monotonic() < deadline:
        time.sleep(0.05)
    return _published(path, run)


def _never_up(args: argparse.Namespace, out_dir: Path, run: run_marker.Run) -> int:
    """The starting run ended before its coordinator was up (refused, say: it said why), or is
    still starting after START_WAIT_S."""
    if run_marker.live_run(out_dir) == run:
        error(f"the run of {args.job} (pid {run.pid}) is still starting after {START_WAIT_S:.0f}s; its coordinator "
              "is not up")
        return EXIT_UNAVAILABLE
    ending = read_status(out_dir)
    if ending is not None and ending.get("finished", 0) >= run.created:   # else an earlier run's
        return _nothing_to_stop(args.job, ending["state"], ending.get("reason", ""))
    if args.json:
        print(json.dumps({"job": {"state": "ENDED_BEFORE_START", "pid": run.pid}, "workers": []}, indent=2))
    else:
        print(f"job {args.job} ended before its coordinator was up (pid {run.pid} said why); nothing to stop")
    return 0


def status(args: argparse.Namespace) -> int:
    """Prints the job and the workers; exits 0 unless the job failed or nothing can be reached.
    `stop` of a job that has already ended says so and exits 0."""
    out_dir: Path | None = None
    job_security: security.Security | None = None
    job_ref = coordinator_pb2.JobRef()  # the coordinator's current job, unless --job names one
    if args.coordinator:
        address = str(args.coordinator)
    elif args.job:
        try:
            job = load_job(args.job, args.set)
        except ConfigError as exc:
            error(str(exc))
            return EXIT_USAGE
        out_dir, job_security = Path(job.resolve(job.output.dir)), job.security_files()
        path = out_dir / ADDRESS_FILE
        starting = run_marker.live_run(out_dir)
        if starting is not None and not _published(path, starting):
            if args.command == "status":
                return _starting(args, starting)
            if not _wait_for_address(args.job, out_dir, starting):
                return _never_up(args, out_dir, starting)
        if not path.exists():
            ended = _left_behind(args, out_dir)
            if ended is not None:
                return ended
            status_file = out_dir / outputs.STATUS_FILE
            error(f"{args.job} has not run here: its output.dir {out_dir} does not exist" if not out_dir.exists()
                  else f"{status_file} cannot be read, or is not what a run writes, and no coordinator address is at "
                       f"{path}: is `hetpipe run {args.job}` running?" if status_file.exists()
                  else f"no coordinator address at {path}: is `hetpipe run {args.job}` running?")
            return EXIT_USAGE
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
        error(str(exc))
        return EXIT_USAGE
    State = coordinator_pb2.JobStatus.State
    with rpc.channel(address) as channel:
        stub = rpc.Stub(channel, "Coordinator")
        try:
            job_status = stub.GetJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S)
            # StopJob answers an ended job as it ended, which cannot tell "stopped now" from "had
            # ended": only a job that has not ended is asked to stop. A coordinator that has had no
            # job is not asked either: it would answer STOPPED, as if a job had been stopped.
            already_ended = args.command == "stop" and (State.Name(job_status.state) in TERMINAL
                                                        or job_status.state == State.NONE)
            if args.command == "stop" and not already_ended:
                return _stopped(args, stub, job_ref, stub.StopJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S), out_dir)
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
                error(f"the job of {args.job} has ended; coordinator {address}: {exc.details()}")
                return EXIT_FAILED
            if out_dir is not None and run_marker.live_run(out_dir) is None:
                # Its coordinator went with it, and it said nothing: killed (kill -9, a power cut).
                if args.command == "stop" and not args.json:
                    return _nothing_to_stop(args.job, "KILLED", "no `hetpipe run` into its output.dir is alive")
                error(f"the run of {args.job} is not alive, and it left no summary of how it ended: it was killed "
                      f"(kill -9?) with its coordinator {address}; its logs are in {out_dir / 'logs'}")
                return EXIT_FAILED
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                # Reached, and refused: another cluster's token, or none. A configuration, not an
                # outage (exit 69 tells a script to try again), as `hetpipe run --coordinator` says too.
                error(f"coordinator {address} refused the call: {exc.code().name}: {exc.details()}")   # names the token
                return EXIT_USAGE
            print(f"hetpipe: coordinator {reach.unreachable(address, exc)}", file=sys.stderr)
            if reach.handshake_failed(exc):   # a configuration, as `hetpipe run --coordinator` says too
                return EXIT_USAGE
            if not (args.coordinator or args.job or os.environ.get("HETPIPE_COORDINATOR")):
                print(f"hetpipe: a local `hetpipe run JOB.yaml` is found with `hetpipe {args.command} --job JOB.yaml`",
                      file=sys.stderr)
            return EXIT_UNAVAILABLE
    if already_ended and not args.json:
        if job_status.state == State.NONE:
            print(f"coordinator {address} has had no job; nothing to stop")
            return 0
        return _nothing_to_stop(job_status.job_id or address, State.Name(job_status.state), job_status.reason)
    if args.json:
        print(json.dumps({"job": job_json(job_status), "workers": [plain(w) for w in workers.workers]}, indent=2))
    else:
        print(f"job: {State.Name(job_status.state)}" + (f" ({job_status.reason})" if job_status.reason else ""))
        if job_status.waiting and State.Name(job_status.state) not in TERMINAL:
            print(f"waiting for workers: {job_status.waiting}")
        if job_status.total_samples:
            # The wire's 0.0 stands for no loss yet: none until a minibatch of this run has finished
            # (a resumed one starts at its cut's samples), as `hetpipe run`'s progress shows it.
            trained = job_status.samples and job_status.samples_per_second
            print(f"progress: {job_status.samples}/{job_status.total_samples} samples, "
                  + (f"loss {job_status.loss:.4f}, " if trained else "")
                  + f"{job_status.samples_per_second:.0f} samples/s{' (emulated GPUs)' if job_status.emulated else ''}")
        print(f"{'worker':<14}{'role':<14}{'address':<22}{'node':<10}{'alive':<7}assigned")
        for w in workers.workers:
            role = coordinator_pb2.WorkerInfo.Role.Name(w.info.role).lower()
            print(f"{w.worker_id:<14}{role:<14}{w.info.address:<22}{w.info.node:<10}"
                  f"{'yes' if w.alive else 'NO':<7}{w.assigned or '-'}")
    return EXIT_FAILED if job_status.state == State.FAILED and not already_ended else 0
