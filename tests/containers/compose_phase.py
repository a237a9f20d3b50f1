"""The compose phase: the cluster of `hetpipe compose` run by podman-compose, trained, checked,
and torn down without a trace.

podman-compose (1.0.x, Debian bookworm's) is not docker compose; the harness bridges the gap in a
copy of the compose file, written next to the run's logs and never into the repository:
- profiles: 1.0.x ignores them and would start both variants of every stage, so the copy keeps
  only the services of the `cpu` profile (and those with no profile);
- images: no registry is reachable, so the copy names the images built here (tests/containers/
  images.py) and drops the `build` sections, which podman-compose cannot give the build-time
  mounts pip needs; Prometheus is Debian's (docker/prometheus/Dockerfile), and Grafana, which
  Debian does not package, is left out;
- the project name (`name:` is ignored by 1.0.x) is given with -p, and bind sources become
  absolute paths, since the copy is not in the compose file's folder;
- a file without a token (the plain cluster): services bind 0.0.0.0 and refuse to without one
  (hetpipe/service.py) unless HETPIPE_INSECURE is 1, so the copy sets it for them.
And in how it is started: 1.0.x reads `depends_on` only as an order, and podman runs no
healthchecks without systemd. So `podman-compose up --no-start` creates every container, and the
harness starts each once what it depends on is as its condition says: started, healthy (the
service's own healthcheck, run with `podman healthcheck run`) or completed successfully (the
one-shot `certs` service). `podman-compose down -v` leaves the project's network (1.0.x): the
harness removes it, then asserts that nothing of the project is left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from checks import LiveCluster, Prometheus, Restartable, checkpoints, restart_mid_job, train_and_check
from engine import BringupError, Engine, Timings, alive, busy_ports
from images import Images
from launch.compose import (COORDINATOR_PORT, CPU_IMAGE, CPU_PROFILE, ENTRY_POINTS, GRAFANA_IMAGE,
                            PROMETHEUS_IMAGE, PROMETHEUS_PORT)

PROJECT = "hetpipe-bringup"   # not compose.yaml's `hetpipe`: a user's own cluster is left alone
COORDINATOR = f"127.0.0.1:{COORDINATOR_PORT}"
PROMETHEUS_URL = f"http://127.0.0.1:{PROMETHEUS_PORT}"
PROMETHEUS_JOB = "hetpipe"    # docker/prometheus/prometheus.yml's job for the compose services
START_DEADLINE_S = 420        # the one-shot certs, then the coordinator, then workers that import torch
# The coordinator's security settings (compose.yaml's environment) -> `hetpipe status` flags.
CREDENTIALS = {"HETPIPE_TLS_CERT": "--tls-cert", "HETPIPE_TLS_KEY": "--tls-key", "HETPIPE_TLS_CA": "--tls-ca",
               "HETPIPE_TOKEN_FILE": "--token-file"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ComposeRun:
    root: Path                # the repository
    job: Path                 # the job file the cluster trains
    checked_in: bool          # run the repository's compose.yaml instead of generating one
    workdir: Path             # generated files, logs, summary.json
    images: Images
    hetpipe: list[str]        # the `hetpipe` command
    accuracy_bar: float
    job_deadline_s: float
    restart_coordinator: bool = False   # restart it once the job trains: the job runs again from the start


def for_podman(doc: dict[str, Any], *, compose_dir: Path, images: Images) -> dict[str, Any]:
    """The compose file doc, as podman-compose runs it here (the module docstring says why)."""
    services = {}
    for name, service in doc["services"].items():
        profiles = service.get("profiles")
        if (profiles and CPU_PROFILE not in profiles) or service.get("image") == GRAFANA_IMAGE:
            continue
        service = {k: v for k, v in service.items() if k not in ("profiles", "build")}
        if service.get("image") == CPU_IMAGE:
            service["image"] = images.hetpipe
            env = dict(service.get("environment") or {})
            if _server(service) and "HETPIPE_TOKEN_FILE" not in env and "--token-file" not in service["command"]:
                env["HETPIPE_INSECURE"] = "1"
                service["environment"] = env
        elif service.get("image") == PROMETHEUS_IMAGE:
            service["image"] = images.prometheus
        service["volumes"] = [
            {**v, "source": str((compose_dir / v["source"]).resolve())} if v.get("type") == "bind" else v
            for v in service.get("volumes", [])]
        services[name] = service
    for service in services.values():
        kept = {k: v for k, v in depends_on(service).items() if k in services}
        if kept:
            service["depends_on"] = {k: {"condition": c} for k, c in kept.items()}
        else:
            service.pop("depends_on", None)
    return {"services": services, "volumes": doc.get("volumes", {})}


def _server(service: dict[str, Any]) -> bool:
    """A HetPipe service process (coordinator, shard, stage), not a one-shot command of the image."""
    command = service.get("command") or []
    return bool(command) and command[0] in ENTRY_POINTS


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Service name -> condition, from either form of depends_on."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {k: (v or {}).get("condition", "service_started") for k, v in deps.items()}


def one_shots(doc: dict[str, Any]) -> set[str]:
    """Services another one waits on to complete: they exit, the others must keep running."""
    return {d for s in doc["services"].values() for d, c in depends_on(s).items()
            if c == "service_completed_successfully"}


def published_ports(doc: dict[str, Any]) -> list[int]:
    return sorted(int(p["published"]) for s in doc["services"].values() for p in s.get("ports", [])
                  if isinstance(p, dict) and p.get("published"))


class Cluster:
    """The project's containers, by compose service name, started as depends_on says."""

    def __init__(self, engine: Engine, doc: dict[str, Any]) -> None:
        self.engine = engine
        self.doc = doc
        self.one_shots = one_shots(doc)
        self.long_running = [s for s in doc["services"] if s not in self.one_shots]
        self._healthy: set[str] = set()

    def containers(self) -> dict[str, dict[str, Any]]:
        return {c["Labels"]["com.docker.compose.service"]: c for c in self.engine.containers(PROJECT)}

    def name(self, service: str) -> str:
        return str(self.containers()[service]["Names"][0])

    def healthy(self, service: str) -> bool:
        """The service's healthcheck, run now (and no more once it passed)."""
        if service not in self._healthy and self.engine.run(
                [self.engine.podman, "healthcheck", "run", self.name(service)], timeout=60, check=False).returncode == 0:
            self._healthy.add(service)
        return service in self._healthy

    def met(self, service: str, condition: str, containers: dict[str, dict[str, Any]]) -> bool:
        state = containers[service]["State"]
        if condition == "service_completed_successfully":
            if state in ("exited", "stopped") and containers[service].get("ExitCode") != 0:
                raise BringupError(f"{service} exited {containers[service].get('ExitCode')}: the services "
                                   "waiting for it to complete cannot start")
            return state in ("exited", "stopped")
        if state != "running":
            return False
        return condition != "service_healthy" or self.healthy(service)

    def start_in_order(self, deadline_s: float) -> list[str]:
        """Starts every container once its dependencies' conditions hold, then waits until every
        long-running service with a healthcheck is healthy. Returns when each one started (s)."""
        end, started, waiting, log = time.monotonic() + deadline_s, time.monotonic(), list(self.doc["services"]), []
        while waiting and time.monotonic() < end:
            containers = self.containers()
            ready = [s for s in waiting
                     if all(self.met(d, c, containers) for d, c in depends_on(self.doc["services"][s]).items())]
            for service in ready:
                self.engine.run([self.engine.podman, "start", self.name(service)], timeout=120)
                log.append(f"{service} +{time.monotonic() - started:.0f}s")
                waiting.remove(service)
            if not ready:
                self.assert_running([s for s in self.long_running if s not in waiting])
                time.sleep(2)
        checked = [s for s in self.long_running if "healthcheck" in self.doc["services"][s]]
        while time.monotonic() < end and not all(self.healthy(s) for s in checked):
            self.assert_running(self.long_running)
            time.sleep(3)
        unhealthy = [s for s in checked if s not in self._healthy]
        if waiting or unhealthy:
            raise BringupError(f"within {deadline_s:.0f} s: never started {waiting}, not healthy {unhealthy}")
        return log

    def assert_running(self, services: list[str]) -> None:
        containers = self.containers()
        gone = [f"{s} ({containers[s]['State']}, exit {containers[s].get('ExitCode')})" if s in containers
                else f"{s} (no container)" for s in services if not alive(containers.get(s))]
        if gone:
            raise BringupError(f"containers gone: {gone}")


