"""`hetpipe compose`: the docker compose file of a job's cluster spec and plan.

One explicit service per planned stage and per parameter-server shard, plus the coordinator,
Prometheus and Grafana, sharing their settings through YAML anchors. Every stage has two
variants: `vwV-stageQ` under the `cpu` profile (emulated on the CPU, image hetpipe:cpu) and
`vwV-stageQ-gpu` under the `gpu` profile (its own GPU of this host, image hetpipe:cuda), which
answers to the same name on the network. The repository's `.env` makes `cpu` the default
profile. The text is written line by line, not dumped, so that the output is the same bytes for
the same job, plan and paths: the checked-in compose.yaml is this module's output for
examples/compose-cluster.yaml (tests/unit/test_compose.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
from dataclasses import dataclass
from modulefinder import ModuleFinder
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from hetpipe import outputs
from hetpipe.catalog import CATALOG
from hetpipe.config import JobConfig

log = logging.getLogger(__name__)

if TYPE_CHECKING:   # the planner imports torch, which writing these files does not need
    from coordinator.planner import Plan

# Inside the containers (docker/Dockerfile): every service listens for gRPC on WORKER_PORT, the
# coordinator on COORDINATOR_PORT, and serves metrics on METRICS_PORT, which
# docker/prometheus/prometheus.yml scrapes on every service name.
WORKER_PORT = 50051
COORDINATOR_PORT = 50050   # published as is: `hetpipe status`'s default port
METRICS_PORT = 9100
# Host ports of the metrics, one per service in file order; 9100 itself is node_exporter's.
HOST_METRICS_BASE = 19100
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000
HOST_IP = "127.0.0.1"      # published on loopback only, though every gRPC service needs TLS and the token
HEALTH_PORT = 50052        # plaintext gRPC health alone, for the healthchecks (hetpipe.service --health-port)
CERTS = "/certs"           # named volume: the CA, the cluster certificate and token, made by the certs service
CERT_NAME = "cluster"      # one certificate for every service, its names as subject alternative names
GRAFANA_PASSWORD = "grafana-admin-password"
JOB_MOUNT = "/etc/hetpipe/job.yaml"
RUNS = "/runs"             # named volume: outputs and shard checkpoints
CPU_PROFILE, GPU_PROFILE = "cpu", "gpu"
CPU_IMAGE, GPU_IMAGE = "hetpipe:cpu", "hetpipe:cuda"
PROMETHEUS_IMAGE = "prom/prometheus:v3.1.0"
GRAFANA_IMAGE = "grafana/grafana:11.4.0"
# Workers start after the coordinator is healthy, then import torch: give them time on a laptop.
CLAIM_TIMEOUT_S = 600
COORDINATOR_RESTARTS = 3   # a coordinator that crashed comes back this often (restart: on-failure:N)
ENTRY_POINTS = ("coordinator", "ps_server", "stage_worker")
# Installed in every image (pyproject.toml's packages): never carried beside the job file.
OWN_PACKAGES = ("hetpipe", "coordinator", "ps_server", "stage_worker", "baselines", "launch")


@dataclass(frozen=True, slots=True)
class StageService:
    name: str        # vwV-stageQ; the GPU variant is named name-gpu and answers to name too
    vw: int
    stage: int
    node: str
    gpu: str         # catalog type; "" for a job without a cluster spec (generic workers)
    device_id: int   # this host's GPU: the cluster's GPUs numbered in job-file order


@dataclass(frozen=True, slots=True)
class ShardService:
    name: str
    index: int
    node: str


@dataclass(frozen=True, slots=True)
class Mount:
    source: str      # host path, relative to the compose file's folder
    target: str      # container path


def stage_services(job: JobConfig, plan: Plan) -> list[StageService]:
    """A service per planned stage, with the host GPU it reserves under the `gpu` profile.

    Compose runs on one host, so the cluster's nodes are groups of this host's GPUs, numbered in
    the job file's order (n0's first). Which GPU of a (node, type) a stage gets does not matter.
    """
    free: dict[tuple[str, str], list[int]] = {}
    index = 0
    for node in job.cluster.nodes if job.cluster else ():
        for group in node.gpus:
            for _ in range(group.count):
                free.setdefault((node.name, group.type), []).append(index)
                index += 1
    out = []
    for i, s in enumerate(plan.stages):
        if job.cluster is None:
            gpu, device = "", i
        else:
            gpu, device = s.gpu, free[(s.node, s.gpu)].pop(0)
        out.append(StageService(f"vw{s.vw}-stage{s.stage}", s.vw, s.stage, s.node, gpu, device))
    return out


def shard_services(job: JobConfig) -> list[ShardService]:
    """The shards the coordinator claims: none for a lone VW (its local weights are w_global).
    One per node in turn, as in the paper; the node is only a label for shards."""
    nodes = [n.name for n in job.cluster.nodes] if job.cluster else ["local"]
    count = job.parallel.started_shards
    return [ShardService(f"ps-{i}", i, nodes[i % len(nodes)]) for i in range(count)]


def _relative(path: Path, start: Path) -> str:
    """path from start, POSIX style, starting with ./ or ../ as compose's bind sources do."""
    rel = Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()
    if rel == "." or rel == ".." or rel.startswith("../"):
        return rel
    return f"./{rel}"


