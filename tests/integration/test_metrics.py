"""The metric contract (docs/metrics.md) against a live local job: every documented name on the
right process with its type and labels and a sane value, gRPC codes (an INVALID_ARGUMENT we
provoke included), and `promtool check metrics` clean on every endpoint."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from hetpipe.outputs import ADDRESS_FILE, TOKEN_FILE
from launch.local import TARGETS_FILE
from conftest import run_token
from hetpipe import rpc, security, wire
from hetpipe.catalog import gpu_type
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, ps_pb2, wire_pb2
from tests.prometheus_tools import ensure_promtool, promtool_check_metrics

pytestmark = pytest.mark.timeout(240)
CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NM, D = 2, 0
# 2 VWs x 2 emulated T4 stages, 2 shards: long enough (a few seconds of training) to be scraped
# while it runs, short enough for an integration test.
JOB: dict[str, Any] = {
    "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 4}]}],
                "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.02}},
    "train": {"steps": 80},
    "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": NM, "D": D, "ps_shards": 2},
    "output": {"trace": False},
}
Info = coordinator_pb2.WorkerInfo


# ---- the contract, read from docs/metrics.md -------------------------------------------------

@dataclass(frozen=True)
class Documented:
    name: str          # as exposed: counters with _total
    type: str          # counter / gauge / histogram
    labels: frozenset[str]


def contract() -> dict[str, list[Documented]]:
    """Section ('stage', 'ps', 'coordinator', 'grpc') -> its documented metrics with full label sets."""
    sections: dict[str, list[Documented]] = {}
    section, common = "", frozenset[str]()
    for line in CONTRACT.read_text().splitlines():
        if line.startswith("## "):
            title = line.lower()
            section = ("grpc" if "grpc" in title else "stage" if "stage worker" in title
                       else "ps" if "parameter-server" in title else "coordinator" if "coordinator" in title else "")
            # "(labels `vw`, `stage`)" / "(label `shard`)" / "(label `role` = ...)": on every row below
            inside = re.search(r"\(labels? (.*)\)", line)
            common = frozenset(re.findall(r"`(\w+)`", inside.group(1).split("=")[0])) if inside else frozenset()
            sections[section] = []
            continue
        row = re.match(r"\|\s*`(hetpipe_\w+)(?:\{([^}]*)\})?`\s*\|\s*(\w+)", line)
        if row and section:
            extra = frozenset(x.strip() for x in (row.group(2) or "").split(",") if x.strip())
            sections[section].append(Documented(row.group(1), row.group(3), common | extra))
    return sections


# ---- scraping ----------------------------------------------------------------------------------

@dataclass
class Endpoint:
    role: str                     # coordinator / stage_worker / ps_shard
    port: int
    assigned: str = ""            # "stage 1 of vw 0", "ps shard 0", ...
    address: str = ""
    text: str = ""                # the latest scrape
    before: str = ""              # the last scrape before the INVALID_ARGUMENT calls
    scrapes: int = 0
    after_provoked: int = 0       # scrapes since the INVALID_ARGUMENT calls
    seen_running: bool = False
    running: str = ""             # the coordinator's latest scrape while the job ran

    def scrape(self, provoked: bool) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
            text = r.read().decode()
        if not text:
            return  # cut short by the process exiting at the end of the job: keep the last scrape
        self.text = text
        self.scrapes += 1
        self.after_provoked += provoked
        if self.role == "coordinator" and 'hetpipe_job_state{state="RUNNING"} 1.0' in self.text:
            self.seen_running = True
            self.running = text


@dataclass
class Samples:
    """One endpoint's scrape: family name -> type, and every sample."""

    types: dict[str, str] = field(default_factory=dict)
    rows: list[tuple[str, str, dict[str, str], float]] = field(default_factory=list)  # family, sample, labels, v

    @classmethod
    def parse(cls, text: str) -> Samples:
        out = cls()
        for fam in text_string_to_metric_families(text):
            out.types[fam.name] = fam.type
            for s in fam.samples:
                out.rows.append((fam.name, s.name, dict(s.labels), s.value))
        return out

    def get(self, sample: str, **labels: str) -> list[float]:
        return [v for _, name, ls, v in self.rows if name == sample and all(ls.get(k) == x for k, x in labels.items())]

    def one(self, sample: str, **labels: str) -> float:
        values = self.get(sample, **labels)
        assert len(values) == 1, f"{sample}{labels}: {len(values)} samples"
        return values[0]


def _family(doc: Documented) -> str:
    return doc.name[: -len("_total")] if doc.type == "counter" else doc.name


