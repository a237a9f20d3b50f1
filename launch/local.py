"""`hetpipe run`: the embedded default. A coordinator in this process, every worker a local
process that registers with it over gRPC, the job submitted at start as a compose cluster's is."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetpipe import data_check, devices, metrics, outputs, progress, rpc, security, threads
from hetpipe.config import ConfigError, JobConfig
from hetpipe.errors import JobFailed, JobStopped, interrupt_reason
from hetpipe.outputs import STATUS_FILE, TARGETS_FILE, TOKEN_FILE, publish_address, unpublish_address, write_status
from hetpipe.v1 import coordinator_pb2
from coordinator import checkpoints
from coordinator.__main__ import build
from coordinator.job import JobRunner
from coordinator.planner import Plan, cache, make_plan
from coordinator.servicer import PROTO_STATE
from coordinator.state import JobState
from launch.interrupts import interrupts_held
from launch import plan_report, processes
from launch.ending import warn
from launch.processes import MAX_SHARD_RESTARTS, LocalProcesses

ROLES = {"stage_worker": "stage_worker", "ps_server": "ps_shard"}  # module -> `role` label (docs/metrics.md)
TERMINAL = {PROTO_STATE[s] for s in JobState if s.is_terminal}
WAITING_EVERY_S = 5.0   # what a job waits for, said again when it changed, at most this often


def write_targets(path: Path, coordinator_metrics_port: int, procs: LocalProcesses) -> None:
    """Writes (atomically) one file_sd entry per process, labelled with its role, for a Prometheus
    started with docker/prometheus/prometheus.yml's file_sd job pointed at this file. (Each is
    told apart by its `instance`; the series name their stage or shard themselves, docs/metrics.md.)"""
    entries = [{"targets": [f"127.0.0.1:{coordinator_metrics_port}"], "labels": {"role": "coordinator"}}]
    for p in procs.processes:
        entries.append({"targets": [f"{procs.host}:{p.metrics_port}"], "labels": {"role": ROLES[p.module]}})
    outputs.write_text_atomically(path, json.dumps(entries, indent=2) + "\n")


def _watch_processes(procs: LocalProcesses, runner: JobRunner, on_restart: Callable[[], None]) -> None:
    """A dead stage is reported at once (no waiting for heartbeats); a dead shard is restarted
    from its checkpoint and push log, and re-registers at the same address."""
    for p in procs.dead():
        if p.module == "ps_server" and p.restarts < MAX_SHARD_RESTARTS:
            print(f"hetpipe: {p.name} {p.exit_description()}; restarting it from its checkpoint", file=sys.stderr)
            runner.report_dead(p.address, "is restarting")
            procs.restart(p)
            on_restart()  # its metrics port is new
        else:
            runner.report_dead(p.address, f"(pid {p.popen.pid}) {p.exit_description()}")


def _kill_hung(procs: LocalProcesses, address: str, why: str) -> None:
    name = procs.kill(address)
    print(f"hetpipe: {why}; killed {name} to restart it from its checkpoint", file=sys.stderr)


def _resume_wave(out_dir: Path, job: JobConfig, plan: Plan, *, resume: bool, fresh: bool) -> int:
    """The wave to resume from (0: none), refused before any process starts where the cut is of
    another job. A run that would delete an earlier run's checkpoints without being told to is
    refused, as transformers' Trainer refuses a used output_dir: the cuts may hold hours of
    training that a forgotten --resume would otherwise lose."""
    folder = out_dir / outputs.CHECKPOINTS
    wave = checkpoints.latest(folder)
    if not resume:
        if wave is not None and not fresh:
            raise ConfigError(f"output.dir {out_dir} holds an earlier run's checkpoints (the latest after wave "
                              f"{wave}): --resume goes on from it, --fresh deletes them and starts over")
        return 0
    if wave is None:
        raise ConfigError(f"--resume: no complete checkpoint in {folder} "
                          "(train.checkpoint_every sets how often a run writes one)")
    try:
        checkpoints.check_cut(folder, wave, checkpoints.manifest(folder, wave),
                              checkpoints.job_shape(job, plan, job.parallel.started_shards))
    except ConfigError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    if outputs.read_summary(out_dir) is not None:   # a run clears it as it starts: the last one finished
        warn(f"--resume: the run in {out_dir} finished (its summary.json is there): this one trains again from its "
             f"latest checkpoint, after wave {wave}, and writes its results in their place")
    print(f"hetpipe: resuming from the checkpoint of wave {wave} (after each VW's minibatch {wave * plan.nm} of "
          f"{job.train.steps})", file=sys.stderr)
    return wave


def preflight(job: JobConfig) -> Plan:
    """What must hold before any process starts (checked_inputs), and the job's plan, so that
    `hetpipe plan` finds what `hetpipe run` would. Raises ConfigError or PlanError naming what is
    wrong, in one line."""
    notes = checked_inputs(job)
    plan = make_plan(job)  # profiles models.structure(...) and may read data.batch_shapes(job)
    return dataclasses.replace(plan, warnings=(*plan.warnings, *notes))


def checked_inputs(job: JobConfig) -> list[str]:
    """What any mode's processes need, checked before one starts: the model factory gives a model
    (built on the meta device); the data factories give datasets of (input, target) that the model
    takes and the loss can use, without NaN or Inf; model.init has the model's keys and shapes,
    finite; output.dir can be written; the security section's files can be read. Raises
    ConfigError naming what is wrong, in one line; returns warnings."""
    import torch

    from coordinator.planner.shapes import boundaries
    from hetpipe import model_init, models

    _check_security(job.security_files())
    for env in (threads.THREADS_ENV, threads.PS_THREADS_ENV):
        threads.env_threads(env)
    model = models.structure(job.model, job.base_dir, dtype=job.train.dtype)
    # Only torch's own forward is known to take the data's values as ids (a subclass may hash them first).
    first = model[0]
    plain = type(first).forward in (torch.nn.Embedding.forward, torch.nn.EmbeddingBag.forward)
    ids = first.num_embeddings if plain and isinstance(first, (torch.nn.Embedding, torch.nn.EmbeddingBag)) else None
    key = cache.model_key(job.model, job.base_dir, job.model.args, model)
    notes = data_check.check(
        job, lambda x: boundaries(model, x, strict=True, cache_dir=cache.default_cache_dir(), model_key=key)[-1][0], ids)
    if job.model.init is not None:
        model_init.check_init(job, model)
    outputs.check_dir(Path(job.resolve(job.output.dir)))
    return notes


def check_host_memory(job: JobConfig, host: plan_report.HostMemory) -> list[str]:
    """Refuses (ConfigError) a run whose processes on this machine's CPU (an emulated cluster's
    every stage or rank) need more memory than the machine has: the planner checks each stage,
    and ddp each rank, against its emulated GPU's capacity only, and the run would swap or be
    killed part way. Returns a warning where they need more than is available now."""
    if host.largest is None or host.need_bytes <= host.available_bytes:
        return []
    if host.emulated:
        hint = ("give model.args a small stand-in's sizes and the full ones as cluster.emulate.model_args (the "
                "plan, its times and its memory stay the full model's)")
    elif job.parallel.mode == "ddp":
        hint = "use fewer ranks (parallel.virtual_workers) or a smaller model"
    else:
        hint = "use fewer virtual workers or stages, a smaller parallel.nm or a smaller model"
    if host.need_bytes > host.total_bytes:
        raise ConfigError(f"this machine's memory: {host.describe()}: {hint}")
    return [f"this machine's memory: {host.describe()}: the run may swap or be killed; {hint}"]


def _check_real_gpus(job: JobConfig) -> None:
    """A cluster without emulate names real GPUs: run here without a CUDA device, its stages would
    compute on the CPU under those GPUs' names, their numbers labelled as not emulated."""
    if job.cluster is None or job.emulate is not None or devices.local_devices()[0].kind == "cuda":
        return
    types = sorted({g.type for n in job.cluster.nodes for g in n.gpus})
    raise ConfigError(f"cluster: names real GPUs ({', '.join(types)}; there is no cluster.emulate), and this machine "
                      "has no CUDA device: add cluster.emulate: {} to emulate them on the CPU, or leave cluster out "
                      "to train on this machine's own devices")