def job_file_mounts(job: JobConfig, compose_dir: Path) -> list[Mount]:
    """Files the job names (data.path, model.init) and the modules of its factories that sit
    beside the job file (a package folder or NAME.py; others must be installed in the image),
    mounted where the job, read from JOB_MOUNT, resolves them: the coordinator and the stages
    read the data and build the model, the coordinator reads the init."""
    mounts = []
    for path in (job.data.path if job.data.name == "npz" else None, job.model.init):
        if not path:
            continue
        target = path if posixpath.isabs(path) else posixpath.normpath(
            posixpath.join(posixpath.dirname(JOB_MOUNT), path))
        mounts.append(Mount(_relative(job.resolve(path), compose_dir), target))
        for part in index_parts(job.resolve(path)):   # a sharded model.init: its files beside the index
            mounts.append(Mount(_relative(job.resolve(path).parent / part, compose_dir),
                                posixpath.join(posixpath.dirname(target), part)))
    for module in sorted(factory_modules(job)):
        mounts.append(Mount(_relative(Path(job.base_dir) / module, compose_dir),
                            posixpath.join(posixpath.dirname(JOB_MOUNT), module)))
    return mounts


def index_parts(path: Path) -> list[str]:
    """The files a safetensors index (model.safetensors.index.json) names beside it; none for any
    other file. preflight has checked the index before this reads it."""
    if not path.name.endswith(outputs.INDEX_SUFFIX):
        return []
    return sorted(set(outputs.read_weight_map(path).values()))


def factory_modules(job: JobConfig) -> set[str]:
    """The top-level packages (folders) and modules (NAME.py) beside the job file that its
    factories import, and those their code imports in turn: what a container needs besides the
    image to build the model and data. Found by reading the code (modulefinder), running none;
    a name given to importlib at run time is not found. HetPipe's own packages are the image's."""
    base = Path(os.path.abspath(job.base_dir))   # not resolved: a module may be a link beside the job file
    found: set[str] = set()
    for spec in job.factories.values():
        module = spec.partition(":")[0]
        top = module.partition(".")[0]
        found.update(name for name in (top, f"{top}.py") if (base / name).exists())
        finder = ModuleFinder(path=[str(base)])   # only what lies beside the job file is found
        try:
            finder.import_hook(module)
        except Exception as exc:   # modulefinder raises more than ImportError; preflight imports it for real
            log.debug("modulefinder could not import %s (%s)", module, exc)
            # A folder without __init__.py (a namespace package) is one it cannot import: read
            # the module's own file as a script instead, for what it imports.
            file = base / (module.replace(".", "/") + ".py")
            with contextlib.suppress(Exception):
                if file.is_file():
                    finder.run_script(str(file))
        for found_module in finder.modules.values():   # (typeshed's Module lacks __file__)
            name = getattr(found_module, "__file__", None)
            path = Path(os.path.abspath(name)) if name else None   # None: a built-in module
            if path is not None and base in path.parents:
                found.add(path.relative_to(base).parts[0])   # NAME.py, or the package's folder
    return {name for name in found if name.removesuffix(".py") not in OWN_PACKAGES}


