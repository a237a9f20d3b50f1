"""`hetpipe certs DIR NAME...`: a CA, a certificate per host and a cluster token, for a quick start.

Each certificate is the host's identity for mutual TLS, as client and as server: its subject
alternative names are the host's name (or IP address) and any --san, plus localhost and
127.0.0.1 so that the same files serve a run on one machine. Keys are ECDSA P-256. For a real
cluster, certificates from your own PKI work the same way (--tls-cert, --tls-key, --tls-ca).
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hetpipe import security

VALID_DAYS = 365
CA_NAME = "hetpipe cluster CA"
# A DNS name (RFC 1123 labels, a leading "*." for a --san), as a certificate's SAN can hold one.
_DNS = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def check_names(hosts: list[str], sans: list[str], passwords: list[str]) -> None:
    """ValueError naming the first host, --san or password file that cannot be written as asked,
    before anything is: a host is an IP address or a DNS name, whose NAME.pem and NAME.key go in
    the folder (`ca` would overwrite the CA's); a password file is a plain name in the folder
    other than those the command writes (`token` would leave the cluster token readable)."""
    for kind, names in (("host", hosts), ("--san", sans)):
        for name in names:
            try:
                ipaddress.ip_address(name)
                continue
            except ValueError:
                pass
            if len(name) > 253 or not _DNS.fullmatch(name) or (kind == "host" and name.startswith("*")):
                raise ValueError(f"{kind} {name!r}: expected an IP address or a DNS name (letters, digits, '-', '.')")
    if "ca" in hosts:
        raise ValueError("host 'ca': its ca.pem and ca.key would overwrite the CA's; name the host otherwise")
    ours = {"ca.pem", "ca.key", "token", *(f"{h}.{ext}" for h in hosts for ext in ("pem", "key"))}
    for name in passwords:
        if not name or "/" in name or name in (".", "..") or name in ours:
            raise ValueError(f"--password-file {name!r}: expected a plain file name in the folder other than "
                             "ca.pem, ca.key, token and the hosts' NAME.pem and NAME.key")


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(pem)


def _new_ca(out: Path, start: datetime.datetime, end: datetime.datetime) -> tuple[x509.Certificate, Any]:
    key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(CA_NAME)).issuer_name(_name(CA_NAME))
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(key, hashes.SHA256()))
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca.key", key)
    return ca, key


def _kept(out: Path, host: str, names: list[str], ca: x509.Certificate, now: datetime.datetime) -> bool:
    """Whether host's pair in out still serves: the CA's, valid for another day, naming every
    name asked for. A compose volume or a CERTS folder outlives its job: one made for fewer
    shards or VWs would fail the new ones' TLS handshakes at run time."""
    if not ((out / f"{host}.pem").exists() and (out / f"{host}.key").exists()):
        return False
    try:
        cert = x509.load_pem_x509_certificate((out / f"{host}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return cert.not_valid_after_utc > now + datetime.timedelta(days=1) and all(_alt_name(n) in have for n in names)


def unnamed(cert_pem: str, ca_pem: str, names: Iterable[str]) -> list[str]:
    """The names a certificate does not carry of those asked; ValueError where it is not one the
    CA issued, or cannot be read."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        ca = x509.load_pem_x509_certificate(ca_pem.encode())
        cert.verify_directly_issued_by(ca)
        have = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except InvalidSignature:
        raise ValueError("it was not issued by ca.pem") from None
    except (ValueError, TypeError, x509.ExtensionNotFound) as exc:
        raise ValueError(f"it cannot be read as a certificate with subject alternative names ({exc})") from None
    return [n for n in names if _alt_name(n) not in have]


def make(out: Path, hosts: list[str], sans: list[str] | None = None,
         passwords: list[str] | None = None) -> list[Path]:
    """Writes ca.pem (+ ca.key), NAME.pem and NAME.key for each host, and token; returns the files
    written. Idempotent: a CA (while valid for another day) and token already in out are kept (a
    new host's certificate must be from the cluster's CA), and so is a host's existing pair while
    it serves (_kept), else it is issued anew. passwords: files to write a random password into (Grafana's admin password,
    for compose). ValueError, before anything is written, for names check_names refuses, and for a
    CA half there without the other (ca.key moved off, as the README advises)."""
    check_names(hosts, sans or [], passwords or [])
    halves = [name for name in ("ca.pem", "ca.key") if (out / name).exists()]
    if len(halves) == 1:   # a new CA would replace the cluster's: no running host would trust what it signs
        missing = "ca.key" if halves == ["ca.pem"] else "ca.pem"
        raise ValueError(f"{out} holds {halves[0]} without {missing}: put {missing} back to issue certificates "
                         f"from the cluster's CA (or move {halves[0]} away too, to start a new CA)")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    written: list[Path] = []
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes()) if halves else None
    # A CA that has expired, or is about to, is replaced as a host's pair is: every chain from it
    # fails its handshake ("certificate has expired"), however new the certificate it signed.
    if ca is not None and ca.not_valid_after_utc > now + datetime.timedelta(days=1):
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    else:
        ca, ca_key = _new_ca(out, start, end)
        written += [out / "ca.pem", out / "ca.key"]
    for host in hosts:
        names = list(dict.fromkeys([host, *(sans or []), "localhost", "127.0.0.1"]))
        if _kept(out, host, names, ca, now):
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(host)).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName([_alt_name(n) for n in names]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
        (out / f"{host}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(out / f"{host}.key", key)
        written += [out / f"{host}.pem", out / f"{host}.key"]
    for name in passwords or ():
        if not (out / name).exists():  # readable by other users: Grafana's container runs as its own
            (out / name).write_text(security.new_secret() + "\n")
            (out / name).chmod(0o644)
            written.append(out / name)
    token = out / "token"
    if not token.exists():
        security.write_secret(token, security.new_secret())
        written.append(token)
    return written
