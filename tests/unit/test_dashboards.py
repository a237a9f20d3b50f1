"""The Grafana dashboards and the Prometheus config are valid against the metric contract
(docs/metrics.md): every panel queries only contract metrics through the provisioned datasource,
the provider finds the dashboards, and Prometheus's discovery matches the compose naming scheme.

The helpers here (contract, dashboards, panel queries, Grafana-variable expansion) are shared with
tests/e2e/test_prometheus_live.py, which runs every panel's query against a live cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "metrics.md"
PROVISIONING = ROOT / "docker" / "grafana" / "provisioning"
GRAFANA_MOUNT = "/etc/grafana/provisioning"  # where compose mounts PROVISIONING
PROMETHEUS_YML = ROOT / "docker" / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# ---- shared helpers ---------------------------------------------------------------------------------


def contract() -> dict[str, str]:
    """Metric name -> type ('counter' / 'gauge' / 'histogram'), from the contract's tables."""
    out: dict[str, str] = {}
    for line in CONTRACT.read_text().splitlines():
        m = re.match(r"\|\s*`(hetpipe_[a-z0-9_]+)(\{[^}]*\})?`\s*\|\s*(\w+)", line)
        if m:
            out[m.group(1)] = m.group(3)
    return out


def contract_series() -> set[str]:
    """Every series name a contract metric exposes (histograms as _bucket, _sum and _count)."""
    names: set[str] = set()
    for name, kind in contract().items():
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return names


