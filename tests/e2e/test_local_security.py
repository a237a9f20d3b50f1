"""A local `hetpipe run` is reachable from this machine only, and only with its token: every
process listens on loopback (gRPC and metrics alike), the per-run token is its owner's alone and
gone after the run; a job with a `security` section trains over mutual TLS."""

from __future__ import annotations

import ipaddress
import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import BASE_JOB, deep_update
from launch import certs

pytestmark = pytest.mark.timeout(120)
HETPIPE = [sys.executable, "-m", "launch.cli"]
PARALLEL = {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1}  # stages and a shard


def _job_file(tmp_path: Path, **overrides: object) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(deep_update(BASE_JOB, {"output": {"trace": False}, "parallel": PARALLEL,
                                                          **overrides})))
    return path


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.1 also as gRPC's IPv6 socket shows it, ::ffff:127.0.0.1."""
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _listening(root: psutil.Process) -> dict[int, list[str]]:
    """pid -> the addresses each process of root's tree listens on."""
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            out[p.pid] = [f"{c.laddr.ip}:{c.laddr.port}" for c in p.net_connections("inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_local_run_listens_on_loopback_only(tmp_path: Path) -> None:
    job = _job_file(tmp_path, train={"steps": 100000})
    run = subprocess.Popen([*HETPIPE, "run", "-q", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    out_dir = tmp_path / "out"
    try:
        deadline = time.monotonic() + 90
        while True:
            status = subprocess.run([*HETPIPE, "status", "--job", str(job), "--json"], capture_output=True,
                                    text=True, timeout=60)
            if status.returncode == 0 and json.loads(status.stdout)["job"].get("state") == "RUNNING":
                doc = json.loads(status.stdout)   # the shape an ended job's has too
                assert isinstance(doc["job"]["total_samples"], int) and isinstance(doc["workers"], list), doc
                assert {w["info"]["role"] for w in doc["workers"]} == {"STAGE_WORKER", "PS_SHARD"}, doc
                break
            assert time.monotonic() < deadline and run.poll() is None, (status.stdout, status.stderr)
            time.sleep(0.2)
        token = out_dir / "coordinator.token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        listening = _listening(psutil.Process(run.pid))
        servers = {pid: addrs for pid, addrs in listening.items() if addrs}
        # The launcher (coordinator + its metrics) and every stage worker and shard (gRPC + metrics).
        assert len(servers) >= 1 + 2 + 1, listening
        assert all(len(addrs) >= 2 for addrs in servers.values()), servers
        hosts = {ipaddress.ip_address(a.rsplit(":", 1)[0]) for addrs in servers.values() for a in addrs}
        assert all(_loopback(h) for h in hosts), servers
        stop = subprocess.run([*HETPIPE, "stop", "--job", str(job)], capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr
        run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
    assert not (out_dir / "coordinator.token").exists()


def test_a_job_with_a_security_section_trains_over_mutual_tls(tmp_path: Path) -> None:
    certs.make(tmp_path / "certs", ["localhost"])
    job = _job_file(tmp_path, train={"steps": 20}, security={
        "tls": {"cert": "certs/localhost.pem", "key": "certs/localhost.key", "ca": "certs/ca.pem"},
        "token_file": "certs/token"})
    run = subprocess.run([*HETPIPE, "run", "-q", str(job)], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 20
    log = (tmp_path / "out" / "logs" / "stage_worker_0.log").read_text()
    assert "serving on" in log
