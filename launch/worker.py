"""`hetpipe worker`: this host joins the cluster of a coordinator that runs elsewhere. One stage
worker process per device (each pinned to its GPU, or standing for an emulated GPU type) and,
if asked, parameter-server shards, each registering with the coordinator; in the foreground
until stopped, and none of them outlives it.

A process serves one job: the coordinator stops a job's stages when it ends and never claims a
process that served one again (the registry marks it spent), so this launcher starts a fresh
process in its place, on the same port. So does a process whose coordinator restarted while it
held a job (it exits EXIT_ORPHANED: the job ended with that coordinator). A stage worker that
dies otherwise ends the launcher (exit 1, naming it and its log); a shard that dies is restarted
from its checkpoint, as under `hetpipe run`."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import grpc

from hetpipe import catalog, children, outputs, reach, rpc, security, threads
from hetpipe.config import ConfigError
from hetpipe.errors import JobFailed
from hetpipe.registration import NO_COORDINATOR, TOKEN_HINT
from hetpipe.service import EXIT_ORPHANED, EXIT_REFUSED, loopback
from hetpipe.v1 import wire_pb2
from launch.interrupts import HELD, INTERRUPTING, interrupts_held, not_ignored
from launch import processes
from launch.processes import MAX_SHARD_RESTARTS, LocalProcesses, Process

POLL_S = 0.5          # how often the children are checked
SPENT_KILL_S = 30.0   # a spent process still there this long after its SIGTERM is killed (its port for a fresh one)
REGISTRY_POLL_S = 1.0  # how often the coordinator is asked which of them served a job
CUDA_ENV = "CUDA_VISIBLE_DEVICES"
WORKER_LOCK = "worker.lock"   # in logs/NODE: one launcher per node and output root
ANY_ADDRESS = ("0.0.0.0", "::", "")
# A host name's characters and length: the node also names this host's log folder (logs/NODE).
NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")


class Terminated(Exception):
    """SIGTERM: stop every child and exit 0."""


@dataclass(frozen=True, slots=True)
class StageDevice:
    """What one stage worker process computes on, and how it registers."""

    label: str                      # for the listing: "t4 (emulated on the CPU)", "GPU 1: NVIDIA A100 ..."
    gpu_type: str                   # catalog type it registers with; "" = generic
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    coordinator: str
    gpus: tuple[int, ...] | None = None   # None: every visible CUDA device (or one CPU worker)
    emulate: str = ""
    count: int = 1
    shards: int = 0
    host: str = "127.0.0.1"
    advertise_host: str = ""
    node: str = ""
    output_root: str = "runs"
    security: security.Security = security.Security()
    insecure: bool = False


def add_flags(ap: argparse.ArgumentParser) -> None:
    env = os.environ.get
    ap.add_argument("--coordinator", required=not env("HETPIPE_COORDINATOR"), default=env("HETPIPE_COORDINATOR"),
                    metavar="HOST:PORT", help="the coordinator to join (`hetpipe coordinator` on some host)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--gpus", metavar="LIST", help="CUDA devices to serve, e.g. 0,1, one stage worker each "
                      "(default: every visible one, else one CPU worker); 'none': no stage worker")
    what.add_argument("--emulate", metavar="TYPE", help=f"stage workers that emulate this GPU type on the CPU "
                      f"({', '.join(catalog.CATALOG)})")
    ap.add_argument("--count", type=int, help="with --emulate: how many stage workers (default 1)")
    ap.add_argument("--shards", type=int, default=0, help="parameter-server shards to serve here (default 0)")
    ap.add_argument("--host", default=env("HETPIPE_HOST", "127.0.0.1"),
                    help="address the workers bind (0.0.0.0: every interface)")
    ap.add_argument("--advertise-host", default="", metavar="NAME",
                    help="the name or address peers reach this host at (default: --host, or the host name "
                         "when binding 0.0.0.0)")
    ap.add_argument("--node", default=env("HETPIPE_NODE", socket.gethostname()),
                    help="this host's node name in plans and messages (default: the host name)")
    ap.add_argument("--output-root", default=env("HETPIPE_OUTPUT_ROOT", "runs"), metavar="DIR",
                    help="logs, shard checkpoints and traces (output.trace) go here (default ./runs)")
    ap.add_argument("--insecure", action="store_true", default=env("HETPIPE_INSECURE", "") == "1",
                    help="bind beyond loopback without --token-file")
    security.add_flags(ap)


def config(ns: argparse.Namespace) -> WorkerConfig:
    """The flags as a WorkerConfig; ConfigError naming the flag that is wrong."""
    gpus: tuple[int, ...] | None = None
    if ns.gpus is not None:
        try:
            gpus = () if ns.gpus == "none" else tuple(int(g) for g in ns.gpus.split(","))
        except ValueError:
            raise ConfigError(f"--gpus {ns.gpus}: expected device indices such as 0,1, or none") from None
        if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise ConfigError(f"--gpus {ns.gpus}: expected distinct device indices >= 0")
    if ns.emulate and ns.emulate not in catalog.CATALOG:
        raise ConfigError(f"--emulate {ns.emulate}: expected one of {', '.join(catalog.CATALOG)}")
    if ns.count is not None and not ns.emulate:
        raise ConfigError("--count: only with --emulate TYPE (with real GPUs, --gpus says which)")
    if ns.count is not None and ns.count < 0 or ns.shards < 0:
        raise ConfigError("--count and --shards: expected numbers >= 0")
    if ":" not in ns.coordinator:
        raise ConfigError(f"--coordinator {ns.coordinator}: expected HOST:PORT")
    if not NODE.fullmatch(ns.node):
        raise ConfigError(f"--node {ns.node[:64]!r}: expected a host name: letters, digits, '.', '-' and '_', "
                          "at most 253 of them, not starting with '.' or '-'")
    return WorkerConfig(coordinator=ns.coordinator, gpus=gpus, emulate=ns.emulate or "",
                        count=1 if ns.count is None else ns.count, shards=ns.shards, host=ns.host,
                        advertise_host=ns.advertise_host, node=ns.node, output_root=ns.output_root,
                        security=security.from_namespace(ns), insecure=ns.insecure)


def stage_devices(cfg: WorkerConfig) -> list[StageDevice]:
    """One entry per stage worker to start: emulated ones see no GPU; a real GPU is the one device
    its worker sees (CUDA_VISIBLE_DEVICES), registered as the catalog type of its name and memory."""
    if cfg.emulate:
        return [StageDevice(f"{cfg.emulate} (emulated on the CPU)", cfg.emulate, {CUDA_ENV: ""})] * cfg.count
    with interrupts_held():
        import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.gpus is None and count == 0:
        return [StageDevice("cpu (no GPU type: planned as the coordinator's own kind of device)", "", {CUDA_ENV: ""})]
    wanted = list(range(count)) if cfg.gpus is None else list(cfg.gpus)
    if any(g >= count for g in wanted):
        raise ConfigError(f"--gpus {','.join(map(str, wanted))}: this host has {count} visible CUDA devices")
    # Indices are this process's view; a child's CUDA_VISIBLE_DEVICES names the system's.
    visible = os.environ.get(CUDA_ENV, "").split(",") if os.environ.get(CUDA_ENV) else [str(i) for i in range(count)]
    out = []
    for g in wanted:
        props = torch.cuda.get_device_properties(g)
        gpu = catalog.match(props.name, int(props.total_memory)) or ""
        label = f"GPU {g}: {props.name}" + ("" if gpu else " (not in the catalog: registered without a GPU type)")
        out.append(StageDevice(label, gpu, {CUDA_ENV: visible[g]}))
    return out


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _refusal(p: Process) -> str:
    """The coordinator's refusal as the process logged it (registration.py), else its exit."""
    said = [line for line in p.log_tail(40).splitlines() if "refused this process" in line]
    return said[-1].split(" ERROR ", 1)[-1].removesuffix("; exiting") if said else f"{p.exit_description()} (refused by its coordinator)"


