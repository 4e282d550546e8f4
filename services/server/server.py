"""The running kvtier server: ``create_server`` opens the store, builds the servicer
(``services.server.servicer``), binds (TLS when configured, ``services.serving.tls``),
registers health checking and, when ``reflection`` is set, reflection, records its
connectable address in ``{data_dir}/server.addr`` (``services.server.address_file``) and
serves metrics. Health checking says NOT_SERVING until the server is ready: with
``replay_warmup`` once the in-process replay model is loaded and has run once
(``KVTierServer.ready``), else at once. Every request is bounded in size before it is parsed
(``services.server.sizes``) and the event loop's lag is measured throughout
(``services.server.loop_lag``). Remote tiers are probed every ``probe_interval_s``, and
health says NOT_SERVING while a required one is down (``services.server.probes``).
``services.server.reload`` re-reads what may change without a restart (``kvtier serve``
runs it on SIGHUP). ``KVTierServer.stop``
drains in-flight calls, then the write-back queue.

    server, port = await create_server(load_config(preset="test", overrides={...}))
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import shutil
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.encryption.resealer import Resealer
from kvstore.encryption.seal import Keyring
from kvstore.format.errors import Busy
from kvstore.remote.breaker import CircuitBreaker
from kvstore.session.manager import TierManager
from proto import kvtier_pb2_grpc as pb_grpc
from services.server import address_file, reflection, sizes
from services.server.config import ServerConfig
from services.server.config_load import load_config
from services.server.fleet_node import FleetNode
from services.server.loop_lag import LoopMonitor
from services.server.metrics import ServiceMetrics
from services.server.probes import Prober
from services.server.remote_metrics import observe_store
from services.server.replay_backend import (
    ReplayBackend,
    make_replay_backend,
    probe_replay,
    warm_up_replay,
)
from services.server.requests import RequestInterceptor
from services.server.servicer import SERVICE, KVTierServicer
from services.server.store import open_manager
from services.server.tracing import Tracing, tracing_for
from services.serving import auth
from services.serving.audit import AuditLog
from services.serving.errors import add_servicer
from services.serving.lifecycle import end_task
from services.serving.tls import server_credentials
from services.serving.tls_front import PlaintextAudit, TlsFront

log = logging.getLogger(__name__)


class KVTierServer:
    """A running server: the grpc.aio server, the store under it, and its metrics."""

    def __init__(self, grpc_server: grpc.aio.Server, servicer: KVTierServicer,
                 health_servicer: health.aio.HealthServicer, port: int,
                 loop_monitor: LoopMonitor, prober: Prober) -> None:
        self.grpc_server = grpc_server
        self.loop_monitor = loop_monitor  # running from start to stop
        self.servicer = servicer
        self.health = health_servicer
        self.port = port
        self.address = address_file.connectable(servicer.config.listen, port)
        self.address_path: Path | None = None  # {data_dir}/server.addr once recorded
        self.metrics_port: int | None = None
        self._refresher: asyncio.Task | None = None
        self.fleet_node: FleetNode | None = None  # a fleet node's heartbeat (shared metadata)
        self.prober = prober
        self.interceptors: list[grpc.aio.ServerInterceptor] = []  # auth: swapped on reload
        self._probing: asyncio.Task | None = None
        # done once health checking says SERVING (create_server awaits it by default)
        self.ready: asyncio.Task | None = None
        self._stopped = False
        self.tracing: Tracing | None = None  # flushed at stop
        self.resealer: Resealer | None = None  # an encrypting node's own media
        self._resealing: asyncio.Task | None = None
        self.front: TlsFront | None = None  # a TLS port's public side (_bind)

    @property
    def manager(self) -> TierManager:
        return self.servicer.manager

    @property
    def metrics(self) -> ServiceMetrics:
        return self.servicer.metrics

    def start_metrics(self, port: int, addr: str = "127.0.0.1", *, certfile: str | None = None,
                      keyfile: str | None = None) -> int:
        self.metrics_port = self.metrics.serve_http(port, addr, certfile=certfile,
                                                    keyfile=keyfile)
        return self.metrics_port

    async def _refresh(self, interval_s: float) -> None:
        while True:
            with contextlib.suppress(Exception):  # a failed refresh keeps the last figures
                self.metrics.update(await self.manager.stat())
            if self.servicer.leases is not None:
                self.servicer.leases.reap()
                self.metrics.shm_segments.set(len(self.servicer.leases))
            with contextlib.suppress(OSError):  # the data directory removed under us
                self.metrics.disk_free.set(
                    shutil.disk_usage(self.servicer.config.data_dir).free)
            await asyncio.sleep(interval_s)

    async def _become_ready(self, warm_up: bool, freeze_startup: bool) -> None:
        """Warm the replay model up (``warm_up``), freeze what start-up made
        (``freeze_startup``), then say SERVING."""
        if warm_up:
            try:
                if await warm_up_replay(self.servicer.replay):
                    log.info("replay model loaded and run once (replay_warmup)")
            except Exception:  # resumes that need replay fail then, the rest serves
                log.exception("replay warm-up failed: resumes that need replay will load "
                              "the model again")
        if freeze_startup:
            # What start-up made (the store's modules, torch, the model) lives as long as
            # the process: out of the collector's sight, a full collection walks only what
            # serving made since. The one collection here holds the loop ~100 ms, before
            # SERVING: the lag monitor restarts after it, so it is no serving stall.
            await self.loop_monitor.stop()
            gc.collect()
            gc.freeze()
            self.loop_monitor.start()
        if not self._stopped:
            await self.prober.set_ready()  # SERVING unless a required tier is down

    def reseal(self) -> None:
        """Reseal this node's own media under its keyring's current key in the background,
        when the keyring holds another key; a pass already running starts over (the
        current key may have changed)."""
        resealer = self.resealer
        keyring = resealer.keyring() if resealer is not None else None
        if resealer is None or keyring is None or not resealer.needed(keyring):
            return
        self._resealing = asyncio.create_task(self._reseal(resealer, keyring,
                                                           self._resealing))

    async def _reseal(self, resealer: Resealer, keyring: Keyring,
                      previous: asyncio.Task[None] | None) -> None:
        await end_task(previous)
        try:
            await resealer.run(keyring)
        except Exception:  # noqa: BLE001 - a medium error: the next start or reload retries
            log.exception("resealing this node's media under key %s failed; every value "
                          "is under one key or the other", keyring.current)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()

    async def _stop_serving(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        try:
            if self.front is not None:  # new connections refused, as gRPC's stop does
                await asyncio.to_thread(self.front.close)
            await self.grpc_server.stop(grace_s)
        finally:
            if self.front is not None:  # what the drain left open
                self.front.close_connections()

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let running ones finish (``grace_s``), then drain the
        write-back queue and close every tier."""
        if self._stopped:
            return
        self._stopped = True
        config = self.servicer.config
        if self.ready is not None:  # a model load in its thread cannot be cancelled
            await asyncio.gather(self.ready, return_exceptions=True)
        try:
            await self._stop_serving(config.grace_s if grace_s is None else grace_s)
        finally:
            if self.address_path is not None:
                address_file.forget(self.address_path, self.address)
            for task in (self._refresher, self._probing, self._resealing):
                await end_task(task)
            if self.fleet_node is not None:
                await self.fleet_node.stop()
            await self.loop_monitor.stop()
            try:
                await self.manager.close()
            finally:
                if self.servicer.replay is not None:
                    await self.servicer.replay.close()
                if self.servicer.leases is not None:
                    self.servicer.leases.close()
                if self.servicer.audit is not None:
                    self.servicer.audit.close()
                if self.tracing is not None:
                    await asyncio.to_thread(self.tracing.close)  # exports what is batched
                self.metrics.stop_http()


