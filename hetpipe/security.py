"""Who may call what: mutual TLS on every channel and server, and bearer tokens by role.

Every process of a cluster reads the same secret, the cluster token (`--token-file`). A caller
presents, in the `authorization` metadata of every call, either that token itself (the job's
token: the operator's CLI and the coordinator) or a role token derived from it with HMAC:
`hp1.<role>.<subject>.<mac>`. A server checks the MAC and then the role against METHOD_ROLES.
A derived token does not reveal the secret, so a role token that leaks (from a log, or from the
metadata a peer receives) can do only what its role may. Roles do not separate processes that
all hold the secret: that needs per-host credentials issued by the coordinator (docs/design.md).

Without a token file a server is open; it must then bind loopback only (hetpipe.service).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import hmac
import errno
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

COORDINATOR, STAGE, SEED, SHARD = "coordinator", "stage", "seed", "shard"
# SEED: the credential VW 0's stages give shards their initial values with (Init); a stage's own
# token may push and pull but not (re)initialise a shard.
PREFIX = "hp1"
MIN_SECRET_CHARS = 16
HEADER = "authorization"
# How a PERMISSION_DENIED about the token's role ends: a client tells it from the refusals that are
# not about the token (a path outside the coordinator's --data-root).
ROLE_REFUSAL = "may not call this method"

# service -> method -> roles that may call it. A method not listed is the coordinator's alone;
# a service not listed (server reflection) is open to every valid token; health needs none.
METHOD_ROLES: dict[str, dict[str, frozenset[str]]] = {
    "hetpipe.v1.Coordinator": {"Register": frozenset({STAGE, SHARD}), "Heartbeat": frozenset({STAGE, SHARD})},
    "hetpipe.v1.Stage": {"Forward": frozenset({STAGE}), "Backward": frozenset({STAGE}),
                         "ForwardLink": frozenset({STAGE}), "BackwardLink": frozenset({STAGE}),
                         "LinkSocket": frozenset({STAGE})},
    "hetpipe.v1.ParameterServer": {"Push": frozenset({STAGE}), "PushFrame": frozenset({STAGE}),
                                   "Exchange": frozenset({STAGE}),
                                   "Pull": frozenset({STAGE, COORDINATOR}), "Init": frozenset({COORDINATOR, SEED})},
}
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
_SUBJECT = re.compile(r"[A-Za-z0-9_:-]{1,128}")


class SecurityError(ValueError):
    """A security setting that cannot work: a missing file, half a TLS triple, a short token."""


@dataclass(frozen=True, slots=True)
class Security:
    """Paths of the TLS material and token file; all empty = plaintext and no token."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    token_file: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    def check(self) -> None:
        """Raises SecurityError unless every named file can be read and TLS is all or nothing."""
        given = [bool(self.cert), bool(self.key), bool(self.ca)]
        if any(given) and not all(given):
            raise SecurityError("TLS needs a certificate, its key and the CA together (--tls-cert, --tls-key, "
                                "--tls-ca), got only " + ", ".join(n for n, g in zip(("cert", "key", "ca"), given) if g))
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca),
                           ("token file", self.token_file)):
            # A folder too: what a bind mount of a missing file makes, or a secret volume's mount point.
            if path and (not os.access(path, os.R_OK) or os.path.isdir(path)):
                why = "is a folder, not a file" if os.path.isdir(path) else "cannot be read"
                raise SecurityError(f"TLS {what} {path}: {why}" if what != "token file" else f"token file {path}: {why}")
        if self.token_file:
            read_secret(self.token_file)
        if self.tls:
            self._check_pem()

    def _check_pem(self) -> None:
        """The TLS files hold what their flags say, the key the certificate's: else the server
        fails to start saying only "Failed to bind to address", or every handshake fails."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        def load(what: str, path: str, parse: Any) -> Any:
            try:
                return parse(Path(path).read_bytes())
            except (ValueError, TypeError) as exc:   # TypeError: a key behind a password
                raise SecurityError(f"TLS {what} {path}: cannot be read as PEM ({exc})") from None

        certificate = load("certificate", self.cert, x509.load_pem_x509_certificates)[0]
        cas = load("CA", self.ca, x509.load_pem_x509_certificates)
        # Out of its dates, every handshake fails: a server's peers are told "certificate has
        # expired", and a client finds only a closed socket, which reads as an outage.
        now = datetime.datetime.now(datetime.timezone.utc)
        for what, path, dated in (("certificate", self.cert, [certificate]), ("CA", self.ca, cas)):
            if not any(c.not_valid_before_utc <= now <= c.not_valid_after_utc for c in dated):
                c = dated[0]
                raise SecurityError(f"TLS {what} {path}: valid from {c.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                                    f"{c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now ({now:%Y-%m-%d %H:%M}): "
                                    "issue it anew (`hetpipe certs DIR HOST` replaces one that expired)")
        key = load("key", self.key, lambda data: serialization.load_pem_private_key(data, password=None))

        def public(k: Any) -> bytes:
            return bytes(k.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo))

        if public(key.public_key()) != public(certificate.public_key()):
            raise SecurityError(f"TLS key {self.key} is not the key of the certificate {self.cert} (another host's?)")


def read_secret(path: str) -> str:
    try:
        text = Path(path).read_text().strip()
    except UnicodeDecodeError:
        text = "\0"   # not text: refused below with what a token file holds
    except OSError as exc:
        raise SecurityError(f"token file {path}: cannot be read ({exc.strerror})") from None
    if (len(text) < MIN_SECRET_CHARS or any(c.isspace() for c in text) or not text.isprintable()
            or not text.isascii()):  # gRPC metadata carries ASCII only: every call would fail
        raise SecurityError(f"token file {path}: expected one line of at least {MIN_SECRET_CHARS} "
                            "printable ASCII characters without spaces (hetpipe certs DIR writes one)")
    return text


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def write_secret(path: Path, secret: str) -> None:
    """Writes the token readable by its owner only, whole: it is written under another name and
    then takes path's, so that a reader (`hetpipe status`) never finds it empty or half written.
    An existing file is replaced; a link is refused (OSError), not followed nor replaced."""
    path = Path(path)
    if path.is_symlink():
        raise OSError(errno.ELOOP, f"{path} is a link: a token is not written through one")
    temp = path.with_name(f".{path.name}.{os.getpid()}.new")
    temp.unlink(missing_ok=True)   # one a killed writer of this pid left
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _mac(secret: str, role: str, subject: str) -> str:
    digest = hmac.new(secret.encode(), f"{PREFIX}.{role}.{subject}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def mint(secret: str, role: str, subject: str) -> str:
    """The token of role for subject (a name in logs: an address, "vw0-stage1")."""
    subject = re.sub(r"[^A-Za-z0-9_:-]", "-", subject)[:128] or "-"
    return f"{PREFIX}.{role}.{subject}.{_mac(secret, role, subject)}"


def identify(secret: str, token: str) -> tuple[str, str] | None:
    """(role, subject) of a valid token, None for anything else. The secret itself is the job's
    token, with the coordinator's rights."""
    if hmac.compare_digest(token.encode(), secret.encode()):
        return COORDINATOR, "job token"
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != PREFIX or not _SUBJECT.fullmatch(parts[2]):
        return None
    _, role, subject, mac = parts
    # As bytes: compare_digest raises TypeError on a str that is not ASCII (a raw HTTP/2 client's).
    if role not in (COORDINATOR, STAGE, SEED, SHARD) or not hmac.compare_digest(mac.encode(),
                                                                                 _mac(secret, role, subject).encode()):
        return None
    return role, subject


