"""compose.yaml, `hetpipe compose` and the image (issue 5, Must show).

The checked-in compose.yaml validates offline against the compose-spec JSON schema and keeps
the project's rules: healthchecks throughout, every depends_on target has one, host ports are
unique, every command is a real entry point whose --help exits 0, the GPU services sit under the
`gpu` profile; and it is byte for byte what `hetpipe compose examples/compose-cluster.yaml`
prints. No Docker engine is needed: everything is checked statically, plus the health-check
script against a real gRPC health service.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hetpipe.config import ConfigError
from launch import cli
from launch.local import preflight
from hetpipe.config import load_job
from launch import compose
from coordinator.planner import make_plan

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
EXAMPLE = ROOT / "examples" / "compose-cluster.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
CONFIG_MODULES = {"coordinator": "coordinator.config", "ps_server": "ps_server.config",
                  "stage_worker": "stage_worker.config"}


def _doc() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _services() -> dict[str, dict[str, Any]]:
    return _doc()["services"]


def _project(service: dict[str, Any]) -> bool:
    """A service of this project's image (built from docker/Dockerfile), not a third-party one."""
    return "build" in service


def _one_shot(service: dict[str, Any]) -> bool:
    """The certs service: runs `hetpipe certs` and exits; the others wait for it to succeed."""
    return service.get("command", [""])[0] == "launch.cli"


