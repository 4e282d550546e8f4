"""Whether a configuration can be served, decided once for ``kvtier serve`` and
``kvtier serve --print-config``: both call ``check``, so a configuration one refuses the
other refuses with the same message.

``check`` runs everything the server would refuse before it accepts a call that needs
no store and no network: the configuration's own rules (``ServerConfig``), the exposure
rules (``services.serving.tls``: gRPC and metrics off loopback), the ports, and every
file the server reads at start-up, each read by the function the server reads it with
(TLS certificate and key, the tokens file, the JWT key, the encryption keyring,
configured layouts, the audit log, the replay weights the warm-up loads), and the data
directory (``prepare_data_dir``, without creating it). What only opening the store can
tell (the data directory's writer lock held by another server, a bucket S3 says does not
exist, a damaged index) is refused by ``serve`` alone.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.format.errors import InvalidRequest
from services.server.config import ServerConfig
from services.server.startup import check_node_name, prepare_data_dir
from services.serving.lifecycle import refuse_if_taken
from services.serving.tls import exposure_problem, metrics_exposure_problem, server_credentials


def check(config: ServerConfig, *, insecure: bool = False) -> None:
    """A ``KVTierError`` (or ``OSError``) naming the first reason ``config`` cannot be
    served; ``insecure`` is ``kvtier serve --insecure`` (a non-loopback address in clear)."""
    problem = (exposure_problem(config.listen, config.tls, config.authenticates)
               or metrics_exposure_problem(config.metrics_host, config.metrics_port,
                                           config.tls))
    if problem and not insecure:
        raise InvalidRequest(problem)
    refuse_if_taken(config.listen)
    if config.metrics_port:
        refuse_if_taken(f"{config.metrics_host}:{config.metrics_port}",
                        "--metrics-port (0: none)")
    check_node_name(config)
    if config.tls:
        check_tls_pair(config.tls_cert, config.tls_key, config.tls_client_ca)
    from services.serving.audit import AuditLog
    from services.serving.auth import Authenticator

    Authenticator.from_settings(config.auth_tokens_file, config.auth_jwt_key,
                                config.auth_jwt_audience)
    if config.encrypts:
        from kvstore.encryption.seal import load_keyring

        load_keyring(config.encryption_key_file, config.encryption_key)
    if config.replay_warmup and config.replay_mode == "in-process" and \
            config.replay_weights and not Path(config.replay_weights).is_file():
        raise InvalidRequest(f"replay_weights {config.replay_weights} is not a file: the "
                             "replay warm-up (replay_warmup) would load it before serving")
    prepare_data_dir(config.data_dir, create=False)
    if config.manager_preset != ServerConfig.manager_preset:
        from services.server.store import manager_config  # the store's modules: only then

        manager_config(config)
    if config.layouts:
        from services.server.layout_registry import ServerLayouts

        ServerLayouts(config.layouts, config.data_dir, config.layout_policy,
                      config.max_message_bytes)
    if config.audit_log:
        AuditLog(config.audit_log).close()


def check_tls_pair(cert: str, key: str, client_ca: str = "") -> None:
    """InvalidRequest unless ``cert`` holds PEM certificates, ``key`` the private key of
    the first and ``client_ca`` (when set) PEM certificates: gRPC itself only says it
    cannot bind."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    server_credentials(cert, key, client_ca)  # each file readable
    try:
        chain = x509.load_pem_x509_certificates(Path(cert).read_bytes())
    except ValueError as exc:
        raise InvalidRequest(f"tls_cert {cert} holds no PEM certificate: {exc}") from exc
    try:
        private = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"tls_key {key} is not an unencrypted PEM private key: "
                             f"{exc}") from exc
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.PEM
    if (private.public_key().public_bytes(encoding, public)
            != chain[0].public_key().public_bytes(encoding, public)):
        raise InvalidRequest(f"tls_key {key} is not the key of the certificate in "
                             f"tls_cert {cert}")
    if client_ca:
        try:
            x509.load_pem_x509_certificates(Path(client_ca).read_bytes())
        except ValueError as exc:
            raise InvalidRequest(f"tls_client_ca {client_ca} holds no PEM certificate: "
                                 f"{exc}") from exc
