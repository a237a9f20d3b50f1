"""`hetpipe k8s` (launch/k8s.py): the Kubernetes manifests of a job's cluster and plan.

Every manifest validates offline against the Kubernetes API's own schema (kubernetes-validate,
strict: an unknown field fails) for the emulated compose example and for the same cluster on
real GPUs; the stages ask for the GPU the plan chose for them, the shards are the plan's, every
address a process advertises resolves to a Service, and every process gets its certificates,
token, health port and metrics. No cluster is needed.
"""

from __future__ import annotations

import base64
import importlib
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from coordinator.planner import make_plan
from hetpipe import catalog
from hetpipe.config import ConfigError, JobConfig, load_job
from launch import cli, compose, k8s, k8s_pod

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "compose-cluster.yaml"
# The oldest Kubernetes still under upstream support when this was written; gRPC probes (1.24+),
# StatefulSet PVC retention (1.27+ beta) and everything else used here are in its API.
K8S_VERSION = "1.30"
CONFIG_MODULES = {"coordinator": "coordinator.config", "ps_server": "ps_server.config",
                  "stage_worker": "stage_worker.config"}
SECURITY_FLAGS = ("--health-port", "--tls-cert", "--tls-key", "--tls-ca", "--token-file")

Doc = dict[str, Any]


def _real_job(tmp_path: Path, policy: str = "ED") -> Path:
    """The compose example on real GPUs: the same two nodes, without cluster.emulate."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    del raw["cluster"]["emulate"]
    raw["parallel"]["policy"] = policy
    path = tmp_path / f"real-{policy}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _render(path: Path, **kwargs: Any) -> tuple[JobConfig, Any, dict[str, list[Doc]]]:
    job = load_job(path)
    plan = make_plan(job)
    files = k8s.render(job, plan, job_file=path, **kwargs)
    return job, plan, {name: [d for d in yaml.safe_load_all(text) if d] for name, text in files.items()}


def _objects(files: dict[str, list[Doc]], kind: str | None = None) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for docs in files.values() for d in docs if kind in (None, d["kind"])}


def _pods(files: dict[str, list[Doc]]) -> dict[str, Doc]:
    """Workload name -> its pod template."""
    return {name: d["spec"]["template"] for name, d in _objects(files).items()
            if d["kind"] in ("Deployment", "StatefulSet")}


def _flags(container: Doc) -> dict[str, str]:
    args = container["args"]
    return dict(zip(args[0::2], args[1::2]))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hetpipe certs` for the example's cluster: one certificate, cluster, naming every service."""
    from launch import certs as issue

    folder = tmp_path_factory.mktemp("certs")
    job = load_job(EXAMPLE)
    issue.make(folder, ["cluster"], k8s.certificate_names(job, make_plan(job)))
    return folder


# ---- every manifest is valid Kubernetes ---------------------------------------------------------


@pytest.mark.parametrize("variant", ["emulated", "real-ED", "real-NP"])
def test_every_manifest_validates_strictly(variant: str, tmp_path: Path, certs: Path) -> None:
    path = EXAMPLE if variant == "emulated" else _real_job(tmp_path, variant.split("-")[1])
    _, _, files = _render(path, certs=certs)
    assert set(files) == {"coordinator.yaml", "runs.yaml", "ps.yaml", "stages.yaml", "podmonitor.yaml",
                          "secrets.yaml"}
    kinds = set()
    for name, docs in files.items():
        for doc in docs:
            kinds.add(doc["kind"])
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: kubernetes-validate ships only the core API's schemas
            assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, (name, doc["kind"])
    assert kinds == {"ConfigMap", "PersistentVolumeClaim", "Service", "Deployment", "StatefulSet", "Secret",
                     "PodMonitor"}


def test_the_validator_refuses_broken_manifests() -> None:
    """The check above is live: the same validator refuses a stage with a misplaced GPU request,
    an unknown field, and a wrongly typed replica count."""
    _, _, files = _render(EXAMPLE)
    good = _objects(files, "Deployment")["vw0-stage0"]
    assert kubernetes_validate.validate(good, K8S_VERSION, strict=True)

    def broken(edit: Any) -> Doc:
        doc = yaml.safe_load(yaml.safe_dump(good))
        edit(doc)
        return doc

    container = ("spec", "template", "spec", "containers", 0)
    for doc, where in [
        (broken(lambda d: d["spec"]["template"]["spec"]["containers"][0].update({"limits": {"nvidia.com/gpu": 1}})),
         container),
        (broken(lambda d: d["spec"]["template"]["spec"].update({"nodeAfinity": {}})), container[:3]),
        (broken(lambda d: d["spec"].update({"replicas": "one"})), ("spec", "replicas")),
    ]:
        with pytest.raises(kubernetes_validate.ValidationError) as caught:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert tuple(caught.value.path) == where