def _options(config: ServerConfig) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0)]


def breakers_of(manager: TierManager, replay: object) -> list[CircuitBreaker]:
    """The circuit breakers of the store's remote tiers and of the replay backend."""
    found = [breaker for tier in manager.tiers
             if (breaker := getattr(tier, "breaker", None)) is not None]
    return found + list(getattr(replay, "breakers", list)())


async def create_server(config_or_addr: ServerConfig | str, *, wait_ready: bool = True,  # noqa: C901 - start-up steps in order, each undone on a later failure
                        freeze_startup: bool = False, tracing: Tracing | None = None
                        ) -> tuple[KVTierServer, int]:
    """Open the store, bind, start; ``(server, port)`` (port 0 in the address: a free one).
    ``wait_ready``: return once health checking says SERVING (else at once, the replay
    warm-up still to run: ``server.ready``). ``freeze_startup``: a server process's own
    (``kvtier serve``): what start-up made is frozen out of the garbage collector's sight
    before SERVING (a process hosting many servers, as tests do, keeps collecting it).
    ``tracing``: where spans go (default: the config's ``otlp_endpoint``, if any)."""
    config = (load_config(overrides={"listen": config_or_addr})
              if isinstance(config_or_addr, str) else config_or_addr)
    tracing = tracing if tracing is not None else tracing_for(config)
    manager = await open_manager(config)
    replay: tuple[ReplayBackend | None, str] = (None, "")
    servicer = None
    front: TlsFront | None = None
    try:
        replay = make_replay_backend(config)
        metrics = ServiceMetrics()
        metrics.watch_breakers(lambda: breakers_of(manager, replay[0]))
        observe_store(manager.tiers, manager.meta, metrics.remote)
        servicer = KVTierServicer(manager, config, metrics, replay)
        monitor = LoopMonitor(metrics)
        guards = _interceptors(config, servicer)
        grpc_server = grpc.aio.server(
            options=_options(config),
            interceptors=[RequestInterceptor(config.slow_request_s, tracing),
                          monitor.interceptor(), *guards])
        add_servicer(sizes.bounded(pb_grpc.add_KVTierServicer_to_server,
                                   config.max_header_bytes), servicer, grpc_server)
        health_servicer = health.aio.HealthServicer()
        for name in ("", SERVICE):  # until ready (KVTierServer._become_ready)
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        if config.reflection:  # it lists the services to anyone who asks: only on request
            reflection.enable(
                (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                grpc_server)
        port, front = _bind(grpc_server, config, servicer)
        servicer.address = config.advertised(port)  # known once bound (port 0 picks one)
        fleet_node = None
        if config.metadata == "shared":  # recorded in this node's manifests
            from kvstore.fleet.shared_meta import SharedMetaStore

            assert isinstance(manager.meta, SharedMetaStore)  # open_manager made one
            manager.meta.node_address = servicer.address
            fleet_node = FleetNode(manager.meta, config, servicer.address, metrics.remote)
            servicer.heartbeat = fleet_node.heartbeat
            manager.draining.move = fleet_node.peers  # a drain moves its windows to peers
        await grpc_server.start()
        if front is not None:
            front.start()
    except BaseException:
        if front is not None:
            front.close()
            front.close_connections()
        if replay[0] is not None:
            await replay[0].close()
        if servicer is not None and servicer.leases is not None:
            servicer.leases.close()
        await manager.close()  # releases the disk tier's writer lock for the next try
        if tracing is not None:
            tracing.close()
        raise
    prober = Prober(manager, health_servicer, metrics, ("", SERVICE), config.required_tiers,
                    config.probe_interval_s, functools.partial(probe_replay, replay[0]))
    server = KVTierServer(grpc_server, servicer, health_servicer, port, monitor, prober)
    server.interceptors = guards
    server.front = front
    server.tracing = tracing
    try:
        if fleet_node is not None:
            server.fleet_node = fleet_node
            fleet_node.start()
        metrics.update(await manager.stat())
        server._refresher = asyncio.create_task(server._refresh(config.metrics_interval_s))
        server._probing = asyncio.create_task(prober.run())
        # the remote tiers' state before the first call, unless a dependency that does not
        # answer holds the first round past one interval (it goes on in the background)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(prober.first_round.wait(), config.probe_interval_s)
        try:
            server.address_path = address_file.record(config.data_dir, server.address)
        except OSError as exc:  # tools then need the address passed explicitly
            log.warning("cannot record the server address in %s: %s", config.data_dir, exc)
        if config.metrics_port:
            _start_metrics(server, config)
        monitor.start()  # from here on every tick is one of serving
        # a fleet's bucket is the fleet's: kvtier rekey reseals it beside the servers
        server.resealer = Resealer(manager.tiers, manager.meta, manager.store.catalog,
                                   manager.store.locks, ("disk",) if config.metadata ==
                                   "shared" else ("disk", "object"))
        server.reseal()
        server.ready = asyncio.create_task(server._become_ready(config.replay_warmup,
                                                                freeze_startup))
        if wait_ready:
            await server.ready
    except BaseException:
        await server.stop(0)  # a half-started server closes like a running one
        raise
    log.info("kvtier serving on port %d", port)
    return server, port


def _interceptors(config: ServerConfig, servicer: KVTierServicer
                  ) -> list[grpc.aio.ServerInterceptor]:
    """Authentication, authorization and audit (``services.serving.auth``), when any of
    them is configured; else none (tenants are what requests name)."""
    authenticator = auth.Authenticator.from_settings(
        config.auth_tokens_file, config.auth_jwt_key, config.auth_jwt_audience)
    if authenticator is None and not config.audit_log:
        return []
    servicer.audit = AuditLog(config.audit_log, servicer.metrics.registry)
    return [auth.AuthInterceptor(authenticator, servicer.audit, servicer)]


def _bind(grpc_server: grpc.aio.Server, config: ServerConfig, servicer: KVTierServicer
          ) -> tuple[int, TlsFront | None]:
    """Add the port; Busy (naming what to do) when it cannot be had. A TLS port on a host
    address is kvtier's own (``services.serving.tls_front``: plaintext attempts audited),
    relaying to gRPC's private listener; its port is the one returned."""
    listen = config.listen
    front = None
    try:
        if config.tls and not listen.startswith("unix:"):
            metrics = servicer.metrics
            front = TlsFront.bind(listen, PlaintextAudit(lambda: servicer.audit,
                                                         metrics.plaintext_attempts.inc),
                                  metrics.tls_front_connections.set)
        if config.tls:
            port = grpc_server.add_secure_port(
                front.private_target if front is not None else listen,
                server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca))
        else:
            port = grpc_server.add_insecure_port(listen)
    except (RuntimeError, OSError):  # grpcio raises where older releases returned 0
        port = 0
    except BaseException:
        if front is not None:
            front.close()
            front.close_connections()
        raise
    if not port:
        if front is not None:
            front.close()
            front.close_connections()
        raise Busy(f"cannot listen on {listen}: the port is in use or the host is not one of "
                   "this machine's; stop what holds it or choose another listen address")
    return (front.port, front) if front is not None else (port, None)


def _start_metrics(server: KVTierServer, config: ServerConfig) -> None:
    try:
        # HTTPS with the gRPC port's certificate when that is TLS (Prometheus then needs
        # the CA: deploy/prometheus.yml).
        server.start_metrics(config.metrics_port, config.metrics_host,
                             certfile=config.tls_cert or None, keyfile=config.tls_key or None)
    except OSError as exc:
        raise Busy(f"cannot serve metrics on port {config.metrics_port} ({exc.strerror}): "
                   "choose another metrics_port, or 0 for none") from exc
