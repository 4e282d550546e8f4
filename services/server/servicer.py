"""The kvtier gRPC server (grpc.aio): a thin servicer over ``kvstore.TierManager``.

    server, port = await create_server(load_config(preset="test", overrides={...}))
    ...
    await server.stop()          # drains in-flight RPCs, then the write-back queue

Every request is validated (``services.server.validate``) before the store sees it,
and every failure becomes a gRPC status by ``grpc_errors``, with its code from the one
table in ``kvstore.errors`` (``STATUS_NAMES``); bytes that are not a request are
INVALID_ARGUMENT (``kvtier.errors.add_servicer``). Streams and the bytes of spills in
flight are bounded (``services.server.limits``). The
server also registers gRPC health checking (``kvtier.v1.KVTier`` and "" are SERVING
while it runs) and, when ``reflection`` is set, reflection, and records its connectable
address in ``{data_dir}/server.addr`` while it serves (``services.server.address_file``).
With TLS configured it listens over TLS (``services.server.tls``); with authentication
or an audit log configured every call passes ``services.server.auth`` first, and the
handlers check the tenant a request names against the caller's (``_own_session``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.errors import (
    Busy,
    ChunksNotHeld,
    CodecError,
    InvalidRequest,
    KVTierError,
    MissingChunks,
    PreconditionFailed,
    SharedMemoryUnavailable,
)
from kvstore.manager import TierManager
from kvstore.manifest import SessionManifest
from kvstore.quota import TenantReport
from kvtier import shm
from kvtier.errors import add_servicer, grpc_errors
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.replay.hook import ReplayBackend, make_replay_backend
from services.server import address_file, auth, reflection
from services.server import validate as check
from services.server.audit import AuditLog
from services.server.config import ServerConfig, load_config
from services.server.limits import Bounds, InFlight, Limits, idle_bounded
from services.server.metrics import ServiceMetrics, tier_lookups
from services.server.prefix_rpcs import PrefixRPCs
from services.server.restore_stream import RestoreStreamer, StreamOptions
from services.server.shm import LeaseTable
from services.server.store import open_manager, restore_tier, tiers_holding
from services.server.tls import server_credentials

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["KVTier"].full_name
MAX_TOKENS = 1 << 26


class KVTierServicer(PrefixRPCs, pb_grpc.KVTierServicer):
    def __init__(self, manager: TierManager, config: ServerConfig, metrics: ServiceMetrics,
                 replay: tuple[ReplayBackend | None, str]) -> None:
        self.manager = manager
        self.config = config
        self.metrics = metrics
        self.replay, self.why_no_replay = replay
        # Shared memory the server created and leased to clients (None: no /dev/shm).
        self.leases = LeaseTable(config.shm_lease_s, config.shm_lease_bytes_per_client,
                                 config.shm_lease_bytes_total) if shm.available() else None
        self.streamer = RestoreStreamer(manager, metrics, self.leases,
                                        lambda: (self.replay, self.why_no_replay),
                                        config.max_message_bytes)
        self.replays = 0
        self.audit: AuditLog | None = None  # set when auth or an audit log is configured
        self.limits = Limits(Bounds.from_config(config))

    def record_error(self, method: str, code: grpc.StatusCode) -> None:
        self.metrics.record_error(method, code.name)

    def record_done(self, method: str, seconds: float, ok: bool) -> None:
        self.metrics.record_done(method, seconds, ok)

    # -- Spill --

    @grpc_errors
    async def Spill(self, request_iterator: AsyncIterator[pb.SpillRequest],
                    context: grpc.aio.ServicerContext) -> pb.SpillReply:
        peer = context.peer()
        with self.limits.stream(peer, "Spill"), self.limits.in_flight() as flight:
            messages = idle_bounded(request_iterator, self.limits.idle_s, "Spill")
            return await self._spill(messages, peer, flight)

    async def _spill(self, request_iterator: AsyncIterator[pb.SpillRequest],
                     peer: str, flight: InFlight) -> pb.SpillReply:
        started = time.perf_counter()
        plan = None

        def read(payload: pb.Payload) -> bytes:
            data = self._payload_bytes(payload, peer,
                                       self.config.max_spill_bytes - plan.bytes_received)
            flight.reserve(plan.tenant, len(data))
            return data

        async for message in request_iterator:
            kind = check.spill_item(message, plan)
            if kind == "header":
                # Held until the call ends (its token ids): counted before it is checked.
                tenant, _ = _own_session(message.header.session, "header.session")
                flight.reserve(tenant, message.ByteSize())
                plan = check.spill_header(message.header, self.config.default_ack, MAX_TOKENS,
                                          self.config.dedupe_domains)
            elif kind == "chunk":
                plan.add_chunk(message.chunk.key, read(message.chunk))
            elif kind == "tail":
                plan.add_tail(message.tail.key, read(message.tail))
            else:
                plan.add_window(message.window.key, read(message.window))
        plan = check.spill_ended(plan)
        plan.finish()
        # Chunks left out go by key only: the store confirms it holds that key with that
        # digest, unread.
        chunks = [(key, plan.chunks.get(i)) for i, key in enumerate(plan.block_keys)]
        try:
            manifest = await self.manager.spill(
                plan.tenant, plan.session_id, layout_id=plan.spec.layout_id,
                generation=plan.generation, token_ids=plan.tokens, chunks=chunks,
                tail=plan.tail or b"", window=plan.window, ack=plan.ack, hint=plan.hint,
                ttl_s=plan.ttl_s, model_fingerprint=plan.model_fingerprint,
                dedupe_domain=plan.dedupe_domain)
        except ChunksNotHeld as exc:
            raise MissingChunks(str(exc)) from exc
        except CodecError as exc:
            raise InvalidRequest(f"spilled bytes do not verify: {exc}") from exc
        self.metrics.spill_seconds.observe(time.perf_counter() - started)
        # What the spill that stored this generation answered (this one, or the first
        # attempt of a retry whose reply was lost).
        receipt = manifest.receipt
        return pb.SpillReply(
            generation=manifest.generation, tier=receipt.tier,
            chunks_written=receipt.chunks_written, chunks_deduped=receipt.chunks_deduped,
            durable=receipt.durable, bytes_received=receipt.bytes_received,
            window_kept=receipt.window_kept)

    def _payload_bytes(self, payload: pb.Payload, peer: str, budget: int) -> bytes:
        body = payload.WhichOneof("body")
        if body == "shm":
            data = self._leases().read(peer, payload.shm, budget)
            self.metrics.spill_bytes.labels("shm").inc(len(data))
        else:
            data = payload.data
            self.metrics.spill_bytes.labels("grpc").inc(len(data))
        if len(data) > budget:
            raise InvalidRequest(f"the Spill stream exceeds max_spill_bytes "
                                 f"({self.config.max_spill_bytes} B)")
        return data

    # -- Restore, Resume --

    @grpc_errors
    async def Restore(self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.RestoreReply]:
        tenant, session_id = _own_session(request.session)
        opts = StreamOptions(layer_by_layer=request.layer_by_layer,
                             want_window=request.want_window,
                             use_shared_memory=request.use_shared_memory,
                             reply_lease=request.reply_lease, peer=context.peer())
        with self.limits.stream(opts.peer, "Restore"):
            async for reply in self.streamer.stream(tenant, session_id, opts):
                yield reply

    @grpc_errors
    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.RestoreReply]:
        tenant, session_id = _own_session(request.session)
        opts = StreamOptions(want_window=True, use_shared_memory=request.use_shared_memory,
                             reply_lease=request.reply_lease, peer=context.peer(), resume=True,
                             replay_tokens=check.replay_tokens(request.replay_tokens,
                                                               self.config.replay_tokens))
        with self.limits.stream(opts.peer, "Resume"):
            async for reply in self._resume(tenant, session_id, opts):
                yield reply

    async def _resume(self, tenant: str, session_id: str, opts: StreamOptions
                      ) -> AsyncIterator[pb.RestoreReply]:
        generation, window = 0, b""
        async for reply in self.streamer.stream(tenant, session_id, opts):
            kind = reply.WhichOneof("item")
            if kind == "header":
                generation = reply.header.generation
            elif kind == "window":
                window = reply.window.data  # the rebuilt one (last) is always inline
            elif kind == "summary" and reply.summary.replayed:
                self.replays += 1
                await self._keep_window(tenant, session_id, generation, window)
            yield reply

    async def _keep_window(self, tenant: str, session_id: str, generation: int,
                           window: bytes) -> None:
        """Store a window rebuilt by replay, so the next Resume of this generation finds
        it held. The resume itself succeeded whatever happens here."""
        try:
            tier = await self.manager.store_window(tenant, session_id, generation, window)
        except KVTierError as exc:  # spilled again or deleted meanwhile: nothing to keep
            log.info("rebuilt window of %s/%s not kept: %s", tenant, session_id, exc)
            return
        if tier is None:
            log.info("rebuilt window of %s/%s not kept: no window tier has room",
                     tenant, session_id)

    # -- shared memory (same-host fast path; rules in proto/kvtier.proto) --

    def _leases(self) -> LeaseTable:
        if self.leases is None:
            raise SharedMemoryUnavailable("this server has no shared memory (/dev/shm): "
                                          "send bytes inline")
        return self.leases

    @grpc_errors
    async def LeaseSegment(self, request: pb.LeaseRequest, context: grpc.aio.ServicerContext
                           ) -> pb.SharedMemoryLease:
        leases = self._leases()
        lease = leases.create(context.peer(), request.size)
        self.metrics.shm_segments.set(len(leases))
        return leases.describe(lease)

    @grpc_errors
    async def ReleaseSegments(self, request: pb.ReleaseRequest,
                              context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        if self.leases is None:  # nothing was ever leased
            return pb.ReleaseReply()
        released = self.leases.release(context.peer(), request.lease_ids)
        self.metrics.shm_segments.set(len(self.leases))
        return pb.ReleaseReply(released=released)

    # -- control --

    @grpc_errors
    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext
                       ) -> pb.PrefetchReply:
        tenant, session_id = _own_session(request.session)
        names = [t.name for t in self.manager.tiers]
        target = check.tier_name(request.target_tier, names, "target_tier")
        if target not in (None, names[0]):
            raise PreconditionFailed(f"prefetch moves blocks to the top tier ({names[0]}) "
                                     f"only, not to {target!r}")
        timeout = check.seconds("timeout_s", request.timeout_s, self.config.prefetch_timeout_s)
        started = time.perf_counter()
        result = await self.manager.prefetch(tenant, session_id, timeout)
        manifest = await self.manager.get_manifest(tenant, session_id)
        return pb.PrefetchReply(tier=restore_tier(self.manager, manifest.chunk_keys)
                                or manifest.window_tier or "",
                                complete=result.complete,
                                seconds=time.perf_counter() - started)

    @grpc_errors
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext
                    ) -> pb.EvictReply:
        tenant, session_id = _own_session(request.session)
        names = [t.name for t in self.manager.tiers]
        target = check.tier_name(request.target_tier, names, "target_tier")
        before = await self.manager.get_manifest(tenant, session_id)
        after = await self.manager.demote(tenant, session_id, target)
        return pb.EvictReply(tier=target or names[-1],
                             window_dropped=before.window_key is not None
                             and after.window_key is None)

    @grpc_errors
    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext
                     ) -> pb.DeleteReply:
        tenant, session_id = _own_session(request.session)
        result = await self.manager.delete(tenant, session_id)
        return pb.DeleteReply(chunks_released=result.chunks_released,
                              chunks_freed=result.chunks_freed)

    @grpc_errors
    async def Stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext
                   ) -> pb.StatReply:
        session = None
        if request.session.tenant or request.session.session_id:
            tenant, session_id = _own_session(request.session)
            session = self._info(await self.manager.get_manifest(tenant, session_id))
        usage = None
        if request.tenant:
            auth.check_tenant(request.tenant)  # another tenant's use is its own business
            usage = _tenant_usage(self.manager.tenant_usage(request.tenant))
        stats = await self.manager.stat()
        self.metrics.update(stats)
        lookups = tier_lookups(stats)
        hits = stats.counters["hits"]
        return pb.StatReply(
            tiers=[pb.TierStat(name=t.name, capacity_bytes=t.capacity_bytes,
                               used_bytes=t.used_bytes, items=t.items, available=t.available,
                               lookups=lookups[t.name], hits=hits.get(t.name, 0))
                   for t in stats.tiers],
            sessions=stats.sessions,
            writeback_queue_depth=stats.writeback_depth, replays=self.replays,
            session=session, tenant_usage=usage)

    @grpc_errors
    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext
                   ) -> pb.ListReply:
        tenant = auth.list_scope(check.tenant_filter(request.tenant))
        size = check.page_size(request.page_size)
        after = request.page_token
        manifests = [m for m in await self.manager.list_sessions(tenant)
                     if f"{m.tenant}/{m.session_id}" > after]
        page = manifests[:size]
        more = len(manifests) > size
        return pb.ListReply(
            sessions=[self._info(m) for m in page],
            next_page_token=f"{page[-1].tenant}/{page[-1].session_id}" if more else "")

    def _info(self, m: SessionManifest) -> pb.SessionInfo:
        return pb.SessionInfo(
            session=pb.SessionRef(tenant=m.tenant, session_id=m.session_id),
            layout_id=m.layout_id, generation=m.generation, num_tokens=m.num_tokens,
            chunks=len(m.chunk_keys), window_tier=m.window_tier or "",
            last_access_unix=m.last_access, tiers=tiers_holding(self.manager, m.chunk_keys),
            writeback_failed=m.writeback_failed)


def _own_session(ref: pb.SessionRef, field_name: str = "session") -> tuple[str, str]:
    """The (tenant, session_id) a request names, if the caller may use that tenant's
    sessions (PermissionDenied otherwise: nothing of it is read)."""
    tenant, session_id = check.session_ref(ref, field_name=field_name)
    auth.check_tenant(tenant)
    return tenant, session_id


def _tenant_usage(report: TenantReport) -> pb.TenantUsage:
    use, limits = report.usage, report.limits
    return pb.TenantUsage(
        tenant=report.tenant, sessions=use.sessions, durable_bytes=use.durable_bytes,
        memory_bytes=use.memory_bytes, sessions_limit=limits.sessions,
        durable_bytes_limit=limits.durable_bytes, memory_bytes_limit=limits.memory_bytes,
        rejections=report.rejections)


class KVTierServer:
    """A running server: the grpc.aio server, the store under it, and its metrics."""

    def __init__(self, grpc_server: grpc.aio.Server, servicer: KVTierServicer,
                 health_servicer: health.aio.HealthServicer, port: int) -> None:
        self.grpc_server = grpc_server
        self.servicer = servicer
        self.health = health_servicer
        self.port = port
        self.address = address_file.connectable(servicer.config.listen, port)
        self.address_path: Path | None = None  # {data_dir}/server.addr once recorded
        self.metrics_port: int | None = None
        self._refresher: asyncio.Task | None = None
        self._stopped = False

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
            await asyncio.sleep(interval_s)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let running ones finish (``grace_s``), then drain the
        write-back queue and close every tier."""
        if self._stopped:
            return
        self._stopped = True
        config = self.servicer.config
        try:
            await self.health.enter_graceful_shutdown()
            await self.grpc_server.stop(config.grace_s if grace_s is None else grace_s)
        finally:
            if self.address_path is not None:
                address_file.forget(self.address_path, self.address)
            if self._refresher is not None:
                self._refresher.cancel()
                await asyncio.gather(self._refresher, return_exceptions=True)
            try:
                await self.manager.close()
            finally:
                if self.servicer.replay is not None:
                    await self.servicer.replay.close()
                if self.servicer.leases is not None:
                    self.servicer.leases.close()
                if self.servicer.audit is not None:
                    self.servicer.audit.close()
                self.metrics.stop_http()