def datasource_uid() -> str:
    files = sorted((PROVISIONING / "datasources").glob("*.y*ml"))
    assert len(files) == 1, files
    sources = yaml.safe_load(files[0].read_text())["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus", sources
    return str(sources[0]["uid"])


def dashboard_dir() -> Path:
    """The folder the file provider loads, mapped from its path in the container to this repo."""
    files = sorted((PROVISIONING / "dashboards").glob("*.y*ml"))
    assert len(files) == 1, files
    providers = yaml.safe_load(files[0].read_text())["providers"]
    assert len(providers) == 1 and providers[0]["type"] == "file", providers
    path = str(providers[0]["options"]["path"])
    assert path.startswith(GRAFANA_MOUNT + "/"), path
    return PROVISIONING / path.removeprefix(GRAFANA_MOUNT + "/")


def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> parsed dashboard JSON, for every dashboard the provider loads."""
    return {p.name: json.loads(p.read_text()) for p in sorted(dashboard_dir().glob("*.json"))}


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel with queries (rows and their nested panels included, the rows themselves not)."""
    for p in dash.get("panels", []):
        if p.get("type") == "row":
            yield from (q for q in p.get("panels", []) if q.get("type") != "row")
        else:
            yield p


def queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every panel target."""
    for p in panels(dash):
        for t in p.get("targets", []):
            yield p["title"], t["expr"]


# What Grafana substitutes before a query reaches Prometheus; the live test and promtool need
# real PromQL. A multi-value variable with "All" becomes its allValue (.*) under =~.
GRAFANA_VARIABLES = {"__rate_interval": "10s", "__interval": "5s", "__range": "1m", "vw": ".*"}


def expand(expr: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in GRAFANA_VARIABLES:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, expr)


_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "atan2"}
_TOKEN = re.compile(r"""
      (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<other>\S)
""", re.VERBOSE)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label names inside {...} or grouping lists, or durations."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expand(expr))]
    names: set[str] = set()
    depth_braces = 0
    grouping = False  # inside by (...), on (...), ...
    for i, (kind, text) in enumerate(tokens):
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "{":
            depth_braces += 1
        elif text == "}":
            depth_braces -= 1
        elif text == ")" and grouping:
            grouping = False
        elif kind == "ident" and not depth_braces and not grouping:
            low = text.lower()
            if low in {"by", "without", "on", "ignoring", "group_left", "group_right"} and nxt == "(":
                grouping = True
            elif low not in _KEYWORDS and nxt != "(" and nxt.lower() not in {"by", "without"}:
                names.add(text)  # not a function, nor an aggregation with its grouping first
    assert depth_braces == 0, f"unbalanced braces in {expr!r}"
    return names


# ---- dashboards ----------------------------------------------------------------------------------------


def test_contract_parses() -> None:
    c = contract()
    assert len(c) >= 30 and set(c.values()) <= {"counter", "gauge", "histogram"}, c
    assert all(n.endswith("_total") for n, kind in c.items() if kind == "counter")
    for name in ("hetpipe_stage_samples_total", "hetpipe_ps_clock_distance", "hetpipe_stage_push_seconds",
                 "hetpipe_grpc_server_handled_total", "hetpipe_job_state"):
        assert name in c


def test_metric_names_parser() -> None:
    expr = ('(sum by (role, grpc_method) (rate(hetpipe_grpc_server_handled_total{grpc_code!="OK", x=~"a|b"}'
            '[$__rate_interval])) or on (role) foo:bar * 0) / ignoring (le) histogram_quantile(0.99, '
            'sum by (le) (rate(hetpipe_stage_pull_seconds_bucket{vw=~"$vw"}[5m] offset 1m))) > bool 1e3')
    assert metric_names(expr) == {"hetpipe_grpc_server_handled_total", "foo:bar", "hetpipe_stage_pull_seconds_bucket"}
    with pytest.raises(KeyError):
        expand("rate(x[$__nope])")


def test_every_dashboard_parses_and_is_distinct() -> None:
    boards = dashboards()
    assert set(boards) == {"overview.json", "pipeline.json", "parameter-servers.json", "grpc.json"}, set(boards)
    uids = [d["uid"] for d in boards.values()]
    titles = [d["title"] for d in boards.values()]
    assert len(set(uids)) == len(uids) and len(set(titles)) == len(titles)
    for name, d in boards.items():
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"
        assert sum(1 for _ in panels(d)) >= 4, name


def test_every_panel_queries_contract_metrics_only() -> None:
    known = contract_series()
    for name, d in dashboards().items():
        for p in panels(d):
            assert p.get("targets"), f"{name}: panel {p['title']!r} has no query"
            for t in p["targets"]:
                used = metric_names(t["expr"])
                assert used, f"{name}: {p['title']!r}: {t['expr']!r} selects no metric"
                unknown = used - known
                assert not unknown, f"{name}: {p['title']!r} queries {sorted(unknown)}, not in docs/metrics.md"
        for v in d.get("templating", {}).get("list", []):
            if v.get("type") == "query":
                q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q)
                assert m and m.group(1) in known, f"{name}: variable {v['name']}: {q!r}"


def test_dashboards_cover_the_issue() -> None:
    """Each dashboard shows what issue 5 asks of it."""
    used = {name: set().union(*(metric_names(e) for _, e in queries(d))) for name, d in dashboards().items()}
    need = {
        "overview.json": {"hetpipe_stage_samples_total", "hetpipe_stage_loss", "hetpipe_ps_vw_clock",
                          "hetpipe_ps_clock_distance", "hetpipe_stage_pull_wait_seconds_total"},
        "pipeline.json": {"hetpipe_stage_compute_seconds_total", "hetpipe_stage_idle_seconds_total",
                          "hetpipe_stage_queue_depth", "hetpipe_stage_in_flight_minibatches",
                          "hetpipe_stage_sent_bytes_total"},
        "parameter-servers.json": {"hetpipe_ps_pushes_total", "hetpipe_stage_pull_seconds_count",
                                   "hetpipe_stage_push_seconds_bucket", "hetpipe_stage_pull_seconds_bucket",
                                   "hetpipe_ps_received_bytes_total", "hetpipe_ps_sent_bytes_total",
                                   "hetpipe_stage_staleness_minibatches_bucket"},
        "grpc.json": {"hetpipe_grpc_server_handled_total", "hetpipe_grpc_server_handling_seconds_bucket",
                      "hetpipe_grpc_server_msg_received_total"},
    }
    for name, metrics in need.items():
        assert metrics <= used[name], f"{name} lacks {sorted(metrics - used[name])}"


def test_datasource_uid_matches_every_panel() -> None:
    uid = datasource_uid()
    for name, d in dashboards().items():
        for p in panels(d):
            assert p["datasource"] == {"type": "prometheus", "uid": uid}, f"{name}: {p['title']!r}"
            for t in p["targets"]:
                assert t.get("datasource", p["datasource"])["uid"] == uid, f"{name}: {p['title']!r}"
        for v in d.get("templating", {}).get("list", []):
            if "datasource" in v:
                assert v["datasource"]["uid"] == uid, f"{name}: variable {v['name']}"


def test_provider_loads_the_dashboards_folder() -> None:
    folder = dashboard_dir()
    assert folder == PROVISIONING / "dashboards" / "hetpipe" and folder.is_dir()
    assert sorted(folder.glob("*.json")), folder
    # The datasource points at the compose service that runs Prometheus.
    src = yaml.safe_load(next((PROVISIONING / "datasources").glob("*.y*ml")).read_text())["datasources"][0]
    assert src["url"] == "http://prometheus:9090"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each expanded panel query as a recording rule's expression."""
    rules = [{"record": f"hetpipe:panel_{i}", "expr": expand(expr)}
             for i, (_, expr) in enumerate(q for d in dashboards().values() for q in queries(d))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- Prometheus --------------------------------------------------------------------------------------


def _scrape_configs() -> dict[str, dict[str, Any]]:
    return {c["job_name"]: c for c in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]}


def test_prometheus_discovers_the_compose_services() -> None:
    """The DNS job asks for the names compose gives services (coordinator, ps-N, vwV-stageQ) on the
    image's metrics port, and labels every one with its role."""
    job = _scrape_configs()["hetpipe"]
    assert job["honor_labels"] is True
    port = int(re.search(r"HETPIPE_METRICS_PORT=(\d+)", DOCKERFILE.read_text()).group(1))  # type: ignore[union-attr]
    (sd,) = job["dns_sd_configs"]
    assert sd["type"] == "A" and sd["port"] == port
    names = sd["names"]
    assert "coordinator" in names and "ps-0" in names and "vw0-stage0" in names and "vw3-stage3" in names
    roles = {r["replacement"]: r["regex"] for r in job["relabel_configs"] if r.get("target_label") == "role"}
    assert set(roles) == {"coordinator", "ps_shard", "stage_worker"}
    for n in names:
        matched = [role for role, regex in roles.items() if re.fullmatch(regex, n)]
        assert len(matched) == 1, (n, matched)
    # The file job reads the targets `hetpipe run` writes (the live test uses it).
    assert _scrape_configs()["hetpipe-file"]["honor_labels"] is True


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_prometheus_config_is_valid() -> None:
    done = subprocess.run(["promtool", "check", "config", "--syntax-only", str(PROMETHEUS_YML)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of a compose service's bind mounts (short or long syntax)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            host, container = v.split(":")[:2]
        else:
            host, container = v.get("source", ""), v.get("target", "")
        out[container] = str(Path(host).as_posix()).removeprefix("./")
    return out


def test_compose_mounts_these_files() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text()).get("services", {})
    if "prometheus" not in services or "grafana" not in services:
        pytest.skip("compose.yaml has no prometheus/grafana services yet")
    assert _mounts(services["prometheus"]).get("/etc/prometheus/prometheus.yml") == "docker/prometheus/prometheus.yml"
    assert _mounts(services["grafana"]).get(GRAFANA_MOUNT) == "docker/grafana/provisioning"
