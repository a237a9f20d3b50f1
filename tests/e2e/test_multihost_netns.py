"""Three hosts for real: network namespaces joined by veth pairs through a bridge, one link shaped
to 200 Mbit/s. hosta runs `hetpipe coordinator` and a parameter-server shard (`hetpipe worker
--gpus none --shards 1`), hostb and hostc `hetpipe worker --emulate t4`, each with `ip netns exec
NS` in front of the command a user types, every process bound to its host's own address and
holding the cluster token and its own certificate (mutual TLS). O2 holds exactly across the hosts; then hostc dies mid-job and the job
fails fast naming it.

        hosta 10.99.0.1 ----+
        hostb 10.99.0.2 ----+---- bridge (a namespace of its own)
        hostc 10.99.0.3 ----+     hostc's link: tbf 200 Mbit/s, burst 256 kB, 50 ms queue, both ways

Needs root and `ip netns` (iproute2) with tc; skipped otherwise. Nothing leaves the namespaces,
and the namespaces, their links and every process in them are removed whatever happens."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import BASE_JOB, deep_update
from hetpipe import weight_files
from hetpipe.config import load_job
from hetpipe.reference import initial_model, train_reference
from launch import certs

HETPIPE = [sys.executable, "-m", "launch.cli"]
REPO = Path(__file__).resolve().parents[2]
HOSTS = {"hosta": "10.99.0.1", "hostb": "10.99.0.2", "hostc": "10.99.0.3"}
SHAPED = "hostc"
RATE = "200mbit"  # tc tbf: 200 Mbit/s = 25 MB/s, burst 256 kB, at most 50 ms queued
PORT = 50050
COORDINATOR = f"{HOSTS['hosta']}:{PORT}"


def _ip_netns_usable() -> str:
    """Why this test cannot run here, or '' if it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2's ip and tc"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available"
    return ""


pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(bool(_ip_netns_usable()), reason=_ip_netns_usable() or "usable")]


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@dataclass
class Hosts:
    tmp: Path
    prefix: str
    namespaces: dict[str, str] = field(default_factory=dict)   # host -> its namespace
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, host: str) -> dict[str, str]:
        """The environment of a command on host: the cluster token and the host's own certificate."""
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # gRPC would use a proxy
        certs = self.tmp / "certs"
        return {**env, "PYTHONPATH": str(REPO), "HETPIPE_TOKEN_FILE": str(certs / "token"),
                "HETPIPE_TLS_CERT": str(certs / f"{HOSTS[host]}.pem"), "HETPIPE_TLS_KEY": str(certs / f"{HOSTS[host]}.key"),
                "HETPIPE_TLS_CA": str(certs / "ca.pem")}

    def command(self, host: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *HETPIPE, *args]

    def start(self, host: str, name: str, *args: str) -> subprocess.Popen[bytes]:
        (self.tmp / name).mkdir(exist_ok=True)
        with open(self.tmp / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(self.command(host, *args), cwd=self.tmp / name, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env(host))
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def kill_host(self, host: str) -> None:
        """Every process in the host's namespace, at once: the host dies."""
        found = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True)
        for pid in found.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self, job: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """`hetpipe run JOB --coordinator` from hosta: the client must reach the coordinator too."""
        return subprocess.run(self.command("hosta", "run", "-q", str(job), "--coordinator", COORDINATOR),
                              cwd=job.parent, capture_output=True, text=True, timeout=timeout, env=self.env("hosta"))


def _network(hosts: Hosts) -> None:
    """The namespaces, the bridge and the veth pairs; hostc's link shaped both ways."""
    p = hosts.prefix
    bridge = hosts.namespaces["bridge"] = f"{p}br"
    _sh("ip", "netns", "add", bridge)
    _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
    _sh("ip", "-n", bridge, "link", "set", "br0", "up")
    for i, (host, address) in enumerate(HOSTS.items()):
        ns = hosts.namespaces[host] = f"{p}{host[-1]}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # Created here with unique names, then moved: inside, each namespace has its own eth0 and port.
        _sh("ip", "link", "add", f"{p}h{i}", "type", "veth", "peer", "name", f"{p}b{i}")
        _sh("ip", "link", "set", f"{p}h{i}", "netns", ns)
        _sh("ip", "link", "set", f"{p}b{i}", "netns", bridge)
        _sh("ip", "-n", ns, "link", "set", f"{p}h{i}", "name", "eth0")
        _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", bridge, "link", "set", f"{p}b{i}", "master", "br0", "up")
        if host == SHAPED:
            for where, dev in ((ns, "eth0"), (bridge, f"{p}b{i}")):
                _sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", RATE,
                    "burst", "256kb", "latency", "50ms")