def _check_security(given: security.Security | None) -> None:
    if given is None:
        return
    try:
        given.check()
    except security.SecurityError as exc:
        raise ConfigError(f"security: {exc}") from None


def local_security(job: JobConfig, out_dir: Path, flags: security.Security = security.Security()) -> security.Security:
    """The job's security section, else the command line's (--token-file, --tls-*), else a fresh
    per-run token in out_dir (loopback, no TLS)."""
    given = job.security_files() or (flags if flags.token_file or flags.tls else None)
    if given is not None:
        return given
    path = out_dir / TOKEN_FILE
    security.write_secret(path, security.new_secret())
    return security.Security(token_file=str(path))


def run_local(job: JobConfig, *, quiet: bool = False, heartbeat_interval_s: float = 1.0,
              resume: bool = False, fresh: bool = False,
              flags: security.Security = security.Security()) -> dict[str, Any]:
    """Trains job on this machine; returns the summary. Stops every process it started. resume:
    from the latest checkpoint in output.dir (ConfigError if there is none); fresh: deleting an
    earlier run's checkpoints there (without either, ConfigError if there are some)."""
    out_dir = Path(job.resolve(job.output.dir))
    _check_real_gpus(job)
    if job.parallel.mode != "hetpipe":  # the baselines (DESIGN §7): ddp, torch-pipeline
        if resume or fresh:
            raise ConfigError(f"--{'resume' if resume else 'fresh'}: parallel.mode {job.parallel.mode} writes no "
                              "checkpoints, so there is none to resume from or delete")
        outputs.check_reads(out_dir, job.read_paths, keep_checkpoints=True)   # what their start_local removes
        from baselines import run_baseline

        for warning in checked_inputs(job):   # a baseline has no plan, and its data the same checks
            warn(warning)
        if job.parallel.mode == "ddp":
            for warning in check_host_memory(job, plan_report.ddp_host_memory(job)):
                warn(warning)

        with outputs.locked(out_dir):
            return run_baseline(job, quiet=quiet)
    processes.warm_up()  # the fork server imports torch while this process plans
    plan = preflight(job)
    for warning in (*plan.warnings, *check_host_memory(job, plan_report.host_memory(job, plan))):
        warn(warning)
    # Every refusal comes before an earlier run's results are cleared: a refused run changes nothing.
    resume_wave = _resume_wave(out_dir, job, plan, resume=resume, fresh=fresh)
    outputs.check_reads(out_dir, job.read_paths, keep_checkpoints=resume)
    with outputs.locked(out_dir):
        credentials = local_security(job, out_dir, flags)
        try:   # the per-run token goes however this ends (_run_coordinated's own finally, once there)
            _check_security(credentials)
            # With this launcher's own folders: an earlier run's logs of processes this one lacks, or
            # its trace where this one writes none, would pass for this run's (`hetpipe trace`).
            # Stages write their trace anew even on --resume; eval.jsonl keeps the evaluations before the cut.
            kept = (outputs.evals_through(out_dir, resume_wave * plan.nm) if resume_wave else []) if resume else None
            outputs.start_local(out_dir, keep_checkpoints=resume, evals=kept)
            with security.using(credentials, security.COORDINATOR, "hetpipe run"):
                return _run_coordinated(job, plan, out_dir, credentials, quiet=quiet, resume_wave=resume_wave,
                                        heartbeat_interval_s=heartbeat_interval_s)
        finally:
            if credentials.token_file == str(out_dir / TOKEN_FILE):
                (out_dir / TOKEN_FILE).unlink(missing_ok=True)