def allowed(method: str, role: str) -> bool:
    """Whether role may call method ("/package.Service/Method")."""
    service, _, name = method.lstrip("/").partition("/")
    if service not in METHOD_ROLES:
        return True  # reflection: any valid token
    return role in METHOD_ROLES[service].get(name, frozenset({COORDINATOR}))


# ---- the process's own credentials ---------------------------------------------------------------


@dataclass
class _Process:
    security: Security
    secret: str           # "" = no token
    token: str            # what this process presents
    root_ca: bytes = b""
    key: bytes = b""
    cert: bytes = b""


_current = _Process(Security(), "", "")


def use(security: Security, role: str, subject: str) -> None:
    """Makes security this process's: every rpc.Server and rpc.channel from now on applies it, and
    calls present role's token for subject (COORDINATOR with the secret: the job's token)."""
    global _current
    security.check()
    secret = read_secret(security.token_file) if security.token_file else ""
    token = "" if not secret else secret if role == COORDINATOR else mint(secret, role, subject)
    read = (lambda p: Path(p).read_bytes()) if security.tls else (lambda p: b"")
    _current = _Process(security, secret, token, read(security.ca), read(security.key), read(security.cert))


@contextmanager
def using(security: Security, role: str, subject: str) -> Iterator[None]:
    """use() for the duration of a block (an in-process coordinator), then what was before."""
    global _current
    before = _current
    use(security, role, subject)
    try:
        yield
    finally:
        _current = before


