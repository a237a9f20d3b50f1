"""podman for the bring-up: every command under a hard timeout, logged, and the phases timed."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class BringupError(Exception):
    """A step failed: the message says which and shows the end of its output."""


class Skip(Exception):
    """This machine cannot run containers: the bring-up is skipped, not failed."""


@dataclass
class Timings:
    """Seconds per phase, in the order they ran."""

    phases: list[tuple[str, float]] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        print(f"==> {name}", flush=True)
        start = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            seconds = time.monotonic() - start
            self.phases.append((name, seconds))
            print(f"<== {name}: {seconds:.1f} s{'' if ok else ' (failed)'}", flush=True)

    def table(self) -> str:
        width = max((len(n) for n, _ in self.phases), default=5)
        rows = [f"  {n:<{width}}  {s:7.1f} s" for n, s in self.phases]
        return "\n".join(["phase timings:", *rows, f"  {'total':<{width}}  {sum(s for _, s in self.phases):7.1f} s"])


class Engine:
    """Runs podman (and podman-compose) with a deadline per command; appends all output to log."""

    def __init__(self, log: Path, podman: str = "podman") -> None:
        self.log = log
        self.podman = podman

    def run(self, argv: list[str], *, timeout: float, check: bool = True, cwd: Path | None = None,
            log_output: bool = True) -> subprocess.CompletedProcess[str]:
        with self.log.open("a") as out:
            out.write(f"\n$ {shlex.join(argv)}\n")
            out.flush()
            try:
                done = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                                      text=True, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                out.write(f"[timed out after {timeout:.0f} s]\n")
                raise BringupError(f"`{shlex.join(argv)}` took over {timeout:.0f} s") from exc
            out.write((done.stdout + done.stderr if log_output or done.returncode else "") + f"[exit {done.returncode}]\n")
        if check and done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
            raise BringupError(f"`{shlex.join(argv)}` exited {done.returncode}:\n{tail}")
        return done

    def podman_json(self, *args: str, timeout: float = 60) -> list[dict[str, Any]]:
        text = self.run([self.podman, *args, "--format", "json"], timeout=timeout, log_output=False).stdout.strip()
        return json.loads(text) if text else []

    def image_exists(self, image: str) -> bool:
        return self.run([self.podman, "image", "exists", image], timeout=60, check=False).returncode == 0

    def containers(self, project: str) -> list[dict[str, Any]]:
        return self.podman_json("ps", "-a", "--filter", f"label=io.podman.compose.project={project}")

    def leftovers(self, project: str, names: tuple[str, ...] = ()) -> list[str]:
        """What of the project is still there: its containers, pods, volumes and networks, found by
        compose's project label, and any pod, volume or network named in names."""
        label = f"label=io.podman.compose.project={project}"
        left = [f"container {c['Names'][0]} ({c['State']})" for c in self.containers(project)]
        left += [f"pod {p['Name']}" for p in self.podman_json("pod", "ps")
                 if p["Name"] in names or (p.get("Labels") or {}).get("io.podman.compose.project") == project]
        left += [f"volume {v['Name']}" for v in self.podman_json("volume", "ls", "--filter", label)]
        left += [f"volume {v['Name']}" for v in self.podman_json("volume", "ls")
                 if v["Name"] in names and f"volume {v['Name']}" not in left]
        left += [f"network {n['name']}" for n in self.podman_json("network", "ls")
                 if n["name"] in names or (n.get("labels") or {}).get("io.podman.compose.project") == project]
        return left

    def save_logs(self, containers: list[str], folder: Path) -> None:
        """Each container's log into folder, for a failure's post-mortem; never raises."""
        folder.mkdir(parents=True, exist_ok=True)
        for name in containers:
            try:
                done = self.run([self.podman, "logs", "--tail", "200", name], timeout=30, check=False)
                (folder / f"{name}.log").write_text(done.stdout + done.stderr)
            except BringupError:
                pass


def alive(container: dict[str, Any] | None) -> bool:
    """Running, or ended cleanly: the workers exit 0 once the coordinator releases them at the
    end of the job (and a pod's restart policy starts them again). A crash is a non-zero exit."""
    if container is None:
        return False
    return container["State"] == "running" or container.get("ExitCode") == 0


def preflight(podman: str, base_image: str, *, compose: bool) -> None:
    """Raises Skip, saying why, unless podman can run a container of base_image here."""
    for tool in [podman, *(["podman-compose"] if compose else [])]:
        if shutil.which(tool) is None:
            raise Skip(f"{tool} is not installed (on Debian: apt-get install podman runc podman-compose)")
    try:
        info = subprocess.run([podman, "info", "--format", "json"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise Skip("`podman info` did not answer within 60 s") from None
    if info.returncode != 0:
        raise Skip(f"podman cannot run here: {info.stderr.strip().splitlines()[-1:]}")
    if subprocess.run([podman, "image", "exists", base_image], timeout=60).returncode != 0:
        raise Skip(f"no base image {base_image}: no registry is assumed, so build it from Debian's "
                   "packages (debootstrap --variant=minbase bookworm DIR && tar -C DIR -c . | "
                   f"podman import - {base_image}), or name one with --base-image")
    try:
        probe = subprocess.run([podman, "run", "--rm", "--network", "none", base_image, "true"],
                               capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise Skip(f"`podman run {base_image} true` took over 120 s") from None
    if probe.returncode != 0:
        raise Skip(f"podman cannot start a container: {probe.stderr.strip().splitlines()[-1:]}")


def busy_ports(ports: list[int], host: str = "127.0.0.1") -> list[int]:
    """Those of ports that something on this host already listens on."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy
