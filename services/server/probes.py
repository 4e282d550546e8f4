"""Health that probes: every remote dependency of the tier stack (Redis or a Redis
Cluster, the S3 bucket, and with it a fleet's shared metadata, which lives there, and the
remote replay workers) is asked whether it answers every ``probe_interval_s``, whether
requests come or not.

Each tier's ``probe()`` goes through its circuit breaker, so an open breaker half-opens on
this timer after its cool-down (``breaker_cooldown_s``) and closes when the probe is
answered: on an idle node ``kvtier_tier_up`` and ``kvtier_breaker_open`` say what is true
now, within one probe interval after the cool-down. After each round the tier figures are
refreshed for metrics, and gRPC health (the server as a whole and ``kvtier.v1.KVTier``)
says NOT_SERVING while a tier named in ``required_tiers`` is configured and down, and
SERVING again once it answers (never before the server is ready). ``replay`` in
``required_tiers`` counts as down while every worker of a remote replay backend is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from grpc_health.v1 import health, health_pb2

from kvstore.session.manager import TierManager
from services.server.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class Prober:
    def __init__(self, manager: TierManager, health_servicer: health.aio.HealthServicer,
                 metrics: ServiceMetrics, services: Sequence[str],
                 required_tiers: Sequence[str], interval_s: float,
                 probe_replay: Callable[[], Awaitable[bool | None]] | None = None) -> None:
        self.manager, self.health, self.metrics = manager, health_servicer, metrics
        self.probe_replay = probe_replay
        self.services, self.required = tuple(services), frozenset(required_tiers)
        self.interval_s = interval_s
        self.ready = False  # set by the server once it may say SERVING
        self.down: list[str] = []  # required tiers down at the last round
        self._serving: bool | None = None
        self.first_round = asyncio.Event()  # set once the first round ended, however

    @property
    def probed(self) -> list:
        return [tier for tier in self.manager.tiers if hasattr(tier, "probe")]

    async def run(self) -> None:
        while True:
            try:
                await self.probe_once()
            except Exception:  # noqa: BLE001 - a failed round keeps the last verdict
                log.debug("probe round failed", exc_info=True)
            finally:
                self.first_round.set()
            await asyncio.sleep(self.interval_s)

    async def probe_once(self) -> None:
        """Ask every remote tier once, refresh the tier figures, then say health."""
        tiers = self.probed
        answers = await asyncio.gather(*(tier.probe() for tier in tiers))
        replay_up = None if self.probe_replay is None else await self.probe_replay()
        self.metrics.update(await self.manager.stat())
        down = [tier.name for tier, up in zip(tiers, answers, strict=True)
                if not up and tier.name in self.required]
        if replay_up is False and "replay" in self.required:
            down.append("replay")
        if down and not self.down:
            log.error("health NOT_SERVING: required tiers down: %s", ", ".join(down))
        elif self.down and not down:
            log.warning("health: every required tier answers again (%s)",
                        ", ".join(self.down))
        self.down = down
        await self.say_health()

    async def set_ready(self) -> None:
        self.ready = True
        await self.say_health()

    async def say_health(self) -> None:
        serving = self.ready and not self.down
        if serving == self._serving:
            return
        self._serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.services:
            await self.health.set(name, status)