# ---- the plan: stages on their GPUs, shards -------------------------------------------------------


@pytest.mark.parametrize("policy", ["ED", "NP"])
def test_each_stage_asks_for_the_gpu_the_plan_gave_it(policy: str, tmp_path: Path) -> None:
    """Each (vw, stage) requires a node whose GPU feature discovery product is its planned type's
    (ED: each VW has one GPU of each node; NP: VW 0 all TITAN V, VW 1 all RTX 2060), requests one
    GPU, and registers as that (node, type), which the coordinator claims it by."""
    _, plan, files = _render(_real_job(tmp_path, policy))
    pods = _pods(files)
    assert {n for n in pods if n.startswith("vw")} == {f"vw{s.vw}-stage{s.stage}" for s in plan.stages}
    assert len({s.gpu for s in plan.stages}) == 2
    for s in plan.stages:
        spec = pods[f"vw{s.vw}-stage{s.stage}"]["spec"]
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (expression,) = term["matchExpressions"]
        assert expression == {"key": "nvidia.com/gpu.product", "operator": "In", "values": list(k8s.GPU_PRODUCTS[s.gpu])}
        (container,) = spec["containers"]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        assert container["image"] == compose.GPU_IMAGE
        flags = _flags(container)
        assert (flags["--gpu-type"], flags["--node"]) == (s.gpu, s.node)
        # Stages of one job node prefer one machine.
        (preferred,) = spec["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert preferred["podAffinityTerm"]["labelSelector"]["matchLabels"]["hetpipe.io/node"] == s.node
    for name in ("coordinator", "ps"):
        (container,) = pods[name]["spec"]["containers"]
        assert "resources" not in container and "affinity" not in pods[name]["spec"]
        assert container["image"] == compose.CPU_IMAGE


def test_emulated_stages_ask_for_no_gpu() -> None:
    """Emulated GPU types run on any node's CPU: no GPU request, no affinity, the CPU image."""
    _, plan, files = _render(EXAMPLE, image="registry.example/hetpipe:cpu")
    pods = _pods(files)
    for s in plan.stages:
        spec = pods[f"vw{s.vw}-stage{s.stage}"]["spec"]
        (container,) = spec["containers"]
        assert "resources" not in container
        assert "affinity" not in spec and "tolerations" not in spec and "nodeSelector" not in spec
        assert container["image"] == "registry.example/hetpipe:cpu"
        flags = _flags(container)
        assert (flags["--gpu-type"], flags["--node"]) == (s.gpu, s.node)
    assert "nvidia.com" not in "".join(yaml.safe_dump_all(docs) for n, docs in files.items())


def test_gpu_products_cover_the_catalog_and_name_its_types() -> None:
    """Every catalog type has a product label, and each product, read back as the device name it
    comes from (dashes for spaces), is that type by the catalog's own device-name rules."""
    assert set(k8s.GPU_PRODUCTS) == set(catalog.CATALOG)
    for gpu, products in k8s.GPU_PRODUCTS.items():
        assert products and len(set(products)) == len(products)
        for product in products:
            assert re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_.]*", product) and len(product) <= 63  # a label value
            assert catalog.match(product.replace("-", " "), catalog.CATALOG[gpu].memory_bytes) == gpu, product


