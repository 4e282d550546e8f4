"""Windows moved between fleet nodes while one drains (``AdoptWindow``, role ``peer``;
docs/fleet.md "Liveness and draining").

The sender (``PeerMover``, the draining node's ``Draining.move``) picks a live peer for
each window: the fleet's nodes from their heartbeats (``kvstore.fleet.liveness``), those
``serving`` and not down, sorted by node id; first the one a router's hash of tenant and
session id picks among them (``kvtier.routing.Router.chosen``), then the others in turn.
It sends one header (the session, its generation, how the window was made, its own node
id, the window's digest and length) and the window's bytes, over the ``peer_tls_*``
settings with the token in ``peer_token_file``.

The receiver (``adopt``) trusts the sender for nothing it can check: the window's length
against the header and the layout's bound (``window_bytes_max``, before the window is
read), its digest (DATA_LOSS on a mismatch, nothing adopted), and through
``TierManager.adopt_window`` the stored manifest (the session must still be at that
generation with its window in the sender's memory: the tenant is the manifest's) and the
window against the layout and the manifest's token ids. Kept in its memory tiers like a
window it rebuilt; never written to a durable tier, so an encrypting node holds it as it
holds every window (in memory), and on the wire it is what TLS protects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvstore.fleet.liveness import NodeLiveness, read_nodes
from kvstore.fleet.shared_meta import SharedMetaStore
from kvstore.format.checks import window_bytes_max
from kvstore.format.errors import (
    DataLoss,
    InvalidRequest,
    KVTierError,
    SessionNotFound,
    StaleGeneration,
)
from kvstore.format.keys import chunk_digest
from kvstore.format.registry import get_layout
from kvstore.session.manager import TierManager
from kvstore.session.manifest import SessionManifest
from kvstore.tiers.base import Buffer
from kvtier.channel import Credentials, open_channel, token_from_file
from kvtier.errors import error_from_rpc
from kvtier.routing import hashed_node
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server import requests
from services.server import validate as check
from services.server.config import ServerConfig
from services.server.layout_registry import ServerLayouts

log = logging.getLogger(__name__)
PEER_CALL_S = 30.0  # one AdoptWindow: a window is at most a few MiB on a local network
# A peer that answers so will not adopt a later window of this drain either: not tried again.
PEER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                       grpc.StatusCode.PERMISSION_DENIED})


async def adopt(manager: TierManager, layouts: ServerLayouts, node_id: str,
                messages: AsyncIterator[pb.AdoptWindowRequest]) -> pb.AdoptWindowReply:
    """The receiver's side of ``AdoptWindow``: the header, then the window, checked."""
    header: pb.AdoptWindowHeader | None = None
    bound = 0
    window: bytes | None = None
    async for message in messages:
        kind = message.WhichOneof("item")
        if kind == "header":
            if header is not None:
                raise InvalidRequest("the header was sent twice")
            header = message.header
            bound = await _window_bound(manager, layouts, header)
        elif kind == "window":
            if header is None:
                raise InvalidRequest("the first message must be the header")
            if window is not None:
                raise InvalidRequest("the window was sent twice")
            window = message.window
        else:
            raise InvalidRequest("a message carries neither header nor window")
    if header is None or window is None:
        raise InvalidRequest("the stream ended before " + ("the header" if header is None
                                                           else "the window"))
    _check_window(header, window, bound)
    tenant, session_id = header.session.tenant, header.session.session_id
    tier = await manager.adopt_window(tenant, session_id, header.generation, window,
                                      replayed_tokens=header.window_replayed,
                                      from_node=header.from_node)
    requests.note(tier=tier or "", bytes=len(window), generation=header.generation)
    if tier is None:
        return pb.AdoptWindowReply(node_id=node_id, declined="no memory tier (or the "
                                   "tenant's memory_bytes quota) has room for it")
    log.info("adopted the window of %s/%s from node %s (%s)", tenant, session_id,
             header.from_node, tier)
    return pb.AdoptWindowReply(adopted=True, window_tier=tier, node_id=node_id)


async def _window_bound(manager: TierManager, layouts: ServerLayouts,
                        header: pb.AdoptWindowHeader) -> int:
    """The most bytes the session's window may take (``window_bytes_max`` of the stored
    manifest's layout); ``InvalidRequest`` for a header past it or naming no session."""
    tenant, session_id = check.session_ref(header.session, field_name="header.session")
    requests.note(tenant=tenant, session=session_id)
    if not header.from_node or len(header.from_node) > 256:
        raise InvalidRequest("header.from_node must name the sending node (at most 256 "
                             "characters)")
    if len(header.window_digest) != 32:
        raise InvalidRequest("header.window_digest must be the 32-byte BLAKE2b-256 of the "
                             "window (kvstore.format.keys.chunk_digest)")
    manifest = await manager.store.catalog.load_required(tenant, session_id)
    await layouts.resolve(manifest.layout_id)  # a layout another node registered
    bound = window_bytes_max(get_layout(manifest.layout_id))
    if not 0 < header.window_bytes <= bound:
        raise InvalidRequest(f"header.window_bytes {header.window_bytes}: layout "
                             f"{manifest.layout_id} encodes a window in 1 to {bound} B")
    return bound


