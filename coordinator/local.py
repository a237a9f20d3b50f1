"""`hetpipe run`: the embedded default. A coordinator in this process, every worker a local
process that registers with it over gRPC, the job submitted as a compose cluster would."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hetpipe import rpc
from hetpipe.config import JobConfig
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, wire_pb2
from coordinator import state as st
from coordinator.__main__ import build
from coordinator.driver import JobFailed, JobStopped
from coordinator.job import JobRunner
from coordinator.launcher import LocalProcesses

MAX_SHARD_RESTARTS = 3
ADDRESS_FILE = "coordinator.address"  # where `hetpipe status/stop --job` find the coordinator


def _watch_processes(procs: LocalProcesses, runner: JobRunner) -> None:
    """A dead stage is reported at once (no waiting for heartbeats); a dead shard is restarted
    from its checkpoint and push log, and re-registers at the same address."""
    for p in procs.dead():
        if p.name.startswith("ps shard") and p.restarts < MAX_SHARD_RESTARTS:
            print(f"hetpipe: {p.name} {p.exit_description()}; restarting it from its checkpoint", file=sys.stderr)
            runner.report_dead(p.address, "is restarting")
            procs.restart(p)
        else:
            runner.report_dead(p.address, f"(pid {p.popen.pid}) {p.exit_description()}")


def run_local(job: JobConfig, *, quiet: bool = False, heartbeat_interval_s: float = 1.0) -> dict[str, Any]:
    """Trains job on this machine; returns the summary. Stops every process it started."""
    out_dir = Path(job.resolve(job.output.dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "ps", ignore_errors=True)  # a fresh job must not restore an old one's shards
    server, servicer = build("127.0.0.1", 0, heartbeat_interval_s=heartbeat_interval_s)
    server.start()
    (out_dir / ADDRESS_FILE).write_text(server.address + "\n")
    channel = rpc.channel(server.address)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    try:
        with LocalProcesses(out_dir / "logs") as procs:
            par = job.parallel
            register = ["--coordinator", server.address, "--node", "local"]
            # Neutral names: the coordinator decides which worker serves which stage, and says so
            # in the worker's log ("stage q of vw v assigned ...") and in every error.
            for i in range(par.virtual_workers * par.stages_per_vw):
                procs.spawn("stage_worker", f"stage worker {i}", register)
            # A lone VW needs no parameter server: its local weights are w_global.
            for i in range(par.ps_shards if par.virtual_workers > 1 else 0):
                procs.spawn("ps_server", f"ps shard {i}",
                            [*register, "--checkpoint-dir", str(out_dir / "ps" / f"shard{i}")])
            procs.wait_ready()
            stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=rpc.CONTROL_DEADLINE_S)
            try:
                status = _follow(stub, procs, servicer.runner, quiet=quiet)
            except KeyboardInterrupt:
                servicer.runner.stop("interrupted (Ctrl-C)")
                servicer.runner.machine.wait_terminal(5.0)
                raise
    finally:
        channel.close()
        server.stop()
    if status.state == st.COMPLETED:
        summary: dict[str, Any] = json.loads(status.summary_json)
        return summary
    if status.state == st.STOPPED:
        raise JobStopped(status.reason)
    raise JobFailed(status.reason)


def _follow(stub: coordinator_pb2_grpc.CoordinatorStub, procs: LocalProcesses, runner: JobRunner, *,
            quiet: bool) -> coordinator_pb2.JobStatus:
    """Shows progress until the job ends; returns its final status."""
    bar: tqdm[Any] | None = None
    try:
        while True:
            status = stub.GetJob(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)
            if status.state in st.TERMINAL:
                return status
            _watch_processes(procs, runner)
            if status.state == st.RUNNING and bar is None:
                bar = tqdm(total=status.total_samples, unit="sample", disable=quiet, file=sys.stderr,
                           dynamic_ncols=True, desc="train (emulated GPUs)" if status.emulated else "train")
            if bar is not None:
                bar.n = status.samples
                bar.set_postfix(loss=f"{status.loss:.4f}", samples_s=f"{status.samples_per_second:.0f}",
                                refresh=False)
                bar.refresh()
            time.sleep(0.1)
    finally:
        if bar is not None:
            bar.close()