def current() -> Security:
    return _current.security


def has_token() -> bool:
    return bool(_current.secret)


def role_metadata(role: str, subject: str) -> tuple[tuple[str, str], ...]:
    """Metadata that presents role's token instead of the process's own, for one call."""
    if not _current.secret:
        return ()
    return ((HEADER, f"Bearer {mint(_current.secret, role, subject)}"),)


def server_credentials() -> grpc.ServerCredentials | None:
    """Mutual TLS: a client without a certificate from the CA cannot complete the handshake."""
    if not _current.security.tls:
        return None
    return grpc.ssl_server_credentials([(_current.key, _current.cert)], root_certificates=_current.root_ca,
                                       require_client_auth=True)


def channel_credentials() -> grpc.ChannelCredentials | None:
    if not _current.security.tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_current.root_ca, private_key=_current.key,
                                        certificate_chain=_current.cert)


# ---- flags ---------------------------------------------------------------------------------------


def add_flags(ap: argparse.ArgumentParser) -> None:
    env = os.environ.get
    ap.add_argument("--tls-cert", default=env("HETPIPE_TLS_CERT", ""), help="this host's certificate (PEM)")
    ap.add_argument("--tls-key", default=env("HETPIPE_TLS_KEY", ""), help="its private key (PEM)")
    ap.add_argument("--tls-ca", default=env("HETPIPE_TLS_CA", ""), help="the CA every peer's certificate is from")
    ap.add_argument("--token-file", default=env("HETPIPE_TOKEN_FILE", ""), help="the cluster token")


def from_namespace(ns: argparse.Namespace) -> Security:
    """The command line's flags, their paths absolute: as from where the command was given, whatever
    folder it works in later (`hetpipe worker` moves into its --output-root)."""
    paths = (ns.tls_cert, ns.tls_key, ns.tls_ca, ns.token_file)
    cert, key, ca, token_file = (os.path.abspath(p) if p else "" for p in paths)
    return Security(cert=cert, key=key, ca=ca, token_file=token_file)


def child_args(security: Security) -> list[str]:
    """The flags that give a child process the same security (absolute paths)."""
    out: list[str] = []
    for flag, path in (("--tls-cert", security.cert), ("--tls-key", security.key), ("--tls-ca", security.ca),
                       ("--token-file", security.token_file)):
        if path:
            out += [flag, os.path.abspath(path)]
    return out


# ---- interceptors --------------------------------------------------------------------------------


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that answers code without reading the request."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses a call without a valid token (UNAUTHENTICATED) or whose role may not call the
    method (PERMISSION_DENIED), before the handler runs: a refused call changes nothing."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.lstrip("/").partition("/")[0] in OPEN_SERVICES:
            return handler
        header = dict(details.invocation_metadata or ()).get(HEADER, "")
        token = header[len("Bearer "):] if isinstance(header, str) and header.startswith("Bearer ") else ""
        who = identify(self._secret, token) if token else None
        if who is None:
            why = "no bearer token" if not token else "an invalid token"
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, f"{method}: {why} (the cluster's "
                            "--token-file, or `hetpipe run`'s per-run token)")
        role, subject = who
        if not allowed(method, role):
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            f"{method}: a {role} token ({subject}) {ROLE_REFUSAL}")
        return handler


def server_interceptors() -> list[grpc.ServerInterceptor]:
    return [AuthInterceptor(_current.secret)] if _current.secret else []


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the process's token to every call that does not carry one already."""

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or ())
        if _current.token and not any(k == HEADER for k, _ in metadata):
            metadata.append((HEADER, f"Bearer {_current.token}"))
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


BEARER = _Bearer()