def _run_coordinated(job: JobConfig, plan: Plan, out_dir: Path, credentials: security.Security, *, quiet: bool,
                     resume_wave: int, heartbeat_interval_s: float) -> dict[str, Any]:
    """run_local once the output folder and the credentials are ready: the coordinator in this
    process, a process per worker, progress until the job ends."""
    server, servicer = build("127.0.0.1", 0, heartbeat_interval_s=heartbeat_interval_s)
    server.start()
    runner = servicer.runner
    metrics_server: Any = None
    channel: Any = None
    status: coordinator_pb2.JobStatus | None = None
    logs: dict[str, Path] = {}   # each worker's address -> its log
    try:   # from here on the finally below removes the run's token and address, whatever fails
        # Submitted before anyone can find the coordinator: a `hetpipe stop` from then on stops this job.
        job_ref = coordinator_pb2.JobRef(job_id=runner.submit(job, plan, resume_wave=resume_wave))
        publish_address(out_dir, server.address, job_ref.job_id)
        # The embedded coordinator serves this process's registry, as `python -m coordinator` does.
        metrics_server = metrics.start(0, "127.0.0.1")
        channel = rpc.channel(server.address)
        stub = rpc.Stub(channel, "Coordinator")
        on_gpu = sum(s.device.startswith("cuda") for s in plan.stages)
        stage_threads, shard_threads = threads.thread_split(len(plan.stages) - on_gpu, on_gpu, job.parallel.started_shards)
        env = {threads.THREADS_ENV: stage_threads, threads.PS_THREADS_ENV: shard_threads}
        with LocalProcesses(out_dir / "logs", env=env) as procs:
            runner.kill_hung = lambda address, why: _kill_hung(procs, address, why)
            register = ["--coordinator", server.address, "--node", "local", "--output-root", str(out_dir),
                        *security.child_args(credentials)]
            # Neutral names: the coordinator decides which worker serves which stage, and says so
            # in the worker's log ("stage q of vw v assigned ...") and in every error.
            for i in range(len(plan.stages)):
                procs.spawn("stage_worker", f"stage worker {i}", register)
            shard_trace = ["--trace-dir", str(out_dir / "trace")] if job.output.trace else []
            for i in range(job.parallel.started_shards):
                procs.spawn("ps_server", f"ps server {i}",
                            [*register, "--checkpoint-dir", str(out_dir / "ps" / f"shard{i}"), *shard_trace])
            procs.wait_ready(notice=None if quiet else lambda text: print(f"hetpipe: {text}", file=sys.stderr))
            logs.update((p.address, p.log_path) for p in procs.processes)
            targets = out_dir / TARGETS_FILE
            write_targets(targets, metrics_server.port, procs)
            try:
                restarted = functools.partial(write_targets, targets, metrics_server.port, procs)
                status = follow(lambda: stub.GetJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S), quiet=quiet,
                                on_status=lambda _: _watch_processes(procs, runner, restarted),
                                unsaid_wait_s=WAITING_EVERY_S)
            except KeyboardInterrupt as exc:
                # Give the runner a moment to stop the stages cleanly; the processes are terminated
                # right after anyway, and Ctrl-C must end the run within seconds even on a busy host.
                runner.stop(interrupt_reason(exc))
                runner.machine.wait_terminal(2.0)
                if runner.machine.state != JobState.COMPLETED:
                    raise
                # It came after the job had ended: its results stand, and the run ends as the job did.
                status = stub.GetJob(job_ref, timeout=rpc.CONTROL_DEADLINE_S)
    except BaseException as exc:
        # What status.json says: a start-up failure's own message, an interrupt's signal.
        if isinstance(exc, JobFailed):
            runner.machine.try_to(JobState.FAILED, str(exc))
        runner.stop(interrupt_reason(exc) if isinstance(exc, KeyboardInterrupt) else "the launcher failed")
        raise
    finally:
        # Seconds long, and whole: an interrupt that comes meanwhile is raised once it is done.
        with interrupts_held():
            runner.stop("the launcher ended")  # no-op for a job that ended; its workers are gone anyway
            runner.join(10.0)
            if channel is not None:
                channel.close()
            # Before the server goes: `hetpipe status --job` that finds it gone reads how the job
            # ended here (it found neither, and said the coordinator was unreachable).
            view = runner.view()
            try:
                write_status(out_dir, view.state.name, view.reason)
            except OSError as exc:   # a full disk: the job's own ending is what to report, and the rest must go
                warn(f"could not write {out_dir / STATUS_FILE}: {exc.strerror or exc}")
            server.stop()
            if metrics_server is not None:
                metrics_server.close()
            if credentials.token_file == str(out_dir / TOKEN_FILE):  # the per-run token, not the user's file
                (out_dir / TOKEN_FILE).unlink(missing_ok=True)
            unpublish_address(out_dir)  # the port is free now: another run may take it
    assert status is not None
    if runner.machine.state == JobState.COMPLETED:
        summary: dict[str, Any] = json.loads(status.summary_json)
        return summary
    if runner.machine.state == JobState.STOPPED:
        raise JobStopped(status.reason)
    raise JobFailed(naming_logs(status.reason, logs))


