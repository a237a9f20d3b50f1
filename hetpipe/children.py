"""Child processes of a launcher: start one with its own log, describe its exit, stop them all.

A service process (`python -m MODULE`) is forked from a fork server that has already imported
torch and gRPC's modules (multiprocessing's forkserver): each one then starts in a fraction of a
second instead of paying those imports again. The server itself is a fresh interpreter that never
creates a gRPC object, so nothing that cannot survive fork() is ever forked.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)
LAUNCHER_PID_ENV = "HETPIPE_LAUNCHER_PID"  # whose death ends a service process (launcher_pid)
# Set when the launcher ignores SIGINT (a script's background job, nohup): a Ctrl-C at that
# terminal is not for its services either. They cannot tell by themselves: the fork server they
# come from ignores SIGINT whatever the launcher does.
SIGINT_IGNORED_ENV = "HETPIPE_SIGINT_IGNORED"

# The libraries every service imports. autograd.grad imports symbolic_shapes (and sympy, 0.4 s) on
# its first call with grad_outputs: preloaded, no stage pays it inside its first backward. gRPC's
# modules only import: gRPC starts its threads when its first channel or server is made, in the
# worker, after the fork. Not this project's own packages: the fork server imports from its own
# sys.path, and a worker must take them from its launcher's (another checkout, say).
PRELOAD = ["torch", "torch.fx.experimental.symbolic_shapes", "numpy", "yaml", "psutil", "grpc",
           "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "prometheus_client", "setproctitle"]


FORK_SERVER_GONE = 255   # multiprocessing's exit code for a child whose fork server died


def running(pid: int) -> bool:
    """Whether process pid lives (a zombie has exited)."""
    return found(pid) is not None


class Forked:
    """A process forked from the fork server, with the subprocess.Popen calls the launchers use."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.args: list[str] = []
        self._process_found = found(process.pid)

    @property
    def returncode(self) -> int | None:
        code = self._process.exitcode
        if code == FORK_SERVER_GONE and still_runs(self._process_found):
            # multiprocessing says 255 for every child once the fork server is gone (killed, say),
            # whether or not the child is: it reads each exit code from the server. The same
            # start time, not merely the pid, says it is ours: another process may have that pid
            # by now, and a signal meant for our child would end it.
            return None
        return None if code is None else int(code)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._process.join(timeout)
        # Once the fork server is gone join returns at once, its pipe closed, for a child that
        # may live on (returncode None): poll that one until it ends or the time is up.
        while (code := self.returncode) is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:   # reaped by the fork server, its exit code not yet reported
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_module(module: str, argv: list[str], log_path: str, append: bool, env: dict[str, str], cwd: str,
                path: list[str]) -> None:
    """In the forked child: output to the log, the launcher's environment, then `python -m module`,
    under that name in ps and top (a forked child would otherwise show the fork server's command)."""
    from setproctitle import setproctitle

    setproctitle(" ".join([sys.executable, "-m", module, *argv]))
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def warm_up() -> None:
    """Starts the fork server now (it imports torch: about a second), so that it is ready by the
    time the first worker is started; a launcher calls it before its own set-up work."""
    _context()
    _ensure_server()