@pytest.fixture(scope="module", autouse=True)
def help_runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """`python -m MODULE ARGS --help` for the first service of each entry point, started before the
    first test so that they run alongside the others: the stage worker imports torch before it
    parses its flags, which takes seconds."""
    first: dict[str, list[str]] = {}
    for service in _services().values():
        if _project(service) and not _one_shot(service):
            first.setdefault(service["command"][0], service["command"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = {module: subprocess.Popen([sys.executable, "-m", *command, "--help"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for module, command in first.items()}
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.communicate()


# ---- the schema and the project's rules ---------------------------------------------------------


def test_validates_against_the_compose_spec_schema_offline(tmp_path: Path) -> None:
    """check-jsonschema's vendored compose-spec schema (no network). A copy with one broken field
    rides along in the same run, to show that the check does look at the services."""
    bad = tmp_path / "broken.yaml"
    bad.write_text(COMPOSE.read_text().replace("capabilities: [gpu]", "capabilities: gpu"))
    done = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(COMPOSE), str(bad)], capture_output=True, text=True, timeout=60)
    errors = [ln for ln in done.stdout.splitlines() if "::" in ln]
    assert done.returncode == 1 and errors, (f"check-jsonschema (dev extra, pinned in constraints.txt; "
                                             f"`make install`):\n{done.stdout}{done.stderr}")
    assert all(ln.strip().startswith(f"{bad}::") and "capabilities" in ln for ln in errors), done.stdout


def test_services_coordinator_shards_stages_prometheus_grafana() -> None:
    services = _services()
    job, plan = load_job(EXAMPLE), make_plan(load_job(EXAMPLE))
    stages = [f"vw{s.vw}-stage{s.stage}" for s in plan.stages]
    shards = [f"ps-{i}" for i in range(plan.shards)]
    assert job.cluster is not None and len(stages) == 4 and len(shards) == 2
    assert list(services) == ["certs", "coordinator", *shards, *stages, *(f"{s}-gpu" for s in stages), "prometheus",
                              "grafana"]
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def test_every_service_has_a_healthcheck_and_every_dependency_is_on_health() -> None:
    services = _services()
    for name, service in services.items():
        if _one_shot(service):
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert not service["healthcheck"].get("disable"), name
        for target, dep in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            if _one_shot(services[target]):
                assert dep == {"condition": "service_completed_successfully"}, f"{name} -> {target}: {dep}"
                continue
            assert services[target].get("healthcheck", {}).get("test"), f"{name} -> {target}: no healthcheck"
            assert dep == {"condition": "service_healthy"}, f"{name} -> {target}: {dep}"
    for name, service in services.items():
        if name != "coordinator" and _project(service) and not _one_shot(service):
            assert "coordinator" in service["depends_on"], f"{name} registers with the coordinator"
    assert "prometheus" in services["grafana"]["depends_on"]


def test_shards_and_stages_come_back_after_a_failure_and_stay_down_after_their_job() -> None:
    """A shard restores its checkpoint; a process whose coordinator restarted exits 75 and comes
    back fresh for the job run again; one that ended as asked (0) stays down. A coordinator that
    crashed comes back and runs its job again, a few times at most (one that refuses its job
    at start exits 2 each time)."""
    for name, service in _services().items():
        if service.get("command", [""])[0] in ("ps_server", "stage_worker"):
            assert service.get("restart") == "on-failure", name
    assert _services()["coordinator"]["restart"] == "on-failure:3"


def test_project_healthchecks_call_the_grpc_health_script() -> None:
    """On the plaintext health-only port: the gRPC port itself needs TLS and the token."""
    for name, service in _services().items():
        if _project(service) and not _one_shot(service):
            test = service["healthcheck"]["test"]
            assert test == ["CMD", "hetpipe-healthcheck"], (name, test)
            env = service["environment"]
            assert env["HETPIPE_HEALTH_ADDRESS"] == f"127.0.0.1:{env['HETPIPE_HEALTH_PORT']}", name


def test_every_project_service_has_tls_and_the_token_and_grafana_a_password() -> None:
    services = _services()
    for name, service in services.items():
        if not _project(service) or _one_shot(service):
            continue
        env = service["environment"]
        assert {env[k] for k in ("HETPIPE_TLS_CERT", "HETPIPE_TLS_KEY", "HETPIPE_TLS_CA", "HETPIPE_TOKEN_FILE")} == {
            "/certs/cluster.pem", "/certs/cluster.key", "/certs/ca.pem", "/certs/token"}, name
        certs = [v for v in service["volumes"] if isinstance(v, dict) and v["source"] == "certs"]
        assert certs == [{"type": "volume", "source": "certs", "target": "/certs", "read_only": True}], name
    command = services["certs"]["command"]
    sans = {command[i + 1] for i, a in enumerate(command) if a == "--san"}
    assert sans == {n for n in services if _project(services[n]) and not _one_shot(services[n])
                    and not n.endswith("-gpu")}  # the -gpu twins answer to their twin's name
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/certs/grafana-admin-password"
    assert "grafana-admin-password" in command


def test_host_ports_are_unique() -> None:
    published = []
    for name, service in _services().items():
        for p in service.get("ports", []):
            assert isinstance(p, dict), f"{name}: long port syntax expected, got {p!r}"
            published.append((p.get("host_ip", ""), int(p["published"]), p.get("protocol", "tcp"), name))
    ports = [(ip, port, proto) for ip, port, proto, _ in published]
    duplicates = {p for p in ports if ports.count(p) > 1}
    assert not duplicates, [x for x in published if x[:3] in duplicates]
    numbers = {port: name for _, port, _, name in published}
    assert numbers[50050] == "coordinator" and numbers[9090] == "prometheus" and numbers[3000] == "grafana"
    # Every project service publishes its metrics port, each on its own host port.
    for name, service in _services().items():
        if _project(service) and not _one_shot(service):
            assert any(p["target"] == compose.METRICS_PORT for p in service["ports"]), name


def test_every_command_is_an_entry_point_whose_help_exits_0(help_runs: dict[str, subprocess.Popen[str]]) -> None:
    """Each project service's command parses with its module's own parser (so no flag is unknown or
    malformed) and `python -m MODULE ARGS --help` exits 0; third-party images are skipped."""
    modules = set()
    for name, service in _services().items():
        if not _project(service):
            continue
        module, *args = service["command"]
        if _one_shot(service):
            assert cli.parser().parse_args(args).func.__name__ == "_certs", name
            continue
        assert module in CONFIG_MODULES, f"{name}: {module} is not an entry point of this project"
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module
        importlib.import_module(CONFIG_MODULES[module]).parse_args(args)  # SystemExit(2) on a bad flag
        modules.add(module)
    assert modules == set(CONFIG_MODULES)
    for module, proc in help_runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"python -m {module} ... --help: {err[-2000:]}"
        assert "usage: python -m " + module in out


def test_gpu_services_sit_under_the_gpu_profile() -> None:
    services = _services()
    gpu = {n for n, s in services.items() if s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")}
    assert gpu == {n for n in services if n.endswith("-gpu")} and len(gpu) == 4
    device_ids = []
    for name in gpu:
        s = services[name]
        assert s["profiles"] == ["gpu"], name
        assert s["image"] == compose.GPU_IMAGE and s["build"]["args"] == {"VARIANT": "cuda"}
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"] and "count" not in dev
        device_ids += dev["device_ids"]
        twin = services[name.removesuffix("-gpu")]
        assert twin["profiles"] == ["cpu"] and "deploy" not in twin and twin["image"] == compose.CPU_IMAGE
        assert twin["command"] == s["command"]  # same plan, same flags
        assert s["networks"]["default"]["aliases"] == [name.removesuffix("-gpu")]  # same address
    assert sorted(device_ids) == ["0", "1", "2", "3"]
    # Everything else always runs; .env makes `cpu` the default profile.
    for name, s in services.items():
        if name not in gpu and not re.fullmatch(r"vw\d+-stage\d+", name):
            assert "profiles" not in s, name
    assert re.search(r"^COMPOSE_PROFILES=cpu$", (ROOT / ".env").read_text(), re.M)


def test_stage_services_follow_the_plan() -> None:
    """Each stage service registers as its planned stage's (node, GPU type) and is reachable at its
    own service name; the coordinator claims workers by (node, type)."""
    services = _services()
    plan = make_plan(load_job(EXAMPLE))
    for s in plan.stages:
        command = services[f"vw{s.vw}-stage{s.stage}"]["command"]
        flags = dict(zip(command[1::2], command[2::2]))
        assert flags == {"--coordinator": "coordinator:50050", "--advertise": f"vw{s.vw}-stage{s.stage}:50051",
                         "--node": s.node, "--gpu-type": s.gpu}
    coordinator = services["coordinator"]
    assert "--job" in coordinator["command"]
    job_mount = coordinator["command"][coordinator["command"].index("--job") + 1]
    binds = {v["target"]: v["source"] for v in coordinator["volumes"] if isinstance(v, dict) and v["type"] == "bind"}
    assert binds[job_mount] == "./examples/compose-cluster.yaml"


def test_mounted_and_built_paths_exist() -> None:
    for name, service in _services().items():
        for v in service.get("volumes", []):
            if v["type"] == "bind":
                assert (ROOT / v["source"]).exists(), f"{name}: {v['source']}"
        if _project(service):
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == DOCKERFILE


# ---- the checked-in file is the generated one ---------------------------------------------------


def test_checked_in_file_is_the_generated_one(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    assert cli.main(["compose", "examples/compose-cluster.yaml"]) == 0
    generated = capsys.readouterr().out
    assert generated.encode() == COMPOSE.read_bytes(), (
        "compose.yaml is stale: run `hetpipe compose examples/compose-cluster.yaml -o compose.yaml`")


def test_output_file_paths_are_relative_to_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "deploy" / "compose.yaml"   # its folder made, as `hetpipe k8s -o` makes its own
    assert cli.main(["compose", str(EXAMPLE), "-o", str(out), "--context", str(ROOT)]) == 0
    doc = yaml.safe_load(out.read_text())
    for name, service in doc["services"].items():
        for v in service.get("volumes", []):
            if v["type"] == "bind":
                assert (out.parent / v["source"]).resolve().exists(), (name, v)
        if "build" in service:
            assert (out.parent / service["build"]["context"]).resolve() == ROOT
    # The same cluster, only the paths differ.
    assert {n: s["command"] for n, s in doc["services"].items() if "command" in s} == \
        {n: s["command"] for n, s in _services().items() if "command" in s}
    # A context that is no source tree would build nothing: refused, nothing written.
    elsewhere = tmp_path / "elsewhere.yaml"
    assert cli.main(["compose", str(EXAMPLE), "-o", str(elsewhere), "--context", str(tmp_path)]) == cli.EXIT_USAGE
    assert not elsewhere.exists()


def test_generated_file_for_other_jobs(make_job: Any, tmp_path: Path) -> None:
    """One VW: no shards (it needs none); no cluster spec: generic workers on node `local`; an npz
    data file is mounted where the job, read from its mount point, resolves it."""
    import numpy as np

    np.savez(tmp_path / "data.npz", x=np.zeros((8, 64), np.float32), y=np.zeros(8, np.int64))
    job = make_job({"data": {"name": "npz", "path": "data.npz"}})
    plan = make_plan(job)
    text = compose.render(job, plan, job_file=tmp_path / "job.yaml", compose_dir=tmp_path, root=ROOT)
    assert text == compose.render(job, plan, job_file=tmp_path / "job.yaml", compose_dir=tmp_path, root=ROOT)
    services = yaml.safe_load(text)["services"]
    assert not [n for n in services if n.startswith("ps-")]
    assert services["vw0-stage0"]["command"][-2:] == ["--node", "local"]  # no --gpu-type: generic
    data = {"type": "bind", "source": "./data.npz", "target": "/etc/hetpipe/data.npz", "read_only": True}
    assert data in services["coordinator"]["volumes"] and data in services["vw0-stage0"]["volumes"]
    assert data in services["vw0-stage0-gpu"]["volumes"]
    assert "from its latest checkpoint" not in text


def test_a_checkpointing_job_is_run_and_its_header_says_it_goes_on(make_job: Any, tmp_path: Path) -> None:
    """train.checkpoint_every: the coordinator's --job goes on from the latest cut of an unfinished
    run in the volume `runs` (which every stage mounts: test_mounted_and_built_paths_exist)."""
    job = make_job({"train": {"checkpoint_every": 5}})
    text = compose.render(job, make_plan(job), job_file=tmp_path / "job.yaml", compose_dir=tmp_path, root=ROOT)
    assert "goes on\n#   from its latest checkpoint in volume `runs`" in text


def test_a_sharded_model_init_is_mounted_with_the_files_its_index_names(tmp_path: Path) -> None:
    """The index alone was mounted: every stage failed loading a file beside it that was not there."""
    from safetensors.torch import save_file

    from hetpipe import models, weight_files

    init = tmp_path / "init"
    init.mkdir()
    state = models.build(load_job(EXAMPLE)).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "whole.safetensors"))
    files = weight_files.write_from(init, [tmp_path / "whole.safetensors"], max_shard_bytes=64 << 10)
    parts = sorted(p.name for p in files if p.name.endswith(".safetensors"))
    assert len(parts) > 1
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["model"]["init"] = "init/model.safetensors.index.json"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    job = load_job(tmp_path / "job.yaml")
    mounts = {m.target: m.source for m in compose.job_file_mounts(job, tmp_path)}
    want = ["model.safetensors.index.json", *parts]
    assert {t: s for t, s in mounts.items() if "/init/" in t} == {
        f"/etc/hetpipe/init/{name}": f"./init/{name}" for name in want}
    (init / parts[-1]).unlink()
    with pytest.raises(ConfigError, match=f"model.init: {init / parts[-1]}, which the index model.safetensors.index.json "
                                          "names, does not exist"):
        preflight(job)


def test_bad_job_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compose", str(tmp_path / "missing.yaml")]) == cli.EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["ddp", "torch-pipeline"])
def test_a_baseline_job_is_refused_where_a_coordinator_would_run_it(mode: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """compose, k8s, a coordinator's --job and `hetpipe run --coordinator`: each would have a
    coordinator run it, which runs HetPipe, shards and all, whatever parallel.mode says. Refused,
    naming the mode, before anything is written or contacted."""
    from coordinator.__main__ import main as coordinator_main

    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["parallel"]["mode"] = mode
    if mode == "torch-pipeline":   # it does not evaluate, and says so first
        raw.pop("eval")
        raw["data"].pop("eval_fraction")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    for argv in (["compose", str(job), "-o", str(tmp_path / "compose.yaml")], ["k8s", str(job), "-o", str(tmp_path / "k8s")],
                 ["run", "-q", "--coordinator", "127.0.0.1:1", str(job)]):
        assert cli.main(argv) == cli.EXIT_USAGE
        assert f"parallel.mode: {mode} is a baseline" in capsys.readouterr().err
    assert coordinator_main(["--job", str(job), "--port", "0"]) == 2
    assert f"parallel.mode: {mode} is a baseline" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


@pytest.mark.parametrize("case", ["shm", "bad init"])
def test_what_the_containers_could_not_do_is_refused_before_they_start(case: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """transport shm: each container has its own /dev/shm, so setup would fail once every worker
    had started. A model.init that `hetpipe run` refuses: the stages would fail loading it.
    compose and k8s refuse each."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    if case == "shm":
        raw["parallel"]["transport"] = "shm"
        needle = "parallel.transport: shm, but a"
    else:
        raw["model"]["init"] = "init.safetensors"
        (tmp_path / "init.safetensors").write_bytes(b"not weights")
        needle = "model.init"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv in (["compose", str(job), "-o", str(tmp_path / "compose.yaml")], ["k8s", str(job), "-o", str(tmp_path / "k8s")]):
        assert cli.main(argv) == cli.EXIT_USAGE
        assert needle in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- the image --------------------------------------------------------------------------------------


def test_dockerfile_one_image_two_variants_non_root_grpc_healthcheck() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert "cpu)" in text and "cuda)" in text and "download.pytorch.org/whl/cpu" in text
    assert "-c constraints.txt" in text
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    (check,) = [ln for ln in lines if ln.startswith("HEALTHCHECK ")]
    assert "hetpipe-healthcheck" in check and "docker/healthcheck.py /usr/local/bin/hetpipe-healthcheck" in text
    assert 'ENTRYPOINT ["python", "-m"]' in lines
    # compose.yaml builds the image from this file with these variants.
    for service in _services().values():
        if _project(service):
            assert service["build"]["args"]["VARIANT"] in ("cpu", "cuda")
    # The build context sends only what the image copies.
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    copied = {m.group(1) for m in re.finditer(r"^COPY (\S+) ", text, re.M)}
    assert "*" in ignore and all(f"!{c}" in ignore or f"!{c}/" in ignore for c in copied), copied


class _Health:
    def __init__(self) -> None:
        self.server = grpc.server(ThreadPoolExecutor(2))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def _healthcheck_module() -> Any:
    spec = importlib.util.spec_from_file_location("hetpipe_healthcheck", HEALTHCHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_healthcheck(*args: str) -> int:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True,
                          timeout=30).returncode


def test_healthcheck_script_exits_0_only_when_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _healthcheck_module().main
    h = _Health()
    try:
        address = f"127.0.0.1:{h.port}"
        h.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check([address]) == 1
        h.health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _run_healthcheck(address) == 0  # as the image runs it: a program
        monkeypatch.setenv("HETPIPE_PORT", str(h.port))
        assert check([]) == 0  # the image's default address: 127.0.0.1:$HETPIPE_PORT
        assert check([address, "no.such.Service"]) == 1
        assert check(["--help"]) == 1
        h.health.enter_graceful_shutdown()  # what a stopping HetPipe server says
        assert check([address]) == 1
    finally:
        h.server.stop(0)
    assert _run_healthcheck(address) == 1  # nothing listening


def test_factory_modules_are_what_the_factories_import_beside_the_job_file(tmp_path: Path) -> None:
    """Read, never run: a namespace package (no __init__.py), a module it imports, and that one's
    import of a module linked in from elsewhere are carried; built-in modules, modules no factory
    imports and HetPipe's own packages (the image's) are not. Code modulefinder cannot read
    crashes nothing: a module with a syntax error is carried by its name (preflight reports it),
    a corrupt compiled one is left out."""
    import dataclasses

    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "digits.py").write_text("import sys\nimport widths\n")
    (tmp_path / "widths.py").write_text("import linked\nimport hetpipe\n")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "linked.py").write_text("")
    (tmp_path / "linked.py").symlink_to(elsewhere / "linked.py")
    (tmp_path / "hetpipe").mkdir()
    (tmp_path / "hetpipe" / "__init__.py").write_text("")
    (tmp_path / "unused.py").write_text("")
    (tmp_path / "broken.py").write_text("def rows(:\n")
    (tmp_path / "compiled.pyc").write_bytes(b"\0" * 64)   # modulefinder raises ValueError reading it
    job = load_job(EXAMPLE)
    job = dataclasses.replace(job, base_dir=str(tmp_path),
                              model=dataclasses.replace(job.model, factory="nets.digits:build"),
                              data=dataclasses.replace(job.data, factory="broken:rows", eval_factory="compiled:rows"))
    assert compose.factory_modules(job) == {"nets", "widths.py", "linked.py", "broken.py"}
