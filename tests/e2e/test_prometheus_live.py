"""A real Prometheus server against a live `hetpipe run` cluster (issue 5, must show): every target
is up, `promtool check metrics` is clean on every endpoint, every metric of the contract is
exported, and the PromQL of every dashboard panel returns data."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from hetpipe.errors import JobStopped
from hetpipe.outputs import ADDRESS_FILE
from launch.local import TARGETS_FILE, run_local
from hetpipe import rpc
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.prometheus_tools import ensure_prometheus, ensure_promtool, promtool_check_metrics
from tests.unit.test_dashboards import PROMETHEUS_YML, contract, dashboards, expand, queries

# Installing the Debian package (once per machine) can take a minute or two; the cluster part has
# its own deadlines below, well inside this.
pytestmark = pytest.mark.timeout(300)

VWS, STAGES, SHARDS = 2, 2, 2
ROLES = {"coordinator": 1, "stage_worker": VWS * STAGES, "ps_shard": SHARDS}
START_DEADLINE_S = 120   # processes importing torch on a loaded 2-core machine
UP_DEADLINE_S = 30
DATA_DEADLINE_S = 60     # until every panel has data (rates need a few 1 s scrapes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    return json.loads(body) if r.headers.get_content_type() == "application/json" else body


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    reply = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert reply["status"] == "success", (expr, reply)
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def _prometheus_config(targets: Path) -> dict[str, Any]:
    """docker/prometheus/prometheus.yml's file_sd job, pointed at the run's targets file, scraping every second."""
    checked_in = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = [j for j in checked_in["scrape_configs"] if j["job_name"] == "hetpipe-file"]
    job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [job]}


def _wait(what: str, deadline_s: float, check: Any) -> Any:
    """Polls check() until it returns something truthy; fails with its last answer."""
    end = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < end:
        try:
            last = check()
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if last and not isinstance(last, Missing):
                return last
        time.sleep(0.5)
    pytest.fail(f"{what} within {deadline_s:.0f}s; last: {last}")


class Missing(list[str]):
    """A falsy-looking answer that still says what is missing."""


def test_prometheus_scrapes_a_live_cluster(make_job, tmp_path: Path) -> None:
    prometheus, promtool = ensure_prometheus(), ensure_promtool()
    job = make_job({
        "train": {"steps": 100_000},  # stopped once checked
        "parallel": {"virtual_workers": VWS, "stages_per_vw": STAGES, "nm": 2, "D": 1, "ps_shards": SHARDS},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": VWS * STAGES}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.02}},
        "output": {"trace": False},
    })
    out = tmp_path / "out"
    outcome: dict[str, BaseException] = {}

    def train() -> None:
        try:
            run_local(job, quiet=True)
        except BaseException as exc:  # JobStopped expected: the test stops the job
            outcome["error"] = exc

    trainer = threading.Thread(target=train, name="hetpipe-run", daemon=True)
    trainer.start()
    prom: subprocess.Popen[bytes] | None = None
    try:
        targets = out / TARGETS_FILE

        def started() -> bool:
            if "error" in outcome:
                pytest.fail(f"hetpipe run failed: {outcome['error']!r}")
            return targets.exists()

        _wait("hetpipe run wrote its Prometheus targets", START_DEADLINE_S, started)
        entries = json.loads(targets.read_text())
        assert sorted(e["labels"]["role"] for e in entries) == sorted(r for r, n in ROLES.items() for _ in range(n))

        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(_prometheus_config(targets)))
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        with open(tmp_path / "prometheus.log", "wb") as log:
            prom = subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        # ---- every target up, labelled with its role
        def all_up() -> Missing | list[dict[str, Any]]:
            active = _get(f"{base}/api/v1/targets?state=active")["data"]["activeTargets"]
            down = Missing(f"{t['scrapeUrl']}: {t['health']} {t['lastError']}" for t in active if t["health"] != "up")
            if down or len(active) != len(entries):
                return Missing([*down, f"{len(active)} of {len(entries)} targets"])
            return list(active)

        assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()
        active = _wait("every target up", UP_DEADLINE_S, all_up)
        roles = sorted(t["labels"]["role"] for t in active)
        assert roles == sorted(r for r, n in ROLES.items() for _ in range(n)), roles

        # ---- promtool check metrics: clean on every endpoint
        for t in active:
            code, report = promtool_check_metrics(_get(t["scrapeUrl"]), promtool)
            assert (code, report) == (0, ""), f"{t['labels']['role']} {t['scrapeUrl']}:\n{report}"

        # ---- every contract metric exported; no relabelling collision (honor_labels)
        exported = {s["metric"]["__name__"] for s in _query(base, 'count by (__name__) ({__name__=~"hetpipe_.+"})')}
        expected = {f"{n}_count" if kind == "histogram" else n for n, kind in contract().items()}
        assert not expected - exported, f"contract metrics the live cluster does not export: {sorted(expected - exported)}"
        assert _query(base, '{exported_role=~".+"}') == []

        # ---- every panel's PromQL (and the pipeline dashboard's vw variable) returns data
        panel_queries = [(f"{name}: {title}", expand(expr)) for name, d in dashboards().items()
                         for title, expr in queries(d)]

        def empty_panels() -> Missing | bool:
            empty = Missing(f"{where}: {expr}" for where, expr in panel_queries if not _query(base, expr))
            return empty or True

        _wait("every dashboard panel returns data", DATA_DEADLINE_S, empty_panels)
        vws = _get(f"{base}/api/v1/label/vw/values?" + urllib.parse.urlencode({"match[]": "hetpipe_stage_local_clock"}))
        assert sorted(vws["data"]) == [str(v) for v in range(VWS)]
        assert "error" not in outcome, f"the run ended early: {outcome['error']!r}"
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(10)
            except subprocess.TimeoutExpired:
                prom.kill()
                prom.wait()
        _stop_job(out, trainer)
    assert not trainer.is_alive(), "hetpipe run did not end after StopJob"
    assert isinstance(outcome.get("error"), JobStopped), repr(outcome.get("error"))


def _stop_job(out: Path, trainer: threading.Thread, deadline_s: float = 60.0) -> None:
    """What `hetpipe stop --job OUT` does (StopJob on the coordinator the run embeds), repeated
    until the run is over: a job stopped before it was submitted would otherwise start after."""
    end = time.monotonic() + deadline_s
    while trainer.is_alive() and time.monotonic() < end:
        address_file = out / ADDRESS_FILE
        if address_file.exists():
            channel = rpc.channel(address_file.read_text().strip())
            try:
                coordinator_pb2_grpc.CoordinatorStub(channel).StopJob(coordinator_pb2.JobRef(), timeout=rpc.CONTROL_DEADLINE_S)
            except grpc.RpcError:  # not serving yet, or already gone
                pass
            finally:
                channel.close()
        trainer.join(2.0)
