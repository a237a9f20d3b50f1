"""TLS, tokens and roles against real service processes: without the token, or in plaintext to
a TLS server, every method of every service is refused and changes nothing; a stage's token may
not stop a stage or initialise a shard; paths from the network stay inside the output root."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from hetpipe import reach, rpc, security
from hetpipe.v1 import coordinator_pb2, stage_pb2, wire_pb2
from hetpipe.config import ConfigError
from launch import certs, remote
from tests import service_process

pytestmark = pytest.mark.timeout(120)
SERVICES = {"stage_worker": "Stage", "ps_server": "ParameterServer", "coordinator": "Coordinator"}


@dataclass
class Cluster:
    tmp: Path
    credentials: security.Security
    addresses: dict[str, str]      # module -> host:port



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("secure")
    certs.make(tmp / "certs", ["localhost"])
    credentials = security.Security(cert=str(tmp / "certs/localhost.pem"), key=str(tmp / "certs/localhost.key"),
                                    ca=str(tmp / "certs/ca.pem"), token_file=str(tmp / "certs/token"))
    flags = (*security.child_args(credentials), "--output-root", str(tmp / "out"))
    with security.using(credentials, security.COORDINATOR, "test"):
        gens = [service_process.start(m, s, tmp, flags) for m, s in SERVICES.items()]
        try:
            services = {m: next(g) for m, g in zip(SERVICES, gens)}
            yield Cluster(tmp, credentials, {m: s.address for m, s in services.items()})
        finally:
            for g in gens:
                g.close()


def _empty_request(method: object) -> object:
    """An empty request of method's kind: no frames for a stream of them."""
    return iter(()) if method.client_streaming else b""  # type: ignore[attr-defined]


