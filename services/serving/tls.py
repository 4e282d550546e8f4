"""TLS for the kvtier server and the replay worker, and the safe default that refuses to
expose either in clear.

    creds = server_credentials("server.pem", "server-key.pem", client_ca="ca.pem")
    port = grpc_server.add_secure_port(listen, creds)

With ``client_ca`` the peer must present a certificate that CA signed (mTLS); its subject
CN is then what ``services.serving.auth`` maps to an identity. Certificates are read once:
replacing them takes a restart.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from kvstore.format.errors import InvalidRequest

INSECURE_FLAG = "--insecure"


def _read(setting: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"{setting}: cannot read {path}: {exc.strerror}") from exc


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    pair = (_read("tls_key", key), _read("tls_cert", cert))
    if client_ca:
        return grpc.ssl_server_credentials([pair], root_certificates=_read("tls_client_ca",
                                                                           client_ca),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def is_loopback(listen: str) -> bool:
    """Whether ``listen`` (host:port, or unix:path) is reachable from this machine only."""
    if listen.startswith("unix:"):
        return True
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or a wildcard: other machines may reach it


def exposure_problem(listen: str, tls: bool, authenticates: bool) -> str | None:
    """Why serving ``listen`` like this is unsafe (None: it is not): off loopback, calls
    must be encrypted and carry a credential, or anyone on the network reads, lists and
    deletes every tenant's sessions."""
    if is_loopback(listen) or (tls and authenticates):
        return None
    missing = " and ".join(name for name, on in (("TLS (tls_cert, tls_key)", tls),
                                                 ("authentication (auth_tokens_file or "
                                                  "auth_jwt_key)", authenticates)) if not on)
    return (f"refusing to serve {listen} without {missing}: anyone who reaches the port "
            f"could read and delete every tenant's sessions; configure it, listen on "
            f"127.0.0.1, or pass {INSECURE_FLAG}")


def metrics_exposure_problem(host: str, port: int, tls: bool) -> str | None:
    """Why serving the Prometheus endpoint on ``host`` like this is unsafe (None: it is
    not): off loopback it must be HTTPS, or anyone on the path reads every tenant's
    figures and the server's build, and a scraper can be fed forged ones."""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not port or is_loopback(listen) or tls:
        return None
    return (f"refusing to serve metrics on {listen} without TLS (tls_cert, tls_key): plain "
            f"HTTP reachable from other machines; configure TLS, set metrics_host = "
            f'"127.0.0.1", or pass {INSECURE_FLAG}')