def _scalar(value: object) -> str:
    """A YAML scalar that reads back as exactly value: plain when that is safe, else quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    plain = text and all(c.isalnum() or c in "_./-" for c in text) and text[0] != "-"
    if plain and yaml.safe_load(text) == text:
        return text
    return json.dumps(text)


def _flow(items: list[str]) -> str:
    """An exec-form list (command, healthcheck test): JSON, which is YAML."""
    return json.dumps(items)


class _Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, indent: int, text: str = "") -> None:
        self.lines.append(("  " * indent + text).rstrip())

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _port(out: _Lines, indent: int, target: int, published: int) -> None:
    out(indent, f"- {{target: {target}, published: {_scalar(str(published))}, host_ip: {HOST_IP}, protocol: tcp}}")


def _http_healthcheck(out: _Lines, url: str, *, start_period: str) -> None:
    """A service's healthcheck: its HTTP endpoint answers (wget ships with both images)."""
    out(2, "healthcheck:")
    out(3, f"test: {_flow(['CMD', 'wget', '-q', '-O', '/dev/null', url])}")
    out(3, "interval: 5s")
    out(3, "timeout: 3s")
    out(3, "retries: 5")
    out(3, f"start_period: {start_period}")


def _bind(out: _Lines, indent: int, source: str, target: str) -> None:
    out(indent, f"- {{type: bind, source: {_scalar(source)}, target: {_scalar(target)}, read_only: true}}")


