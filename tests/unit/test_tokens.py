"""Role tokens, the method table and `hetpipe certs`: pure checks, no processes."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from hetpipe import security
from hetpipe.config import ConfigError
from launch import certs

SECRET = "s" * 20
ROLES = (security.COORDINATOR, security.STAGE, security.SEED, security.SHARD)


@pytest.mark.parametrize("role", ROLES)
def test_a_minted_token_identifies_its_role_and_nothing_forged_does(role: str) -> None:
    token = security.mint(SECRET, role, "vw0-stage1")
    assert security.identify(SECRET, token) == (role, "vw0-stage1")
    prefix, _, subject, mac = token.split(".")
    others = [r for r in ROLES if r != role]
    forged = [
        f"{prefix}.{others[0]}.{subject}.{mac}",             # another role, same MAC
        f"{prefix}.{role}.vw1-stage0.{mac}",                  # another subject
        f"{prefix}.{role}.{subject}.{mac[:-1]}A",             # a changed MAC
        security.mint("t" * 20, role, "vw0-stage1"),          # another cluster's secret
        f"{prefix}.admin.{subject}.{security._mac(SECRET, 'admin', subject)}",  # a role that does not exist
        "", SECRET[:-1], f"Bearer {SECRET}",
        f"{prefix}.{role}.{subject}.{mac[:-1]}\xe9",         # not ASCII: a raw HTTP/2 client can send it
    ]
    assert [security.identify(SECRET, f) for f in forged] == [None] * len(forged)


def test_the_secret_itself_is_the_jobs_token() -> None:
    assert security.identify(SECRET, SECRET) == (security.COORDINATOR, "job token")


def test_subjects_are_sanitised_into_the_token() -> None:
    token = security.mint(SECRET, security.STAGE, "10.0.0.2:50051 / x.y")
    assert security.identify(SECRET, token) == (security.STAGE, "10-0-0-2:50051---x-y")


# (method, roles that may call it): the rules of docs/design.md, written out separately.
RULES = {
    "/hetpipe.v1.Stage/Assign": {"coordinator"}, "/hetpipe.v1.Stage/Start": {"coordinator"},
    "/hetpipe.v1.Stage/Stop": {"coordinator"}, "/hetpipe.v1.Stage/Continue": {"coordinator"},
    "/hetpipe.v1.Stage/GetWeights": {"coordinator"}, "/hetpipe.v1.Stage/Status": {"coordinator"},
    "/hetpipe.v1.Stage/Evaluate": {"coordinator"},
    "/hetpipe.v1.Stage/Forward": {"stage"}, "/hetpipe.v1.Stage/Backward": {"stage"},
    "/hetpipe.v1.Stage/ForwardLink": {"stage"}, "/hetpipe.v1.Stage/BackwardLink": {"stage"},
    "/hetpipe.v1.Stage/LinkSocket": {"stage"},
    "/hetpipe.v1.ParameterServer/Init": {"coordinator", "seed"},
    "/hetpipe.v1.ParameterServer/Push": {"stage"}, "/hetpipe.v1.ParameterServer/PushFrame": {"stage"},
    "/hetpipe.v1.ParameterServer/Exchange": {"stage"},
    "/hetpipe.v1.ParameterServer/Pull": {"stage", "coordinator"},
    "/hetpipe.v1.ParameterServer/Status": {"coordinator"}, "/hetpipe.v1.ParameterServer/Evict": {"coordinator"},
    "/hetpipe.v1.Coordinator/Register": {"stage", "shard"}, "/hetpipe.v1.Coordinator/Heartbeat": {"stage", "shard"},
    "/hetpipe.v1.Coordinator/Submit": {"coordinator"}, "/hetpipe.v1.Coordinator/StopJob": {"coordinator"},
    "/hetpipe.v1.Coordinator/GetJob": {"coordinator"}, "/hetpipe.v1.Coordinator/ListWorkers": {"coordinator"},
    "/hetpipe.v1.Coordinator/Results": {"coordinator"},
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": set(ROLES),
}


@pytest.mark.parametrize("method", sorted(RULES))
def test_each_method_admits_exactly_its_roles(method: str) -> None:
    assert {r for r in ROLES if security.allowed(method, r)} == RULES[method]


def test_every_rpc_of_every_service_has_a_rule_here() -> None:
    from hetpipe import rpc

    names = {f"/{d.full_name}/{m.name}" for d in rpc.SERVICES.values() for m in d.methods}
    assert names <= set(RULES), names - set(RULES)


def test_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    with pytest.raises(security.SecurityError, match="together"):
        security.Security(cert="a.pem").check()
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(security.SecurityError, match="at least 16"):
        security.Security(token_file=str(short)).check()
    with pytest.raises(security.SecurityError, match="cannot be read"):
        security.Security(token_file=str(tmp_path / "missing")).check()
    accented = tmp_path / "accented"
    accented.write_text("\xe9" * 20 + "\n")  # printable, but no gRPC metadata can carry it
    with pytest.raises(security.SecurityError, match="printable ASCII"):
        security.Security(token_file=str(accented)).check()
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff" * 20)   # not UTF-8: was a UnicodeDecodeError traceback
    with pytest.raises(security.SecurityError, match="printable ASCII"):
        security.Security(token_file=str(binary)).check()
    # A folder (a bind mount of a missing file, a secret volume's mount point) was an
    # IsADirectoryError traceback, the token's at check(), TLS files' at use().
    folder = tmp_path / "secret-volume"
    folder.mkdir()
    with pytest.raises(security.SecurityError, match=f"token file {folder}: is a folder, not a file"):
        security.Security(token_file=str(folder)).check()
    with pytest.raises(security.SecurityError, match=f"TLS CA {folder}: is a folder, not a file"):
        security.use(security.Security(cert=str(short), key=str(short), ca=str(folder)), security.STAGE, "s")


def test_tls_files_that_hold_something_else_are_refused_naming_them(tmp_path: Path) -> None:
    """A server given them failed to start with "RuntimeError: Failed to bind to address
    127.0.0.1:0", naming neither the file nor what is wrong with it."""
    certs.make(tmp_path, ["n0", "n1"])
    (tmp_path / "garbage").write_text("not a certificate\n")

    def tls(cert: str, key: str, ca: str = "ca.pem") -> security.Security:
        return security.Security(cert=str(tmp_path / cert), key=str(tmp_path / key), ca=str(tmp_path / ca))

    tls("n0.pem", "n0.key").check()
    for settings, message in ((tls("n0.pem", "n1.key"), f"TLS key {tmp_path}/n1.key is not the key of the certificate "
                                                        f"{tmp_path}/n0.pem"),
                              (tls("garbage", "n0.key"), f"TLS certificate {tmp_path}/garbage: cannot be read as PEM"),
                              (tls("n0.pem", "n0.pem"), f"TLS key {tmp_path}/n0.pem: cannot be read as PEM"),
                              (tls("n0.pem", "n0.key", "n0.key"), f"TLS CA {tmp_path}/n0.key: cannot be read as PEM")):
        with pytest.raises(security.SecurityError, match=message):
            security.use(settings, security.STAGE, "s")