def naming_logs(reason: str, logs: dict[str, Path]) -> str:
    """reason, with the log of each worker it names by address: the logs' names (stage_worker_3)
    follow the order the workers started in, not the stage each came to serve."""
    named = [str(path) for address, path in logs.items() if re.search(re.escape(address) + r"(?!\d)", reason)]
    return reason + (f"; log {', '.join(named)}" if named else "")


def follow(get_status: Callable[[], coordinator_pb2.JobStatus], *, quiet: bool,
           on_status: Callable[[coordinator_pb2.JobStatus], None] = lambda status: None,
           unsaid_wait_s: float = 0.0) -> coordinator_pb2.JobStatus:
    """Shows progress until the job ends (a bar on a terminal, else a line now and then); returns
    its final status. on_status sees each status of the job while it is under way (a local
    launcher watches its processes there). unsaid_wait_s: a wait for workers this short goes
    unsaid (a local run's own workers register a moment after they are ready)."""
    shown: progress.Bar | progress.Lines | None = None
    running = PROTO_STATE[JobState.RUNNING]
    waiting, told_at, since = "", -math.inf, math.inf
    try:
        while True:
            status = get_status()
            ended = status.state in TERMINAL
            if not ended:
                on_status(status)
            now = time.monotonic()
            since = min(since, now) if status.waiting else math.inf
            if (status.waiting != waiting and not quiet and now - told_at >= WAITING_EVERY_S
                    and (not status.waiting or now - since >= unsaid_wait_s)):
                # Before it runs, a job may wait for workers up to its claim timeout: say for which.
                waiting, told_at = status.waiting, now
                if waiting:
                    print(f"hetpipe: waiting for workers: {waiting}", file=sys.stderr)
            # The total comes with the first progress report, a moment after the job is RUNNING
            # (a short job may end before this loop sees one: its last line is still shown).
            if (status.state == running or ended) and shown is None and not quiet and status.total_samples:
                desc = "train (emulated GPUs)" if status.emulated else "train"
                shown = progress.shown(status.total_samples, desc, status.samples)
            if shown is not None and status.total_samples:  # the last one too: a bar left at 0% reads as a hang
                # No loss until a minibatch of this run has finished (a resumed one starts at the
                # cut's samples): the wire's 0.0 stands for none yet.
                trained = status.samples and status.samples_per_second
                shown.show(status.samples, status.total_samples, status.loss if trained else None,
                           status.samples_per_second, last=ended)
            if ended:
                return status
            time.sleep(0.1)
    finally:
        if shown is not None:
            shown.close()
