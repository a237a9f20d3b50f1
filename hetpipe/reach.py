"""Why a call found no server, in words a user can act on: gRPC reports a TLS mismatch as
UNAVAILABLE, like a server that is down, and its details say which."""

from __future__ import annotations

import grpc

from hetpipe import security

TLS_FLAGS = "--tls-cert/--tls-key/--tls-ca"


def handshake_failed(exc: grpc.RpcError) -> bool:
    """The call reached a server but the TLS handshake failed (another CA, TLS at one end only,
    a certificate that does not name the address dialled): a configuration, not an outage. gRPC
    reports it as UNAVAILABLE, like a server that is down (its details say which)."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and ("handshake failed" in details
                                                          or "verification check failed" in details)


def why(exc: grpc.RpcError) -> str:
    """What an UNAVAILABLE call's details say about its connection, in words a user can act on
    ('' where they say nothing more)."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    details = exc.details() or ""
    if handshake_failed(exc) and "hostname verification" in details.lower():
        return ("the TLS handshake failed: its certificate does not name the address dialled (make it with "
                "that name or IP: `hetpipe certs DIR HOST --san NAME`)")
    if handshake_failed(exc) and "certificate has expired" in details:
        return ("the TLS handshake failed: the server's certificate, or its CA, has expired (issue them anew: "
                "`hetpipe certs DIR HOST`)")
    if handshake_failed(exc):
        return (f"the TLS handshake failed: both ends need certificates from the same CA ({TLS_FLAGS}), "
                "or neither uses TLS")
    if "Socket closed" in details and not security.current().tls:
        # What a plaintext client meets at a TLS server: it hangs up on the first bytes.
        return f"it closed the connection at once: does it use TLS ({TLS_FLAGS}), which this process does not?"
    if refused(exc):
        return "nothing listens at that address (not started yet, or stopped)"
    return ""


def refused(exc: grpc.RpcError) -> bool:
    """Nothing listens there: the call never reached a server (so it may be sent again, even
    one that is not idempotent)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "Connection refused" in (exc.details() or "")


def failure(exc: grpc.RpcError) -> str:
    """'CODE: why' for messages: why()'s words where it has some, else the details."""
    return f"{exc.code().name}: " + (why(exc) or exc.details() or "no details")


def unreachable(address: str, exc: grpc.RpcError) -> str:
    return f"{address} unreachable: {failure(exc)}"
