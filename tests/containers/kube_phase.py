"""The kube phase: the manifests of `hetpipe k8s` played by `podman kube play`, trained, checked,
and torn down without a trace.

podman kube play (4.3, Debian bookworm's) runs Pods, Deployments, PersistentVolumeClaims and
ConfigMaps, and is no Kubernetes: no scheduler, no Services, no cluster DNS, no kubelet probes. The
harness converts the manifests into what it plays (`for_podman`), in the run's folder:
- Deployment (1 replica) -> a Pod of the Deployment's name (kube play would name it NAME-pod);
  StatefulSet -> its Pods NAME-0..N-1, each with the claims of its volumeClaimTemplates;
- Service -> nothing: every pod gets a static IP on a network of the harness, and every pod's
  /etc/hosts (hostAliases) names them all as the cluster's DNS would: the Deployments' Services
  by their names, the StatefulSet's pods as POD.SERVICE (ps-0.ps);
- Secret, ConfigMap -> files under the run's folder mounted with hostPath (kube play 4.3 plays no
  Secret and ignores subPath; a subPath mount becomes a mount of that one file). Secret files get
  the volume's defaultMode and the pod's fsGroup as group, as the kubelet gives them;
- PersistentVolumeClaim -> a podman volume of the claim's name, made writable by the pod's fsGroup
  (what the kubelet does for fsGroup; podman does not);
- env valueFrom.fieldRef (metadata.name, spec.nodeName) -> the value, and $(VAR) in command and
  args expanded, as the kubelet does (podman does not);
- gRPC probes -> the liveness probe as an exec probe of the image's hetpipe-healthcheck on the
  same port (podman makes that the container's healthcheck, and runs it with `podman healthcheck
  run` here); startup and readiness probes are dropped;
- PodMonitor -> a Prometheus pod (Debian's, docker/prometheus/Dockerfile) that scrapes the pods it
  selects on its port, with its relabelings, from static targets carrying the pods' meta labels;
- containerPort -> nothing (kube play 4.3 would publish each on the host as itself, and the pods'
  ports collide), but `kubectl port-forward svc/coordinator` -> the coordinator's gRPC port
  published on 127.0.0.1.
The cluster certificate comes from `hetpipe certs`, for the names the manifests' pods answer to.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import time
from dataclasses import dataclass, field
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import yaml

from checks import LiveCluster, Prometheus, Restartable, checkpoints, restart_mid_job, train_and_check
from engine import BringupError, Engine, Timings, alive, busy_ports
from images import Images
from launch.compose import COORDINATOR_PORT, PROMETHEUS_PORT

Manifest = dict[str, Any]

NETWORK = "hetpipe-bringup-kube"
LABEL = "io.hetpipe.bringup=kube"       # on the volumes the harness makes, to find what is left
NODE_NAME = "podman"                    # spec.nodeName: one host
PROMETHEUS_POD = "prometheus"
PROMETHEUS_JOB = "hetpipe"
ROLE, INSTANCE_LABEL = "hetpipe.io/role", "hetpipe.io/name"
START_DEADLINE_S = 420


@dataclass(frozen=True, slots=True, kw_only=True)
class KubeRun:
    root: Path
    job: Path
    workdir: Path
    images: Images
    hetpipe: list[str]
    accuracy_bar: float
    job_deadline_s: float
    restart_coordinator: bool = False   # restart it once the job trains: the job runs again from the start


@dataclass
class Played:
    """What for_podman made: the documents to play and what the harness must set up around them."""

    docs: list[Manifest] = field(default_factory=list)       # Pods only, in play order
    ips: list[str] = field(default_factory=list)              # one per Pod, in the same order
    claims: dict[str, int | None] = field(default_factory=dict)  # volume -> fsGroup to give it
    servers: dict[str, str] = field(default_factory=dict)     # pod -> its process's `instance` label
    coordinator: str = ""                                     # the coordinator's pod


# ---- conversion (no I/O but the files of Secrets and ConfigMaps) ----------------------------------


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in command and args; $$ escapes, unknown names stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _files(doc: Manifest) -> dict[str, bytes]:
    """A Secret's or ConfigMap's keys and contents."""
    text, encoded = ("data", "binaryData") if doc["kind"] == "ConfigMap" else ("stringData", "data")
    out = {k: v.encode() for k, v in (doc.get(text) or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (doc.get(encoded) or {}).items()})
    return out


def _materialize(doc: Manifest, folder: Path, mode: int, group: int | None) -> Path:
    target = folder / f"{doc['kind'].lower()}-{doc['metadata']['name']}"
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o755)
    for key, data in _files(doc).items():
        path = target / key
        path.write_bytes(data)
        path.chmod(mode)
        if group is not None and os.geteuid() == 0:  # rootless podman maps ids itself
            os.chown(path, 0, group)
    return target


def _pods(docs: list[Manifest]) -> list[tuple[str, Manifest, str]]:
    """(pod name, pod template with its spec, the StatefulSet's service or "") per pod to run."""
    out = []
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Pod":
            out.append((name, {"metadata": doc["metadata"], "spec": doc["spec"]}, ""))
        elif kind == "Deployment":
            if doc["spec"].get("replicas", 1) != 1:
                raise BringupError(f"Deployment {name}: {doc['spec']['replicas']} replicas, the harness plays 1")
            out.append((name, copy.deepcopy(doc["spec"]["template"]), ""))
        elif kind == "StatefulSet":
            for i in range(doc["spec"].get("replicas", 1)):
                template = copy.deepcopy(doc["spec"]["template"])
                for claim in doc["spec"].get("volumeClaimTemplates", []):
                    template["spec"].setdefault("volumes", []).append(
                        {"name": claim["metadata"]["name"],
                         "persistentVolumeClaim": {"claimName": f"{claim['metadata']['name']}-{name}-{i}"}})
                out.append((f"{name}-{i}", template, doc["spec"]["serviceName"]))
    return out


def _container(container: Manifest, pod: str) -> Manifest:
    env = {}
    for e in container.get("env", []):
        ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if ref is None and "valueFrom" in e:
            raise BringupError(f"{pod}: env {e['name']}: only fieldRef is converted, not {e['valueFrom']}")
        values = {"metadata.name": pod, "spec.nodeName": NODE_NAME, None: e.get("value", "")}
        if ref not in values:
            raise BringupError(f"{pod}: env {e['name']}: fieldRef {ref} is not converted")
        env[e["name"]] = values[ref]
    # podman 4.3 publishes a containerPort without hostPort on the host as that same port, where
    # the pods would collide: in a pod the ports are documentation only, so they go.
    out = {k: v for k, v in container.items() if k not in ("startupProbe", "readinessProbe", "ports")}
    out["env"] = [{"name": k, "value": v} for k, v in env.items()]
    for key in ("command", "args"):
        if key in out:
            out[key] = [_expand(str(a), env) for a in out[key]]
    probe = out.get("livenessProbe")
    if probe and "grpc" in probe:
        out["livenessProbe"] = {
            "exec": {"command": ["hetpipe-healthcheck", f"127.0.0.1:{probe['grpc']['port']}",
                                 *([probe["grpc"]["service"]] if probe["grpc"].get("service") else [])]},
            **{k: v for k, v in probe.items() if k != "grpc"}}
    return out


def _volumes(spec: Manifest, files: dict[tuple[str, str], Manifest], folder: Path,
             claims: dict[str, int | None]) -> None:
    """Secret and ConfigMap volumes -> hostPath (subPath mounts: the one file); claims noted."""
    group = (spec.get("securityContext") or {}).get("fsGroup")
    folders: dict[str, Path] = {}
    volumes = []
    for v in spec.get("volumes", []):
        if "secret" in v or "configMap" in v:
            kind, name = ("Secret", v["secret"]["secretName"]) if "secret" in v else ("ConfigMap", v["configMap"]["name"])
            source = v.get("secret") or v.get("configMap") or {}
            if (kind, name) not in files:
                raise BringupError(f"volume {v['name']}: no {kind} {name} in the manifests")
            folders[v["name"]] = _materialize(files[kind, name], folder, source.get("defaultMode", 0o644), group)
            volumes.append({"name": v["name"], "hostPath": {"path": str(folders[v["name"]]), "type": "Directory"}})
        else:
            if "persistentVolumeClaim" in v:
                claims[v["persistentVolumeClaim"]["claimName"]] = group
            volumes.append(v)
    for c in spec["containers"]:
        for i, m in enumerate(c.get("volumeMounts", [])):
            if m.get("subPath"):
                if m["name"] not in folders:
                    raise BringupError(f"mount {m['mountPath']}: subPath of a volume that is no Secret or ConfigMap")
                name = f"{m['name']}-file{i}"
                volumes.append({"name": name, "hostPath": {"path": str(folders[m["name"]] / m["subPath"]),
                                                           "type": "File"}})
                c["volumeMounts"][i] = {"name": name, "mountPath": m["mountPath"], "readOnly": True}
    spec["volumes"] = volumes


def _prometheus_config(monitor: Manifest, pods: list[tuple[str, Manifest]]) -> dict[str, Any]:
    """The PodMonitor as a scrape job over static targets labelled as Kubernetes discovery would."""
    endpoint, = monitor["spec"]["podMetricsEndpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    targets = []
    for name, template in pods:
        labels = template["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        port = next(p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
                    if p.get("name") == endpoint["port"])
        meta = {"__meta_kubernetes_pod_name": name,
                **{"__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in labels.items()}}
        targets.append({"targets": [f"{name}:{port}"], "labels": meta})
    rename = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    relabel = [{rename.get(k, k): v for k, v in r.items()} for r in endpoint.get("relabelings", [])]
    return {
        "global": {"scrape_interval": endpoint.get("interval", "5s"), "scrape_timeout": "4s"},
        "scrape_configs": [{"job_name": PROMETHEUS_JOB, "honor_labels": bool(endpoint.get("honorLabels")),
                            "static_configs": targets, "relabel_configs": relabel}],
    }


def for_podman(docs: list[Manifest], *, folder: Path, subnet: str, images: Images) -> Played:
    """The manifests as podman kube play runs them (the module docstring says how and why)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Secret", "ConfigMap")}
    pods = _pods(docs)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    hosts = iter(ip_network(subnet).hosts())
    next(hosts)  # the gateway
    played = Played()
    aliases = []
    for name, _, service in [*pods, *([(PROMETHEUS_POD, {}, "")] if monitors else [])]:
        ip = str(next(hosts))
        played.ips.append(ip)
        aliases.append({"ip": ip, "hostnames": [name, *([f"{name}.{service}"] if service else [])]})
    config = _prometheus_config(monitors[0], [(n, t) for n, t, _ in pods]) if monitors else None
    for name, template, _ in pods:
        spec = template["spec"]
        spec["containers"] = [_container(c, name) for c in spec["containers"]]
        _volumes(spec, files, folder, played.claims)
        spec["hostAliases"] = aliases
        labels = template["metadata"].get("labels", {})
        played.servers[name] = labels.get(INSTANCE_LABEL, name)
        if labels.get(ROLE) == "coordinator":
            played.coordinator = name
            spec["containers"][0]["ports"] = [
                {"containerPort": COORDINATOR_PORT, "hostPort": COORDINATOR_PORT, "hostIP": "127.0.0.1"}]
        played.docs.append({"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": name, "labels": labels,
                                         "annotations": template["metadata"].get("annotations", {})},
                            "spec": spec})
    if config is not None:
        path = folder / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o644)
        played.docs.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": PROMETHEUS_POD}, "spec": {
            "hostAliases": aliases,
            "containers": [{"name": "prometheus", "image": images.prometheus,
                            "ports": [{"containerPort": PROMETHEUS_PORT, "hostPort": PROMETHEUS_PORT,
                                       "hostIP": "127.0.0.1"}],
                            "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus/prometheus.yml",
                                              "readOnly": True}]}],
            "volumes": [{"name": "config", "hostPath": {"path": str(path), "type": "File"}}]}})
    if not played.coordinator:
        raise BringupError("no pod with label hetpipe.io/role=coordinator in the manifests")
    return played


def certificate_names(docs: list[Manifest]) -> list[str]:
    """The names the pods dial each other at (hostAliases of for_podman), and localhost."""
    return [*(f"{n}.{s}" if s else n for n, _, s in _pods(docs)), "localhost"]


# ---- the phase ----------------------------------------------------------------------------------


class Pods:
    """The played pods' containers: their state and healthchecks."""

    def __init__(self, engine: Engine, played: Played) -> None:
        self.engine = engine
        self.played = played
        self.pods = [d["metadata"]["name"] for d in played.docs]

    def containers(self) -> dict[str, dict[str, Any]]:
        """Pod -> its (one) container, the pod's infra container left out."""
        return {c["PodName"]: c for c in self.engine.podman_json("ps", "-a", "--pod")
                if not c.get("IsInfra") and c.get("PodName") in self.pods}

    def assert_running(self) -> None:
        containers = self.containers()
        gone = [f"{p} ({containers[p]['State']}, exit {containers[p].get('ExitCode')})" if p in containers
                else f"{p} (no container)" for p in self.pods if not alive(containers.get(p))]
        if gone:
            raise BringupError(f"pods gone: {gone}")

    def wait_healthy(self, deadline_s: float) -> None:
        end, waiting = time.monotonic() + deadline_s, [p for p in self.pods if p != PROMETHEUS_POD]
        while waiting and time.monotonic() < end:
            self.assert_running()
            containers = self.containers()
            waiting = [p for p in waiting if self.engine.run(
                [self.engine.podman, "healthcheck", "run", containers[p]["Names"][0]], timeout=60,
                check=False).returncode != 0]
            if waiting:
                time.sleep(3)
        if waiting:
            raise BringupError(f"not healthy within {deadline_s:.0f} s: {waiting}")

    def name(self, pod: str) -> str:
        return str(self.containers()[pod]["Names"][0])


def _manifests(folder: Path) -> list[Manifest]:
    docs: list[Manifest] = []
    for path in sorted(folder.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def run(engine: Engine, timings: Timings, cfg: KubeRun) -> list[str]:
    """The kube phase; returns its report lines. Raises BringupError on any failure, after tearing
    everything down and saving the containers' logs under cfg.workdir/kube/logs."""
    folder = cfg.workdir / "kube"
    manifests, certs = folder / "manifests", folder / "certs"
    _tear_down(engine, [], [])  # what an interrupted earlier run left
    with timings.phase("kube: generate manifests and certificates"):
        image = ["--image", cfg.images.hetpipe]
        engine.run([*cfg.hetpipe, "k8s", str(cfg.job), "-o", str(manifests), *image], timeout=120, cwd=cfg.root)
        sans = [a for n in certificate_names(_manifests(manifests)) for a in ("--san", n)]
        engine.run([*cfg.hetpipe, "certs", str(certs), "cluster", *sans], timeout=120)
        engine.run([*cfg.hetpipe, "k8s", str(cfg.job), "-o", str(manifests), *image, "--certs", str(certs)],
                   timeout=120, cwd=cfg.root)
        docs = _manifests(manifests)
        kinds = sorted({d["kind"] for d in docs})
    busy = busy_ports([COORDINATOR_PORT, PROMETHEUS_PORT])
    if busy:
        raise BringupError(f"ports {busy} on 127.0.0.1 are taken: the harness publishes them")
    played, pods, ok = Played(), None, False
    report = [f"manifests: {manifests} ({', '.join(kinds)}), played as {folder / 'play.yaml'}"]
    try:
        with timings.phase("kube: podman kube play"):
            engine.run([engine.podman, "network", "create", "--label", LABEL, NETWORK], timeout=60)
            subnet = engine.podman_json("network", "inspect", NETWORK)[0]["subnets"][0]["subnet"]
            played = for_podman(docs, folder=folder / "volumes", subnet=subnet, images=cfg.images)
            for claim, group in played.claims.items():
                engine.run([engine.podman, "volume", "create", "--label", LABEL, claim], timeout=60)
                if group is not None:  # the kubelet's fsGroup: the group owns the volume, may write
                    mount = Path(engine.podman_json("volume", "inspect", claim)[0]["Mountpoint"])
                    os.chown(mount, 0, group)
                    mount.chmod(0o2775)
            play = folder / "play.yaml"
            play.write_text(yaml.safe_dump_all(played.docs, sort_keys=False))
            engine.run([engine.podman, "kube", "play", "--network", NETWORK,
                        *(a for ip in played.ips for a in ("--ip", ip)), str(play)], timeout=600)
            pods = Pods(engine, played)
        with timings.phase("kube: until every pod is healthy"):
            pods.wait_healthy(START_DEADLINE_S)
        report.append(f"pods: {', '.join(pods.pods)} on network {NETWORK}; volumes {', '.join(played.claims)}")
        credentials = [a for flag, name in (("--tls-cert", "cluster.pem"), ("--tls-key", "cluster.key"),
                                            ("--tls-ca", "ca.pem"), ("--token-file", "token"))
                       for a in (flag, str(certs / name))]
        output = next(c["args"][c["args"].index("--output-dir") + 1] for d in played.docs
                      if d["metadata"]["name"] == played.coordinator for c in d["spec"]["containers"])
        live = LiveCluster(
            hetpipe=cfg.hetpipe, coordinator=f"127.0.0.1:{COORDINATOR_PORT}", credentials=credentials,
            prometheus=Prometheus(f"http://127.0.0.1:{PROMETHEUS_PORT}"), prometheus_job=PROMETHEUS_JOB,
            instances=set(played.servers.values()), assert_running=pods.assert_running,
            copy_summary=lambda path: engine.run(
                [engine.podman, "cp", f"{pods.name(played.coordinator)}:{output}/summary.json", str(path)],
                timeout=60))
        if cfg.restart_coordinator:
            with timings.phase("kube: restart the coordinator mid-job, until its job runs again"):
                report.append(restart_mid_job(Restartable(engine, pods.containers, played.coordinator,
                                                          list(played.servers), pods.assert_running,
                                                          resumes=checkpoints(cfg.job)),
                                              live, deadline_s=cfg.job_deadline_s))
        report += train_and_check(live, timings, "kube", workdir=folder, accuracy_bar=cfg.accuracy_bar,
                                  deadline_s=cfg.job_deadline_s)
        ok = True
    finally:
        with timings.phase("kube: down, volumes and network removed, nothing left"):
            if not ok and pods is not None:
                engine.save_logs(list(pods.containers()[p]["Names"][0] for p in pods.containers()),
                                 folder / "logs")
            left = _tear_down(engine, [d["metadata"]["name"] for d in played.docs],
                              [folder / "play.yaml"] if played.docs else [])
    if left:
        raise BringupError(f"`podman kube down` and removing the volumes left {left} (removed by force since)")
    report.append("down: no pod, container, volume or network of the kube phase left")
    return report


def _left(engine: Engine, pods: list[str]) -> list[str]:
    """The pods of the phase (by name, or on its network) and their containers, its volumes and
    its network, as far as they are still there."""
    on_network = {p["Name"] for p in engine.podman_json("pod", "ps", "--filter", f"network={NETWORK}")}
    mine = set(pods) | on_network
    left = [f"pod {p['Name']}" for p in engine.podman_json("pod", "ps") if p["Name"] in mine]
    left += [f"container {c['Names'][0]}" for c in engine.podman_json("ps", "-a", "--pod")
             if c.get("PodName") in mine]
    left += [f"volume {v['Name']}" for v in engine.podman_json("volume", "ls", "--filter", f"label={LABEL}")]
    left += [f"network {n['name']}" for n in engine.podman_json("network", "ls") if n["name"] == NETWORK]
    return left


def _tear_down(engine: Engine, pods: list[str], play: list[Path]) -> list[str]:
    """podman kube down, then the volumes and the network the harness made (kube down keeps
    volumes, as deleting a cluster keeps its claims); returns what else was left, removed by force."""
    for path in play:
        engine.run([engine.podman, "kube", "down", str(path)], timeout=300, check=False)
    for v in engine.podman_json("volume", "ls", "--filter", f"label={LABEL}"):
        engine.run([engine.podman, "volume", "rm", v["Name"]], timeout=60, check=False)
    engine.run([engine.podman, "network", "rm", NETWORK], timeout=60, check=False)
    left = _left(engine, pods)
    for kind in ("pod", "container", "volume", "network"):
        for thing in left:
            if thing.startswith(f"{kind} "):
                name = thing.split()[1]
                engine.run([engine.podman, *([] if kind == "container" else [kind]), "rm", "-f", name],
                           timeout=60, check=False)
    return left
