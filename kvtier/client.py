"""``AsyncClient`` (blocking twin: ``kvtier.sync.Client``): tensors in, tensors
out, over the kvtier gRPC service.

    async with AsyncClient("127.0.0.1:50051") as kv:
        await kv.spill("acme", "s1", "kvtier-bundled", token_ids, persistent, window=window,
                       generation=1)
        session = await kv.resume("acme", "s1")   # session.persistent, session.window

Spill cuts the persistent streams into chunks of ``layout.chunk_tokens``, encodes them
(``kvstore.format.chunk``), keys them (``kvstore.format.keys.chain_keys``: the tenant's or a shared
dedupe domain, the layout, the model fingerprint), states the BLAKE2b-256 digest of every
chunk, the tail and the window (every digest of the bytes of this spill), and sends only
chunks the server may not hold: a chunk whose fresh digest is the one the server
acknowledged for this session before, or a lookup found held, goes by key and digest,
and if the server lost it it answers ``MissingChunks`` and the client sends everything.
A restore checks every chunk and the tail against the digests the server returns
(``DataLoss`` if one differs).

Calls failing with UNAVAILABLE are retried with exponential backoff and jitter (streams
are restarted whole, so one retry mechanism covers every call; a retried Spill whose
first attempt landed gets that attempt's reply, the server's spills being idempotent
per generation and content, and a retried WriteChunks names the same content-addressed
chunks again). ``timeout_s`` (``DEFAULT_TIMEOUT_S`` unless given) bounds the whole
call, retries, failovers and a stream's every message included: past it the call raises
``DeadlineExceeded``. A node silent for its share of that deadline is down like one
refusing; Delete and Fork, which must not be applied twice, are then not sent again
(``DeadlineExceeded`` says they may have been applied). Any other failure
raises the ``kvstore.format.errors`` class the server raised. On the same host chunk bytes go
through shared memory (``shared_memory=None``: whenever the target is loopback).

``write_chunks`` and ``read_chunks`` store and read prefix chunks of no session
(``kvtier.prefix_chunks`` frames them).

``AsyncClient(servers=[a, b, c])`` talks to a fleet: each session's calls go to the node
holding its window, found through ``Stat`` and cached; a node down, to another
(``kvtier.routing``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore.format.chunk import Buffer, LayerSlice, StreamData
from kvstore.format.errors import (
    DeadlineExceeded,
    InvalidRequest,
    KVTierError,
    MissingChunks,
    SharedMemoryUnavailable,
    StaleGeneration,
    TierUnavailable,
    UnknownLayout,
    shown,
)
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import chunk_digest, dedupe_scope
from kvstore.format.layout import LayoutSpec, layout_to_json
from kvstore.format.model_identity import check_model
from kvtier import codec as cc
from kvtier import replies, shm
from kvtier.channel import LOOPBACK, Credentials, tls_mismatch
from kvtier.errors import client_deadline_passed, error_from_rpc
from kvtier.known_layouts import KnownLayouts, info_from
from kvtier.prefix_chunks import keyed, read_once, unheld, write_header, write_once
from kvtier.routing import Node, Ref, Router, RoutingPolicy, open_node
from kvtier.types import (
    DeleteResult,
    DrainProgress,
    EvictResult,
    ForkResult,
    LayoutInfo,
    PrefetchResult,
    ReadChunksResult,
    RestoredSession,
    RetryPolicy,
    SessionInfo,
    SpillResult,
    StatResult,
    TokenIds,
    WriteChunksResult,
)
from kvtier.upload import Item, upload
from proto import kvtier_pb2 as pb

Reply = TypeVar("Reply")
ACKS = {"memory": pb.ACK_MEMORY, "durable": pb.ACK_DURABLE, None: pb.ACK_UNSPECIFIED}
# Every call's deadline unless the caller sets one: retries and failovers included, so a
# hung node costs a call at most this (on a fleet, its share of it), never for ever.
DEFAULT_TIMEOUT_S = 60.0


class AsyncClient:
    def __init__(self, target: str | None = None, *, servers: Sequence[str] | None = None,
                 shared_memory: bool | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float | None = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = 64 << 20, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, routing: RoutingPolicy = RoutingPolicy()) -> None:
        """``target``: one server (default ``127.0.0.1:50051``); or ``servers``: a fleet's
        nodes, each call routed to one of them (``kvtier.routing``), with the same TLS and
        token for every node. ``tls_ca``, ``tls_cert`` + ``tls_key``, ``token``: see
        ``kvtier.channel``. ``timeout_s``: the deadline of a whole call, every retry and
        failover included (``DeadlineExceeded`` past it); None: no deadline, so a hung
        node hangs the call."""
        if target is not None and servers is not None:
            raise ValueError("give target or servers=, not both")
        if servers is not None and not servers:
            raise ValueError("servers= names no server")
        addresses = list(servers) if servers is not None else [target or "127.0.0.1:50051"]
        self.target = addresses[0]
        self.servers = addresses
        self.shared_memory = (shm.available()
                              and all(a.startswith(LOOPBACK) for a in addresses)
                              if shared_memory is None else shared_memory)
        self.retry = retry
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self._credentials = credentials = Credentials(tls_ca, tls_cert, tls_key, token)
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Reconnect about as fast as calls are retried (gRPC's default waits 1 s+).
            ("grpc.initial_reconnect_backoff_ms", int(retry.initial_backoff_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(retry.max_backoff_s * 1000))]
        self._router = Router([open_node(a, credentials, options) for a in addresses], routing)
        # Per session: chain key -> digest of the chunks the server acknowledged.
        self._held: dict[tuple[str, str], dict[str, bytes]] = {}
        # (tenant, scope, layout, model) -> chain key -> digest, from the latest lookup
        self._looked_up: dict[tuple[str, str, str, str], dict[str, bytes]] = {}
        self._layouts = KnownLayouts()  # this process's and those the server listed

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every node's channel and give its shared-memory segments back."""
        for node in self._router.nodes:
            await node.segments.close()
            await node.channel.close()

    def _deadline(self, started: float | None = None) -> float | None:
        """The ``time.monotonic()`` a call started at ``started`` (None: now) must end by
        (None: no deadline)."""
        if self.timeout_s is None:
            return None
        return (time.monotonic() if started is None else started) + self.timeout_s

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    async def _call(self, attempt: Callable[[Node], Awaitable[Reply]], ref: Ref | None = None,  # noqa: C901 - each way an attempt ends, in the one retry loop
                    ask: bool = True, idempotent: bool = True, started: float | None = None
                    ) -> Reply:
        """``attempt(node)`` on the node ``ref`` routes to (``Router.route``), retried on
        UNAVAILABLE with backoff; with ``servers``, the retry goes to another node at once
        while one is up. The whole call ends within ``timeout_s``: each attempt waits for
        its node at most ``Router.share`` of the time left, and a node silent that long is
        down like one refusing (``_hung``); ``started``: when the caller's call began, if
        this is its second part (a spill sent again whole)."""
        deadline = self._deadline(started)
        delays = self.retry.delays()
        leases_lost = False
        while True:
            node = await self._router.route(ref, ask, deadline)
            share = self._router.share(self._left(deadline))
            try:
                return await asyncio.wait_for(attempt(node), share)
            except SharedMemoryUnavailable:
                if not self.shared_memory:
                    raise
                self.shared_memory = False  # not the same host after all: bytes inline
                continue
            except TimeoutError:
                self._hung(node, ref, share, deadline, idempotent)
                continue
            except grpc.aio.UsageError as exc:  # gRPC's word for a call on a closed channel
                raise TierUnavailable("this kvtier client is closed") from exc
            except grpc.aio.AioRpcError as exc:
                if client_deadline_passed(exc):
                    self._hung(node, ref, share, deadline, idempotent, exc)
                    continue
                delay = next(delays, None)
                error = error_from_rpc(exc)
                if isinstance(error, SharedMemoryUnavailable) and self.shared_memory:
                    # The server does not hold our lease (restarted, or it ran out): lease
                    # afresh once; refused again, the bytes go inline.
                    node.segments.forget()
                    self.shared_memory = not leases_lost
                    leases_lost = True
                    continue
                if exc.code() != grpc.StatusCode.UNAVAILABLE or delay is None:
                    raise await self._named(node, exc, error) from exc
                self._router.failed(node, ref)
                if self._router.routed and self._router.any_up():
                    continue  # another node is up: no wait
                self._wait_fits(node, delay, deadline, exc)
            await asyncio.sleep(delay)

    async def _named(self, node: Node, exc: grpc.aio.AioRpcError, error: KVTierError
                     ) -> KVTierError:
        """``error``, or for a connection TLS did not agree on, one that names that."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            return error
        problem = await tls_mismatch(node.address, self._credentials, exc.details() or "")
        return error if problem is None else TierUnavailable(f"{problem} ({error})")

    def _wait_fits(self, node: Node, delay: float, deadline: float | None,
                   exc: grpc.aio.AioRpcError) -> None:
        """``DeadlineExceeded`` when a backoff of ``delay`` before the retry would end past
        ``deadline``: the call says so now rather than sleep into it."""
        if deadline is not None and time.monotonic() + delay >= deadline:
            raise DeadlineExceeded(f"{node.address} is unavailable and the "
                                   f"{self.timeout_s:g} s deadline leaves no time to retry: "
                                   f"{error_from_rpc(exc)}") from exc

    def _hung(self, node: Node, ref: Ref | None, share: float | None,
              deadline: float | None, idempotent: bool, cause: BaseException | None = None
              ) -> None:
        """``node`` did not answer within ``share``: down for the cool-down, like one
        refusing. Returns when the call may go to another node; else raises
        ``DeadlineExceeded``: the deadline passed, no other node is up, or the call must
        not be sent twice (it may have been applied on the silent node)."""
        self._router.failed(node, ref)
        silent = f"{node.address} did not answer within {share or 0:.3g} s"
        if not idempotent:
            raise DeadlineExceeded(f"{silent}; the call may have been applied there, so it "
                                   "is not sent again") from cause
        if not self._router.routed or not self._router.any_up() or (
                self._left(deadline) or 0) <= 0:
            raise DeadlineExceeded(f"{silent}; the call's {self.timeout_s:g} s deadline "
                                   f"is spent (servers: {', '.join(self.servers)})") from cause

    # -- spill --

    async def spill(self, tenant: str, session_id: str, layout: str | LayoutSpec,
                    token_ids: TokenIds, persistent: cc.Streams | None = None, *,
                    chunks: list[bytes] | None = None, tail: bytes = b"",
                    window: cc.Streams | bytes | None = None,
                    generation: int, ack: str | None = None,
                    hint: ResumeHint | None = None, ttl_s: float = 0.0,
                    model_fingerprint: str = "", dedupe_domain: str = "") -> SpillResult:
        """Store a session. Give ``persistent`` streams (cut and encoded here) or already
        encoded ``chunks`` + ``tail``; ``window``: window streams or an encoded blob.

        ``model_fingerprint``: the weights/version id of the model whose KV this is
        (chunks of two fingerprints never dedupe; some layouts require one);
        ``dedupe_domain``: a shared domain the server lets this tenant use, "" for the
        tenant's own."""
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        if (persistent is None) == (chunks is None):
            raise ValueError("give exactly one of persistent= and chunks=")
        if window is not None and not isinstance(window, bytes | bytearray | memoryview):
            window = await asyncio.to_thread(cc.encode_window, spec, tokens, window)
        ref = (tenant, session_id)
        header = pb.SpillHeader(
            session=pb.SessionRef(tenant=tenant, session_id=session_id),
            layout_id=spec.layout_id, generation=generation, token_ids=tokens.tobytes(),
            ack=ACKS[ack], ttl_s=ttl_s, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain,
            tail_digest=chunk_digest(tail) if chunks is not None and tail else b"",
            window_digest=chunk_digest(window) if window is not None else b"",
            hint=None if hint is None else pb.ResumeHint(
                expected_pause_s=hint.expected_pause_s or 0.0, priority=hint.priority))
        scope = dedupe_scope(tenant, dedupe_domain or None)

        async def encode(held: dict[str, bytes]) -> cc.EncodedSession:
            if persistent is None:
                assert chunks is not None  # exactly one of them, checked above
                encoded = cc.encoded_chunks(spec, tokens, chunks, tail, scope=scope,
                                            model_fingerprint=model_fingerprint, held=held)
            else:
                encoded = await asyncio.to_thread(
                    cc.encode_session, spec, tokens, persistent, scope=scope,
                    model_fingerprint=model_fingerprint, held=held)
                header.tail_digest = chunk_digest(encoded.tail) if encoded.tail else b""
            encoded.window = window
            del header.chunk_keys[:], header.chunk_digests[:]
            header.chunk_keys.extend(encoded.keys)
            header.chunk_digests.extend(encoded.digests)
            return encoded

        # what the server holds (this session's last spill, a lookup): only a chunk whose
        # freshly computed digest is the held one goes without its bytes
        looked_up = self._looked_up.get((tenant, scope, spec.layout_id, model_fingerprint), {})
        encoded = await encode({**looked_up, **self._held.get(ref, {})})
        spilled_on: list[Node] = []

        async def spill_once(node: Node) -> pb.SpillReply:
            spilled_on[:] = [node]
            return await self._spill_once(node, header, encoded)

        started = time.monotonic()
        try:
            reply = await self._call(spill_once, ref, ask=False)
        except MissingChunks:
            encoded = await encode({})
            reply = await self._call(spill_once, ref, ask=False, started=started)
        self._router.remember(ref, spilled_on[0])  # its window is there now
        self._held[ref] = dict(zip(encoded.keys, encoded.digests, strict=True))
        return SpillResult(reply.generation, reply.tier, reply.chunks_written,
                           reply.chunks_deduped, len(encoded.chunks), reply.durable,
                           reply.bytes_received, reply.window_kept)

    async def _spill_once(self, node: Node, header: pb.SpillHeader, enc: cc.EncodedSession
                          ) -> pb.SpillReply:
        items = [Item("chunk", enc.keys[i], data) for i, data in sorted(enc.chunks.items())]
        if enc.tail:
            items.append(Item("tail", "", enc.tail))
        if enc.window is not None:
            items.append(Item("window", "", enc.window))
        return await upload(
            node, pb.SpillRequest(header=header), items,
            lambda item, payload: pb.SpillRequest(**{item.what: payload}),  # type: ignore[arg-type]
            lambda stream: node.stub.Spill(stream, timeout=self.timeout_s),
            shared_memory=self.shared_memory, max_message_bytes=self.max_message_bytes,
            timeout_s=self.timeout_s)

    # -- restore, resume --

    async def restore(self, tenant: str, session_id: str, *, want_window: bool = True,
                      decode: bool = True, model_fingerprint: str = "") -> RestoredSession:
        """The whole session; ``decode=False`` leaves the (verified) bytes undecoded.
        ``model_fingerprint``: the caller's model; a session spilled with another (or
        none) raises ``ModelMismatch``; "" takes it unchecked (``.model_fingerprint``
        says the session's)."""
        request = pb.RestoreRequest(session=pb.SessionRef(tenant=tenant, session_id=session_id),
                                    want_window=want_window,
                                    use_shared_memory=self.shared_memory,
                                    model_fingerprint=model_fingerprint)
        return await self._call(lambda node: self._receive(node, node.stub.Restore, request,
                                                           decode), (tenant, session_id))

    async def resume(self, tenant: str, session_id: str, *, replay_tokens: int = 0,
                     decode: bool = True, model_fingerprint: str = "") -> RestoredSession:
        """Restore, with the window rebuilt by bounded replay if it was dropped (only by
        weights of the session's fingerprint); ``model_fingerprint`` as in ``restore``."""
        request = pb.ResumeRequest(session=pb.SessionRef(tenant=tenant, session_id=session_id),
                                   replay_tokens=replay_tokens,
                                   use_shared_memory=self.shared_memory,
                                   model_fingerprint=model_fingerprint)
        ref = (tenant, session_id)
        session = await self._call(lambda node: self._receive(node, node.stub.Resume, request,
                                                              decode), ref)
        if session.replayed:  # its node did not hold the window: ask Stat again next time
            self._router.forget(ref)
        return session

    async def _receive(self, node: Node, method: Callable[..., Any],
                       request: pb.RestoreRequest | pb.ResumeRequest, decode: bool
                       ) -> RestoredSession:
        """One call; on the shared-memory path it offers a segment it holds (warm pages)
        as ``reply_lease``; the server writes into it, or into a new one it leases us."""
        request.use_shared_memory = self.shared_memory  # may have fallen back since
        offered = node.segments.for_reply() if self.shared_memory else None
        request.reply_lease = offered.lease_id if offered is not None else ""
        used = [offered] if offered is not None else []  # every segment this call touched
        started = time.monotonic()
        decoding: list[asyncio.Future[dict[str, StreamData]]] = []

        async def persistent(header: pb.SessionHeader, chunks: Sequence[replies.Body],
                             tail: replies.Body) -> None:
            # Every byte checked against what its spiller stated, whatever tier it came
            # from; then decoded while the rest (a replayed window) is still to come.
            cc.check_digests(chunks, header.chunk_digests, tail, header.tail_digest)
            if decode:
                spec = await self.layout(header.layout_id)
                tokens = cc.as_tokens(np.frombuffer(header.token_ids, dtype="<u4"))
                decoding.append(asyncio.ensure_future(asyncio.to_thread(
                    cc.decode_persistent, spec, tokens, chunks, tail)))

        try:
            header, chunks, tail, window, summary, segment = await replies.collect(
                method(request, timeout=self.timeout_s), node.segments, used, persistent,
                request.model_fingerprint)
        except Exception:  # the server may still be writing into them: never reuse them
            await node.segments.release(used)
            await asyncio.gather(*decoding, return_exceptions=True)
            raise
        except BaseException:  # cancelled: no call to release them, the server reaps them
            for held in used:
                held.close()
            for future in decoding:
                future.cancel()
            raise
        await node.segments.replied(used, segment, started)
        spec = await self.layout(header.layout_id)
        if not decode:
            return replies.restored_session(spec, header, chunks, tail, window, summary, None)
        return await asyncio.to_thread(replies.restored_session, spec, header, chunks, tail,
                                       window, summary, await decoding[0])

    async def restore_layers(self, tenant: str, session_id: str, *,  # noqa: C901 - one retry loop around one reply stream, its cases the stream's items
                             model_fingerprint: str = "") -> AsyncIterator[LayerSlice]:
        """Each (stream, layer) of the whole session as soon as it has arrived, layer 0 of
        every stream first: codes (entries, *codes_shape), scales (entries, groups);
        ``model_fingerprint`` as in ``restore``. Every section is checked against its
        chunk's table before it is used, and the digests of uncompressed chunks once the
        stream has ended, before the last layer is yielded (``cc.LayerAssembler``).

        UNAVAILABLE restarts the stream with backoff, like every call; layers already
        yielded are not yielded again, and a session that changed generation meanwhile
        raises StaleGeneration rather than mixing two versions."""
        request = pb.RestoreRequest(session=pb.SessionRef(tenant=tenant, session_id=session_id),
                                    layer_by_layer=True, model_fingerprint=model_fingerprint)
        ref = (tenant, session_id)
        deadline = self._deadline()
        delays = self.retry.delays()
        delivered: set[tuple[str, int]] = set()
        generation = None
        while True:
            assembler = None
            node = await self._router.route(ref, True, deadline)
            share = self._router.share(self._left(deadline))
            try:
                async for reply in node.stub.Restore(request, timeout=share):
                    kind = reply.WhichOneof("item")
                    if kind == "header":
                        check_model(model_fingerprint, reply.header.model_fingerprint,
                                    f"{tenant}/{session_id}")
                        if generation not in (None, reply.header.generation):
                            raise StaleGeneration(
                                f"session {tenant}/{session_id} changed from generation "
                                f"{generation} to {reply.header.generation} while its layers "
                                "were being restored")
                        generation = reply.header.generation
                        assembler = cc.LayerAssembler.for_header(
                            await self.layout(reply.header.layout_id), reply.header)
                    elif kind == "section":
                        if assembler is None:
                            raise InvalidRequest("a Restore reply sent a section before its "
                                                 "header")
                        done = assembler.add(reply.section)
                        if done is not None and (done.stream, done.layer) not in delivered:
                            delivered.add((done.stream, done.layer))
                            yield done
                last = assembler.finish() if assembler is not None else None
                if last is not None and (last.stream, last.layer) not in delivered:
                    yield last
                return
            except grpc.aio.AioRpcError as exc:
                if client_deadline_passed(exc):
                    self._hung(node, ref, share, deadline, True, exc)
                    continue
                delay = next(delays, None)
                if exc.code() != grpc.StatusCode.UNAVAILABLE or delay is None:
                    raise await self._named(node, exc, error_from_rpc(exc)) from exc
                self._router.failed(node, ref)
                self._wait_fits(node, delay, deadline, exc)
            await asyncio.sleep(delay)

    # -- layouts (kvtier.known_layouts) --

    async def layouts(self) -> list[LayoutInfo]:
        """Every layout the server serves (ListLayouts); each becomes known to this client."""
        reply = await self._call(lambda node: node.stub.ListLayouts(pb.ListLayoutsRequest(),
                                                                timeout=self.timeout_s))
        infos = [info_from(message) for message in reply.layouts]
        for info in infos:
            self._layouts.add(info)
        return infos

    async def register_layout(self, layout: LayoutSpec | str) -> str:
        """Have the server serve ``layout`` (a spec or any JSON encoding of one); its id.
        The same layout again is no error; a name the server knows with another shape is
        InvalidRequest, and the server's register_layouts may refuse the caller."""
        text = layout_to_json(layout) if isinstance(layout, LayoutSpec) else layout
        request = pb.RegisterLayoutRequest(layout_json=text)
        reply = await self._call(lambda node: node.stub.RegisterLayout(request,
                                                                   timeout=self.timeout_s))
        info = info_from(reply.layout)
        self._layouts.add(info)
        return info.layout_id

    async def layout(self, name_or_id: str) -> LayoutSpec:
        """The spec of a layout name or id: this process's, else the server's (listed
        once more when not yet known); UnknownLayout when neither has it."""
        spec = self._layouts.find(name_or_id)
        if spec is None:
            await self.layouts()
            spec = self._layouts.find(name_or_id)
        if spec is None:
            raise UnknownLayout(f"neither this process nor the server {self.target} knows "
                                f"layout {shown(name_or_id)}")
        return spec

    # -- prefix chunks (kvtier.prefix_chunks): of no session. A write is safe to send
    # again on another node: its chunks are content-addressed, a second copy a dedupe.

    async def write_chunks(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds,
                           chunks: Sequence[Buffer], *, first_chunk: int = 0,
                           model_fingerprint: str = "", dedupe_domain: str = "",
                           ack: str = "memory", skip_held: bool = True) -> WriteChunksResult:
        """Store encoded ``chunks`` (one per whole chunk of ``token_ids`` from ``first_chunk``)
        as cache of no session; ``skip_held``: send only those a Lookup does not find held
        with the same digest (``kvtier.prefix_chunks``)."""
        return await self._write(tenant, layout, token_ids, chunks, first_chunk,
                                 model_fingerprint, dedupe_domain, ack, skip_held, False)

    async def write_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                       token_ids: TokenIds, chunks: Sequence[bytes], *,
                                       model_fingerprint: str = "", dedupe_domain: str = "",
                                       ack: str = "memory", skip_held: bool = False
                                       ) -> WriteChunksResult:
        """``write_chunks`` of unrelated chunks in one call: ``chunks[i]`` is chunk 0 of the
        sequence ``token_ids[i * chunk_tokens:(i + 1) * chunk_tokens]`` (encoded at start
        token 0), keyed alone (``kvtier.prefix_chunks``)."""
        return await self._write(tenant, layout, token_ids, chunks, 0, model_fingerprint,
                                 dedupe_domain, ack, skip_held, True)

    async def _write(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds,
                     chunks: Sequence[Buffer], first_chunk: int, model_fingerprint: str,
                     dedupe_domain: str, ack: str, skip_held: bool, independent: bool
                     ) -> WriteChunksResult:
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        scope = dedupe_scope(tenant, dedupe_domain or None)
        keys, digests = keyed(spec, tokens, chunks, first_chunk, scope, model_fingerprint,
                              independent)
        header = write_header(spec, tenant, tokens, digests, first_chunk=first_chunk,
                              model_fingerprint=model_fingerprint, dedupe_domain=dedupe_domain,
                              ack=f"ACK_{ack.upper()}", independent=independent)
        send = list(range(len(chunks)))
        started = time.monotonic()  # the lookup, the write and its resend: one deadline
        if skip_held and chunks:
            lookup = pb.LookupRequest(tenant=tenant, layout_id=spec.layout_id,
                                      model_fingerprint=model_fingerprint,
                                      dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(),
                                      independent_chunks=independent)
            held: pb.LookupReply = await self._call(lambda node: node.stub.Lookup(lookup,
                                                                  timeout=self.timeout_s),
                                    started=started)
            send = unheld(held, keys, digests, first_chunk)

        def attempt(node: Node, send: Sequence[int] = send) -> Awaitable[WriteChunksResult]:
            return write_once(node, header, keys, chunks, send,
                              shared_memory=self.shared_memory, timeout_s=self.timeout_s,
                              max_message_bytes=self.max_message_bytes)

        try:
            return await self._call(attempt, started=started)
        except MissingChunks:  # one went since the lookup: send every chunk
            return await self._call(lambda node: attempt(node, range(len(chunks))),
                                    started=started)

    async def read_chunks(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds, *,
                          first_chunk: int = 0, max_chunks: int = 0, model_fingerprint: str = "",
                          dedupe_domain: str = "", digests: Sequence[bytes] | None = None,
                          use_shared_memory: bool | None = None,
                          check_digests: bool = True, in_place: bool = False
                          ) -> ReadChunksResult:
        """Chunks of ``token_ids`` by position (``max_chunks`` 0: every whole one), each
        verified again here; ``digests``: the expected ones, one per chunk read.
        ``check_digests`` False: each chunk's bytes are still checked whole against its own
        checksums (header, section table, xxh3 of the payload) and its token range, but its
        BLAKE2b digest is not recomputed: a caller that only needs intact KV of these tokens
        (the vLLM connector) skips the costliest check, which only another version of the
        same tokens' chunk would fail. ``in_place``: over shared memory the chunks are
        views of the reply segment, valid until the caller calls the result's ``release``
        (it must, once done with them); inline they are the reply's bytes."""
        return await self._read(tenant, layout, token_ids, first_chunk, max_chunks,
                                model_fingerprint, dedupe_domain, digests, use_shared_memory,
                                check_digests, in_place, False)

    async def read_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                      token_ids: TokenIds, *, model_fingerprint: str = "",
                                      dedupe_domain: str = "",
                                      use_shared_memory: bool | None = None,
                                      check_digests: bool = True, in_place: bool = False
                                      ) -> ReadChunksResult:
        """``read_chunks`` of unrelated chunks in one call: chunk ``i`` of the result is
        chunk 0 of the sequence ``token_ids[i * chunk_tokens:(i + 1) * chunk_tokens]``, read
        and checked alone (``kvtier.prefix_chunks``); a missing or corrupt one is missing
        alone."""
        return await self._read(tenant, layout, token_ids, 0, 0, model_fingerprint,
                                dedupe_domain, None, use_shared_memory, check_digests,
                                in_place, True)

    async def _read(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds,
                    first_chunk: int, max_chunks: int, model_fingerprint: str,
                    dedupe_domain: str, digests: Sequence[bytes] | None,
                    use_shared_memory: bool | None, check_digests: bool, in_place: bool,
                    independent: bool) -> ReadChunksResult:
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        request = pb.ReadChunksRequest(
            tenant=tenant, layout_id=spec.layout_id, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(), first_chunk=first_chunk,
            max_chunks=max_chunks, chunk_digests=digests or [],
            independent_chunks=independent)

        def attempt(node: Node) -> Awaitable[ReadChunksResult]:
            request.use_shared_memory = (self.shared_memory if use_shared_memory is None
                                         else use_shared_memory and self.shared_memory)
            return read_once(node, request, spec, tokens, self.timeout_s, check_digests,
                             in_place)

        return await self._call(attempt)

    async def lookup_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                        token_ids: TokenIds, *, model_fingerprint: str = "",
                                        dedupe_domain: str = "") -> list[bool]:
        """Whether the server holds each whole chunk of ``token_ids``, each keyed alone
        (as ``write_independent_chunks`` wrote it) in the caller's domain: one Lookup."""
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        request = pb.LookupRequest(tenant=tenant, layout_id=spec.layout_id,
                                   model_fingerprint=model_fingerprint,
                                   dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(),
                                   independent_chunks=True)
        reply: pb.LookupReply = await self._call(
            lambda node: node.stub.Lookup(request, timeout=self.timeout_s))
        held = [False] * (len(tokens) // spec.chunk_tokens)
        for chunk in reply.chunks:
            if chunk.index >= len(held):
                raise InvalidRequest(f"a Lookup reply names chunk {chunk.index} of "
                                     f"{len(held)}")
            held[chunk.index] = True
        return held

    # -- control --

    def _ref(self, tenant: str, session_id: str) -> pb.SessionRef:
        return pb.SessionRef(tenant=tenant, session_id=session_id)

    async def prefetch(self, tenant: str, session_id: str, *, timeout_s: float = 0.0,
                       target_tier: str = "") -> PrefetchResult:
        """Bring a session's blocks up to ``target_tier`` ("": the fastest) ahead of a
        restore; waits at most ``timeout_s`` (0: the server's choice) for them."""
        request = pb.PrefetchRequest(session=self._ref(tenant, session_id), timeout_s=timeout_s,
                                     target_tier=target_tier)
        reply = await self._call(lambda node: node.stub.Prefetch(request,
                                                                 timeout=self.timeout_s),
                                 (tenant, session_id))
        return replies.value(PrefetchResult, reply)

    async def evict(self, tenant: str, session_id: str, target_tier: str = ""
                    ) -> EvictResult:
        """Demote a session's blocks to ``target_tier`` (e.g. "disk", "object")."""
        request = pb.EvictRequest(session=self._ref(tenant, session_id), target_tier=target_tier)
        reply = await self._call(lambda node: node.stub.Evict(request, timeout=self.timeout_s),
                                 (tenant, session_id))
        return replies.value(EvictResult, reply)

    async def delete(self, tenant: str, session_id: str) -> DeleteResult:
        """Delete a session; chunks no other session references are freed."""
        self._held.pop((tenant, session_id), None)
        self._router.forget((tenant, session_id))
        request = pb.DeleteRequest(session=self._ref(tenant, session_id))
        # Not sent twice: a second Delete after one landed would answer NOT_FOUND.
        reply = await self._call(lambda node: node.stub.Delete(request, timeout=self.timeout_s),
                                 idempotent=False)
        return replies.value(DeleteResult, reply)

    async def lookup(self, tenant: str, layout: str | LayoutSpec, token_ids: TokenIds, *,
                     model: str | None = None, dedupe_domain: str = "") -> int:
        """Tokens of ``token_ids`` (whole chunks from the first) whose chunks the server
        holds in the tenant's (or the shared) dedupe domain. A later ``spill`` with the
        same layout, model and domain then sends only the chunks past that prefix."""
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        request = pb.LookupRequest(tenant=tenant, layout_id=spec.layout_id,
                                   model_fingerprint=model or "", dedupe_domain=dedupe_domain,
                                   token_ids=cc.as_tokens(token_ids).tobytes())
        reply: pb.LookupReply = await self._call(
            lambda node: node.stub.Lookup(request, timeout=self.timeout_s))
        scope = dedupe_scope(tenant, dedupe_domain or None)
        # the latest lookup per domain, layout and model: what a spill may name by key
        self._looked_up[(tenant, scope, spec.layout_id, model or "")] = {
            chunk.chunk_key: chunk.digest for chunk in reply.chunks}
        return reply.tokens_held

    async def fork(self, tenant: str, source_session: str, new_session: str, *,
                   upto_tokens: int) -> ForkResult:
        """A new session (generation 1) sharing ``source_session``'s chunks up to
        ``upto_tokens`` rounded down to a chunk boundary (copy on write)."""
        request = pb.ForkRequest(source=self._ref(tenant, source_session),
                                 new_session_id=new_session, upto_tokens=upto_tokens)
        reply = await self._call(lambda node: node.stub.Fork(request, timeout=self.timeout_s),
                                 idempotent=False)  # a second Fork would find it made
        return replies.value(ForkResult, reply)

    async def stat(self, tenant: str = "", session_id: str = "", *,
                   usage_of: str = "", fleet: bool = False) -> StatResult:
        """Tiers and counters; with ``tenant``/``session_id`` also that session, with
        ``usage_of`` also that tenant's use against its quotas (``reply.tenant_usage``),
        with ``fleet`` the fleet's view of a fleet node (``reply.fleet``)."""
        request = pb.StatRequest(session=self._ref(tenant, session_id)
                                 if tenant or session_id else None, tenant=usage_of,
                                 fleet=fleet)
        reply = await self._call(lambda node: node.stub.Stat(request, timeout=self.timeout_s))
        return replies.value(StatResult, reply)

    async def drain(self, on_progress: Callable[[DrainProgress], None] | None = None, *,
                    progress_interval_s: float = 1.0) -> DrainProgress:
        """Drain the server before it stops (admin; ``kvtier drain``): it refuses new
        writes (UNAVAILABLE), makes every memory-acked session durable and, in a fleet,
        releases the windows it holds. ``on_progress`` is told each progress message
        (at least every ``progress_interval_s``); returns the last, ``done`` once nothing
        of a session depends on the node. One server only: the node to stop."""
        if self._router.routed:
            raise InvalidRequest("drain one node: Client(address) of the node to stop")
        request = pb.DrainRequest(progress_interval_s=progress_interval_s)

        async def follow(node: Node) -> DrainProgress:
            last = replies.value(DrainProgress, pb.DrainProgress())
            async for step in node.stub.Drain(request, timeout=self.timeout_s):
                last = replies.value(DrainProgress, step)
                if on_progress is not None:
                    on_progress(last)
            return last

        return await self._call(follow)

    async def list(self, tenant: str = "", *, page_size: int = 0) -> list[SessionInfo]:
        """Every session (of one tenant), following pages."""
        out: list[SessionInfo] = []
        token = ""
        while True:
            request = pb.ListRequest(tenant=tenant, page_size=page_size, page_token=token)

            def page(node: Node, request: pb.ListRequest = request) -> Awaitable[pb.ListReply]:
                return node.stub.List(request, timeout=self.timeout_s)  # type: ignore[no-any-return]

            reply = await self._call(page)
            out.extend(replies.value(SessionInfo, s) for s in reply.sessions)
            token = reply.next_page_token
            if not token:
                return out

