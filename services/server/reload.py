"""Reload without a restart: ``kvtier serve`` on SIGHUP (``kvtier reload`` sends it) reads
its configuration again, as at start (the same file, environment and flags), and applies
what may change while serving:

- authentication: the tokens file (``auth_tokens_file``), ``auth_jwt_key`` and
  ``auth_jwt_audience`` (turning authentication on or off needs a restart);
- quotas (``[quota.*]``): new limits for the next admission, usage kept;
- ``log_level``;
- the encryption keyring (``encryption_key_file`` or ``encryption_key``): keys added or
  dropped, the current key changed (turning encryption on or off needs a restart); the
  server then reseals its own media under the current key in the background
  (``kvstore.encryption.resealer``).

Everything is read and checked before anything changes: a file that does not parse (its
line and column named), or a value the server would refuse at start, leaves the running
version whole, and one error line, ``kvtier_config_reload_success 0`` and
``kvtier_config_reloads_total{result="failure"}`` say so. Any other key that changed needs
a restart: a warning names them, and their running values stay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.format.errors import KVTierError
from kvstore.session.quota import Quotas
from services.server.config import ServerConfig
from services.serving.auth import Authenticator, AuthInterceptor

if TYPE_CHECKING:
    from kvstore.encryption.seal import Keyring
    from services.server.server import KVTierServer

log = logging.getLogger(__name__)
AUTH_KEYS = ("auth_tokens_file", "auth_jwt_key", "auth_jwt_audience")
KEYRING_KEYS = ("encryption_key_file", "encryption_key")
RELOADABLE = (*AUTH_KEYS, "quota", "log_level", *KEYRING_KEYS)


def reload(server: KVTierServer, read_config: Callable[[], ServerConfig]) -> tuple[bool, str]:
    """Apply ``read_config()``'s reloadable keys to ``server``, all or none: (whether it
    was taken, the line that says so; the metrics and the log say it too)."""
    metrics = server.metrics
    try:
        running = server.servicer.config
        new = read_config()
        restart = [name for name in _changed(running, new) if name not in RELOADABLE]
        authenticator = _authenticator(server, running, new, restart)
        keyring = _keyring(server, running, new, restart)
        quotas = Quotas.from_tables(new.quota)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the running version stays
        if not isinstance(exc, KVTierError | OSError | ValueError):
            log.exception("reload failed unexpectedly")
        metrics.reload_success.set(0)
        metrics.reloads.labels("failure").inc()
        line = f"reload refused, the running configuration stays in force: {exc}"
        log.error("%s", line)
        return False, line
    taken = {name: getattr(new, name) for name in RELOADABLE if name not in restart}
    interceptor = _interceptor(server)
    if interceptor is not None and authenticator is not None:
        interceptor.authenticator = authenticator
    if keyring is not None:
        running_keyring = _running_keyring(server)
        dropped = set(running_keyring.key_ids) - set(keyring.key_ids)
        if dropped:
            log.warning("reload drops encryption keys %s: values sealed under them can no "
                        "longer be read", sorted(dropped))
        running_keyring.adopt(keyring)
        server.reseal()
    server.manager.set_quotas(quotas)
    logging.getLogger().setLevel(new.log_level.upper())
    server.servicer.config = running.replace(**taken)
    metrics.reload_success.set(1)
    metrics.reloads.labels("success").inc()
    line = (f"reloaded: tokens, quotas ({len(quotas.tenants)} tenant tables), log level "
            f"{new.log_level.upper()}"
            + (f", keyring (current {keyring.current})" if keyring else ""))
    log.info("%s", line)
    if restart:
        later = (f"{', '.join(sorted(restart))} changed but need a restart; their running "
                 "values stay")
        log.warning("reload: %s", later)
        line += f"; {later}"
    return True, line


def _changed(running: ServerConfig, new: ServerConfig) -> list[str]:
    old, now = running.summary(), new.summary()
    return [name for name in now if old[name] != now[name]]


def _interceptor(server: KVTierServer) -> AuthInterceptor | None:
    return next((item for item in server.interceptors if isinstance(item, AuthInterceptor)),
                None)


def _authenticator(server: KVTierServer, running: ServerConfig, new: ServerConfig,
                   restart: list[str]) -> Authenticator | None:
    """The new authenticator (its files read now: a bad one raises), or None when the
    running one stays (``restart`` gets the keys when authentication is turned on or off)."""
    if running.authenticates != new.authenticates or _interceptor(server) is None:
        restart.extend(name for name in AUTH_KEYS
                       if getattr(running, name) != getattr(new, name))
        return None
    return Authenticator.from_settings(new.auth_tokens_file, new.auth_jwt_key,
                                       new.auth_jwt_audience)


def _running_keyring(server: KVTierServer) -> Keyring:
    return next(keyring for tier in server.manager.tiers
                if (keyring := getattr(tier, "keyring", None)) is not None)


def _keyring(server: KVTierServer, running: ServerConfig, new: ServerConfig,
             restart: list[str]) -> Keyring | None:
    """The new keyring (read now: a bad file raises), or None when the running one stays."""
    if running.encrypts != new.encrypts:
        restart.extend(name for name in KEYRING_KEYS
                       if getattr(running, name) != getattr(new, name))
        return None
    if not running.encrypts or not any(getattr(tier, "keyring", None) is not None
                                       for tier in server.manager.tiers):
        return None
    from kvstore.encryption.seal import load_keyring

    return load_keyring(new.encryption_key_file, new.encryption_key)
