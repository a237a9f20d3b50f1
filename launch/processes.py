"""Starts service processes on this machine and guarantees that none outlives the launcher."""

from __future__ import annotations

import atexit
import fcntl
import multiprocessing.util
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from hetpipe import children, shm
from hetpipe.children import Child
from hetpipe.errors import JobFailed
from launch.interrupts import interrupts_held

# A shard that dies is restarted from its checkpoint and push log this many times in a job; the next
# death fails the job (a local run and `hetpipe worker` alike).
MAX_SHARD_RESTARTS = 3


@dataclass
class Process(Child):
    """A service process (python -m MODULE): its arguments, and the address it published."""

    ready_file: Path = Path()
    args: list[str] = field(default_factory=list)
    address: str = ""
    metrics_port: int = 0
    restarts: int = 0

    @property
    def module(self) -> str:
        return self.args[self.args.index("-m") + 1]


class RunDir:
    """A launcher's scratch folder (its workers' ready files), locked for as long as the launcher
    lives. sweep() removes the folders of launchers that died without cleaning up (kill -9), with
    the folder multiprocessing made for their fork server, which outlives them the same way."""

    PREFIX = "hetpipe-run-"
    _LOCK = "owner.lock"
    _FORKSERVER_DIR = "forkserver_dir"

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=self.PREFIX))
        # Locked under another name, then renamed: sweep() never finds the lock file unlocked.
        making = self.path / f"{self._LOCK}.new"
        self._fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(making, self.path / self._LOCK)
        (self.path / self._FORKSERVER_DIR).write_text(multiprocessing.util.get_temp_dir())

    def cleanup(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1

    @classmethod
    def sweep(cls) -> list[str]:
        """Removes every run folder whose launcher has ended (nobody holds its lock); returns them."""
        removed = []
        root = Path(tempfile.gettempdir())
        for path in root.glob(f"{cls.PREFIX}*"):
            try:
                if path.lstat().st_uid != os.getuid():
                    continue   # another user's: it could name one of our fork servers' folders as its own
                fd = os.open(path / cls._LOCK, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # not a run folder, or one still being made
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its launcher lives
            finally:
                os.close(fd)
            try:
                forkserver = Path((path / cls._FORKSERVER_DIR).read_text())
            except OSError:
                forkserver = Path()
            if forkserver.parent == root and re.fullmatch(r"pymp-\w+", forkserver.name):
                shutil.rmtree(forkserver, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        return removed


_LAUNCHER: RunDir | None = None   # warm_up's record of this process's fork server, for its lifetime


def warm_up() -> None:
    """Starts the fork server now (children.warm_up), once its folder is recorded in a run folder
    this process holds until it exits: a launcher killed from here on, before any worker started,
    leaves nothing that the next launcher's sweep does not remove."""
    global _LAUNCHER
    if _LAUNCHER is None:
        shm.sweep()
        RunDir.sweep()
        _LAUNCHER = RunDir()
        atexit.register(_LAUNCHER.cleanup)
    children.warm_up()


@dataclass
class LocalProcesses:
    """A set of service processes on loopback, each with its own log file."""

    log_dir: Path
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # What an earlier run on this host left when it was killed whole (kill -9 of its group).
        shm.sweep()
        RunDir.sweep()
        self._run_dir = RunDir()

    def spawn(self, module: str, name: str, extra: list[str] | None = None, *, port: int = 0) -> Process:
        """Starts `python -m module` on port (0: any free one; a fixed one when it must be known
        beforehand, as for --advertise)."""
        slug = name.replace(" ", "_")
        ready = self._run_dir.path / f"{slug}.ready"
        log_path = self.log_dir / f"{slug}.log"
        args = [sys.executable, "-m", module, "--host", self.host, "--metrics-port", "0",
                "--ready-file", str(ready), "--exit-with-parent", *(extra or [])]
        # Whole: a child started but not listed would never be stopped, and multiprocessing's exit
        # handler would wait for it (as it waits for its launcher) for good. An interrupt waits.
        with interrupts_held():
            proc = Process(name, children.start([*args, "--port", str(port)], log_path, env=self._environment()),
                           log_path, ready, args)
            self.processes.append(proc)
        return proc

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def restart(self, proc: Process, timeout: float = 60.0, *, fresh: bool = False) -> None:
        """Starts a dead process again on the same port, so its peers reconnect to it; fresh: one
        that ended as asked, replaced for the next job, which does not count as a restart."""
        proc.ready_file.unlink(missing_ok=True)
        shm.sweep()  # what the dead process left in /dev/shm
        port = proc.address.rsplit(":", 1)[1]
        with interrupts_held():   # as in spawn: the new process recorded before an interrupt comes
            proc.popen = children.start([*proc.args, "--port", port], proc.log_path, env=self._environment(),
                                        append=True)
        proc.restarts = 0 if fresh else proc.restarts + 1
        deadline = time.monotonic() + timeout
        while not proc.ready_file.exists():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise JobFailed(f"{proc.name} did not come back: it {proc.exit_description()}; log {proc.log_path}")
            time.sleep(0.02)
        proc.metrics_port = int(proc.ready_file.read_text().split()[1])  # a fresh one (--metrics-port 0)

    def wait_ready(self, timeout: float = 120.0, notice: Callable[[str], None] | None = None,
                   every: float = 15.0) -> None:
        """Waits until every spawned process has published its address; tells `notice` every
        `every` seconds which ones it still waits for (a slow torch import on a loaded host)."""
        start = time.monotonic()
        deadline, next_notice = start + timeout, start + every
        for proc in self.processes:
            while not proc.ready_file.exists():
                if proc.popen.poll() is not None:
                    raise JobFailed(
                        f"{proc.name} {proc.exit_description()} before serving; log {proc.log_path}:\n{proc.log_tail()}"
                    )
                now = time.monotonic()
                if now > deadline:
                    raise JobFailed(f"{proc.name} did not start serving within {timeout:.0f}s; log {proc.log_path}")
                if notice is not None and now >= next_notice:
                    waiting = [p.name for p in self.processes if not p.ready_file.exists()]
                    notice(f"waiting for {', '.join(waiting)} to start serving ({now - start:.0f}s of "
                           f"{timeout:.0f}; logs in {self.log_dir})")
                    next_notice = now + every
                time.sleep(0.02)
            address, metrics = proc.ready_file.read_text().split()
            proc.address, proc.metrics_port = address, int(metrics)

    def kill(self, address: str) -> str:
        """SIGKILL to the process serving address (a hung one: SIGTERM would wait for it);
        returns its name and pid."""
        for p in self.processes:
            if p.address == address and p.popen.poll() is None:
                p.popen.kill()
                return f"{p.name} (pid {p.popen.pid})"
        return f"no live process at {address}"

    def dead(self) -> list[Process]:
        return [p for p in self.processes if p.popen.poll() is not None]

    def stop_all(self, grace: float = 3.0, sig: signal.Signals = signal.SIGTERM) -> None:
        """sig (SIGTERM), then SIGKILL whatever is still alive after grace seconds. Whole: an
        interrupt that comes meanwhile (a Ctrl-C as a run that ended stops its processes) is raised
        once it is done; raised inside, it skipped the SIGKILL of a process that did not stop, and
        the launcher then waited for it at exit (multiprocessing joins its children) for good."""
        with interrupts_held():
            children.stop(self.processes, grace, sig)
            # A process that was killed (or crashed) could not remove its shared-memory segments.
            shm.sweep()
            self._run_dir.cleanup()

    def __enter__(self) -> LocalProcesses:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()