def _ensure_server() -> None:
    """The fork server, started without the current folder first on its sys.path, where its
    `python -c` would put it: a `yaml.py` in the folder `hetpipe run` runs in (a job's folder)
    would otherwise be the yaml it preloads for every service (PYTHONSAFEPATH, Python 3.11)."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    # Started with SIGINT ignored: it ignores SIGINT itself only once its preload (torch, a second
    # or more) is done, and a Ctrl-C at the terminal before then printed its traceback under our
    # one line. Blocked here meanwhile, so that a Ctrl-C is not lost to this process (Linux keeps a
    # blocked signal pending even while it is ignored). The services the server forks handle
    # SIGINT again (rpc.Server.stop_on_signals).
    main = threading.current_thread() is threading.main_thread()   # where signal.signal works
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        forkserver.ensure_running()
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if before is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = before


def start(args: list[str], log_path: Path, *, env: Mapping[str, str] | None = None,
          append: bool = False) -> Forked:
    """Starts `python -m MODULE ARGS...` (args as a shell would give them) forked from the fork
    server, with stdout and stderr in log_path, no stdin, and the given environment."""
    if len(args) < 3 or args[1] != "-m":
        raise ValueError(f"expected [python, '-m', module, ...], got {args[:3]}")
    context = _context()
    # The worker follows this process, not the fork server it is forked from (launcher_pid).
    environment = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())})
    environment.pop(SIGINT_IGNORED_ENV, None)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        environment[SIGINT_IGNORED_ENV] = "1"
    process = context.Process(
        target=_run_module, name=args[2],
        args=(args[2], args[3:], str(log_path), append, environment, os.getcwd(), list(sys.path)),
    )
    # multiprocessing has each child import the parent's main module first (the spawn rule). A
    # worker runs `python -m module`, not the launcher's program: it starts with a bare one.
    launcher_main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        _ensure_server()
        process.start()
    finally:
        sys.modules["__main__"] = launcher_main
    handle = Forked(process)
    handle.args = args
    return handle


@dataclass
class Child:
    """A started process and its log, named for messages (e.g. "stage worker 3", "rank 1 (...)")."""

    name: str
    popen: Forked
    log_path: Path

    def exit_description(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "is running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop(children: Iterable[Child], grace: float = 3.0, sig: signal.Signals = signal.SIGTERM) -> None:
    """sig (SIGTERM) to every live child, then SIGKILL what is still alive after grace seconds."""
    alive = [c for c in children if c.popen.poll() is None]
    for c in alive:
        c.popen.send_signal(sig)
        # A stopped child (SIGSTOP, a debugger) takes its SIGTERM only once continued: it would
        # wait out the grace and die by SIGKILL, its shared-memory segments left for the sweep.
        c.popen.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + grace
    for c in alive:
        try:
            c.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.popen.kill()
            c.popen.wait()


# ---- the child's side: follow the launcher ----------------------------------------------------------

def sigint_ignored() -> bool:
    """In a service: whether its launcher ignores SIGINT (SIGINT_IGNORED_ENV)."""
    return os.environ.get(SIGINT_IGNORED_ENV) == "1"


def launcher_pid() -> int:
    """The process whose death ends this one: the launcher that started it (hetpipe.children sets
    it: a forked worker's own parent is the fork server, which lives as long as its workers hold
    its pipe, so watching it would keep a killed launcher's workers alive for good), else the parent."""
    return int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())


def found(pid: int) -> psutil.Process | None:
    """The process pid, as it runs now; None where it is gone or a zombie."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process
    except psutil.Error:
        return None


def still_runs(process: psutil.Process | None) -> bool:
    """Whether the process found() found still runs, not another that took its pid since: psutil
    tells them apart by their start in ticks since boot, which a step of the clock (NTP, date -s)
    does not move, as it moves their start in wall time."""
    if process is None:
        return False
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wake_siblings() -> None:
    """SIGCONT to this process group: a sibling stopped with SIGSTOP cannot see the launcher go,
    and continued it does, and exits as this one does. The kernel does as much for a group that
    its launcher's death orphans within a terminal's session, but not for a launcher that leads
    its own session (setsid, a service manager), whose group it leaves stopped for good."""
    try:
        os.killpg(os.getpgrp(), signal.SIGCONT)
    except OSError:
        pass


def exit_with_parent(parent_pid: int, on_orphaned: Callable[[], None]) -> None:
    """Calls on_orphaned once parent_pid is gone, so a killed launcher leaves no orphans."""
    parent = found(parent_pid)

    def watch() -> None:
        while still_runs(parent):
            time.sleep(0.5)
        log.warning("launcher %d is gone: exiting", parent_pid)
        _wake_siblings()
        on_orphaned()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