def _options(config: ServerConfig) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0)]


async def create_server(config_or_addr: ServerConfig | str) -> tuple[KVTierServer, int]:
    """Open the store, bind, start; ``(server, port)`` (port 0 in the address: a free one)."""
    config = (load_config(overrides={"listen": config_or_addr})
              if isinstance(config_or_addr, str) else config_or_addr)
    manager = await open_manager(config)
    replay, servicer = (None, ""), None
    try:
        replay = make_replay_backend(config)
        metrics = ServiceMetrics()
        servicer = KVTierServicer(manager, config, metrics, replay)
        grpc_server = grpc.aio.server(options=_options(config),
                                      interceptors=_interceptors(config, servicer))
        add_servicer(pb_grpc.add_KVTierServicer_to_server, servicer, grpc_server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
        if config.reflection:  # it lists the services to anyone who asks: only on request
            reflection.enable(
                (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                grpc_server)
        port = _bind(grpc_server, config)
        await grpc_server.start()
    except BaseException:
        if replay[0] is not None:
            await replay[0].close()
        if servicer is not None and servicer.leases is not None:
            servicer.leases.close()
        await manager.close()  # releases the disk tier's writer lock for the next try
        raise
    server = KVTierServer(grpc_server, servicer, health_servicer, port)
    try:
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics.update(await manager.stat())
        server._refresher = asyncio.create_task(server._refresh(config.metrics_interval_s))
        try:
            server.address_path = address_file.record(config.data_dir, server.address)
        except OSError as exc:  # tools then need the address passed explicitly
            log.warning("cannot record the server address in %s: %s", config.data_dir, exc)
        if config.metrics_port:
            _start_metrics(server, config)
    except BaseException:
        await server.stop(0)  # a half-started server closes like a running one
        raise
    log.info("kvtier serving on port %d", port)
    return server, port


def _interceptors(config: ServerConfig, servicer: KVTierServicer
                  ) -> list[grpc.aio.ServerInterceptor]:
    """Authentication, authorization and audit (``services.server.auth``), when any of
    them is configured; else none (tenants are what requests name)."""
    authenticator = auth.Authenticator.from_settings(
        config.auth_tokens_file, config.auth_jwt_key, config.auth_jwt_audience)
    if authenticator is None and not config.audit_log:
        return []
    servicer.audit = AuditLog(config.audit_log, servicer.metrics.registry)
    return [auth.AuthInterceptor(authenticator, servicer.audit)]


def _bind(grpc_server: grpc.aio.Server, config: ServerConfig) -> int:
    """Add the port (TLS when configured); Busy (naming what to do) when it cannot be had."""
    listen = config.listen
    try:
        if config.tls:
            port = grpc_server.add_secure_port(listen, server_credentials(
                config.tls_cert, config.tls_key, config.tls_client_ca))
        else:
            port = grpc_server.add_insecure_port(listen)
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if not port:
        raise Busy(f"cannot listen on {listen}: the port is in use or the host is not one of "
                   "this machine's; stop what holds it or choose another listen address")
    return port


def _start_metrics(server: KVTierServer, config: ServerConfig) -> None:
    try:
        # HTTPS with the gRPC port's certificate when that is TLS (Prometheus then needs
        # the CA: deploy/prometheus.yml).
        server.start_metrics(config.metrics_port, config.metrics_host,
                             certfile=config.tls_cert or None, keyfile=config.tls_key or None)
    except OSError as exc:
        raise Busy(f"cannot serve metrics on port {config.metrics_port} ({exc.strerror}): "
                   "choose another metrics_port, or 0 for none") from exc
