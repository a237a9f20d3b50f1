"""What a live cluster must show: the job ending COMPLETED, its accuracy, and Prometheus's view."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine import BringupError, Engine, Timings

# Metrics that are non-zero only once training really ran (docs/metrics.md): samples through the
# stages' backward passes, and wave pushes the shards applied.
TRAINING_METRICS = {
    "stage samples": 'sum(hetpipe_stage_samples_total)',
    "shard pushes applied": 'sum(hetpipe_ps_pushes_total{outcome="applied"})',
}
TERMINAL = ("COMPLETED", "FAILED", "STOPPED")


def job_status(hetpipe: list[str], address: str, credentials: list[str],
               timeout: float = 30) -> tuple[dict[str, Any] | None, str]:
    """(`hetpipe status --json` of the coordinator at address, ""), or (None, why not) while it
    cannot be reached. credentials: its TLS and token flags, if it needs them."""
    try:
        done = subprocess.run([*hetpipe, "status", "--coordinator", address, *credentials, "--json"],
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"`hetpipe status` took over {timeout:.0f} s"
    try:
        return dict(json.loads(done.stdout)["job"]), ""
    except (ValueError, KeyError):  # unreachable: the command said why on stderr
        return None, (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]


def wait_for_job(hetpipe: list[str], address: str, credentials: list[str], *, deadline_s: float,
                 every_s: float = 5, on_poll: Callable[[dict[str, Any] | None], None] = lambda _: None
                 ) -> dict[str, Any]:
    """Polls the coordinator until its job ends; returns the last status. on_poll sees each status
    (None while unreachable) and may raise to give up early. Raises BringupError at the deadline."""
    end = time.monotonic() + deadline_s
    last_print, status, error = 0.0, None, ""
    while time.monotonic() < end:
        status, error = job_status(hetpipe, address, credentials)
        on_poll(status)
        job = status or {}
        state = job.get("state", "UNREACHABLE")
        if state in TERMINAL:
            return job
        if time.monotonic() - last_print >= 30:
            last_print = time.monotonic()
            print(f"    job {state}: {int(job.get('samples', 0))}/{int(job.get('total_samples', 0))} samples, "
                  f"loss {float(job.get('loss', 0)):.3f}" + (f" ({error})" if error else ""), flush=True)
        time.sleep(every_s)
    raise BringupError(f"the job did not end within {deadline_s:.0f} s; last status: {status or error}")


def check_summary(summary: dict[str, Any], accuracy_bar: float) -> str:
    """Raises BringupError unless summary.json reports a held-out accuracy of at least the bar."""
    accuracy = summary.get("eval_accuracy")
    if not isinstance(accuracy, (int, float)):
        raise BringupError(f"summary.json has no eval_accuracy: {sorted(summary)}")
    line = (f"eval_accuracy {accuracy:.4f} (bar {accuracy_bar}), final loss {summary.get('final_loss', float('nan')):.4f}, "
            f"{summary.get('samples_per_second', 0):.0f} samples/s over {summary.get('wall_seconds', 0):.0f} s")
    if accuracy < accuracy_bar:
        raise BringupError(f"accuracy below the bar: {line}")
    return line


@dataclass
class Prometheus:
    """The HTTP API of a Prometheus server."""

    url: str

    def query(self, promql: str, timeout: float = 10) -> list[dict[str, Any]]:
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(address, timeout=timeout) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise BringupError(f"Prometheus refused {promql!r}: {body}")
        return list(body["data"]["result"])

    def scrape_view(self, job: str, instances: set[str]) -> tuple[set[str], dict[str, float]]:
        """(the instances of job that are not up, each training metric's value)."""
        up = {r["metric"].get("instance", ""): float(r["value"][1]) for r in self.query(f'up{{job="{job}"}}')}
        down = {i for i in instances if up.get(i) != 1.0}
        values = {}
        for name, promql in TRAINING_METRICS.items():
            result = self.query(promql)
            values[name] = float(result[0]["value"][1]) if result else 0.0
        return down, values

    def wait_until_scraped(self, job: str, instances: set[str], *, deadline_s: float) -> dict[str, float]:
        """Waits until every instance of job is up and every training metric is non-zero; returns
        the metrics. Raises BringupError at the deadline, saying what was missing."""
        end = time.monotonic() + deadline_s
        down, values, error = set(instances), dict[str, float](), ""
        while time.monotonic() < end:
            try:
                down, values = self.scrape_view(job, instances)
                error = ""
            except (OSError, ValueError) as exc:  # not ready yet: connection refused, or a 503
                error = f"{type(exc).__name__}: {exc}"
            if not error and not down and all(v > 0 for v in values.values()):
                return values
            time.sleep(3)
        raise BringupError(f"Prometheus at {self.url}: targets not up {sorted(down)}, metrics {values}"
                           + (f", last error {error}" if error else ""))


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveCluster:
    """A started cluster, as the checks reach it from this host."""

    hetpipe: list[str]                       # the `hetpipe` command
    coordinator: str                         # host:port published on this host
    credentials: list[str]                   # `hetpipe status` flags: TLS files and token
    prometheus: Prometheus
    prometheus_job: str                      # the scrape job of the HetPipe processes
    instances: set[str]                      # their `instance` labels: one per process
    assert_running: Callable[[], None]       # raises BringupError if a process is gone
    copy_summary: Callable[[Path], object]   # copies the coordinator's summary.json to a path


def train_and_check(live: LiveCluster, timings: Timings, phase: str, *, workdir: Path, accuracy_bar: float,
                    deadline_s: float) -> list[str]:
    """Waits for the job to complete, checking on the way that every process keeps running and
    that Prometheus scrapes them all while they train; then checks summary.json. Report lines."""
    scraped: dict[str, float] = {}

    def on_poll(status: dict[str, Any] | None) -> None:
        state = (status or {}).get("state")
        if state in TERMINAL:
            return
        live.assert_running()
        if state == "RUNNING" and int((status or {}).get("samples", 0)) > 0 and not scraped:
            try:
                down, values = live.prometheus.scrape_view(live.prometheus_job, live.instances)
            except (OSError, ValueError):
                return
            if not down and all(v > 0 for v in values.values()):
                scraped.update(values)

    with timings.phase(f"{phase}: train until the job ends"):
        status = wait_for_job(live.hetpipe, live.coordinator, live.credentials, deadline_s=deadline_s,
                              on_poll=on_poll)
    if status.get("state") != "COMPLETED":
        raise BringupError(f"the job ended {status.get('state')}: {status.get('reason', '')}")
    with timings.phase(f"{phase}: check results and metrics"):
        if not scraped:  # the job was faster than a scrape: the workers still serve their metrics
            scraped.update(live.prometheus.wait_until_scraped(live.prometheus_job, live.instances, deadline_s=60))
        path = workdir / "summary.json"
        live.copy_summary(path)
        return [f"Prometheus (job {live.prometheus_job}): all {len(live.instances)} targets up while training; "
                + ", ".join(f"{k} {v:.0f}" for k, v in scraped.items()),
                check_summary(json.loads(path.read_text()), accuracy_bar)]


@dataclass(frozen=True)
class Restartable:
    """A cluster's containers by service (compose) or pod (kube), for restart_mid_job."""

    engine: Engine
    containers: Callable[[], dict[str, dict[str, Any]]]
    coordinator: str                       # its service or pod
    servers: list[str]                     # every HetPipe process's, the coordinator's too
    assert_running: Callable[[], None]
    resumes: bool = False                  # the job checkpoints: the restart goes on from its latest cut

    def name(self, server: str) -> str:
        return str(self.containers()[server]["Names"][0])


def checkpoints(job: Path) -> bool:
    """Whether the job file sets train.checkpoint_every (Restartable.resumes)."""
    return bool((yaml.safe_load(job.read_text()).get("train") or {}).get("checkpoint_every"))


CUT_WRITTEN = "checkpoint of wave"   # the driver's log line for each cut
RESUMED = re.compile(r"resuming from the checkpoint of wave (\d+)")


class _Training(Exception):
    """The job has trained: stop waiting."""


def restart_mid_job(cluster: Restartable, live: LiveCluster, *, deadline_s: float) -> str:
    """Restarts the coordinator once its job has trained some samples (and, where it checkpoints,
    written a cut). Its job is lost with it; every shard and stage that served it exits 75
    (EXIT_ORPHANED), a shard discarding that job's state, and its restart policy brings it back
    fresh; the restarted coordinator runs its --job from the start, or from its latest cut.
    Returns once that job trains, each server started anew in its own container, having left the
    lost job as an orphan."""
    engine = cluster.engine
    cut = False   # the first run wrote a cut (its coordinator's log says so)

    def trained(status: dict[str, Any] | None) -> None:
        nonlocal cut
        if cluster.resumes and not cut and (status or {}).get("state") == "RUNNING":
            cut = CUT_WRITTEN in logs(cluster.coordinator)
        if (status or {}).get("state") == "RUNNING" and int((status or {}).get("samples", 0)) > 0 and (
                cut or not cluster.resumes):
            raise _Training
        if (status or {}).get("state") not in (None, "PENDING", "PLANNED", "RUNNING"):
            raise BringupError(f"the job ended: {status}")

    def started() -> dict[str, tuple[str, Any]]:
        return {s: (str(c["Id"]), c.get("StartedAt")) for s, c in cluster.containers().items()}

    def logs(server: str) -> str:
        done = engine.run([engine.podman, "logs", cluster.name(server)], timeout=60, log_output=False)
        return done.stdout + done.stderr

    before: dict[str, tuple[str, Any]] = {}
    for attempt in ("first", "rerun"):
        try:
            wait_for_job(live.hetpipe, live.coordinator, live.credentials, deadline_s=deadline_s, on_poll=trained)
        except _Training:
            pass
        if attempt == "first":
            before = started()
            engine.run([engine.podman, "restart", "--time", "30", cluster.name(cluster.coordinator)], timeout=120)
    after = started()
    cluster.assert_running()
    if any(after[s][0] != before[s][0] for s in cluster.servers):
        raise BringupError("a container was made anew: each server must restart in its own")
    kept = [s for s in cluster.servers if after[s][1] == before[s][1]]
    if kept:
        raise BringupError(f"{kept} ran on through the coordinator's restart, holding the job it lost")
    # Left as orphans (exit 75), not by a crash that the same policy would also have restarted.
    crashed = [s for s in cluster.servers if s != cluster.coordinator
               and "exiting, for a fresh process in its place" not in logs(s)]
    if crashed:
        raise BringupError(f"{crashed} restarted without leaving the lost job as an orphan: see their logs")
    how = "from the start"
    if cluster.resumes:
        went_on = RESUMED.search(logs(cluster.coordinator))
        if went_on is None:
            raise BringupError("the restarted coordinator did not go on from its job's checkpoint: see its log")
        how = f"from the checkpoint of wave {went_on[1]}"
    return (f"coordinator restarted mid-job: its job ran again {how}, every other server restarted "
            f"fresh by its policy ({len(cluster.servers) - 1})")
