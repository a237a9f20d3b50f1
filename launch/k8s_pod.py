"""The pieces every HetPipe pod of `hetpipe k8s` is made of (launch/k8s.py puts them together):
its container (ports, gRPC probes, the security flags and context, the secret mounts), its pod
spec, template, Deployment and Service."""

from __future__ import annotations

from typing import Any

from launch.compose import METRICS_PORT, RUNS

Manifest = dict[str, Any]

# Every service also serves grpc.health.v1 alone, in plaintext, on HEALTH_PORT: the kubelet's
# gRPC probes cannot present a client certificate or a token.
HEALTH_PORT = 50052
TLS_SECRET, TOKEN_SECRET = "hetpipe-tls", "hetpipe-token"
TLS_DIR, TOKEN_DIR = "/var/run/secrets/hetpipe/tls", "/var/run/secrets/hetpipe/token"
TOKEN_FILE = "token"
UID = 10001                   # the image's user (docker/Dockerfile)


def security_flags() -> list[str]:
    return ["--health-port", str(HEALTH_PORT),
            "--tls-cert", f"{TLS_DIR}/tls.pem", "--tls-key", f"{TLS_DIR}/tls.key", "--tls-ca", f"{TLS_DIR}/ca.pem",
            "--token-file", f"{TOKEN_DIR}/{TOKEN_FILE}"]


def container(name: str, image: str, module: str, args: list[str], *, grpc_port: int,
              mounts: list[Manifest], env: list[Manifest] | None = None) -> Manifest:
    grpc_probe = {"port": HEALTH_PORT}
    return {
        "name": name,
        "image": image,
        "command": ["python", "-m", module],
        "args": [*args, *security_flags()],
        "env": [
            {"name": "HETPIPE_HOST", "value": "0.0.0.0"},
            {"name": "HETPIPE_PORT", "value": str(grpc_port)},
            {"name": "HETPIPE_METRICS_PORT", "value": str(METRICS_PORT)},
            {"name": "HETPIPE_OUTPUT_ROOT", "value": RUNS},  # where assigned traces and checkpoints may go
            # The root filesystem is read-only: caches (CUDA's, torch's) go to the /tmp volume.
            {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
            *(env or []),
        ],
        "ports": [{"name": "grpc", "containerPort": grpc_port},
                  {"name": "metrics", "containerPort": METRICS_PORT},
                  {"name": "health", "containerPort": HEALTH_PORT}],
        # Stage workers import torch before they serve: up to 5 minutes to start.
        "startupProbe": {"grpc": dict(grpc_probe), "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {"grpc": dict(grpc_probe), "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"grpc": dict(grpc_probe), "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3},
        "volumeMounts": [
            *mounts,
            {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
            {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def pod_spec(container: Manifest, volumes: list[Manifest], **extra: Any) -> Manifest:
    return {
        "automountServiceAccountToken": False,  # no process talks to the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,  # volumes and secrets readable (and the volumes writable) by the image's user
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **extra,
        "containers": [container],
        "volumes": [
            *volumes,
            # 0440 with fsGroup: the key is readable by the image's user and no one else.
            {"name": "tls", "secret": {"secretName": TLS_SECRET, "defaultMode": 0o440}},
            {"name": "token", "secret": {"secretName": TOKEN_SECRET, "defaultMode": 0o440}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }


def template(labels: dict[str, str], spec: Manifest) -> Manifest:
    return {
        "metadata": {
            "labels": labels,
            # For a Prometheus that discovers pods by annotation rather than by podmonitor.yaml.
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)},
        },
        "spec": spec,
    }


def deployment(name: str, labels: dict[str, str], selector: dict[str, str], pod: Manifest) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            # Never two at once: a second coordinator would submit the job again, a second stage
            # would register for the same stage (and wait for the first one's GPU).
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": template(labels, pod),
        },
    }


def service(name: str, labels: dict[str, str], selector: dict[str, str], grpc_port: int, *,
            headless: bool) -> Manifest:
    spec: Manifest = {
        "selector": selector,
        "ports": [{"name": "grpc", "port": grpc_port, "targetPort": "grpc"},
                  {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"}],
    }
    if headless:
        # The name resolves to the pod itself as soon as it exists: a worker advertises it when it
        # registers, which may be before its readiness probe has passed.
        spec = {"clusterIP": "None", "publishNotReadyAddresses": True, **spec}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels}, "spec": spec}
