"""The bring-up's images, built with podman from Debian's packages and PyPI alone (no registry)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from engine import BringupError, Engine

PYPI = "https://pypi.org/simple"


@dataclass(frozen=True, slots=True, kw_only=True)
class Images:
    base: str                      # a Debian bookworm image: python3 and prometheus come from apt
    hetpipe: str = "localhost/hetpipe:cpu"
    prometheus: str = "localhost/hetpipe-prometheus:bookworm"
    wheels: str = ""               # a find-links folder; with torch's CPU wheel, torch comes from it
    ca_bundle: str = ""            # for pip behind a TLS-intercepting proxy
    torch_index: str = ""          # "" = the Dockerfile's default, unless wheels has the CPU wheel


def pip_find_links() -> str:
    """This host's find-links folder, as the container engine script finds it: $PIP_FIND_LINKS,
    else pip's configuration; "" if none is a folder."""
    value = os.environ.get("PIP_FIND_LINKS", "")
    if not value:
        try:
            value = subprocess.run(["pip", "config", "get", "global.find-links"], capture_output=True,
                                   text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            value = ""
    return next((v for v in value.split() if Path(v).is_dir()), "")


def pip_ca_bundle() -> str:
    path = os.environ.get("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    return path if Path(path).is_file() else ""


def cpu_torch_wheel(folder: str) -> bool:
    return bool(folder) and any(Path(folder).glob("torch-*+cpu-*.whl"))


def package_access(images: Images) -> list[str]:
    """podman build flags that give pip the CA bundle and the wheel folder, as build-time mounts
    named by build arguments (docker/Dockerfile): nothing of either stays in the image."""
    flags = []
    if images.ca_bundle:
        flags += ["-v", f"{images.ca_bundle}:/etc/pip-ca.crt:ro", "--build-arg", "PIP_CERT=/etc/pip-ca.crt"]
    if images.wheels:
        flags += ["-v", f"{images.wheels}:/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/wheels"]
    # PyPI's torch 2.13.0 for Linux is the CUDA build (GBs of nvidia-* wheels); the folder's
    # 2.13.0+cpu is a higher version by PEP 440, so pip takes it over PyPI's.
    index = images.torch_index or (PYPI if cpu_torch_wheel(images.wheels) else "")
    if index:
        flags += ["--build-arg", f"TORCH_INDEX={index}"]
    return flags


def build(engine: Engine, root: Path, images: Images) -> None:
    """Builds both images; podman's layer cache makes a rebuild of unchanged sources take seconds."""
    common = [engine.podman, "build", "--format", "docker", "--build-arg", f"BASE_IMAGE={images.base}"]
    engine.run([*common, *package_access(images), "-f", "docker/Dockerfile",
                "--ignorefile", "docker/Dockerfile.dockerignore", "-t", images.hetpipe, "."],
               cwd=root, timeout=1800)
    engine.run([*common, "-f", "docker/prometheus/Dockerfile", "-t", images.prometheus, "docker/prometheus"],
               cwd=root, timeout=900)
    for image in (images.hetpipe, images.prometheus):
        if not engine.image_exists(image):
            raise BringupError(f"podman build reported success but there is no image {image}")