def _call_every_method(address: str, service: str, channel: grpc.Channel) -> dict[str, grpc.StatusCode]:
    """Each method of service called once with an empty request: its status code."""
    codes = {}
    for method in rpc.SERVICES[service].methods:
        kind = f"{'stream' if method.client_streaming else 'unary'}_{'stream' if method.server_streaming else 'unary'}"
        call = getattr(channel, kind)(f"/{rpc.SERVICES[service].full_name}/{method.name}",
                                      request_serializer=None, response_deserializer=None)
        try:
            reply = call(_empty_request(method), timeout=5)
            if method.server_streaming:
                list(reply)
            codes[method.name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[method.name] = exc.code()
    return codes


def _state(cluster: Cluster) -> tuple[object, ...]:
    """What the refused calls must not change: the stage's, shard's and coordinator's status."""
    with security.using(cluster.credentials, security.COORDINATOR, "test"):
        with rpc.channel(cluster.addresses["stage_worker"]) as ch:
            stage = rpc.Stub(ch, "Stage").Status(stage_pb2.StatusRequest(), timeout=5)
        with rpc.channel(cluster.addresses["ps_server"]) as ch:
            shard = rpc.Stub(ch, "ParameterServer").Status(wire_pb2.Empty(), timeout=5)
        with rpc.channel(cluster.addresses["coordinator"]) as ch:
            job = rpc.Stub(ch, "Coordinator").GetJob(coordinator_pb2.JobRef(), timeout=5)
            workers = rpc.Stub(ch, "Coordinator").ListWorkers(wire_pb2.Empty(), timeout=5)
    return stage.state, stage.vw, shard.SerializeToString(), job.state, len(workers.workers)


def test_without_token_every_method_is_unauthenticated_and_changes_nothing(cluster: Cluster) -> None:
    before = _state(cluster)
    tls_only = security.Security(cert=cluster.credentials.cert, key=cluster.credentials.key,
                                 ca=cluster.credentials.ca)
    with security.using(tls_only, security.COORDINATOR, "test"):
        for module, service in SERVICES.items():
            with rpc.channel(cluster.addresses[module]) as ch:
                codes = _call_every_method(cluster.addresses[module], service, ch)
            assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (module, codes)
            with rpc.channel(cluster.addresses[module]) as ch:  # health stays open: probes need it
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert _state(cluster) == before


def test_plaintext_to_a_tls_server_fails_the_handshake_for_every_method(cluster: Cluster) -> None:
    before = _state(cluster)
    for module, service in SERVICES.items():
        with grpc.insecure_channel(cluster.addresses[module]) as ch:
            codes = _call_every_method(cluster.addresses[module], service, ch)
        assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, (module, codes)
    assert _state(cluster) == before


def _health_error(address: str) -> grpc.RpcError:
    """The error of a health check of address through this process's rpc.channel."""
    with rpc.channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return err.value


def test_a_tls_mismatch_is_told_apart_from_an_outage(cluster: Cluster, tmp_path: Path, make_job) -> None:
    """gRPC reports each as UNAVAILABLE; rpc.why_unreachable says which, in words a user can act on,
    and only a failed handshake counts as one (a worker exits on it rather than wait)."""
    address = cluster.addresses["coordinator"]
    certs.make(tmp_path / "other", ["localhost"])
    other_ca = security.Security(cert=str(tmp_path / "other/localhost.pem"), key=str(tmp_path / "other/localhost.key"),
                                 ca=str(tmp_path / "other/ca.pem"))
    with security.using(other_ca, security.COORDINATOR, "test"):
        err = _health_error(address)
    assert reach.handshake_failed(err), err.details()
    assert reach.unreachable(address, err) == (
        f"{address} unreachable: UNAVAILABLE: the TLS handshake failed: both ends need certificates from the "
        "same CA (--tls-cert/--tls-key/--tls-ca), or neither uses TLS")

    with security.using(security.Security(), security.COORDINATOR, "test"):
        err = _health_error(address)
        assert not reach.handshake_failed(err)
        assert "does it use TLS (--tls-cert/--tls-key/--tls-ca), which this process does not?" in \
            reach.why(err), err.details()

        with socket.socket() as s:   # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = f"127.0.0.1:{s.getsockname()[1]}"
        err = _health_error(closed)
        assert not reach.handshake_failed(err)
        assert reach.why(err) == "nothing listens at that address (not started yet, or stopped)"

    with security.using(other_ca, security.COORDINATOR, "test"), rpc.channel(address) as ch:
        with pytest.raises(ConfigError, match="the TLS handshake failed"):   # `hetpipe run --coordinator`: no retries
            remote._submit(rpc.Stub(ch, "Coordinator"), make_job(), address)

    def health_error_from(credentials: grpc.ServerCredentials | None, bind: str, dial: str) -> grpc.RpcError:
        """The error of a health check at dial, of a server bound to bind:0 with credentials."""
        server = grpc.server(futures.ThreadPoolExecutor(1))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = (server.add_secure_port(f"{bind}:0", credentials) if credentials is not None
                else server.add_insecure_port(f"{bind}:0"))
        server.start()
        try:
            return _health_error(f"{dial}:{port}")
        finally:
            server.stop(0)

    with security.using(cluster.credentials, security.COORDINATOR, "test"):
        err = health_error_from(None, "127.0.0.1", "127.0.0.1")   # TLS to a plaintext server
        assert reach.handshake_failed(err), err.details()
        # The cluster's CA, but dialled at a name its certificate lacks (it names localhost, 127.0.0.1).
        err = health_error_from(security.server_credentials(), "0.0.0.0", "127.0.0.2")
    assert reach.handshake_failed(err), err.details()
    assert "its certificate does not name the address dialled" in reach.why(err)


def test_a_forged_token_is_unauthenticated(cluster: Cluster, tmp_path: Path) -> None:
    other = tmp_path / "token"
    security.write_secret(other, security.new_secret())
    forged = security.Security(cert=cluster.credentials.cert, key=cluster.credentials.key,
                               ca=cluster.credentials.ca, token_file=str(other))
    with security.using(forged, security.COORDINATOR, "test"), rpc.channel(cluster.addresses["stage_worker"]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            rpc.Stub(ch, "Stage").Stop(wire_pb2.Empty(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_status_and_stop_with_another_token_say_refused_not_unreachable(cluster: Cluster, tmp_path: Path) -> None:
    """They said 'coordinator ... unreachable' and exited 69, which tells a script to try again: the
    coordinator answered, and refused the token (or its absence), as `hetpipe run --coordinator` says."""
    other = tmp_path / "token"
    security.write_secret(other, security.new_secret())
    tls = ["--tls-cert", cluster.credentials.cert, "--tls-key", cluster.credentials.key, "--tls-ca", cluster.credentials.ca]
    address = cluster.addresses["coordinator"]
    for command, token in (("status", ["--token-file", str(other)]), ("stop", ["--token-file", str(other)]),
                           ("status", [])):
        ran = subprocess.run([sys.executable, "-m", "launch.cli", command, "--coordinator", address, *tls, *token],
                             capture_output=True, text=True, timeout=60, cwd=service_process.REPO,
                             env={k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")})
        assert ran.returncode == 2, (command, token, ran.stderr)
        assert ran.stderr.startswith(f"hetpipe: error: coordinator {address} refused the call: UNAUTHENTICATED: "), \
            ran.stderr
        assert "unreachable" not in ran.stderr, ran.stderr


def test_a_worker_with_a_forged_token_exits_naming_the_refusal(cluster: Cluster, tmp_path: Path) -> None:
    """Registering cannot succeed with another token: the worker exits EXIT_REFUSED at once,
    its log naming the coordinator's refusal, rather than running on unregistered for ever."""
    from hetpipe.service import EXIT_REFUSED
    other = tmp_path / "token"
    security.write_secret(other, security.new_secret())
    forged = security.Security(cert=cluster.credentials.cert, key=cluster.credentials.key,
                               ca=cluster.credentials.ca, token_file=str(other))
    log = tmp_path / "stage.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "stage_worker", "--host", "127.0.0.1", "--port", "0",
                                 "--metrics-port", "0", "--exit-with-parent", "--node", "n0",
                                 "--coordinator", cluster.addresses["coordinator"], *security.child_args(forged),
                                 "--output-root", str(tmp_path / "out")],
                                cwd=service_process.REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        code = proc.wait(60)
    finally:
        proc.kill()
    text = log.read_text()
    assert code == EXIT_REFUSED, text[-2000:]
    assert f"coordinator {cluster.addresses['coordinator']} refused this process: UNAUTHENTICATED" in text, text[-2000:]


def test_a_stages_token_may_not_stop_a_stage_or_init_a_shard(cluster: Cluster) -> None:
    before = _state(cluster)
    with security.using(cluster.credentials, security.STAGE, "vw0-stage1"):
        with rpc.channel(cluster.addresses["stage_worker"]) as ch:
            stage = rpc.Stub(ch, "Stage")
            for call in (lambda: stage.Stop(wire_pb2.Empty(), timeout=5),
                         lambda: stage.Assign(stage_pb2.StageAssignment(), timeout=5),
                         lambda: stage.GetWeights(stage_pb2.WeightsRequest(), timeout=5).next()):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        with rpc.channel(cluster.addresses["ps_server"]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                rpc.Stub(ch, "ParameterServer").Init(iter(()), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with rpc.channel(cluster.addresses["coordinator"]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                rpc.Stub(ch, "Coordinator").StopJob(coordinator_pb2.JobRef(), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _state(cluster) == before


def test_reflection_lists_the_services_behind_the_token(cluster: Cluster) -> None:
    with security.using(cluster.credentials, security.COORDINATOR, "test"), \
            rpc.channel(cluster.addresses["ps_server"]) as ch:
        assert "hetpipe.v1.ParameterServer" in set(ProtoReflectionDescriptorDatabase(ch).get_services())
    tls_only = security.Security(cert=cluster.credentials.cert, key=cluster.credentials.key, ca=cluster.credentials.ca)
    with security.using(tls_only, security.COORDINATOR, "test"), rpc.channel(cluster.addresses["ps_server"]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_assign_may_not_write_outside_the_output_root(cluster: Cluster) -> None:
    victim = cluster.tmp / "victim.txt"
    victim.write_text("keep me")
    with security.using(cluster.credentials, security.COORDINATOR, "test"), \
            rpc.channel(cluster.addresses["stage_worker"]) as ch:
        for field in ("trace_path", "checkpoint_dir", "profile_path"):
            with pytest.raises(grpc.RpcError) as err:
                rpc.Stub(ch, "Stage").Assign(stage_pb2.StageAssignment(**{field: str(victim)}), timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "output root" in err.value.details()
    assert victim.read_text() == "keep me"


def test_a_service_refuses_to_serve_beyond_loopback_without_a_token(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ps_server", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=service_process.REPO)
    assert proc.returncode == 2
    assert "--token-file" in proc.stderr and "--insecure" in proc.stderr


def test_a_certificate_out_of_its_dates_is_named_so(tmp_path: Path) -> None:
    """A server whose certificate expired (while it ran) was reported as a CA mismatch ("both ends
    need certificates from the same CA"); a process started with one served, and as a client met
    only a closed socket, which reads as an outage (its registration retried for ever)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    certs.make(tmp_path, ["localhost"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "old")])
    old = (x509.CertificateBuilder().subject_name(name).issuer_name(ca.subject).public_key(key.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=366))
           .not_valid_after(now - datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
           .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (tmp_path / "old.pem").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "old.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    expired = security.Security(cert=str(tmp_path / "old.pem"), key=str(tmp_path / "old.key"), ca=str(tmp_path / "ca.pem"))
    with pytest.raises(security.SecurityError, match=f"TLS certificate {tmp_path}/old.pem: valid from .* UTC, not now"):
        security.use(expired, security.STAGE, "test")

    server = grpc.server(futures.ThreadPoolExecutor(1))   # one that started before its certificate expired
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials = grpc.ssl_server_credentials([(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                                  serialization.NoEncryption()),
                                                old.public_bytes(serialization.Encoding.PEM))],
                                              root_certificates=(tmp_path / "ca.pem").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        good = security.Security(cert=str(tmp_path / "localhost.pem"), key=str(tmp_path / "localhost.key"),
                                 ca=str(tmp_path / "ca.pem"))
        with security.using(good, security.COORDINATOR, "test"):
            err = _health_error(f"127.0.0.1:{port}")
    finally:
        server.stop(0)
    assert reach.handshake_failed(err), err.details()
    assert reach.why(err).startswith("the TLS handshake failed: the server's certificate, or its CA, has expired")