def status_credentials(engine: Engine, cluster: Cluster, folder: Path) -> list[str]:
    """The `hetpipe status` flags that reach the coordinator as it is secured: its own TLS files
    and token, copied out of its container. None for a plain cluster."""
    env = cluster.doc["services"]["coordinator"].get("environment") or {}
    flags = []
    folder.mkdir(parents=True, exist_ok=True)
    for variable, flag in CREDENTIALS.items():
        if env.get(variable):
            local = folder / Path(env[variable]).name
            engine.run([engine.podman, "cp", f"{cluster.name('coordinator')}:{env[variable]}", str(local)], timeout=60)
            flags += [flag, str(local)]
    return flags


def _output_dir(doc: dict[str, Any]) -> str:
    command = doc["services"]["coordinator"]["command"]
    return str(command[command.index("--output-dir") + 1])


def run(engine: Engine, timings: Timings, cfg: ComposeRun) -> list[str]:
    """The compose phase; returns its report lines. Raises BringupError on any failure, after
    tearing the cluster down and saving the containers' logs under cfg.workdir/logs."""
    with timings.phase("compose: generate"):
        if cfg.checked_in:
            source = cfg.root / "compose.yaml"
        else:
            source = cfg.workdir / "compose.yaml"
            engine.run([*cfg.hetpipe, "compose", str(cfg.job), "-o", str(source)], timeout=120, cwd=cfg.root)
        doc = for_podman(yaml.safe_load(source.read_text()), compose_dir=source.parent, images=cfg.images)
        podman_file = cfg.workdir / "compose.podman.yaml"
        podman_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    cluster = Cluster(engine, doc)
    servers = [s for s in cluster.long_running if _server(doc["services"][s])]
    compose = ["podman-compose", "-p", PROJECT, "-f", str(podman_file)]
    names = (f"{PROJECT}_default", *(f"{PROJECT}_{v}" for v in doc["volumes"]), f"pod_{PROJECT}")
    _tear_down(engine, compose, names)  # what an interrupted earlier run left
    busy = busy_ports(published_ports(doc))
    if busy:
        raise BringupError(f"ports {busy} on 127.0.0.1 are taken: the cluster publishes them")
    report = [f"compose file: {source}; run as {podman_file}: {len(servers)} HetPipe services, "
              f"{sorted(cluster.one_shots) or 'no'} one-shot, Prometheus, no Grafana"]
    ok = False
    try:
        with timings.phase("compose: create (podman-compose up --no-start)"):
            engine.run([*compose, "up", "--no-start"], timeout=600)
        with timings.phase("compose: start in depends_on order, until all healthy"):
            report.append("started: " + ", ".join(cluster.start_in_order(START_DEADLINE_S)))
        credentials = status_credentials(engine, cluster, cfg.workdir / "credentials")
        if credentials:
            report.append("hetpipe status with the coordinator's TLS certificate and token from its container")
        output = _output_dir(doc)
        live = LiveCluster(
            hetpipe=cfg.hetpipe, coordinator=COORDINATOR, credentials=credentials,
            prometheus=Prometheus(PROMETHEUS_URL), prometheus_job=PROMETHEUS_JOB, instances=set(servers),
            assert_running=lambda: cluster.assert_running(cluster.long_running),
            copy_summary=lambda path: engine.run(
                [engine.podman, "cp", f"{cluster.name('coordinator')}:{output}/summary.json", str(path)], timeout=60))
        if cfg.restart_coordinator:
            with timings.phase("compose: restart the coordinator mid-job, until its job runs again"):
                report.append(restart_mid_job(Restartable(engine, cluster.containers, "coordinator", servers,
                                                          lambda: cluster.assert_running(cluster.long_running),
                                                          resumes=checkpoints(cfg.job)),
                                              live, deadline_s=cfg.job_deadline_s))
        report += train_and_check(live, timings, "compose", workdir=cfg.workdir, accuracy_bar=cfg.accuracy_bar,
                                  deadline_s=cfg.job_deadline_s)
        ok = True
    finally:
        with timings.phase("compose: down -v, nothing left"):
            if not ok:
                engine.save_logs([c["Names"][0] for c in engine.containers(PROJECT)], cfg.workdir / "logs")
            left = _tear_down(engine, compose, names)
    if left:
        raise BringupError(f"`podman-compose down -v` left {left} (removed by force since)")
    report.append(f"down -v: no container, pod, volume or network of project {PROJECT} left")
    return report


def _tear_down(engine: Engine, compose: list[str], names: tuple[str, ...]) -> list[str]:
    """podman-compose down -v, then the network 1.0.x always leaves; returns whatever else of the
    project is still there, having removed it by force."""
    if not engine.leftovers(PROJECT, names):
        return []
    engine.run([*compose, "down", "-v"], timeout=300, check=False)
    engine.run([engine.podman, "network", "rm", f"{PROJECT}_default"], timeout=60, check=False)
    left = engine.leftovers(PROJECT, names)
    for thing in left:
        kind, name = thing.split()[:2]
        what = [] if kind == "container" else [kind]
        engine.run([engine.podman, *what, "rm", "-f", name], timeout=60, check=False)
    return left