@dataclass
class Launcher:
    """The children of one `hetpipe worker`: a LocalProcesses per device (each its own environment)
    and one for the shards."""

    cfg: WorkerConfig
    root: Path
    groups: list[LocalProcesses] = field(default_factory=list)
    shard_dirs: dict[str, Path] = field(default_factory=dict)   # a shard's name -> its checkpoint folder
    stopping: dict[int, float] = field(default_factory=dict)    # pids this launcher asked to stop, and when

    @property
    def advertise_host(self) -> str:
        return self.cfg.advertise_host or (socket.gethostname() if self.cfg.host in ANY_ADDRESS else "")

    def registration(self) -> list[str]:
        cfg = self.cfg
        return ["--coordinator", cfg.coordinator, "--node", cfg.node, "--output-root", str(self.root),
                *(["--insecure"] if cfg.insecure else []),
                # SECURITY: this host's TLS files and cluster token, forwarded to every child.
                *security.child_args(cfg.security)]

    def _spawn(self, procs: LocalProcesses, module: str, name: str, extra: list[str]) -> Process:
        """With an advertised name, the port must be known before the process binds it."""
        if not self.advertise_host:
            return procs.spawn(module, name, extra)
        port = _free_port(self.cfg.host)
        return procs.spawn(module, name, [*extra, "--advertise", f"{self.advertise_host}:{port}"], port=port)

    def start(self, stages: list[StageDevice]) -> None:
        log_dir = self.root / "logs" / self.cfg.node
        on_gpu = sum(bool(d.env.get(CUDA_ENV)) for d in stages)
        stage_threads, shard_threads = threads.thread_split(len(stages) - on_gpu, on_gpu, self.cfg.shards)
        for i, d in enumerate(stages):
            procs = LocalProcesses(log_dir, host=self.cfg.host, env={**d.env, threads.THREADS_ENV: stage_threads})
            self.groups.append(procs)
            self._spawn(procs, "stage_worker", f"stage worker {i}",
                        [*self.registration(), *(["--gpu-type", d.gpu_type] if d.gpu_type else [])])
        if self.cfg.shards:
            procs = LocalProcesses(log_dir, host=self.cfg.host, env={CUDA_ENV: "", threads.PS_THREADS_ENV: shard_threads})
            self.groups.append(procs)
            for i in range(self.cfg.shards):
                checkpoints = self.root / "ps" / self.cfg.node / f"shard{i}"
                shutil.rmtree(checkpoints, ignore_errors=True)  # an earlier launch's job is gone
                self.shard_dirs[f"ps shard {i}"] = checkpoints
                self._spawn(procs, "ps_server", f"ps shard {i}",
                            [*self.registration(), "--checkpoint-dir", str(checkpoints)])
        for procs in self.groups:
            procs.wait_ready(notice=lambda text: print(f"hetpipe worker: {text}", file=sys.stderr))

    def processes(self) -> list[tuple[LocalProcesses, Process]]:
        return [(g, p) for g in self.groups for p in g.processes]

    def check(self) -> None:
        """Starts a fresh process for one that served a job, restarts a dead shard from its
        checkpoint; JobFailed for a stage worker that died (or a shard that keeps dying)."""
        for group, p in self.processes():
            code = p.popen.poll()
            if code is None:
                continue
            asked = self.stopping.pop(p.popen.pid, None) is not None
            if code == EXIT_ORPHANED:   # its coordinator restarted, or was unreachable, while it served a job
                print(f"hetpipe worker: {p.name} left the job its coordinator no longer runs (restarted or "
                      "unreachable); starting it again", file=sys.stderr)
                # A shard discarded that job's state if the coordinator said it ended; else its
                # registration asks (RegisterReply.job_unknown).
                group.restart(p, fresh=True)
            elif code == EXIT_REFUSED:  # its registration or token: starting it again changes nothing
                raise JobFailed(f"{p.name} at {p.address}: {_refusal(p)}; log {p.log_path}")
            elif p.module == "stage_worker":
                if code != 0:
                    raise JobFailed(f"{p.name} at {p.address} {p.exit_description()}; log {p.log_path}")
                group.restart(p, fresh=True)  # stopped at the end of a job: a fresh one, for the next
            elif code == 0 and asked:
                shutil.rmtree(self.shard_dirs[p.name], ignore_errors=True)  # that job's state: the next starts afresh
                group.restart(p, fresh=True)   # its restarts are counted per job
            elif p.restarts < MAX_SHARD_RESTARTS:
                print(f"hetpipe worker: {p.name} {p.exit_description()}; restarting it from its checkpoint",
                      file=sys.stderr)
                group.restart(p)
            else:
                raise JobFailed(f"{p.name} at {p.address} {p.exit_description()} {p.restarts + 1} times; "
                                f"log {p.log_path}")

    def stop_spent(self, stub: rpc.Stub) -> None:
        """Asks the processes that served a job to stop (check() then starts fresh ones): a shard
        holds that job's clocks, and the coordinator never claims such a process again."""
        spent = {(e.info.address, e.info.name) for e in stub.ListWorkers(wire_pb2.Empty(),
                                                                         timeout=rpc.CONTROL_DEADLINE_S).workers
                 if e.spent}
        now = time.monotonic()
        for _, p in self.processes():
            if p.popen.poll() is not None:
                continue
            asked = self.stopping.get(p.popen.pid)
            if asked is None and (p.address, f"pid {p.popen.pid}") in spent:
                self.stopping[p.popen.pid] = now
                p.popen.terminate()
            elif asked is not None and now - asked > SPENT_KILL_S:   # it ignores SIGTERM, and keeps its port
                print(f"hetpipe worker: {p.name} did not stop within {SPENT_KILL_S:g}s of SIGTERM; killing it",
                      file=sys.stderr)
                p.popen.kill()

    def stop_all(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """sig to every process at once, SIGKILL to what is left after one grace (each may take its
        leave's deadline to tell the coordinator it goes, registration.LEAVE_DEADLINE_S, which
        group after group would add up), then each group's clean-up."""
        children.stop([p for _, p in self.processes()], sig=sig)
        for group in self.groups:   # nothing left to stop: each group's clean-up
            group.stop_all(sig=sig)

    def listing(self, stages: list[StageDevice]) -> str:
        lines = []
        for _, p in self.processes():
            if p.module == "stage_worker":
                what = stages[int(p.name.rsplit(" ", 1)[1])].label
            else:
                what = f"checkpoints in {self.shard_dirs[p.name]}"
            lines.append(f"  {p.name:<16}{p.address:<24}{what}; log {p.log_path}")
        return "\n".join(lines)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def check_reachable(cfg: WorkerConfig, advertise_host: str) -> None:
    """Refuses what cannot work or would be open to anyone, before anything starts."""
    coordinator_host = cfg.coordinator.rsplit(":", 1)[0].strip("[]")
    reached_at = advertise_host or cfg.host
    if loopback(reached_at) and not loopback(coordinator_host):
        raise ConfigError(f"--host {cfg.host}: the workers would be reachable from this host only, but the "
                          f"coordinator is at {cfg.coordinator}: bind an address the other hosts reach (--host), "
                          "or 0.0.0.0 with --advertise-host")
    if not loopback(cfg.host) and not cfg.security.token_file and not cfg.insecure:
        raise ConfigError(f"--host {cfg.host} without --token-file would let anyone who reaches the ports read the "
                          "model and stop the job: give --token-file (and --tls-cert/--tls-key/--tls-ca), or --insecure")


def hold_node(root: Path, node: str) -> IO[str]:
    """The lock of node's folders under root (its logs, its shards' checkpoints), held by this
    launcher until the returned file is closed; ConfigError naming the pid of another `hetpipe
    worker` that holds it: starting, it would clear that one's live shard checkpoints and share its
    log files. The kernel drops the lock with its process, even a killed one."""
    lock, holder = outputs.pid_lock(root / "logs" / node / WORKER_LOCK)
    if lock is None:
        raise ConfigError(f"--node {node}: another hetpipe worker (pid {holder}) serves this node from --output-root "
                          f"{root} (its logs and shard checkpoints): give this one another --node or --output-root")
    outputs.hold_pid(lock)
    return lock


def serve(cfg: WorkerConfig) -> int:
    """Starts the workers, prints what it started, and watches them until SIGTERM or Ctrl-C; 0
    when stopped by SIGTERM, 130 by Ctrl-C, 1 when a stage worker died."""
    stages = [] if cfg.gpus == () else stage_devices(cfg)
    if not stages and not cfg.shards:
        raise ConfigError("nothing to serve: no stage worker (--gpus none, or --count 0) and no --shards")
    root = Path(cfg.output_root).absolute()
    try:
        (root / "trace").mkdir(parents=True, exist_ok=True)
        (root / "logs" / cfg.node).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--output-root {cfg.output_root}: cannot make its folders: {exc.strerror}: "
                          f"{exc.filename}") from None
    launcher = Launcher(cfg, root)
    check_reachable(cfg, launcher.advertise_host)
    try:
        security.use(cfg.security, security.COORDINATOR, f"worker {cfg.node}")
    except security.SecurityError as exc:
        raise ConfigError(str(exc)) from None
    # The children run in the output root: the coordinator names a job's trace files relative to it.
    sys.path[:] = [os.path.abspath(p) for p in sys.path]
    os.chdir(root)
    processes.warm_up()
    before = {sig: signal.getsignal(sig) for sig in HELD}
    # SIGTERM, and SIGHUP (a closed terminal): the stop that a scheduler's cancel is; nohup's
    # ignored SIGHUP stays ignored.
    for sig in not_ignored(INTERRUPTING):
        signal.signal(sig, _on_sigterm)
    # The signal that stops us, passed on: a stage tells the coordinator which (a Ctrl-C at the
    # terminal reaches the stages too, but may do so after a SIGTERM from us would).
    stop_with = signal.SIGTERM
    lock: IO[str] | None = None
    try:
        lock = hold_node(root, cfg.node)   # before start() clears this node's shard checkpoints
        launcher.start(stages)
        print(f"hetpipe worker: node {cfg.node} serving for coordinator {cfg.coordinator}; output root {root}\n"
              f"{launcher.listing(stages)}\nserving until Ctrl-C or SIGTERM", file=sys.stderr)
        return _watch(launcher)
    except JobFailed as exc:
        print(f"hetpipe worker: error: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        print("hetpipe worker: SIGTERM; stopped every process", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        stop_with = signal.SIGINT
        print("hetpipe worker: interrupted; stopped every process", file=sys.stderr)
        return 130
    finally:
        for sig in HELD:   # a repeat (a second Ctrl-C, a supervisor's SIGTERM) must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        try:
            launcher.stop_all(stop_with)
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
            if lock is not None:   # once its processes are gone
                lock.close()


def _watch(launcher: Launcher) -> int:
    unreachable = False
    asked = 0.0
    with rpc.channel(launcher.cfg.coordinator) as channel:
        stub = rpc.Stub(channel, "Coordinator")
        while True:
            launcher.check()
            if time.monotonic() - asked > REGISTRY_POLL_S:
                asked = time.monotonic()
                try:
                    launcher.stop_spent(stub)
                    if unreachable:
                        print(f"hetpipe worker: coordinator {launcher.cfg.coordinator} answers again", file=sys.stderr)
                    unreachable = False
                except grpc.RpcError as exc:
                    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                        # Not an outage: retrying the same credentials would wait forever.
                        raise JobFailed(f"coordinator {launcher.cfg.coordinator} refused this worker's credentials "
                                        f"({exc.code().name}: {exc.details()}){TOKEN_HINT}") from None
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        raise JobFailed(f"coordinator {launcher.cfg.coordinator}: {reach.failure(exc)} "
                                        f"({NO_COORDINATOR}); give --coordinator the address `hetpipe "
                                        "coordinator` serves on") from None
                    if reach.handshake_failed(exc):
                        raise JobFailed(f"coordinator {reach.unreachable(launcher.cfg.coordinator, exc)} "
                                        f"({exc.details()})") from None
                    if not unreachable:
                        print(f"hetpipe worker: coordinator {reach.unreachable(launcher.cfg.coordinator, exc)}; "
                              "the workers keep trying to register", file=sys.stderr)
                    unreachable = True
            time.sleep(POLL_S)
