"""Prometheus binaries for tests: found on PATH, else installed from Debian's `prometheus`
package (it ships both `prometheus` and `promtool`), else the test is skipped with the reason.

    from tests.prometheus_tools import ensure_promtool, ensure_prometheus, promtool_check_metrics
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest

PACKAGE = "prometheus"
INSTALL_TIMEOUT_S = 600
# Waits for another apt/dpkg (a parallel test session, a helper installing the same package)
# instead of failing at once on the dpkg lock.
_APT = ["apt-get", "-y", "-q", "-o", "DPkg::Lock::Timeout=300", "--no-install-recommends"]

_lock = threading.Lock()
_install_error: str | None = None  # why installing failed, remembered for the session
_install_tried = False


def _run(args: list[str]) -> tuple[bool, str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{' '.join(args[:2])}: {exc}"
    tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
    return out.returncode == 0, f"`{' '.join(args)}` exited {out.returncode}: {' / '.join(tail)}"


def _install() -> str | None:
    """Installs the package once per session; None on success, else why not."""
    global _install_error, _install_tried
    with _lock:
        if _install_tried:
            return _install_error
        _install_tried = True
        if shutil.which("apt-get") is None:
            _install_error = "apt-get is not available (not a Debian-based system)"
        elif os.geteuid() != 0:
            _install_error = "apt-get needs root and the tests do not run as root"
        else:
            ok, why = _run([*_APT, "install", PACKAGE])
            if not ok:  # e.g. no package lists yet in a fresh container
                _run(["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300", "update"])
                ok, why = _run([*_APT, "install", PACKAGE])
            _install_error = None if ok else why
        return _install_error


def _ensure(binary: str) -> str:
    path = shutil.which(binary)
    if path is not None:
        return path
    why = _install()
    path = shutil.which(binary)
    if path is not None:
        return path
    pytest.skip(f"`{binary}` is not on PATH and the Debian package `{PACKAGE}` could not be installed: "
                f"{why or f'installed, but it provides no {binary}'}")


def ensure_promtool() -> str:
    """Path of `promtool`, installing it if needed; skips the calling test if impossible."""
    return _ensure("promtool")


def ensure_prometheus() -> str:
    """Path of the `prometheus` server, installing it if needed; skips the calling test if impossible."""
    return _ensure("prometheus")


def promtool_check_metrics(text: str, promtool: str | None = None) -> tuple[int, str]:
    """`promtool check metrics` on an exposition text: (exit code, its output). Clean is (0, "")."""
    out = subprocess.run([promtool or ensure_promtool(), "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60)
    return out.returncode, (out.stdout + out.stderr).strip()
