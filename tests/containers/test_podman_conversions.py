"""The bring-up's conversions for podman, on the files `hetpipe compose` and `hetpipe k8s` write
for the example cluster (no podman needed: `make test` runs these, not the bring-up)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml

import compose_phase
import kube_phase
from images import Images
from launch import certs, cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "compose-cluster.yaml"
IMAGES = Images(base="localhost/debian-base:bookworm")
STAGES = {f"vw{v}-stage{q}" for v in range(2) for q in range(2)}


@pytest.fixture(scope="module")
def compose_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("compose") / "compose.yaml"
    assert cli.main(["compose", str(EXAMPLE), "-o", str(out)]) == 0
    return yaml.safe_load(out.read_text()), out.parent


def test_compose_keeps_the_cpu_cluster_on_local_images(compose_doc: tuple[dict[str, Any], Path]) -> None:
    source, folder = compose_doc
    doc = compose_phase.for_podman(source, compose_dir=folder, images=IMAGES)
    services = doc["services"]
    # Profiles: the CPU variant of every stage, never the GPU one; Grafana left out.
    assert STAGES | {"coordinator", "ps-0", "ps-1", "prometheus"} <= set(services)
    assert not any(name.endswith("-gpu") or name == "grafana" for name in services)
    for name, service in services.items():
        assert "build" not in service and "profiles" not in service, name
        assert service["image"] in (IMAGES.hetpipe, IMAGES.prometheus), name
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).is_absolute() and Path(volume["source"]).exists(), volume
        # What each service waits for is kept, with its condition, and is a service that runs.
        for dep, condition in compose_phase.depends_on(service).items():
            assert dep in services and condition == compose_phase.depends_on(source["services"][name])[dep]
    for stage in STAGES:
        assert compose_phase.depends_on(services[stage])["coordinator"] == "service_healthy"
    # Every HetPipe server is secured by the file, or told that it may serve without a token.
    for name, service in services.items():
        if compose_phase._server(service):
            env = service.get("environment", {})
            assert ("HETPIPE_TOKEN_FILE" in env) != (env.get("HETPIPE_INSECURE") == "1"), name
    # The ports the cluster publishes are the file's, all on loopback.
    assert set(compose_phase.published_ports(doc)) <= set(compose_phase.published_ports(source))
    assert all(p["host_ip"] == "127.0.0.1" for s in services.values() for p in s.get("ports", []))


def test_compose_plain_file_gets_insecure_servers_only() -> None:
    plain = {"services": {
        "coordinator": {"image": "hetpipe:cpu", "command": ["coordinator", "--port", "50050"],
                        "environment": {"HETPIPE_HOST": "0.0.0.0"}},
        "tool": {"image": "hetpipe:cpu", "command": ["launch.cli", "certs", "/certs", "x"]},
    }, "volumes": {}}
    services = compose_phase.for_podman(plain, compose_dir=Path("."), images=IMAGES)["services"]
    assert services["coordinator"]["environment"] == {"HETPIPE_HOST": "0.0.0.0", "HETPIPE_INSECURE": "1"}
    assert "environment" not in services["tool"]


@pytest.fixture(scope="module")
def kube_docs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("k8s")
    assert cli.main(["k8s", str(EXAMPLE), "-o", str(folder / "plain"), "--image", IMAGES.hetpipe]) == 0
    sans = kube_phase.certificate_names(kube_phase._manifests(folder / "plain"))
    certs.make(folder / "certs", ["cluster"], sans)
    assert cli.main(["k8s", str(EXAMPLE), "-o", str(folder / "manifests"), "--image", IMAGES.hetpipe,
                     "--certs", str(folder / "certs")]) == 0
    return kube_phase._manifests(folder / "manifests")


def test_kube_names_match_the_certificate(kube_docs: list[dict[str, Any]]) -> None:
    assert set(kube_phase.certificate_names(kube_docs)) == {
        "coordinator", "ps-0.ps", "ps-1.ps", *STAGES, "localhost"}


def test_kube_plays_one_pod_per_process_that_finds_the_others(kube_docs: list[dict[str, Any]],
                                                              tmp_path: Path) -> None:
    subnet = "10.89.7.0/24"
    played = kube_phase.for_podman(kube_docs, folder=tmp_path, subnet=subnet, images=IMAGES)
    names = [d["metadata"]["name"] for d in played.docs]
    assert {d["kind"] for d in played.docs} == {"Pod"}
    assert set(names) == {"coordinator", "ps-0", "ps-1", *STAGES, kube_phase.PROMETHEUS_POD}
    assert played.coordinator == "coordinator"
    assert played.servers == {n: n for n in names if n != kube_phase.PROMETHEUS_POD}
    assert set(played.claims) == {"hetpipe-runs", "checkpoint-ps-0", "checkpoint-ps-1"}
    # Static IPs in play order, past the gateway, and every pod's hosts file names them all.
    assert len(set(played.ips)) == len(names) and all(ip_address(ip) in ip_network(subnet) for ip in played.ips)
    assert str(next(iter(ip_network(subnet).hosts()))) not in played.ips
    for doc in played.docs:
        hosts = {h: a["ip"] for a in doc["spec"]["hostAliases"] for h in a["hostnames"]}
        assert hosts["ps-1.ps"] == played.ips[names.index("ps-1")]
        assert hosts["coordinator"] == played.ips[names.index("coordinator")]
    by_name = dict(zip(names, played.docs))
    shard = by_name["ps-1"]["spec"]["containers"][0]
    assert "ps-1.ps:50051" in shard["args"] and "podman" in shard["args"]   # $(POD_NAME), $(NODE_NAME)
    assert {"name": "POD_NAME", "value": "ps-1"} in shard["env"]
    for name, doc in by_name.items():
        spec = doc["spec"]
        for c in spec["containers"]:
            assert not any("$(" in a for a in [*c.get("command", []), *c.get("args", [])]), name
            assert "startupProbe" not in c and "readinessProbe" not in c
            assert not any(m.get("subPath") for m in c.get("volumeMounts", []))
            published = c.get("ports", [])
            assert all(p["hostIP"] == "127.0.0.1" for p in published)
            assert bool(published) == (name in ("coordinator", kube_phase.PROMETHEUS_POD)), name
            if name != kube_phase.PROMETHEUS_POD:
                assert c["livenessProbe"]["exec"]["command"] == ["hetpipe-healthcheck", "127.0.0.1:50052"]
        for v in spec["volumes"]:
            assert set(v) & {"hostPath", "persistentVolumeClaim", "emptyDir"}, (name, v)
            if "hostPath" in v:
                assert Path(v["hostPath"]["path"]).exists(), v
    # The coordinator reads the job file the manifests carry, as one mounted file.
    (job_mount,) = [m for m in by_name["coordinator"]["spec"]["containers"][0]["volumeMounts"]
                    if m["mountPath"] == "/etc/hetpipe/job.yaml"]
    (job_volume,) = [v for v in by_name["coordinator"]["spec"]["volumes"] if v["name"] == job_mount["name"]]
    assert Path(job_volume["hostPath"]["path"]).read_text() == EXAMPLE.read_text()
    # Secret files as the kubelet writes them: the volume's defaultMode.
    (token,) = tmp_path.glob("secret-*/token")
    assert token.stat().st_mode & 0o777 == 0o440


def test_kube_podmonitor_becomes_a_scrape_of_every_pod(kube_docs: list[dict[str, Any]], tmp_path: Path) -> None:
    played = kube_phase.for_podman(kube_docs, folder=tmp_path, subnet="10.89.7.0/24", images=IMAGES)
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == kube_phase.PROMETHEUS_JOB and job["honor_labels"] is True
    targets = {t["targets"][0]: t["labels"] for t in job["static_configs"]}
    assert set(targets) == {f"{n}:9100" for n in played.servers}
    assert targets["ps-0:9100"]["__meta_kubernetes_pod_name"] == "ps-0"
    assert targets["vw0-stage1:9100"]["__meta_kubernetes_pod_label_hetpipe_io_role"] == "stage_worker"
    assert all("source_labels" in r and "target_label" in r for r in job["relabel_configs"])


def test_expand_as_the_kubelet() -> None:
    env = {"POD_NAME": "ps-0"}
    assert kube_phase._expand("$(POD_NAME).ps:1", env) == "ps-0.ps:1"
    assert kube_phase._expand("$$(POD_NAME)", env) == "$(POD_NAME)"
    assert kube_phase._expand("$(OTHER)", env) == "$(OTHER)"