def test_a_token_file_is_written_for_its_owner_only_and_never_through_a_link(tmp_path: Path) -> None:
    existing = tmp_path / "token"
    existing.write_text("old\n")
    existing.chmod(0o644)
    with existing.open() as before:   # a reader that opened it as it was
        security.write_secret(existing, "s" * 20)
        # The file is not cut and rewritten in place (a reader could find it empty): a new one took its name.
        assert before.read() == "old\n"
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600 and existing.read_text() == "s" * 20 + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"], "no file left under another name"
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        security.write_secret(tmp_path / "link", "s" * 20)
    assert not (tmp_path / "elsewhere").exists()


def test_certs_are_issued_by_the_ca_for_their_host_and_keys_are_private(tmp_path: Path) -> None:
    certs.make(tmp_path, ["n0", "10.13.0.2"], ["coordinator"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for host, expected in (("n0", x509.DNSName("n0")), ("10.13.0.2", x509.IPAddress(ipaddress.ip_address("10.13.0.2")))):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{host}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert expected in names and x509.DNSName("coordinator") in names
        assert x509.IPAddress(ipaddress.ip_address("127.0.0.1")) in names
        assert stat.S_IMODE((tmp_path / f"{host}.key").stat().st_mode) == 0o600
    token = (tmp_path / "token").read_text()
    security.Security(token_file=str(tmp_path / "token")).check()
    n0 = (tmp_path / "n0.pem").read_bytes()
    assert certs.make(tmp_path, ["n0", "n1"]) == [tmp_path / "n1.pem", tmp_path / "n1.key"]
    assert (tmp_path / "token").read_text() == token and (tmp_path / "n0.pem").read_bytes() == n0
    x509.load_pem_x509_certificate((tmp_path / "n1.pem").read_bytes()).verify_directly_issued_by(ca)
    # A pair that no longer serves is issued anew by the same CA: one that lacks a name now asked
    # for (compose's volume, made for a job with fewer shards), or one another CA signed.
    assert certs.make(tmp_path, ["n0"], ["coordinator", "ps-2"]) == [tmp_path / "n0.pem", tmp_path / "n0.key"]
    cert = x509.load_pem_x509_certificate((tmp_path / "n0.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert x509.DNSName("ps-2") in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert certs.make(tmp_path, ["n0"], ["ps-2"]) == [], "a pair naming all that is asked, and more, is kept"
    other = tmp_path / "other"
    certs.make(other, ["n0"], ["coordinator", "ps-2"])
    for name in ("n0.pem", "n0.key"):
        (tmp_path / name).write_bytes((other / name).read_bytes())
    assert certs.make(tmp_path, ["n0"], ["ps-2"]) == [tmp_path / "n0.pem", tmp_path / "n0.key"]
    x509.load_pem_x509_certificate((tmp_path / "n0.pem").read_bytes()).verify_directly_issued_by(ca)


def test_a_ca_that_has_expired_is_replaced_and_its_hosts_issued_anew(tmp_path: Path) -> None:
    """compose's certs volume a year on: a pair issued again by the CA that had expired failed
    every handshake ("certificate has expired"), however new the pair."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    certs._new_ca(tmp_path, now - datetime.timedelta(days=366), now - datetime.timedelta(hours=1))
    certs.make(tmp_path, ["n0"])
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    assert ca.not_valid_after_utc > now + datetime.timedelta(days=certs.VALID_DAYS - 1)
    x509.load_pem_x509_certificate((tmp_path / "n0.pem").read_bytes()).verify_directly_issued_by(ca)
    token = (tmp_path / "token").read_text()
    assert certs.make(tmp_path, ["n0"]) == [], "a CA that serves is kept, and so are its pairs"
    assert (tmp_path / "token").read_text() == token


@pytest.mark.parametrize("away", ["ca.key", "ca.pem"])
def test_a_ca_half_without_the_other_is_refused_not_replaced(tmp_path: Path, away: str) -> None:
    """ca.key kept off the machine, as the README advises: adding a host must not make a new CA,
    which would reissue every host's pair from a CA no running host trusts (or lose ca.key)."""
    certs.make(tmp_path, ["n0"])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / away).rename(tmp_path.parent / away)
    with pytest.raises(ValueError, match=f"holds .* without {away}: put {away} back"):
        certs.make(tmp_path, ["n0", "n1"])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {k: v for k, v in before.items() if k != away}


@pytest.mark.parametrize("hosts, sans, passwords, message", [
    (["ca"], [], [], "host 'ca': its ca.pem and ca.key would overwrite the CA's"),
    ([""], [], [], "host '': expected an IP address or a DNS name"),
    (["../escaped"], [], [], "host '../escaped': expected"),
    (["héllo"], [], [], "host 'héllo': expected"),
    (["my host"], [], [], "host 'my host': expected"),
    (["*.n0"], [], [], "host '\\*.n0': expected"),
    (["n0"], ["bad name"], [], "--san 'bad name': expected"),
    (["n0"], [], ["token"], "--password-file 'token': expected a plain file name"),
    (["n0"], [], ["n0.key"], "--password-file 'n0.key'"),
    (["n0"], [], ["../pw"], "--password-file '../pw'"),
], ids=["ca", "empty", "path", "unicode", "space", "wildcard host", "san", "token", "a host's key", "path"])
def test_names_certs_cannot_write_as_asked_are_refused_before_anything_is(tmp_path: Path, hosts: list[str], sans: list[str],
                                                                         passwords: list[str], message: str) -> None:
    """`hetpipe certs DIR ca` overwrote the CA with a leaf; --password-file token left the cluster
    token world-readable; '../x' wrote outside DIR; '' and 'héllo' ended in a traceback with half
    the files written."""
    with pytest.raises(ValueError, match=f"^{message}"):
        certs.make(tmp_path / "c", hosts, sans, passwords)
    assert not (tmp_path / "c").exists(), "refused, but wrote"
    written = certs.make(tmp_path / "ok", ["n0", "10.0.0.2", "node-1.cluster.local"], ["*.svc.local", "::1"], ["grafana"])
    assert {p.name for p in written} >= {"ca.pem", "n0.pem", "10.0.0.2.key", "node-1.cluster.local.pem", "grafana", "token"}


def test_a_local_run_takes_the_jobs_security_then_the_flags_then_makes_a_token(make_job, tmp_path: Path) -> None:
    from hetpipe.outputs import TOKEN_FILE
    from launch.local import local_security

    flags = security.Security(token_file=str(tmp_path / "flag-token"))
    made = local_security(make_job(), tmp_path)
    assert made.token_file == str(tmp_path / TOKEN_FILE) and not made.tls
    assert stat.S_IMODE((tmp_path / TOKEN_FILE).stat().st_mode) == 0o600
    assert local_security(make_job(), tmp_path, flags) == flags
    job = make_job({"security": {"token_file": "job-token"}})
    assert local_security(job, tmp_path, flags) == security.Security(token_file=str(job.resolve("job-token")))


@pytest.mark.parametrize("section", [{}, {"token_file": None}])
def test_a_security_section_that_secures_nothing_is_refused(make_job, section: dict[str, Any]) -> None:
    """It would take the place of the per-run token and leave every method open."""
    with pytest.raises(ConfigError, match=r"security: give token_file, tls or both"):
        make_job({"security": section})


def test_the_command_lines_security_paths_are_absolute_from_where_it_was_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hetpipe worker --token-file token` moves into its --output-root before its children read it."""
    import argparse

    monkeypatch.chdir(tmp_path)
    ns = argparse.Namespace(tls_cert="certs/node.crt", tls_key="", tls_ca="/etc/ca.crt", token_file="token")
    flags = security.from_namespace(ns)
    assert (flags.cert, flags.key, flags.ca, flags.token_file) == (
        str(tmp_path / "certs/node.crt"), "", "/etc/ca.crt", str(tmp_path / "token"))