def render(job: JobConfig, plan: Plan, *, job_file: Path, compose_dir: Path, root: Path,
           out_name: str = "compose.yaml") -> str:
    """The compose file for job and its plan, to be written in compose_dir.

    job_file: the job YAML (mounted into the coordinator); root: the repository root, for the
    build context and the Prometheus and Grafana files; out_name: the file's name, for the
    regeneration command in the header. Paths in the file are relative to compose_dir.
    """
    stages = stage_services(job, plan)
    shards = shard_services(job)
    mounts = job_file_mounts(job, compose_dir)
    job_source = _relative(job_file, compose_dir)
    context = _relative(root, compose_dir)
    docker_dir = posixpath.join(context, "docker") if context != "." else "./docker"
    output_name = posixpath.basename(posixpath.normpath(job.output.dir))
    if output_name in ("", ".", "..", "/"):
        output_name = "job"
    output_dir = f"{RUNS}/{output_name}"
    config_arg = job_source[2:] if job_source.startswith("./") else job_source

    ports: dict[str, int] = {}
    for name in ["coordinator", *(s.name for s in shards), *(s.name for s in stages),
                 *(f"{s.name}-gpu" for s in stages)]:
        ports[name] = HOST_METRICS_BASE + len(ports)

    out = _Lines()
    # ---- header -------------------------------------------------------------------------------
    if job.cluster is not None:
        described = ", ".join(
            f"{n.name} ({' + '.join(f'{g.count}x {g.type}' for g in n.gpus)})" for n in job.cluster.nodes)
        emulated = "emulated GPU types" if job.cluster.emulate else "real GPUs"
    else:
        described, emulated = "this machine's own devices (no cluster spec)", "generic workers"
    for text in (
        "HetPipe cluster for docker compose. GENERATED by `hetpipe compose` from the job file",
        f"{job_source}: do not edit; change the job file and regenerate, in this folder:",
        f"  hetpipe compose {config_arg} -o {out_name}",
        "",
        f"Cluster: {described}; {emulated}.",
        f"Plan: policy {plan.policy}, {plan.virtual_workers} virtual workers x {plan.stages_per_vw} stages, "
        f"{len(shards)} parameter-server shards.",
        "",
        "Profiles. Every planned stage has two services, and exactly one of them runs:",
        "  docker compose up                   profile cpu (the default: .env sets COMPOSE_PROFILES=cpu;",
        "                                      without that .env add --profile cpu): vwV-stageQ,",
        "                                      image hetpipe:cpu, each stage emulates its GPU type on the CPU",
        "  docker compose --profile gpu up     profile gpu (a --profile flag replaces COMPOSE_PROFILES):",
        "                                      vwV-stageQ-gpu, image hetpipe:cuda, each stage reserves its",
        "                                      own GPU of this host (NVIDIA Container Toolkit); for a job",
        "                                      file that describes this host's GPUs, without cluster.emulate",
        "  docker compose --profile \"*\" down   stop and remove either",
        "The coordinator, the shards, Prometheus and Grafana have no profile: they always run. Never",
        "enable both profiles: the two variants of a stage share its network name. Compose runs on one",
        "host: the cluster's nodes are groups of its GPUs, numbered in the job file's order.",
        "",
        "The coordinator submits the job at start (--job) and waits for the workers, so `up` trains.",
        "Every gRPC call needs mutual TLS and the cluster token: the one-shot `certs` service makes a",
        "CA, a certificate for every service name and a token in the volume `certs`. From the host:",
        f"  docker compose cp certs:{CERTS} ./hetpipe-certs",
        f"  progress:  hetpipe status --coordinator {HOST_IP}:{COORDINATOR_PORT} --tls-cert hetpipe-certs/{CERT_NAME}.pem \\",
        f"               --tls-key hetpipe-certs/{CERT_NAME}.key --tls-ca hetpipe-certs/ca.pem --token-file hetpipe-certs/token",
        f"  results:   docker compose cp coordinator:{output_dir} ./runs/   (volume `runs`)",
        "  again:     docker compose down && docker compose up",
        *(["  (train.checkpoint_every: a run that did not finish, the coordinator's restart too, goes on",
           "  from its latest checkpoint in volume `runs`; a finished one starts over, and so does",
           "  HETPIPE_FRESH=$(date +%s) docker compose up: once per value, so that its restarts go on)"]
          if job.train.checkpoint_every else []),
        f"Host ports, on {HOST_IP} only: coordinator gRPC {COORDINATOR_PORT}, Prometheus {PROMETHEUS_PORT}, "
        f"Grafana {GRAFANA_PORT}",
        f"(user admin, password in hetpipe-certs/{GRAFANA_PASSWORD}; dashboards in the HetPipe folder), and",
        f"metrics (container port {METRICS_PORT}) at:",
        f"  {'coordinator':<16}{ports['coordinator']}",
        *(f"  {s.name:<16}{ports[s.name]}   node {s.node}" for s in shards),
        *(f"  {s.name:<16}{ports[s.name]}   {s.name}-gpu {ports[s.name + '-gpu']}   node {s.node}"
          + (f", {s.gpu}" if s.gpu else "") + f", GPU {s.device_id}" for s in stages),
    ):
        out(0, f"# {text}".rstrip())
    out(0, "name: hetpipe")
    out(0)

    # ---- shared settings ----------------------------------------------------------------------
    out(0, "# Every HetPipe service: one image, the role chosen by the command (docker/Dockerfile).")
    out(0, "x-hetpipe: &hetpipe")
    out(1, f"image: {CPU_IMAGE}")
    out(1, "build: &build")
    out(2, f"context: {_scalar(context)}")
    out(2, "dockerfile: docker/Dockerfile")
    out(2, "args: {VARIANT: cpu}")
    out(1, "init: true")
    out(1, "stop_signal: SIGTERM")
    out(1, "stop_grace_period: 30s")
    out(1, "environment:")
    out(2, "HETPIPE_HOST: 0.0.0.0")
    out(2, f"HETPIPE_PORT: {_scalar(str(WORKER_PORT))}")
    out(2, f"HETPIPE_METRICS_PORT: {_scalar(str(METRICS_PORT))}")
    out(2, 'HETPIPE_THREADS: "1"')
    out(2, f"HETPIPE_TLS_CERT: {CERTS}/{CERT_NAME}.pem")
    out(2, f"HETPIPE_TLS_KEY: {CERTS}/{CERT_NAME}.key")
    out(2, f"HETPIPE_TLS_CA: {CERTS}/ca.pem")
    out(2, f"HETPIPE_TOKEN_FILE: {CERTS}/token")
    out(2, f"HETPIPE_OUTPUT_ROOT: {RUNS}   # where assigned traces and checkpoints may go")
    out(2, "HETPIPE_FRESH: ${HETPIPE_FRESH:-0}   # a new value: the coordinator's job starts over, once")
    out(2, f"HETPIPE_HEALTH_PORT: {_scalar(str(HEALTH_PORT))}")
    out(2, f"HETPIPE_HEALTH_ADDRESS: {_scalar(f'127.0.0.1:{HEALTH_PORT}')}")
    out(1, "depends_on:")
    out(2, "certs: {condition: service_completed_successfully}")
    out(1, "volumes:")
    out(2, f"- &runs {{type: volume, source: runs, target: {RUNS}}}")
    out(2, f"- &certs {{type: volume, source: certs, target: {CERTS}, read_only: true}}")
    out(1, "healthcheck: &healthcheck")
    out(2, f"test: {_flow(['CMD', 'hetpipe-healthcheck'])}")
    out(2, "interval: 5s")
    out(2, "timeout: 3s")
    out(2, "retries: 3")
    out(2, "start_period: 120s")
    out(0)
    out(0, "# Shards and stages register with the coordinator, so they start once it is healthy.")
    out(0, "x-worker: &worker")
    out(1, "<<: *hetpipe")
    # A shard restores its checkpoint (the job waits for it); a process whose coordinator
    # restarted exits 75 (EXIT_ORPHANED) and comes back fresh for the job run again. One that
    # ended as asked (0: its job over) stays down.
    out(1, "restart: on-failure")
    out(1, "depends_on:")
    out(2, "coordinator: {condition: service_healthy}")
    out(0)
    out(0, "x-stage-cpu: &stage-cpu")
    out(1, "<<: *worker")
    out(1, f"profiles: [{CPU_PROFILE}]")
    out(0)
    out(0, "x-stage-gpu: &stage-gpu")
    out(1, "<<: *worker")
    out(1, f"profiles: [{GPU_PROFILE}]")
    out(1, f"image: {GPU_IMAGE}")
    out(1, "build:")
    out(2, "<<: *build")
    out(2, "args: {VARIANT: cuda}")
    out(0)

    # ---- services -----------------------------------------------------------------------------
    out(0, "services:")
    names = ["coordinator", *(s.name for s in shards), *(s.name for s in stages)]
    out(1, "certs:   # one-shot: the CA, the certificate of every service name, the token (kept if there)")
    out(2, f"image: {CPU_IMAGE}")
    out(2, "build: *build")
    certs_command = ["launch.cli", "certs", CERTS, CERT_NAME, *(a for n in names for a in ("--san", n)),
                     "--password-file", GRAFANA_PASSWORD]
    out(2, f"command: {_flow(certs_command)}")
    out(2, "volumes:")
    out(3, f"- {{type: volume, source: certs, target: {CERTS}}}")
    out(0)
    coordinator_address = f"coordinator:{COORDINATOR_PORT}"
    command = ["coordinator", "--port", str(COORDINATOR_PORT), "--job", JOB_MOUNT, "--output-dir", output_dir,
               "--claim-timeout", str(CLAIM_TIMEOUT_S)]
    out(1, "coordinator:")
    out(2, "<<: *hetpipe")
    # One that crashed comes back and runs its --job again (from its latest checkpoint, where the
    # job writes them); the workers follow. Stopped (0) it stays down; a job it refuses at start
    # (2) is retried only a few times.
    out(2, f"restart: on-failure:{COORDINATOR_RESTARTS}")
    out(2, f"command: {_flow(command)}")
    out(2, "volumes:")
    out(3, "- *runs")
    out(3, "- *certs")
    _bind(out, 3, job_source, JOB_MOUNT)
    for m in mounts:
        _bind(out, 3, m.source, m.target)
    out(2, "ports:")
    _port(out, 3, COORDINATOR_PORT, COORDINATOR_PORT)
    _port(out, 3, METRICS_PORT, ports["coordinator"])

    for shard in shards:
        out(0)
        command = ["ps_server", "--coordinator", coordinator_address, "--advertise", f"{shard.name}:{WORKER_PORT}",
                   "--node", shard.node, "--checkpoint-dir", f"{output_dir}/ps/shard{shard.index}"]
        out(1, f"{shard.name}:")
        out(2, "<<: *worker")
        out(2, f"command: {_flow(command)}")
        out(2, "ports:")
        _port(out, 3, METRICS_PORT, ports[shard.name])

    for gpu in (False, True):
        for s in stages:
            out(0)
            command = ["stage_worker", "--coordinator", coordinator_address, "--advertise", f"{s.name}:{WORKER_PORT}",
                       "--node", s.node, *(["--gpu-type", s.gpu] if s.gpu in CATALOG else [])]
            name = f"{s.name}-gpu" if gpu else s.name
            out(1, f"{name}:")
            out(2, "<<: *stage-gpu" if gpu else "<<: *stage-cpu")
            out(2, f"command: {_flow(command)}")
            if mounts:
                out(2, "volumes:")
                out(3, "- *runs")
                out(3, "- *certs")
                for m in mounts:
                    _bind(out, 3, m.source, m.target)
            out(2, "ports:")
            _port(out, 3, METRICS_PORT, ports[name])
            if gpu:
                out(2, "networks:")
                out(3, "default:")
                out(4, f"aliases: [{s.name}]")
                out(2, "deploy:")
                out(3, "resources:")
                out(4, "reservations:")
                out(5, "devices:")
                out(6, f"- {{driver: nvidia, device_ids: [{_scalar(str(s.device_id))}], capabilities: [gpu]}}")

    out(0)
    out(1, "prometheus:")
    out(2, f"image: {PROMETHEUS_IMAGE}")
    out(2, "volumes:")
    _bind(out, 3, f"{docker_dir}/prometheus/prometheus.yml", "/etc/prometheus/prometheus.yml")
    out(2, "ports:")
    _port(out, 3, PROMETHEUS_PORT, PROMETHEUS_PORT)
    _http_healthcheck(out, f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready", start_period="30s")
    out(0)
    out(1, "grafana:")
    out(2, f"image: {GRAFANA_IMAGE}")
    out(2, "depends_on:")
    out(3, "prometheus: {condition: service_healthy}")
    out(3, "certs: {condition: service_completed_successfully}")
    out(2, "environment:")
    out(3, 'GF_AUTH_ANONYMOUS_ENABLED: "false"')
    out(3, f"GF_SECURITY_ADMIN_PASSWORD__FILE: {CERTS}/{GRAFANA_PASSWORD}")
    out(2, "volumes:")
    _bind(out, 3, f"{docker_dir}/grafana/provisioning", "/etc/grafana/provisioning")
    out(3, f"- {{type: volume, source: certs, target: {CERTS}, read_only: true}}")
    out(2, "ports:")
    _port(out, 3, GRAFANA_PORT, GRAFANA_PORT)
    _http_healthcheck(out, f"http://127.0.0.1:{GRAFANA_PORT}/api/health", start_period="60s")
    out(0)
    out(0, "volumes:")
    out(1, "runs: {}")
    out(1, "certs: {}")
    return out.text()


def repository_root() -> Path:
    """Where docker/Dockerfile is: the source tree this package runs from, else the working folder."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "docker" / "Dockerfile").exists() else Path.cwd()