def test_shards_follow_the_plan(make_job: Any, tmp_path: Path) -> None:
    """One StatefulSet pod per planned shard, named as compose's shard services (ps-N), each
    advertising its own stable name under the headless Service, with a volume of its own for its
    checkpoint and push log. A lone VW has no shard and no ps.yaml (an earlier one is removed)."""
    job, plan, files = _render(EXAMPLE)
    statefulset = _objects(files, "StatefulSet")["ps"]
    shards = compose.shard_services(job)
    assert statefulset["spec"]["replicas"] == plan.shards == len(shards) == 2
    assert [f"{statefulset['metadata']['name']}-{i}" for i in range(plan.shards)] == [s.name for s in shards]
    service = _objects(files, "Service")[statefulset["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    flags = _flags(container)
    host = flags["--advertise"].removesuffix(":50051")
    assert host == "$(POD_NAME).ps" and flags["--coordinator"] == "coordinator:50050"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert flags["--checkpoint-dir"].startswith(mount["mountPath"] + "/")
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"

    lone = make_job({"output": {"trace": False}})
    out = tmp_path / "lone"
    k8s.write(k8s.render(job, plan, job_file=EXAMPLE), out)
    assert (out / "ps.yaml").exists()
    files_lone = k8s.render(lone, make_plan(lone), job_file=tmp_path / "job.yaml")
    assert "ps.yaml" not in files_lone
    k8s.write(files_lone, out)
    assert not (out / "ps.yaml").exists()
    assert "--gpu-type" not in files_lone["stages.yaml"]  # no cluster spec: generic workers
    # All or none: a manifest that cannot be written leaves the earlier set whole (it left half
    # of the new one beside it), and no temporary.
    before = {p.name: p.read_text() for p in out.iterdir()}
    (out / "stages.yaml").unlink()
    (out / "stages.yaml").mkdir()
    with pytest.raises(OSError) as err:
        k8s.write(k8s.render(job, plan, job_file=EXAMPLE), out)
    assert err.value.filename == str(out / "stages.yaml")
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == {k: v for k, v in before.items()
                                                                          if k != "stages.yaml"}


def test_every_advertised_address_is_a_service_and_a_certificate_name() -> None:
    """What a process dials is what another advertises: each such host is a Service selecting
    exactly that process's pods on that port, and the cluster certificate names it."""
    job, plan, files = _render(EXAMPLE)
    services, pods = _objects(files, "Service"), _pods(files)
    names = set(k8s.certificate_names(job, plan))
    statefulset = _objects(files, "StatefulSet")["ps"]
    for workload, pod in pods.items():
        (container,) = pod["spec"]["containers"]
        flags = _flags(container)
        if workload == "coordinator":
            host, port = "coordinator", flags["--port"]
        else:
            host, port = flags["--advertise"].split(":")
            assert flags["--coordinator"] == "coordinator:50050"
        service = services[host.split(".")[-1] if host.startswith("$(POD_NAME)") else host]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), workload
        assert int(port) in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert int(port) in [p["containerPort"] for p in container["ports"]]
        hosts = ([f"ps-{i}.ps" for i in range(statefulset["spec"]["replicas"])] if workload == "ps" else [host])
        assert set(hosts) <= names, workload
    # No two workloads share a selector: a Service reaches one process.
    selectors = [tuple(sorted(s["spec"]["selector"].items())) for s in services.values()]
    assert len(set(selectors)) == len(selectors)


# ---- what every pod gets ------------------------------------------------------------------------------


def test_secrets_are_mounted_and_their_flags_passed(certs: Path, tmp_path: Path) -> None:
    _, _, files = _render(EXAMPLE, certs=certs)
    secrets = _objects(files, "Secret")
    assert set(secrets) == {k8s_pod.TLS_SECRET, k8s_pod.TOKEN_SECRET}
    assert secrets["hetpipe-tls"]["stringData"] == {"ca.pem": (certs / "ca.pem").read_text(),
                                                    "tls.pem": (certs / "cluster.pem").read_text(),
                                                    "tls.key": (certs / "cluster.key").read_text()}
    assert secrets["hetpipe-token"]["stringData"] == {"token": (certs / "token").read_text()}
    for workload, pod in _pods(files).items():
        (container,) = pod["spec"]["containers"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        flags = _flags(container)
        for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--token-file"):
            folder, key = flags[flag].rsplit("/", 1)
            mount = mounts[folder]
            assert mount["readOnly"] is True, (workload, flag)
            secret = volumes[mount["name"]]["secret"]
            assert key in secrets[secret["secretName"]]["stringData"], (workload, flag)
            assert secret["defaultMode"] == 0o440  # with fsGroup: the image's user, no one else
        assert pod["spec"]["securityContext"]["fsGroup"] == k8s_pod.UID

    out = tmp_path / "out"
    k8s.write(k8s.render(load_job(EXAMPLE), make_plan(load_job(EXAMPLE)), job_file=EXAMPLE, certs=certs), out)
    assert (out / "secrets.yaml").stat().st_mode & 0o777 == 0o600
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("ca.pem", "cluster.pem", "cluster.key"):
        (partial / name).write_text((certs / name).read_text())
    with pytest.raises(ConfigError, match="cannot read token"):
        k8s.render(load_job(EXAMPLE), make_plan(load_job(EXAMPLE)), job_file=EXAMPLE, certs=partial)
    (partial / "ca.pem").unlink()   # named once, as itself: not as a fault of cluster.pem
    with pytest.raises(ConfigError, match=r"^--certs \S+: cannot read ca.pem \(No such file or directory\); expected"):
        k8s.render(load_job(EXAMPLE), make_plan(load_job(EXAMPLE)), job_file=EXAMPLE, certs=partial)
    # A certificate that would fail the pods' handshakes at run time is refused now: one without a
    # name they dial, one another CA issued.
    from launch import certs as issue

    issue.make(tmp_path / "few", ["cluster"], ["coordinator"])
    with pytest.raises(ConfigError, match=r"cluster.pem does not name .*vw0-stage0.*, which the processes dial"):
        k8s.render(load_job(EXAMPLE), make_plan(load_job(EXAMPLE)), job_file=EXAMPLE, certs=tmp_path / "few")
    (tmp_path / "few" / "ca.pem").write_text((certs / "ca.pem").read_text())
    with pytest.raises(ConfigError, match="cluster.pem: it was not issued by ca.pem"):
        k8s.render(load_job(EXAMPLE), make_plan(load_job(EXAMPLE)), job_file=EXAMPLE, certs=tmp_path / "few")


def test_probes_metrics_and_security_context() -> None:
    """gRPC probes on the plaintext health port the process is told to serve, metrics announced
    and collected by the PodMonitor, and a locked-down container as the image's user."""
    uid = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "docker" / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
    assert uid == k8s_pod.UID
    _, _, files = _render(EXAMPLE)
    (monitor,) = files["podmonitor.yaml"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for workload, pod in _pods(files).items():
        (container,) = pod["spec"]["containers"]
        assert _flags(container)["--health-port"] == str(k8s_pod.HEALTH_PORT)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": k8s_pod.HEALTH_PORT}, (workload, probe)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["health"] == k8s_pod.HEALTH_PORT and ports[endpoint["port"]] == compose.METRICS_PORT
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9100"}
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert pod["metadata"]["labels"]["hetpipe.io/role"] in ("coordinator", "ps_shard", "stage_worker")
        context = container["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] == uid and context["readOnlyRootFilesystem"]
        assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
        # The read-only root leaves /tmp writable.
        tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp and {"name": tmp[0]["name"], "emptyDir": {}} in pod["spec"]["volumes"]
        assert pod["spec"]["automountServiceAccountToken"] is False


def test_commands_parse_with_each_entry_point() -> None:
    """Each container's flags, security included, parse with its module's own parser, as compose.yaml's do."""
    _, _, files = _render(EXAMPLE)
    for workload, pod in _pods(files).items():
        (container,) = pod["spec"]["containers"]
        assert container["command"][:2] == ["python", "-m"]
        module = importlib.import_module(CONFIG_MODULES[container["command"][2]])
        args = container["args"]
        assert set(SECURITY_FLAGS) <= set(args), workload
        module.parse_args(args)  # SystemExit(2) on an unknown or malformed flag


def test_job_file_and_its_data_travel_in_the_configmap(make_job: Any, tmp_path: Path) -> None:
    """The coordinator reads the job file from its ConfigMap, unchanged; a data file the job
    names is mounted where the job resolves it, in the coordinator and the stages, as compose does."""
    _, _, files = _render(EXAMPLE)
    configmap = _objects(files, "ConfigMap")[k8s.JOB_CONFIGMAP]
    assert configmap["data"]["job.yaml"] == EXAMPLE.read_text()
    coordinator = _pods(files)["coordinator"]["spec"]["containers"][0]
    flags = _flags(coordinator)
    assert flags["--job"] == compose.JOB_MOUNT and flags["--output-dir"] == "/runs/compose-cluster"
    assert {"name": "job", "mountPath": compose.JOB_MOUNT, "subPath": "job.yaml", "readOnly": True} \
        in coordinator["volumeMounts"]

    import numpy as np

    np.savez(tmp_path / "data.npz", x=np.zeros((8, 64), np.float32), y=np.zeros(8, np.int64))
    job = make_job({"data": {"name": "npz", "path": "data.npz"}, "output": {"trace": False}})
    (target,) = [m.target for m in compose.job_file_mounts(job, tmp_path)]
    rendered = k8s.render(job, make_plan(job), job_file=tmp_path / "job.yaml")
    docs = {n: [d for d in yaml.safe_load_all(t) if d] for n, t in rendered.items()}
    configmap = _objects(docs, "ConfigMap")[k8s.JOB_CONFIGMAP]
    for workload, pod in _pods(docs).items():
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == target]
        assert base64.b64decode(configmap["binaryData"][mount["subPath"]]) == (tmp_path / "data.npz").read_bytes()
        assert {"name": "job", "configMap": {"name": k8s.JOB_CONFIGMAP}} in pod["spec"]["volumes"]
    for doc in (d for ds in docs.values() for d in ds if d["kind"] != "PodMonitor"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    (tmp_path / "data.npz").write_bytes(b"\0" * (k8s.CONFIGMAP_MAX_BYTES + 1))
    with pytest.raises(ConfigError, match="ConfigMap that carries them holds at most"):
        k8s.render(job, make_plan(job), job_file=tmp_path / "job.yaml")


def test_stages_share_the_outputs_volume_only_to_write_into_it(make_job: Any) -> None:
    """Stages write traces, profiles and their part of each checkpoint into the output folder
    themselves: then they mount the coordinator's volume, which must be ReadWriteMany; otherwise
    only the coordinator mounts it. (A profile without a trace had no mount: the stage failed
    writing it, and the job with it.)"""
    profile = {"after": 1, "steps": 1}
    for output, every, access, mounted in (({"trace": True}, 0, "ReadWriteMany", True),
                                           ({"trace": False}, 0, "ReadWriteOnce", False),
                                           ({"trace": False, "profile": profile}, 0, "ReadWriteMany", True),
                                           ({"trace": False}, 2, "ReadWriteMany", True)):
        job = make_job({"output": output, "train": {"steps": 4, "checkpoint_every": every}})
        rendered = k8s.render(job, make_plan(job), job_file=Path(job.base_dir) / "job.yaml")
        docs = {n: [d for d in yaml.safe_load_all(t) if d] for n, t in rendered.items()}
        claim = _objects(docs, "PersistentVolumeClaim")[k8s.RUNS_CLAIM]
        assert claim["spec"]["accessModes"] == [access]
        stage = _pods(docs)["vw0-stage0"]["spec"]["containers"][0]
        assert any(m["mountPath"] == compose.RUNS for m in stage["volumeMounts"]) is mounted


# ---- the command line -----------------------------------------------------------------------------------


def test_cli_writes_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str], certs: Path) -> None:
    out = tmp_path / "k8s"
    assert cli.main(["k8s", str(EXAMPLE), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["coordinator.yaml", "podmonitor.yaml", "ps.yaml", "runs.yaml", "stages.yaml"]
    for name in names:
        assert f"wrote {out / name}" in printed
        assert (out / name).read_text().startswith(k8s.GENERATED)
    # No certificates given: how to make the Secrets, and the names the certificate must carry.
    assert "kubectl create secret generic hetpipe-tls" in printed and "hetpipe certs" in printed
    assert "ps-1.ps" in printed and "vw1-stage1" in printed
    stages = _objects({"s": list(yaml.safe_load_all((out / "stages.yaml").read_text()))}, "Deployment")
    assert sorted(stages) == ["vw0-stage0", "vw0-stage1", "vw1-stage0", "vw1-stage1"]

    assert cli.main(["k8s", str(EXAMPLE), "-o", str(out), "--certs", str(certs)]) == 0
    assert f"wrote {out / 'secrets.yaml'}" in capsys.readouterr().out
    assert cli.main(["k8s", str(EXAMPLE), "-o", str(out), "--certs", str(tmp_path / "none")]) == cli.EXIT_USAGE
    assert "ca.pem" in capsys.readouterr().err
    assert cli.main(["k8s", str(tmp_path / "missing.yaml"), "-o", str(out)]) == cli.EXIT_USAGE


def test_factory_modules_beside_the_job_file_reach_every_container(tmp_path: Path) -> None:
    """model.factory in a package folder and data factories in a NAME.py beside the job file,
    and a module beside it that the package imports: compose binds them and the k8s ConfigMap
    carries them file by file (caches left behind), so that in each container's view of the
    files the job, read from JOB_MOUNT, builds its model and reads its data, with only the
    image's packages installed. A module beside the job file that no factory imports stays."""
    import shutil
    import subprocess
    import sys

    own = ROOT / "examples" / "own-model"
    (tmp_path / "nets" / "__pycache__").mkdir(parents=True)
    (tmp_path / "nets" / "__init__.py").write_text("")
    (tmp_path / "nets" / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    (tmp_path / "nets" / "digits.py").write_text((own / "digits_net.py").read_text() + "from widths import HIDDEN\n")
    (tmp_path / "widths.py").write_text("import json\nHIDDEN = 64\n")
    (tmp_path / "unused.py").write_text("raise SystemExit('no factory imports this')\n")
    shutil.copy(own / "digits_data.py", tmp_path)
    raw = yaml.safe_load((own / "job.yaml").read_text())
    raw["model"]["factory"] = "nets.digits:build"
    raw["cluster"] = yaml.safe_load(EXAMPLE.read_text())["cluster"]
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(raw))
    job = load_job(job_file)
    plan = make_plan(job)

    views = {}  # container -> the files it sees, under a folder standing for its root
    compose_text = compose.render(job, plan, job_file=job_file, compose_dir=tmp_path, root=ROOT)
    for name, service in yaml.safe_load(compose_text)["services"].items():
        if name not in ("coordinator", "vw1-stage1"):
            continue
        root = views[f"compose {name}"] = tmp_path / "views" / f"compose-{name}"
        for bind in (v for v in service["volumes"] if isinstance(v, dict) and v["type"] == "bind"):
            source, target = (tmp_path / bind["source"]).resolve(), root / bind["target"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
    rendered = k8s.render(job, plan, job_file=job_file)
    docs = {n: [d for d in yaml.safe_load_all(t) if d] for n, t in rendered.items()}
    configmap = _objects(docs, "ConfigMap")[k8s.JOB_CONFIGMAP]
    files = {**{k: v.encode() for k, v in configmap["data"].items()},
             **{k: base64.b64decode(v) for k, v in configmap["binaryData"].items()}}
    for workload, pod in _pods(docs).items():
        if workload not in ("coordinator", "vw1-stage1"):
            continue
        root = views[f"k8s {workload}"] = tmp_path / "views" / f"k8s-{workload}"
        for mount in (m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "job"):
            target = root / mount["mountPath"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[mount["subPath"]])
        assert not list(root.rglob("__pycache__")), "a cache file went into the ConfigMap"
    assert len(views) == 4, views
    assert not [root for root in views.values() if list(root.rglob("unused.py"))], "a module no factory imports"
    # A stage reads no job file: the job comes in its assignment, with base_dir JOB_MOUNT's folder.
    check = ("import dataclasses, sys\nfrom hetpipe import datasets, models\nfrom hetpipe.config import load_job\n"
             "job = load_job(sys.argv[1] + '/etc/hetpipe/job.yaml')\n"
             "for root in sys.argv[1:]:\n"
             "    job = dataclasses.replace(job, base_dir=root + '/etc/hetpipe')\n"
             "    assert sum(p.numel() for p in models.structure(job.model, job.base_dir).parameters()) > 0\n"
             "    assert len(datasets.training_set(job)) > 0 and len(datasets.held_out_set(job)) > 0\n"
             "    for name in ('nets', 'nets.digits', 'digits_data', 'widths'):\n"
             "        assert sys.modules[name].__file__.startswith(root), (name, sys.modules[name].__file__)\n"
             "        del sys.modules[name]\n"
             "    sys.path.remove(job.base_dir)\n")
    roots = [views["compose coordinator"], *(v for k, v in views.items() if k != "compose coordinator")]
    done = subprocess.run([sys.executable, "-c", check, *map(str, roots)], cwd=tmp_path / "views",
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
