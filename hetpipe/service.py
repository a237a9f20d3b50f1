"""What every service process shares: its common flags, and serving with registration."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hetpipe import children, metrics, outputs, rpc, security, shm
from hetpipe.registration import Registration, keep_registered
from hetpipe.security import Security
from hetpipe.v1 import coordinator_pb2

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters
# A worker's exit when its coordinator restarted and lost the job it served (EX_TEMPFAIL): not a
# failure, and its launcher starts a fresh process in its place.
EXIT_ORPHANED = 75
# A worker's exit when its coordinator refused its registration or credentials (EX_CONFIG): asking
# again cannot change that, and its launcher reports the failure.
EXIT_REFUSED = 78


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceFlags:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    ready_file: str = ""         # written with "host:port metrics_port" once serving
    exit_with_parent: bool = False
    coordinator: str = ""        # host:port to register with; empty = driven directly
    advertise: str = ""          # address peers should use; default host:port
    node: str = ""               # the host name the coordinator matches plans against
    gpu_type: str = ""           # catalog type this worker stands for; empty = generic
    health_port: int = 0         # plaintext health-only gRPC port for probes; 0 = none
    security: Security = Security()
    insecure: bool = False       # allow binding beyond loopback without a token
    output_root: str = "."       # where paths received over the network may point


def env_number(ap: argparse.ArgumentParser, name: str, default: str, kind: type[int] | type[float]) -> int | float:
    """A numeric flag's default from the environment variable `name`: a value that does not parse
    is a usage error naming the variable (int() would end the process in a traceback naming neither)."""
    value = os.environ.get(name, default)
    try:
        return kind(value)
    except ValueError:
        ap.error(f"${name} is {value!r}: expected {'an integer' if kind is int else 'a number'}")


def add_service_flags(ap: argparse.ArgumentParser, *, default_port: int = 0, worker: bool = True) -> None:
    """Flags of every service; `worker` adds those of processes that register with a coordinator."""
    env = os.environ.get
    ap.add_argument("--host", default=env("HETPIPE_HOST", "127.0.0.1"), help="address to bind")
    ap.add_argument("--port", type=int, default=env_number(ap, "HETPIPE_PORT", str(default_port), int),
                    help=f"gRPC port (0 = any free port; default {default_port})")
    ap.add_argument("--metrics-port", type=int, default=env_number(ap, "HETPIPE_METRICS_PORT", "0", int),
                    help="Prometheus port (0 = any free port)")
    ap.add_argument("--ready-file", default=env("HETPIPE_READY_FILE", ""), help="write host:port here when serving")
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process dies")
    ap.add_argument("--health-port", type=int, default=env_number(ap, "HETPIPE_HEALTH_PORT", "0", int),
                    help="also serve gRPC health alone, in plaintext, on this port (probes); 0 = no")
    ap.add_argument("--insecure", action="store_true", default=env("HETPIPE_INSECURE", "") == "1",
                    help="allow serving beyond loopback without --token-file: anyone who reaches the port "
                         "can read the model and stop the job")
    ap.add_argument("--output-root", default=env("HETPIPE_OUTPUT_ROOT", "."),
                    help="paths that arrive over the network (a stage's trace and checkpoint folder, a submitted "
                         "job's output.dir) must lie inside this folder (default: $HETPIPE_OUTPUT_ROOT, else the "
                         "working folder" + (")" if worker else ", or ./runs under `hetpipe coordinator`)"))
    security.add_flags(ap)
    if not worker:
        ap.set_defaults(coordinator="", advertise="", node="", gpu_type="")
        return
    ap.add_argument("--coordinator", default=env("HETPIPE_COORDINATOR", ""), help="coordinator host:port to register with")
    ap.add_argument("--advertise", default=env("HETPIPE_ADVERTISE", ""), help="host:port peers reach us at")
    ap.add_argument("--node", default=env("HETPIPE_NODE", socket.gethostname()), help="node name for planning")
    ap.add_argument("--gpu-type", default=env("HETPIPE_GPU_TYPE", ""), help="catalog GPU type this worker is")


def service_flags(ns: argparse.Namespace) -> ServiceFlags:
    return ServiceFlags(host=ns.host, port=ns.port, metrics_port=ns.metrics_port, ready_file=ns.ready_file,
                        exit_with_parent=ns.exit_with_parent, coordinator=ns.coordinator, advertise=ns.advertise,
                        node=ns.node, gpu_type=ns.gpu_type, health_port=ns.health_port,
                        security=security.from_namespace(ns), insecure=ns.insecure,
                        output_root=ns.output_root)


def loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def secure(flags: ServiceFlags, role: str) -> None:
    """Makes flags' security this process's (before its server is built), presenting role's token.
    Raises SecurityError for unusable settings, and for a server that would accept anyone beyond
    loopback: without a token, binding another address needs --insecure."""
    if not flags.security.token_file and not loopback(flags.host) and not flags.insecure:
        raise security.SecurityError(
            f"--host {flags.host} without --token-file would let anyone who reaches the port read the model "
            "and stop the job: give --token-file (and --tls-cert/--tls-key/--tls-ca), or --insecure")
    security.use(flags.security, role, flags.advertise or f"{flags.node or 'host'}-{os.getpid()}")


def run_server(
    flags: ServiceFlags, server: rpc.Server, shutdown: Callable[[], None], *,
    role: coordinator_pb2.WorkerInfo.Role | None,
    device: str = "cpu", memory_bytes: int = 0, holds_job: Callable[[], bool] = lambda: False,
    on_orphaned: Callable[[bool], None] = lambda job_ended: None,
) -> int:
    """Starts server and metrics, handles signals and orphaning, registers, and blocks until
    stopped. Returns the exit code: EXIT_ORPHANED when the coordinator that gave this process
    its job restarted (holds_job: whether it has one; on_orphaned(job_ended), as
    keep_registered calls it, runs before shutdown() then), EXIT_REFUSED when it refused this
    process, else 0."""
    raise_open_files_limit()
    metrics_port = metrics.serve(flags.metrics_port, flags.host)  # where --host says, as gRPC
    server.start()
    registration: list[Registration] = []   # once registered: told of a signal before the server stops

    def signalled(signum: signal.Signals) -> None:
        for r in registration:
            r.leave(f"stopped by {signum.name}")

    server.stop_on_signals(shutdown, before=signalled)
    if flags.exit_with_parent:
        children.exit_with_parent(children.launcher_pid(), shutdown)
    address = flags.advertise or server.address
    what = "coordinator" if role is None else coordinator_pb2.WorkerInfo.Role.Name(role).lower()
    logging.info("%s serving on %s (metrics :%d)", what, address, metrics_port)
    stopped, orphaned, refused = threading.Event(), threading.Event(), threading.Event()

    def leave(job_ended: bool) -> None:
        orphaned.set()
        on_orphaned(job_ended)
        shutdown()

    def refuse(why: str) -> None:
        refused.set()
        shutdown()

    if flags.coordinator and role is not None:
        info = coordinator_pb2.WorkerInfo(
            role=role, address=address, node=flags.node, device=device, gpu_type=flags.gpu_type,
            memory_bytes=memory_bytes, metrics_port=metrics_port, name=f"pid {os.getpid()}",
            host_id=shm.host_id(),
        )
        registration.append(keep_registered(flags.coordinator, info, stopped, holds_job=holds_job, on_orphaned=leave,
                                             on_refused=refuse))
    if flags.ready_file:
        # Atomically: a launcher that asked for port 0 polls for it and must never read half.
        outputs.write_atomically(flags.ready_file, lambda tmp: tmp.write_text(f"{address} {metrics_port}"))
    server.wait()
    stopped.set()
    if refused.is_set():
        return EXIT_REFUSED
    return EXIT_ORPHANED if orphaned.is_set() else 0


# A soft limit raised no higher than this where the hard one is unlimited (Linux refuses more
# than fs.nr_open, 1048576 by default).
MAX_OPEN_FILES = 1 << 20


def raise_open_files_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit; returns the soft limit.

    Every shared-memory segment a process keeps mapped holds a descriptor: a reader keeps up to
    256 mappings (a shard reading the chunks of several VWs' large pushes, a stage its two
    neighbours'), and a sender's segment holds two. A stage with both readers full and rings of
    GiB bundles passes 1024, the common soft default, and would fail to map a segment."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # a limit the kernel will not grant: keep the one we have
            pass
    return soft


def return_large_buffers() -> None:
    """Large freed buffers go back to the system at once (glibc: a fixed 128 KiB mmap threshold),
    and all threads share two heaps. Call before any thread starts.

    By default glibc raises the threshold to the largest buffer freed so far, and from then on
    keeps such buffers in each thread's heap; and it gives each thread an arena of its own, each
    keeping what it freed. A control-plane server that once read a few 1 MiB requests on its 16
    threads kept 10-15 MB for good (2-4 MB with these settings). Only for processes that do no
    tensor compute: there, every large tensor would pay an mmap and its page faults."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)
        libc.mallopt(M_ARENA_MAX, 2)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def exit_now(code: int = 0) -> None:
    """Everything is flushed and closed; interpreter teardown of torch and gRPC only adds seconds."""
    shm.unlink_owned()
    # os._exit runs no finalizer: DataLoader workers a stage left open (a failed load, a stop that
    # came mid-read) would outlive it, and their semaphores stay in /dev/shm. Only a process that
    # read data has hetpipe.data loaded; importing it here would load torch into the coordinator.
    data = sys.modules.get("hetpipe.data")
    if data is not None:
        data.close_all()
    ipc = sys.modules.get("hetpipe.cuda_ipc")   # a GPU stage that sent by CUDA IPC: torch's counter files
    if ipc is not None:
        ipc.unlink_counters()
    logging.shutdown()
    os._exit(code)
