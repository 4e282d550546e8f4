"""The one way kvtier's clients open a gRPC channel: plaintext or TLS, with or without a
bearer token.

    channel = open_channel("kv.example:50051", Credentials(tls_ca="ca.pem", token=token))

``tls_ca``: the CA that signed the server's certificate (TLS is on when it or a client
certificate is given); ``tls_cert`` + ``tls_key``: this client's certificate (mTLS);
``token``: sent as ``authorization: Bearer <token>`` on every call. A token never goes
in clear to another machine: without TLS it is refused unless the target is loopback.
Every call also carries a request id (``kvtier.request_ids``).

``tls_mismatch`` names what a failed connection's details mean when it is TLS that did not
agree (a plaintext client and a TLS server, or the reverse, or a CA that did not sign the
server's certificate), so an operator is not sent to check whether the server runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.format.errors import InvalidRequest
from kvtier.request_ids import REQUEST_ID_KEY, outgoing_request_id

LOOPBACK = ("localhost", "127.", "[::1]", "unix:", "ipv4:127.", "ipv6:[::1]")


@dataclass(frozen=True)
class Credentials:
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidRequest("tls_cert and tls_key go together: give both or neither")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)


def token_from_file(setting: str, path: str | None) -> str | None:
    """The bearer token kept in the file at ``path`` (its text, stripped); None without a
    path. ``setting`` names where the path came from, for the error."""
    raw = _read(setting, path)
    return None if raw is None else raw.decode().strip()


def _read(name: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"{name}: cannot read {path}: {exc.strerror}") from exc


class _CallMetadata:
    """Adds the request id and, with a token, the ``authorization`` metadata to every call
    of its kind (grpc.aio files an interceptor under the first kind it is, so there is one
    class per kind)."""

    def __init__(self, token: str | None) -> None:
        self._entries = () if not token else (("authorization", f"Bearer {token}"),)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._entries,
                                     (REQUEST_ID_KEY, outgoing_request_id()))
        # a namedtuple at run time; its stub declares only the fields
        replaced: grpc.aio.ClientCallDetails = details._replace(  # type: ignore[attr-defined]
            metadata=metadata)
        return replaced


class _UnaryUnary(_CallMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_CallMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any,
                                     details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_CallMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any,
                                     details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_CallMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any,
                                      details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def open_channel(target: str, credentials: Credentials = Credentials(),
                 options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    token = credentials.token.strip() if credentials.token else None
    interceptors = [kind(token)
                    for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    if credentials.tls:
        ssl = grpc.ssl_channel_credentials(
            root_certificates=_read("tls_ca", credentials.tls_ca),
            private_key=_read("tls_key", credentials.tls_key),
            certificate_chain=_read("tls_cert", credentials.tls_cert))
        return grpc.aio.secure_channel(target, ssl, options=list(options),
                                       interceptors=interceptors)
    if credentials.token and not target.startswith(LOOPBACK):
        raise InvalidRequest(f"a token would travel in clear to {target}: give tls_ca "
                             "(the CA of the server's certificate) to use TLS")
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)


# HTTP/2's client preface: a plaintext gRPC server answers it with a SETTINGS frame; a
# TLS server takes it for a bad handshake and answers with an alert or hangs up.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_TLS_ALERT, _H2_SETTINGS = 0x15, 0x04


async def tls_mismatch(target: str, credentials: Credentials, details: str) -> str | None:
    """What went wrong with TLS for a call to ``target`` that failed UNAVAILABLE with
    ``details``, or None when TLS is not the cause (the server may not run). A plaintext
    client asks the server once (a preface, a short read) whether it speaks TLS."""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (f"TLS: the certificate of {target} is not signed by the CA given (tls_ca, "
                "--tls-ca); pass the CA that signed the server's certificate")
    if credentials.tls and "WRONG_VERSION_NUMBER" in details:
        return (f"TLS: {target} does not speak TLS (a plaintext server); drop tls_ca "
                "(--tls-ca), or serve TLS (tls_cert, tls_key)")
    if credentials.tls or "Socket closed" not in details or target.startswith("unix:"):
        return None
    host, _, port = target.rpartition(":")
    try:
        async with asyncio.timeout(2.0):
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
            try:
                writer.write(_H2_PREFACE + bytes(9))  # and an empty SETTINGS frame
                first = await reader.read(5)
            finally:
                writer.close()
    except (OSError, ValueError, TimeoutError):
        return None
    plaintext = len(first) >= 4 and first[3] == _H2_SETTINGS
    if plaintext:
        return None
    return (f"TLS: {target} serves TLS and this client spoke plaintext; pass the server's "
            "CA (tls_ca, --tls-ca)")
