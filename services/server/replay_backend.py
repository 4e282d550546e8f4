"""The server's bounded-replay backend, chosen by the config (``ServerConfig.replay_mode``):

- ``in-process``: ``replay.ReplayService``, the bundled model in the server's process
  (weights loaded on the first rebuild);
- ``remote``: ``services.replay.remote.RemoteReplay`` over the ``replay_workers`` addresses
  (``kvtier replay-worker`` processes), taken in turn, a worker that is down skipped;
- ``streams``: ``services.replay.streams.StreamReplay``, jobs through a Redis Streams consumer
  group that any number of workers serve (``replay_redis_url``, default ``redis_url``);
- ``off``: none.

Layouts whose replayer is ``transformers-deepseek-v4`` go, through a ``ReplayRouter``, to
``replay.transformers_worker.TransformersReplayService`` (that model in the server's
process) with ``replay_hf_model`` set, or to the ``kvtier replay-worker --hf-model``
processes of ``replay_hf_workers`` (a ``RemoteReplay`` of their own); the others to the
backend above. With ``streams`` and neither, ``StreamReplay`` sends each job to the stream
of its layout's replayer, which only workers of that model read.

A backend that runs a model in this process also has ``await backend.warm_up()``
(load it and run it once: ``replay_warmup``, ``warm_up_replay``).

Every backend has the same call, ``await backend.rebuild(spec, token_ids, chunks, tail,
replay_tokens, model_fingerprint=...) -> replay.ReplayResult`` (the encoded window,
tokens replayed, seconds), and ``await backend.close()``. ``model_fingerprint`` is the
session's: the worker that runs the model refuses it with ``ModelMismatch`` unless it is
"" or the fingerprint computed from that worker's weights (``kvstore.format.model_identity``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvstore.format.errors import KVTierError, ReplayUnavailable
from kvstore.format.layout import LayoutSpec
from kvstore.tiers.base import Buffer
from kvtier.channel import Credentials, token_from_file
from services.server.config import ServerConfig

log = logging.getLogger(__name__)


class ReplayBackend(Protocol):
    async def rebuild(self, layout: LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = ""): ...

    async def close(self) -> None: ...


class ReplayRouter:
    """Sends each rebuild to the backend of its layout's replayer."""

    def __init__(self, backends: dict[str, ReplayBackend]) -> None:
        self.backends = backends

    async def rebuild(self, layout: LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = ""):
        backend = self.backends.get(layout.replayer)
        if backend is None:
            raise ReplayUnavailable(f"layout {layout.layout_id} names replayer "
                                    f"{layout.replayer!r}, which this server does not run")
        return await backend.rebuild(layout, token_ids, chunks, tail, replay_tokens,
                                     model_fingerprint=model_fingerprint)

    async def warm_up(self) -> None:
        for backend in self.backends.values():
            await warm_up_replay(backend)

    def breakers(self) -> list:
        """The circuit breakers of the backends that call remote workers."""
        return [b for backend in self.backends.values()
                for b in getattr(backend, "breakers", list)()]

    async def close(self) -> None:
        for backend in self.backends.values():
            await backend.close()


async def warm_up_replay(backend: ReplayBackend | None) -> bool:
    """Load and run once the model ``backend`` runs in this process; whether it has one
    (remote workers and streams load their own)."""
    warm_up = getattr(backend, "warm_up", None)
    if warm_up is None:
        return False
    await warm_up()
    return True


async def probe_replay(backend: ReplayBackend | None) -> bool | None:
    """Whether every backend that calls remote replay workers has one that answers (None:
    none calls remote workers, there is nothing to probe)."""
    backends = (list(backend.backends.values()) if isinstance(backend, ReplayRouter)
                else [] if backend is None else [backend])
    remote = [b for b in backends if hasattr(b, "probe")]
    if not remote:
        return None
    return all(await asyncio.gather(*(b.probe() for b in remote)))


def model_layouts(backend: ReplayBackend | None, replayer: str
                  ) -> tuple[LayoutSpec, ...] | None:
    """The caches of the model ``backend`` rebuilds ``replayer``'s layouts with, where
    this process knows them (an in-process model, from its config); None where it does
    not (remote workers, streams: they check every layout they are sent)."""
    if isinstance(backend, ReplayRouter):
        backend = backend.backends.get(replayer)
    own = getattr(backend, "model_layouts", None)
    return own(replayer) if own is not None else None


def make_replay_backend(config: ServerConfig) -> tuple[ReplayBackend | None, str]:
    """(backend, "") or (None, why there is none) for the configured replay mode."""
    backend, why = _bundled_backend(config)
    if config.replay_mode == "off":
        return backend, why
    hf = _transformers_backend(config)
    if hf is None:
        return backend, why
    routes = {"transformers-deepseek-v4": hf}
    if backend is not None:
        routes["bundled"] = backend
    return ReplayRouter(routes), ""


def _transformers_backend(config: ServerConfig) -> ReplayBackend | None:
    try:
        if config.replay_hf_workers:
            return _remote(config, config.replay_hf_workers)
        if not config.replay_hf_model:
            return None
        from replay.transformers_worker import TransformersReplayService

        return TransformersReplayService(config.replay_hf_model, seed=config.replay_hf_seed,
                                         default_tokens=config.replay_tokens)
    except (ImportError, KVTierError) as exc:
        log.warning("no transformers replay backend: %s", exc)
        return None


def _remote(config: ServerConfig, addresses: Sequence[str]) -> ReplayBackend:
    from services.replay.remote import RemoteReplay

    # a request carries the whole session's chunks: the workers' message limit, not the
    # one this server puts on its clients' messages
    return RemoteReplay(addresses, timeout_s=config.replay_timeout_s,
                        breaker_cooldown_s=config.breaker_cooldown_s,
                        credentials=credentials_from(config))


def _bundled_backend(config: ServerConfig) -> tuple[ReplayBackend | None, str]:
    mode = config.replay_mode
    if mode == "off":
        return None, "replay is off in this server's config"
    if mode == "remote" and not config.replay_workers:
        return None, "no replay_workers run the bundled model"
    try:
        if mode == "remote":
            return _remote(config, config.replay_workers), ""
        if mode == "streams":
            from services.replay.streams import StreamReplay

            return StreamReplay(config.replay_redis_url or config.redis_url,
                                timeout_s=config.replay_timeout_s,
                                breaker_cooldown_s=config.breaker_cooldown_s), ""
        from replay import ReplayService

        weights = {"weights": Path(config.replay_weights)} if config.replay_weights else {}
        return ReplayService(default_tokens=config.replay_tokens,
                             max_batch=config.replay_max_batch, **weights), ""
    except (ImportError, KVTierError) as exc:
        log.warning("no %s replay backend: %s", mode, exc)
        return None, f"the {mode} replay backend is unavailable: {exc}"


def credentials_from(config: ServerConfig) -> Credentials:
    """How this server reaches its replay workers, from its ``replay_tls_*`` settings
    and the token in ``replay_token_file``."""
    return Credentials(config.replay_tls_ca or None, config.replay_tls_cert or None,
                       config.replay_tls_key or None,
                       token_from_file("replay_token_file", config.replay_token_file))