def _check_window(header: pb.AdoptWindowHeader, window: bytes, bound: int) -> None:
    """The window is as long as the header says and has the digest it states."""
    if len(window) != header.window_bytes or len(window) > bound:
        raise InvalidRequest(f"the window is {len(window)} B; the header says "
                             f"{header.window_bytes} B (at most {bound} B)")
    if chunk_digest(window) != header.window_digest:
        raise DataLoss("the window's bytes do not have the digest header.window_digest "
                       "states: nothing adopted")


def peer_credentials(config: ServerConfig) -> Credentials:
    """How this node reaches its peers: ``peer_tls_*`` and the token in
    ``peer_token_file``, read now (a rotated token is used by the next drain)."""
    return Credentials(config.peer_tls_ca or None, config.peer_tls_cert or None,
                       config.peer_tls_key or None,
                       token_from_file("peer_token_file", config.peer_token_file))


def peer_order(nodes: list[NodeLiveness], tenant: str, session_id: str
               ) -> list[NodeLiveness]:
    """``nodes`` (sorted by id) from the one a router's hash of the session picks."""
    if not nodes:
        return []
    start = hashed_node((tenant, session_id), len(nodes))
    return nodes[start:] + nodes[:start]


class PeerMover:
    """The draining node's ``Draining.move``: a window to the first live peer that
    adopts it. A peer that cannot be reached, or refuses this node's credential or the
    RPC itself (an older build), is skipped for the rest of the drain."""

    def __init__(self, meta: SharedMetaStore, config: ServerConfig, node_id: str) -> None:
        self._meta = meta
        self._config = config
        self._node_id = node_id
        self._nodes: list[NodeLiveness] = []
        self._read_at = -float("inf")
        self._unreachable: set[str] = set()
        self._stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.KVTierStub]] = {}
        self._credentials: Credentials | None = None

    async def _live(self) -> list[NodeLiveness]:
        """The peers that may adopt a window: serving, not down, not this node; the
        heartbeats read again at most once per ``fleet_heartbeat_s``."""
        now = time.monotonic()
        if now - self._read_at >= self._config.fleet_heartbeat_s:
            self._nodes = list(await read_nodes(self._meta.io, self._meta.paths.root,
                                                down_after_s=self._config.fleet_down_after_s))
            self._read_at = now
        return sorted((n for n in self._nodes if n.state == "serving" and not n.down
                       and n.node_id != self._node_id and n.address
                       and n.node_id not in self._unreachable), key=lambda n: n.node_id)

    def _stub(self, node: NodeLiveness) -> pb_grpc.KVTierStub:
        if node.node_id not in self._stubs:
            if self._credentials is None:
                self._credentials = peer_credentials(self._config)
            channel = open_channel(node.address, self._credentials, options=[
                ("grpc.max_send_message_length", self._config.max_message_bytes)])
            self._stubs[node.node_id] = (channel, pb_grpc.KVTierStub(channel))
        return self._stubs[node.node_id][1]

    async def __call__(self, manifest: SessionManifest, window: Buffer) -> bool:
        data = bytes(window)
        header = pb.AdoptWindowHeader(
            session=pb.SessionRef(tenant=manifest.tenant, session_id=manifest.session_id),
            generation=manifest.generation, window_replayed=manifest.window_replayed,
            from_node=self._node_id, window_digest=chunk_digest(data), window_bytes=len(data))
        try:
            peers = peer_order(await self._live(), manifest.tenant, manifest.session_id)
        except KVTierError as exc:
            log.warning("drain: no fleet membership to move windows to: %s", exc)
            return False
        for node in peers:
            try:
                reply = await self._stub(node).AdoptWindow(
                    _stream(header, data), timeout=PEER_CALL_S)
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc, f"node {node.node_id}: ")
                if isinstance(error, StaleGeneration | SessionNotFound):
                    return False  # the session moved on: nothing of it is this node's
                if exc.code() in PEER_GONE:
                    self._unreachable.add(node.node_id)
                log.warning("drain: the window of %s/%s not moved to %s: %s", manifest.tenant,
                            manifest.session_id, node.node_id, error)
                continue
            except KVTierError as exc:  # this node's peer settings (a token file, a CA)
                log.warning("drain: no peer reached: %s", exc)
                return False
            if reply.adopted:
                return True
            log.info("drain: node %s declined the window of %s/%s: %s", node.node_id,
                     manifest.tenant, manifest.session_id, reply.declined)
        return False

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()


async def _stream(header: pb.AdoptWindowHeader, window: bytes
                  ) -> AsyncIterator[pb.AdoptWindowRequest]:
    yield pb.AdoptWindowRequest(header=header)
    yield pb.AdoptWindowRequest(window=window)
