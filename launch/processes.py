"""Starts service processes on this machine and guarantees that none outlives the launcher."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from hetpipe import children, shm
from hetpipe.children import Child
from hetpipe.errors import JobFailed


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


@dataclass
class LocalProcesses:
    """A set of service processes on loopback, each with its own log file."""

    log_dir: Path
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="hetpipe-")
        shm.sweep()  # what an earlier run on this host left when it was killed whole (kill -9 of its group)

    def spawn(self, module: str, name: str, extra: list[str] | None = None, *, port: int = 0) -> Process:
        """Starts `python -m module` on port (0: any free one; a fixed one when it must be known
        beforehand, as for --advertise)."""
        slug = name.replace(" ", "_")
        ready = Path(self._tmp.name) / f"{slug}.ready"
        log_path = self.log_dir / f"{slug}.log"
        args = [sys.executable, "-m", module, "--host", self.host, "--metrics-port", "0",
                "--ready-file", str(ready), "--exit-with-parent", *(extra or [])]
        proc = Process(name, children.start([*args, "--port", str(port)], log_path, env=self._environment()), log_path,
                       ready, args)
        self.processes.append(proc)
        return proc

    def _environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def restart(self, proc: Process, timeout: float = 60.0) -> None:
        """Starts a dead process again on the same port, so its peers reconnect to it."""
        proc.ready_file.unlink(missing_ok=True)
        shm.sweep()  # what the dead process left in /dev/shm
        port = proc.address.rsplit(":", 1)[1]
        proc.popen = children.start([*proc.args, "--port", port], proc.log_path, env=self._environment(),
                                    append=True)
        proc.restarts += 1
        deadline = time.monotonic() + timeout
        while not proc.ready_file.exists():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise JobFailed(f"{proc.name} did not come back: it {proc.exit_description()}; log {proc.log_path}")
            time.sleep(0.02)
        proc.metrics_port = int(proc.ready_file.read_text().split()[1])  # a fresh one (--metrics-port 0)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Waits until every spawned process has published its address."""
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            while not proc.ready_file.exists():
                if proc.popen.poll() is not None:
                    raise JobFailed(
                        f"{proc.name} {proc.exit_description()} before serving; log {proc.log_path}:\n{proc.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise JobFailed(f"{proc.name} did not start serving within {timeout:.0f}s; log {proc.log_path}")
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

    def stop_all(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL whatever is still alive after grace seconds."""
        children.stop(self.processes, grace)
        # A process that was killed (or crashed) could not remove its shared-memory segments.
        shm.sweep()
        self._tmp.cleanup()

    def __enter__(self) -> LocalProcesses:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()
