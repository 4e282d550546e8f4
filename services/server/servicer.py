"""The kvtier gRPC service (grpc.aio): a typed servicer, each RPC a thin call into
``kvstore.TierManager`` (``services.server.server.create_server`` runs it).

Every request is validated (``services.server.validate``) before the store sees it,
and every failure becomes a gRPC status by ``grpc_errors``, with its code from the one
table in ``kvstore.format.errors`` (``STATUS_NAMES``); bytes that are not a request are
INVALID_ARGUMENT (``services.serving.errors.add_servicer``). Streams and the bytes of spills in
flight are bounded (``services.server.limits``). With authentication or an audit log
configured every call passes ``services.serving.auth`` first, and the handlers check the
tenant a request names against the caller's (``_own_session``, ``auth.check_tenant``).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from kvstore.fleet.liveness import Heartbeat
from kvstore.format.errors import (
    ChunksNotHeld,
    CodecError,
    InvalidRequest,
    KVTierError,
    MissingChunks,
    PreconditionFailed,
    SharedMemoryUnavailable,
    UnknownLayout,
    status_name,
)
from kvstore.format.keys import check_fingerprint, dedupe_scope, split_block_key
from kvstore.format.layout import LayoutSpec, layout_to_json
from kvstore.format.registry import all_layouts
from kvstore.session.manager import TierManager
from kvstore.session.manifest import SessionManifest
from kvstore.session.quota import TenantReport
from kvtier import shm
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server import peers, requests
from services.server import validate as check
from services.server.config import ServerConfig
from services.server.fleet_stat import fleet_stat
from services.server.layout_registry import ServerLayouts, fleet_layouts, is_builtin
from services.server.limits import Bounds, InFlight, Limits, idle_bounded
from services.server.metrics import ServiceMetrics, tier_lookups
from services.server.prefix_chunks import PrefixChunkCalls
from services.server.replay_backend import ReplayBackend, model_layouts
from services.server.restore_stream import RestoreStreamer, StreamOptions
from services.server.shm_leases import LeaseTable
from services.server.store import restore_tier, tiers_holding
from services.serving import auth
from services.serving.audit import AuditLog
from services.serving.errors import grpc_errors

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["KVTier"].full_name
MAX_TOKENS = 1 << 26
HEADER_KEYS_ON_LOOP = 1024  # about a millisecond of hashing


class KVTierServicer(pb_grpc.KVTierServicer):
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
                                        config.max_message_bytes, config.replay_layouts,
                                        default_replay_tokens=config.replay_tokens)
        self.layouts = ServerLayouts(config.layouts, config.data_dir, config.layout_policy,
                                     config.max_message_bytes, fleet_layouts(manager.meta),
                                     lambda replayer: model_layouts(self.replay, replayer))
        self.replays = 0
        self.address = ""  # where other nodes and routers reach this server (once bound)
        self.heartbeat: Heartbeat | None = None  # a fleet node's (once bound)
        self.audit: AuditLog | None = None  # set when auth or an audit log is configured
        self.limits = Limits(Bounds.from_config(config))
        self.chunks = PrefixChunkCalls(
            manager, config, self.limits, self.layouts, self.streamer,
            functools.partial(self._payload_bytes, method="WriteChunks"), MAX_TOKENS)

    def use_replay(self, backend: ReplayBackend, replayers: frozenset[str]) -> None:
        """Rebuild windows with ``backend`` (e.g. a model this process holds already) for
        the layouts whose replayer is one of ``replayers``."""
        self.replay, self.why_no_replay = backend, ""
        self.streamer.replayers = replayers

    def record_error(self, method: str, code: grpc.StatusCode) -> None:
        self.metrics.record_error(method, code.name)

    def record_done(self, method: str, seconds: float, ok: bool) -> None:
        self.metrics.record_done(method, seconds, ok)

    # -- Spill --

    @grpc_errors
    async def Spill(self, request_iterator: AsyncIterator[pb.SpillRequest],
                    context: grpc.aio.ServicerContext) -> pb.SpillReply:
        peer = auth.client_peer(context)
        with self.limits.stream(peer, "Spill"), self.limits.in_flight() as flight:
            messages = idle_bounded(request_iterator, self.limits.idle_s, "Spill")
            return await self._spill(messages, peer, flight)

    async def _spill(self, request_iterator: AsyncIterator[pb.SpillRequest],
                     peer: str, flight: InFlight) -> pb.SpillReply:
        started = time.perf_counter()
        incoming: check.IncomingSpill | None = None

        def read(kind: str, payload: pb.Payload) -> bytes:
            assert incoming is not None  # stream_item: a payload after the header only
            if payload.WhichOneof("body") == "shm" and \
                    payload.shm.length > incoming.payload_limit(kind):
                # refused before it is copied out of the segment (on the event loop)
                raise InvalidRequest(f"the {kind} payload is {payload.shm.length} B of shared "
                                     f"memory; layout {incoming.spec.name} encodes it in at most "
                                     f"{incoming.payload_limit(kind)} B")
            data = self._payload_bytes(payload, peer,
                                       self.config.max_spill_bytes - incoming.bytes_received)
            flight.reserve(incoming.tenant, len(data))
            return data

        async for message in request_iterator:
            kind = check.stream_item(message, incoming is not None)
            if kind == "header":
                # Held until the call ends (its token ids): counted before it is checked.
                tenant, _ = _own_session(message.header.session, "header.session")
                flight.reserve(tenant, message.ByteSize())
                await self.layouts.resolve(message.header.layout_id)  # another node's
                checked = functools.partial(check.spill_header, message.header,
                                            self.config.default_ack, MAX_TOKENS,
                                            self.config.dedupe_domains)
                # every chunk key is hashed again: a long chain is checked off the loop
                incoming = (await asyncio.to_thread(checked)
                            if len(message.header.chunk_keys) > HEADER_KEYS_ON_LOOP
                            else checked())
                continue
            assert incoming is not None  # stream_item: a payload after the header only
            if kind == "chunk":
                incoming.add_chunk(message.chunk.key, read(kind, message.chunk))
            elif kind == "tail":
                incoming.add_tail(message.tail.key, read(kind, message.tail))
            else:
                incoming.add_window(message.window.key, read(kind, message.window))
        request = check.stream_ended(incoming, "Spill").finish()
        requests.record_phase("receive", time.perf_counter() - started)
        try:
            with requests.phase("store"):
                manifest = await self.manager.spill_request(request)
        except ChunksNotHeld as exc:
            raise MissingChunks(str(exc)) from exc
        except CodecError as exc:
            raise InvalidRequest(f"spilled bytes do not verify: {exc}") from exc
        self.metrics.spill_seconds.observe(time.perf_counter() - started)
        # The counts of the spill that stored this generation (this one, or the first
        # attempt of a retry whose reply was lost); tier and window as held now.
        receipt = manifest.receipt
        assert receipt is not None  # a stored spill's manifest has its receipt
        requests.note(tier=receipt.tier, bytes=receipt.bytes_received,
                      generation=manifest.generation, chunks_written=receipt.chunks_written)
        return pb.SpillReply(
            generation=manifest.generation, tier=receipt.tier,
            chunks_written=receipt.chunks_written, chunks_deduped=receipt.chunks_deduped,
            durable=receipt.durable, bytes_received=receipt.bytes_received,
            window_kept=receipt.window_kept)

    def _payload_bytes(self, payload: pb.Payload, peer: str, budget: int,
                       method: str = "Spill") -> bytes:
        body = payload.WhichOneof("body")
        if body == "shm":
            data = self._leases().read(peer, payload.shm, budget)
            self.metrics.spill_bytes.labels("shm").inc(len(data))
        else:
            data = payload.data
            self.metrics.spill_bytes.labels("grpc").inc(len(data))
        if len(data) > budget:
            raise InvalidRequest(f"the {method} stream exceeds max_spill_bytes "
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
                             reply_lease=request.reply_lease, peer=auth.client_peer(context),
                             model_fingerprint=check_fingerprint(request.model_fingerprint))
        with self.limits.stream(opts.peer, "Restore"):
            async for reply in self._stream(self.streamer.restore, tenant, session_id, opts):
                yield reply

    @grpc_errors
    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.RestoreReply]:
        tenant, session_id = _own_session(request.session)
        opts = StreamOptions(want_window=True, use_shared_memory=request.use_shared_memory,
                             reply_lease=request.reply_lease, peer=auth.client_peer(context),
                             replay_tokens=check.replay_tokens(request.replay_tokens),
                             model_fingerprint=check_fingerprint(request.model_fingerprint))
        with self.limits.stream(opts.peer, "Resume"):
            async for reply in self._stream(self.streamer.resume, tenant, session_id, opts):
                if reply.WhichOneof("item") == "summary" and reply.summary.replayed:
                    self.replays += 1
                yield reply

    async def _stream(self, replies_for: Callable[..., AsyncIterator[pb.RestoreReply]],
                      tenant: str, session_id: str, opts: StreamOptions
                      ) -> AsyncIterator[pb.RestoreReply]:
        """The replies ``replies_for`` (the streamer's ``restore`` or ``resume``) frames;
        a session whose layout this node has not met (another node of the fleet
        registered it) has it loaded from the bucket, then starts again. UnknownLayout
        comes before the first reply: the layout is looked up first."""
        replies = replies_for(tenant, session_id, opts)
        try:
            first = await anext(replies)
        except UnknownLayout:
            if not await self._met_layout(tenant, session_id):
                raise
            replies = replies_for(tenant, session_id, opts)
            first = await anext(replies)
        yield first
        async for reply in replies:
            yield reply

    async def _met_layout(self, tenant: str, session_id: str) -> bool:
        """Whether the session's layout was just loaded from the fleet's bucket."""
        if self.layouts.shared is None:
            return False
        manifest = await self.manager.get_manifest(tenant, session_id)
        return await self.layouts.resolve(manifest.layout_id)

    # -- prefix chunks of no session (services.server.prefix_chunks) --

    @grpc_errors
    async def WriteChunks(self, request_iterator: AsyncIterator[pb.WriteChunksRequest],
                          context: grpc.aio.ServicerContext) -> pb.WriteChunksReply:
        return await self.chunks.write(request_iterator, auth.client_peer(context))

    @grpc_errors
    async def ReadChunks(self, request: pb.ReadChunksRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ReadChunksReply]:
        async for reply in self.chunks.read(request, auth.client_peer(context)):
            yield reply

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
        lease = leases.create(auth.client_peer(context), request.size)
        self.metrics.shm_segments.set(len(leases))
        return leases.describe(lease)

    @grpc_errors
    async def ReleaseSegments(self, request: pb.ReleaseRequest,
                              context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        if self.leases is None:  # nothing was ever leased
            return pb.ReleaseReply()
        released = self.leases.release(auth.client_peer(context), request.lease_ids)
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
        # where the session is now: a block already below the target stays there
        return pb.EvictReply(tier=restore_tier(self.manager, after.chunk_keys)
                             or after.window_tier or "",
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
        retained = (stats.retained_chunks, stats.retained_bytes)
        own = auth.list_scope(None)  # a tenant's credential: its own domain's figures only
        if own is not None:
            retained = self.manager.retained_chunks().get(dedupe_scope(own), (0, 0))
        fleet = (await fleet_stat(self.manager, own, self.config.fleet_down_after_s)
                 if request.fleet else None)
        return pb.StatReply(
            tiers=[pb.TierStat(name=t.name, capacity_bytes=t.capacity_bytes,
                               used_bytes=t.used_bytes, items=t.items, available=t.available,
                               lookups=lookups[t.name], hits=hits.get(t.name, 0))
                   for t in stats.tiers],
            sessions=stats.sessions,
            writeback_queue_depth=stats.writeback_depth, replays=self.replays,
            session=session, tenant_usage=usage, node_id=self.config.node_name,
            retained_chunks=retained[0], retained_bytes=retained[1], fleet=fleet)

    @grpc_errors
    async def List(self, request: pb.ListRequest, context: grpc.aio.ServicerContext
                   ) -> pb.ListReply:
        tenant = auth.list_scope(check.tenant_filter(request.tenant))
        size = check.page_size(request.page_size)
        after = check.page_token(request.page_token, tenant)
        # in code point order of "<tenant>/<session_id>", the order the token marks
        manifests = sorted((m for m in await self.manager.list_sessions(tenant)
                            if _list_order(m) > after), key=_list_order)
        page = manifests[:size]
        more = len(manifests) > size
        return pb.ListReply(
            sessions=[self._info(m) for m in page],
            next_page_token=f"{page[-1].tenant}/{page[-1].session_id}" if more else "")

    @grpc_errors
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
                     ) -> pb.LookupReply:
        try:
            tenant, layout_id, tokens, fingerprint, domain = check.lookup_request(
                request, MAX_TOKENS, self.config.dedupe_domains)
        except UnknownLayout:
            if not await self.layouts.resolve(request.layout_id):  # another node's?
                raise
            tenant, layout_id, tokens, fingerprint, domain = check.lookup_request(
                request, MAX_TOKENS, self.config.dedupe_domains)
        auth.check_tenant(tenant)
        found = await self.manager.lookup_fleet(tenant, layout_id, tokens,
                                                model_fingerprint=fingerprint,
                                                dedupe_domain=domain,
                                                independent=request.independent_chunks)
        chunks = []
        for chunk in found.chunks:
            chain, digest = split_block_key(chunk.block_key)
            chunks.append(pb.HeldChunk(chunk_key=chain, digest=digest, tiers=chunk.tiers,
                                       index=chunk.index))
        return pb.LookupReply(tokens_held=found.tokens_held, chunks_held=len(chunks),
                              chunks=chunks)

    @grpc_errors
    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext
                   ) -> pb.ForkReply:
        tenant, source, new, upto = check.fork_request(request)
        auth.check_tenant(tenant)
        try:
            manifest = await self.manager.fork(tenant, source, new, upto_tokens=upto)
        except UnknownLayout:
            if not await self._met_layout(tenant, source):
                raise
            manifest = await self.manager.fork(tenant, source, new, upto_tokens=upto)
        return pb.ForkReply(generation=manifest.generation, num_tokens=manifest.num_tokens,
                            chunks=len(manifest.chunk_keys),
                            window_kept=manifest.window_key is not None)

    # -- layouts at run time (services.server.layout_registry) --

    @grpc_errors
    async def RegisterLayout(self, request: pb.RegisterLayoutRequest,
                             context: grpc.aio.ServicerContext) -> pb.RegisterLayoutReply:
        identity = auth.caller()
        self.layouts.check_caller(identity.role if identity is not None else None)
        try:
            spec, created = await self.layouts.register(request.layout_json)
        except KVTierError as exc:
            self._audit_layout(context, status_name(exc), str(exc))
            raise
        self._audit_layout(context, "OK", f"{spec.layout_id} "
                           f"{'registered' if created else 'already known'}")
        return pb.RegisterLayoutReply(layout=_layout_info(spec), created=created)

    def _audit_layout(self, context: grpc.aio.ServicerContext, result: str, what: str) -> None:
        if self.audit is not None:
            self.audit.record("layout", auth.caller(), "RegisterLayout", auth.client_peer(context),
                              result, what)

    @grpc_errors
    async def ListLayouts(self, request: pb.ListLayoutsRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListLayoutsReply:
        await self.layouts.sync()  # the fleet's, with shared metadata
        specs = sorted(all_layouts(), key=lambda spec: spec.name)
        return pb.ListLayoutsReply(layouts=[_layout_info(spec) for spec in specs])

    @grpc_errors
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.DrainProgress]:
        interval = check.drain_interval(request.progress_interval_s)
        await self._say("draining")
        async for step in self.manager.start_drain(interval):
            if step.done:
                await self._say("drained")
            yield pb.DrainProgress(
                phase=step.phase, writes_in_flight=step.writes_in_flight,
                writeback_pending=step.writeback_pending,
                writeback_failed=step.writeback_failed, windows_held=step.windows_held,
                windows_released=step.windows_released, windows_moved=step.windows_moved,
                done=step.done)

    @grpc_errors
    async def AdoptWindow(self, request_iterator: AsyncIterator[pb.AdoptWindowRequest],
                          context: grpc.aio.ServicerContext) -> pb.AdoptWindowReply:
        """A draining peer's window of a session, kept here (``services.server.peers``)."""
        with self.limits.stream(context.peer(), "AdoptWindow"):
            messages = idle_bounded(request_iterator, self.limits.idle_s, "AdoptWindow")
            return await peers.adopt(self.manager, self.layouts, self.config.node_name,
                                     messages)

    async def _say(self, state: str) -> None:
        """A fleet node's heartbeat says ``state`` now (else with its next beat: a bucket
        away does not stop a drain, it only keeps the write-back from finishing)."""
        if self.heartbeat is not None:
            with contextlib.suppress(KVTierError):
                await self.heartbeat.write(state)

    def _info(self, m: SessionManifest) -> pb.SessionInfo:
        node = address = ""
        if m.window_key is not None:  # held here (node_id is "" on a single node)
            node = m.node_id or self.config.node_name
            address = m.node_address or self.address
        elif m.remote_window is not None:  # in node_id's memory: a router sends the session there
            node, address = m.node_id, m.node_address
        return pb.SessionInfo(
            session=pb.SessionRef(tenant=m.tenant, session_id=m.session_id),
            layout_id=m.layout_id, generation=m.generation, num_tokens=m.num_tokens,
            chunks=len(m.chunk_keys), window_tier=m.window_tier or "",
            last_access_unix=m.last_access, tiers=tiers_holding(self.manager, m.chunk_keys),
            writeback_failed=m.writeback_failed, window_node_id=node,
            window_node_address=address, model_fingerprint=m.model_fingerprint)


def _own_session(ref: pb.SessionRef, field_name: str = "session") -> tuple[str, str]:
    """The (tenant, session_id) a request names, if the caller may use that tenant's
    sessions (PermissionDenied otherwise: nothing of it is read)."""
    tenant, session_id = check.session_ref(ref, field_name=field_name)
    requests.note(tenant=tenant, session=session_id)
    auth.check_tenant(tenant)
    return tenant, session_id


def _list_order(m: SessionManifest) -> str:
    return f"{m.tenant}/{m.session_id}"


def _layout_info(spec: LayoutSpec) -> pb.LayoutInfo:
    return pb.LayoutInfo(layout_id=spec.layout_id, layout_json=layout_to_json(spec),
                         replayer=spec.replayer, builtin=is_builtin(spec))


def _tenant_usage(report: TenantReport) -> pb.TenantUsage:
    use, limits = report.usage, report.limits
    return pb.TenantUsage(
        tenant=report.tenant, sessions=use.sessions, durable_bytes=use.durable_bytes,
        memory_bytes=use.memory_bytes, retained_bytes=use.retained_bytes,
        sessions_limit=limits.sessions,
        durable_bytes_limit=limits.durable_bytes, memory_bytes_limit=limits.memory_bytes,
        rejections=report.rejections)