def _teardown(hosts: Hosts) -> None:
    for host in HOSTS:
        if host in hosts.namespaces:
            hosts.kill_host(host)
    for proc in hosts.procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    for ns in hosts.namespaces.values():  # their links go with them
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for i in range(len(HOSTS)):  # a pair made before the namespace it was meant for
        subprocess.run(["ip", "link", "del", f"{hosts.prefix}h{i}"], capture_output=True)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    h = Hosts(tmp_path, f"hp{os.getpid() % 100000}")
    certs.make(tmp_path / "certs", list(HOSTS.values()))  # mutual TLS between the hosts, and the token
    try:
        try:
            _network(h)
        except subprocess.CalledProcessError as exc:  # root without CAP_NET_ADMIN, a kernel without tbf, ...
            pytest.skip(f"cannot build the network here: {' '.join(exc.cmd)}: {exc.stderr.decode().strip()}")
        h.start("hosta", "coordinator", "coordinator", "--host", HOSTS["hosta"], "--port", str(PORT),
                "--heartbeat-interval", "0.5")
        h.start("hosta", "hosta", "worker", "--coordinator", COORDINATOR, "--gpus", "none", "--shards", "1",
                "--host", HOSTS["hosta"], "--node", "hosta")
        for host in ("hostb", "hostc"):
            h.start(host, host, "worker", "--coordinator", COORDINATOR, "--emulate", "t4", "--host", HOSTS[host],
                    "--node", host)
        deadline = time.monotonic() + 60
        while not all("serving until" in h.log(n) for n in HOSTS):
            for proc, name in zip(h.procs, ["coordinator", *HOSTS]):
                assert proc.poll() is None, h.log(name)
            assert time.monotonic() < deadline, [h.log(n) for n in HOSTS]
            time.sleep(0.1)
        yield h
    finally:
        _teardown(h)


def _job_file(tmp_path: Path, name: str, overrides: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(deep_update(deep_update(BASE_JOB, overrides), {"output": {"dir": name.split(".")[0]}})))
    return path


def test_o2_holds_across_three_hosts_and_a_dead_host_is_named(hosts: Hosts, tmp_path: Path) -> None:
    job_file = _job_file(tmp_path, "o2.yaml", {
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0, "ps_shards": 1},
        "output": {"trace": False},
    })
    run = hosts.run(job_file)
    assert run.returncode == 0, run.stderr + hosts.log("coordinator")
    summary = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert sorted(s["node"] for s in summary["plan"]) == ["hostb", "hostc"] and summary["ps_shards"] == 1
    job = load_job(job_file)
    got, want, w0 = weight_files.read_weights(tmp_path / "o2"), train_reference(job).state_dict(), initial_model(job).state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    assert max(float((want[k] - w0[k]).abs().max()) for k in want) > 1e-3
    shaped = subprocess.run(["ip", "netns", "exec", hosts.namespaces[SHAPED], "tc", "-s", "qdisc", "show", "dev", "eth0"],
                            capture_output=True, text=True, check=True).stdout
    assert "tbf" in shaped and int(re.search(r"Sent (\d+) bytes", shaped)[1]) > 100_000, shaped  # type: ignore[index]

    # The same hosts, a long job; hostc dies under it.
    long_job = _job_file(tmp_path, "long.yaml", {
        "cluster": {"nodes": [{"name": h, "gpus": [{"type": "t4"}]} for h in ("hostb", "hostc")],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.02}},
        "train": {"steps": 20000}, "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1},
        "output": {"trace": True},  # on each stage's host: hostc's tells how far it got
    })
    with open(tmp_path / "client.err", "wb") as err_file:
        client = subprocess.Popen(hosts.command("hosta", "run", "-q", str(long_job), "--coordinator", COORDINATOR),
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True,
                                  env=hosts.env("hosta"))
    hosts.procs.append(client)
    deadline = time.monotonic() + 60
    while sum(len(t.read_text().splitlines()) for t in (tmp_path / "hostc" / "runs" / "trace").glob("vw*.jsonl")) < 5:
        assert client.poll() is None and time.monotonic() < deadline, (tmp_path / "client.err").read_text()
        time.sleep(0.1)
    hosts.kill_host("hostc")
    killed = time.monotonic()
    client.wait(30)
    took = time.monotonic() - killed
    err = (tmp_path / "client.err").read_text()
    assert client.returncode == 1 and took < 10, (client.returncode, took, err)
    assert re.search(r"stage 0 of vw \d at 10\.99\.0\.3:\d+ on node hostc: Status failed: UNAVAILABLE", err), err
    assert "forwards and" in err and "Traceback" not in err, err