def check_contract(s: Samples, docs: list[Documented], where: str) -> None:
    for doc in docs:
        fam = _family(doc)
        assert s.types.get(fam) == doc.type, f"{where}: {doc.name} is {s.types.get(fam)}, documented {doc.type}"
        rows = [(name, labels) for f, name, labels, _ in s.rows if f == fam]
        assert rows, f"{where}: {doc.name} has no samples"
        for name, labels in rows:
            have = set(labels) - ({"le"} if name.endswith("_bucket") else set())
            assert have == doc.labels, f"{where}: {name} has labels {sorted(have)}, documented {sorted(doc.labels)}"


# ---- provoking errors ----------------------------------------------------------------------

def _provoke_invalid_argument(coordinator: str, stage: str, shard: str) -> None:
    """One INVALID_ARGUMENT on each kind of server, none of which disturbs the job."""
    with rpc.channel(coordinator) as ch:
        with pytest.raises(grpc.RpcError) as err:
            coordinator_pb2_grpc.CoordinatorStub(ch).Register(
                Info(role=Info.STAGE_WORKER, address="127.0.0.1:1", node="n0", device="gpu0"), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with rpc.channel(stage) as ch:  # the raw-bytes Forward handler; a tag for a VW that does not exist
        tag = wire_pb2.MinibatchTag(vw=99, minibatch=1, stage=0)
        frames = wire.encode([("activation", torch.zeros(2)), ("target", torch.zeros(2))], minibatch=tag)
        with pytest.raises(grpc.RpcError) as err:
            rpc.Stub(ch, "Stage").Forward(frames, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    with rpc.channel(shard) as ch:  # a streaming-response handler refusing before its first frame
        with pytest.raises(grpc.RpcError) as err:
            list(rpc.Stub(ch, "ParameterServer").Pull(ps_pb2.PullRequest(vw=99, keys=["x"]), timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


# ---- the test ----------------------------------------------------------------------------------

def test_every_process_exports_the_documented_metrics(make_job) -> None:
    promtool = ensure_promtool()
    docs = contract()
    assert {k: len(v) for k, v in docs.items()} == {"stage": 19, "ps": 7, "coordinator": 5, "grpc": 3}, docs
    job = make_job(JOB)
    out_dir = Path(job.resolve(job.output.dir))
    # `hetpipe run` in its own process, as a user runs it: the coordinator's registry then holds
    # only its own metrics, whatever in-process servers earlier tests in this process started.
    started = time.monotonic()
    log = Path(job.base_dir) / "run.log"  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "run", "--quiet", str(Path(job.base_dir) / "job.yaml")],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    endpoints: dict[str, Endpoint] = {}
    provoked = False
    try:
        while proc.poll() is None:
            if not endpoints:
                with run_token(out_dir):
                    endpoints = _discover(out_dir)
            elif not provoked and _running(out_dir):
                stage = next(e for e in endpoints.values() if e.assigned == "stage 1 of vw 0")
                shard = next(e for e in endpoints.values() if e.assigned == "ps shard 0")
                for e in endpoints.values():
                    e.before = e.text
                with security.using(security.Security(token_file=str(out_dir / TOKEN_FILE)), security.STAGE,
                                    "test"):  # Register, Forward and Pull are a worker's calls
                    _provoke_invalid_argument((out_dir / ADDRESS_FILE).read_text().strip(), stage.address,
                                              shard.address)
                provoked = True
            for e in endpoints.values():
                try:
                    e.scrape(provoked)
                except OSError:
                    pass  # the job just ended and the process is gone: keep its last scrape
            time.sleep(0.1)
    finally:
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
    wall = time.monotonic() - started
    assert proc.returncode == 0, log.read_text()
    assert json.loads((out_dir / "summary.json").read_text())["steps"] == 80
    assert provoked, "the job ended before it could be observed running"
    assert endpoints, "no endpoints discovered"
    by_role: dict[str, list[Endpoint]] = defaultdict(list)
    for e in endpoints.values():
        assert e.after_provoked >= 1, f"{e.role} {e.assigned}: no scrape after the provoked errors"
        by_role[e.role].append(e)
    assert {r: len(v) for r, v in by_role.items()} == {"coordinator": 1, "stage_worker": 4, "ps_shard": 2}

    for e in endpoints.values():
        code, output = promtool_check_metrics(e.text, promtool)
        assert code == 0 and output == "", f"promtool check metrics on {e.role} {e.assigned}:\n{output}"
        s = Samples.parse(e.text)
        where = f"{e.role} {e.assigned}".strip()
        check_contract(s, docs["grpc"], where)
        assert set(s.get("hetpipe_grpc_server_handled_total")) and all(
            ls["role"] == e.role for f, _, ls, _ in s.rows if f == "hetpipe_grpc_server_handled"), where
        {"coordinator": _check_coordinator, "stage_worker": _check_stage, "ps_shard": _check_shard}[e.role](
            s, e, docs)
    print(f"\nmetrics test: {wall:.1f}s for the job with scraping; "
          f"{sum(e.scrapes for e in endpoints.values())} scrapes of {len(endpoints)} endpoints")


def _discover(out_dir: Path) -> dict[str, Endpoint]:
    """Every process's metrics endpoint, once all have registered: the coordinator's from the
    embedded `hetpipe run`'s Prometheus targets file, the workers' from ListWorkers."""
    targets = out_dir / TARGETS_FILE
    address_file = out_dir / ADDRESS_FILE
    if not (targets.exists() and address_file.exists()):
        return {}
    coord = [t for entry in json.loads(targets.read_text()) if entry["labels"]["role"] == "coordinator"
             for t in entry["targets"]]
    with rpc.channel(address_file.read_text().strip()) as ch:
        try:
            workers = coordinator_pb2_grpc.CoordinatorStub(ch).ListWorkers(wire_pb2.Empty(), timeout=5).workers
        except grpc.RpcError:
            return {}
    if len(workers) < 6 or not all(w.assigned for w in workers):
        return {}  # not all claimed yet: the labels ("stage 1 of vw 0") come with the claim
    out = {"coordinator": Endpoint("coordinator", int(coord[0].rsplit(":", 1)[1]))}
    for w in workers:
        role = "stage_worker" if w.info.role == Info.STAGE_WORKER else "ps_shard"
        out[w.assigned] = Endpoint(role, w.info.metrics_port, w.assigned, w.info.address)
    return out


def _running(out_dir: Path) -> bool:
    try:
        address = (out_dir / ADDRESS_FILE).read_text().strip()
    except FileNotFoundError:  # the run has ended: the launcher removes it
        return False
    with run_token(out_dir), rpc.channel(address) as ch:
        try:
            state = coordinator_pb2_grpc.CoordinatorStub(ch).GetJob(coordinator_pb2.JobRef(), timeout=5).state
            return bool(state == coordinator_pb2.JobStatus.RUNNING)
        except grpc.RpcError:  # the job ended and the coordinator with it
            return False


def _handled(s: Samples, method: str, code: str) -> float:
    return sum(s.get("hetpipe_grpc_server_handled_total", grpc_method=method, grpc_code=code))


def _check_coordinator(s: Samples, e: Endpoint, docs: dict[str, list[Documented]]) -> None:
    check_contract(s, docs["coordinator"], "coordinator")
    states = {ls["state"]: v for _, name, ls, v in s.rows if name == "hetpipe_job_state"}
    assert sum(states.values()) == 1 and set(states) == {
        "NONE", "PENDING", "PLANNED", "RUNNING", "COMPLETED", "FAILED", "STOPPED"}, states
    assert e.seen_running, "no scrape showed the job RUNNING"
    # While it ran (once it ends, the workers that said they are stopping count as not alive at once).
    running = Samples.parse(e.running)
    assert running.one("hetpipe_workers", role="stage_worker", alive="true") == 4
    assert running.one("hetpipe_workers", role="ps_shard", alive="true") == 2
    assert running.one("hetpipe_job_samples_per_second") > 0
    if states["RUNNING"] == 0:   # an ended job trains nothing: its last rate must not stay on the dashboards
        assert s.one("hetpipe_job_samples_per_second") == 0
    assert 0 < s.one("hetpipe_job_loss") < 10
    assert s.one("hetpipe_job_evicted", vw="0") == s.one("hetpipe_job_evicted", vw="1") == 0
    for method in ("Register", "Heartbeat", "GetJob", "ListWorkers"):  # the job came at start, as with --job
        assert _handled(s, method, "OK") >= 1, method
    # This process may have run other coordinators before (one registry per process): a delta.
    assert e.before, "no coordinator scrape before the provoked errors"
    before = Samples.parse(e.before)
    assert _handled(s, "Register", "INVALID_ARGUMENT") - _handled(before, "Register", "INVALID_ARGUMENT") == 1
    assert s.one("hetpipe_grpc_server_handling_seconds_count", grpc_service="hetpipe.v1.Coordinator",
                 grpc_method="Heartbeat") >= 1


def _check_stage(s: Samples, e: Endpoint, docs: dict[str, list[Documented]]) -> None:
    stage_docs = [d for d in docs["stage"] if d.name != "hetpipe_stage_loss"]
    last = e.assigned.startswith("stage 1")
    check_contract(s, stage_docs + ([d for d in docs["stage"] if d.name == "hetpipe_stage_loss"] if last else []),
                   e.assigned)
    vw, stage = re.match(r"stage (\d) of vw (\d)", e.assigned).group(2, 1)  # type: ignore[union-attr]
    labels = {"vw": vw, "stage": stage}
    assert s.one("hetpipe_stage_samples_total", **labels) > 0
    assert s.one("hetpipe_stage_compute_seconds_total", phase="forward", **labels) > 0
    assert s.one("hetpipe_stage_compute_seconds_total", phase="backward", **labels) > 0
    # Every stage waits for its first input (or gradient): some idle time is always there.
    assert s.one("hetpipe_stage_idle_seconds_total", **labels) > 0
    depth = s.one("hetpipe_stage_queue_depth", **labels)
    assert depth == int(depth) and 0 <= depth <= 2 * NM  # at most nm activations and nm gradients wait
    assert 0 <= s.one("hetpipe_stage_in_flight_minibatches", **labels) <= NM
    sent = "backward" if last else "forward"
    assert s.one("hetpipe_stage_sent_bytes_total", phase=sent, **labels) > 0
    assert s.one("hetpipe_stage_sent_bytes_total", phase="forward" if last else "backward", **labels) == 0
    # transport auto, every process on this host: what it sent and pushed went through shared memory
    assert s.one("hetpipe_stage_shm_bytes_total", **labels) >= s.one("hetpipe_stage_sent_bytes_total", phase=sent,
                                                                      **labels)
    wait = s.one("hetpipe_stage_pull_wait_seconds_total", **labels)
    assert 0 <= s.one("hetpipe_stage_pull_wait_idle_seconds_total", **labels) <= wait + 0.5
    clock = s.one("hetpipe_stage_local_clock", **labels)
    assert clock >= 1 and 0 <= s.one("hetpipe_stage_min_clock", **labels) <= clock
    for hist in ("push_seconds", "pull_seconds", "staleness_minibatches", "global_staleness_waves"):
        assert s.one(f"hetpipe_stage_{hist}_count", **labels) >= 1, hist
        assert s.one(f"hetpipe_stage_{hist}_bucket", le="+Inf", **labels) == s.one(
            f"hetpipe_stage_{hist}_count", **labels)
    if last:
        assert 0 < s.one("hetpipe_stage_loss", **labels) < 10
    used = s.one("hetpipe_device_memory_bytes", kind="used", **labels)
    capacity = s.one("hetpipe_device_memory_bytes", kind="capacity", **labels)
    assert 0 < used < capacity == gpu_type("t4").memory_bytes, (used, capacity)  # emulated: by accounting
    info = [(ls, v) for _, name, ls, v in s.rows if name == "hetpipe_stage_info"]
    assert len(info) == 1 and info[0][1] == 1
    assert info[0][0] == {**labels, "gpu": "t4", "device": "cpu", "emulated": "true"}, info
    # Through shared memory every bundle is one frame: it goes over the peer's link socket, not gRPC.
    first = e.assigned.startswith("stage 0 ")
    sent = {"forward": not last, "backward": not first}
    for phase, sends in sent.items():
        bundles = s.one("hetpipe_stage_link_socket_bundles_total", phase=phase, **labels)
        assert (bundles > 0) == sends, (phase, bundles)
    # The receiver counts a link socket's bundles as messages of the stream it stands in for.
    received = {"ForwardLink": not first, "BackwardLink": not last}
    for method, receives in received.items():
        assert (sum(s.get("hetpipe_grpc_server_msg_received_total", grpc_method=method)) > 0) == receives, method
    if e.assigned == "stage 1 of vw 0":
        assert _handled(s, "Forward", "INVALID_ARGUMENT") == 1
    for method in ("Assign", "Start", "Status"):
        assert _handled(s, method, "OK") >= 1, method


def _check_shard(s: Samples, e: Endpoint, docs: dict[str, list[Documented]]) -> None:
    check_contract(s, docs["ps"], e.assigned)
    shards = {ls["shard"] for _, name, ls, _ in s.rows if name.startswith("hetpipe_ps_")}
    shard = e.assigned.rsplit(" ", 1)[1]  # the coordinator claimed it as "ps shard i" of the plan
    assert shards == {shard}, shards
    assert s.one("hetpipe_ps_pushes_total", shard=shard, outcome="applied") > 0
    assert s.one("hetpipe_ps_pushes_total", shard=shard, outcome="duplicate") == 0  # no retries when healthy
    assert s.one("hetpipe_ps_received_bytes_total", shard=shard) > 0
    assert s.one("hetpipe_ps_sent_bytes_total", shard=shard) > 0
    clocks = [s.one("hetpipe_ps_vw_clock", shard=shard, vw=str(v)) for v in range(2)]
    assert min(clocks) >= 1 and s.one("hetpipe_ps_global_clock", shard=shard) == min(clocks)
    distance = s.one("hetpipe_ps_clock_distance", shard=shard)
    assert distance == max(clocks) - min(clocks) and distance <= D + 1
    for method in ("Init", "PushFrame", "Pull"):
        assert _handled(s, method, "OK") >= 1, method
    if e.assigned == "ps shard 0":
        assert _handled(s, "Pull", "INVALID_ARGUMENT") == 1
    assert math.isfinite(s.one("hetpipe_grpc_server_handling_seconds_sum", grpc_service="hetpipe.v1.ParameterServer",
                               grpc_method="PushFrame"))


# ---- the interceptor alone, in process (fast) ---------------------------------------------------

def test_interceptor_counts_every_kind_of_rpc_with_its_final_code(tmp_path: Path) -> None:
    """Unary and streaming requests and responses, aborts, a deadline, and the health service,
    on one shard servicer in this process: each RPC counted once, under the code the client saw."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hetpipe.metrics import REGISTRY
    from ps_server import metrics as shard_metrics
    from ps_server.servicer import ShardServicer
    from ps_server.shard import Shard

    role = "interceptor_test"
    service = "hetpipe.v1.ParameterServer"

    def handled(method: str, code: str, svc: str = service) -> float:
        labels = {"role": role, "grpc_service": svc, "grpc_method": method, "grpc_code": code}
        return REGISTRY.get_sample_value("hetpipe_grpc_server_handled_total", labels) or 0.0

    def timed(method: str) -> float:
        labels = {"role": role, "grpc_service": service, "grpc_method": method}
        return REGISTRY.get_sample_value("hetpipe_grpc_server_handling_seconds_count", labels) or 0.0

    servicer = ShardServicer(Shard(), None, max_pull_wait_s=30.0)
    server = rpc.Server("127.0.0.1", 0, role=role, workers=8)
    server.add("ParameterServer", servicer)
    shard_metrics.bind(servicer.metrics_snapshot)
    server.start()
    w = [("w", torch.ones(3))]
    try:
        with rpc.channel(server.address) as ch:
            stub = rpc.Stub(ch, "ParameterServer")
            # stream request, unary response
            stub.Init(wire.encode(w, init=wire_pb2.InitTag(virtual_workers=2, shard=3)), timeout=5)
            stub.Push(wire.encode(w, push=wire_pb2.PushTag(vw=0, clock=0)), timeout=5)
            with pytest.raises(grpc.RpcError) as err:  # a clock that skips ahead: FAILED_PRECONDITION
                stub.Push(wire.encode(w, push=wire_pb2.PushTag(vw=0, clock=5)), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # unary request, streaming response: OK, refused, and out of time
            assert len(list(stub.Pull(ps_pb2.PullRequest(vw=0, keys=["w"]), timeout=5))) >= 1
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Pull(ps_pb2.PullRequest(vw=0, keys=["nope"]), timeout=5))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as err:  # vw 1 never pushes: c_global stays 0
                list(stub.Pull(ps_pb2.PullRequest(vw=0, keys=["w"], min_clock=1), timeout=1.5))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            stub.Status(wire_pb2.Empty(), timeout=5)
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        deadline = time.monotonic() + 5  # the server records a streamed RPC as its last frame is taken
        while timed("Pull") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (handled("Init", "OK"), handled("Push", "OK"), handled("Push", "FAILED_PRECONDITION")) == (1, 1, 1)
        assert (handled("Pull", "OK"), handled("Pull", "NOT_FOUND"), handled("Pull", "DEADLINE_EXCEEDED")) == (1, 1, 1)
        assert handled("Status", "OK") == 1 and handled("Check", "OK", "grpc.health.v1.Health") == 1
        assert (timed("Init"), timed("Push"), timed("Pull"), timed("Status")) == (1, 2, 3, 1)
        assert REGISTRY.get_sample_value("hetpipe_ps_pushes_total", {"shard": "3", "outcome": "applied"}) == 1
        assert REGISTRY.get_sample_value("hetpipe_ps_received_bytes_total", {"shard": "3"}) == 12
        assert REGISTRY.get_sample_value("hetpipe_ps_sent_bytes_total", {"shard": "3"}) == 12
    finally:
        server.stop()
        shard_metrics.unbind()
