"""Which node of a fleet a client's call goes to (``AsyncClient(servers=[...])``).

A session's resume, restore, prefetch and evict go to its home: the node whose memory
holds its window, as ``Stat`` names it (``window_node_address``, or ``window_node_id``
of a node this client has heard from), asked of the session's chosen node (below) once
and cached (an LRU of ``RoutingPolicy.entries`` sessions, each kept ``ttl_s``). An entry
is dropped when a call it routed fails with UNAVAILABLE or hangs, or its node served the
session by replay (it no longer held the window: the next call asks ``Stat`` again).

A session without a home among ``servers`` goes to its chosen node: a stable hash of
tenant and session id over ``servers``, so one session's calls keep to one node and
sessions spread over the fleet. A spill goes to the cached home, else the chosen node
(no ``Stat``), and its node is the home after. Calls naming no session go to the first
node up. A node failing with UNAVAILABLE, or silent for its share of the call's deadline
(``share``: the time left split evenly over the nodes up, so a hung node leaves the
others their turn), is down for ``cooldown_s``: calls skip it while another is up, the
call goes to another node at once (one of ``RetryPolicy.attempts``), and once the
cool-down is over the node is tried again.

Routing only chooses the node: every node answers every call from the fleet's shared
metadata, so a stale route costs time (a replay), never a wrong tensor.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvtier import shm
from kvtier.channel import Credentials, open_channel
from kvtier.errors import client_deadline_passed
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class RoutingPolicy:
    entries: int = 4096      # sessions whose home is cached
    ttl_s: float = 30.0      # how long a cached home is trusted
    cooldown_s: float = 5.0  # how long a node that failed or hung is skipped


@dataclass(eq=False)
class Node:
    """One server of ``servers``: its channel, stub and shared-memory segments."""
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.KVTierStub
    segments: shm.ClientSegments
    node_id: str = ""  # as its Stat replies name it, once one came
    down_until: float = 0.0  # monotonic time it is up again


def open_node(address: str, credentials: Credentials, options: Sequence[tuple[str, object]]
              ) -> Node:
    channel = open_channel(address, credentials, options=options)
    stub = pb_grpc.KVTierStub(channel)
    return Node(address, channel, stub, shm.ClientSegments(stub))


Ref = tuple[str, str]  # (tenant, session_id)


def hashed_node(ref: Ref, nodes: int) -> int:
    """The index, among ``nodes`` nodes, of the one a session is routed to when it has
    no home: a stable hash of tenant and session id (a draining node offers the
    session's window to the same one first)."""
    digest = hashlib.blake2b("/".join(ref).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % nodes


class Router:
    def __init__(self, nodes: list[Node], policy: RoutingPolicy = RoutingPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nodes = nodes
        self.policy = policy
        self._clock = clock
        self._homes: OrderedDict[Ref, tuple[Node, float]] = OrderedDict()  # -> (node, expiry)

    @property
    def routed(self) -> bool:
        """Whether there is a choice to make (one server: every call goes to it)."""
        return len(self.nodes) > 1

    def _up(self, node: Node) -> bool:
        return bool(node.down_until <= self._clock())

    def _first_up(self, start: int) -> Node:
        n = len(self.nodes)
        for i in range(n):
            node = self.nodes[(start + i) % n]
            if self._up(node):
                return node
        return min(self.nodes, key=lambda node: node.down_until)  # all down: the soonest back

    def any(self) -> Node:
        return self._first_up(0)

    def any_up(self) -> bool:
        return any(self._up(node) for node in self.nodes)

    def chosen(self, ref: Ref) -> Node:
        return self._first_up(hashed_node(ref, len(self.nodes)))

    def cached(self, ref: Ref) -> Node | None:
        """The session's cached home, if fresh and up."""
        entry = self._homes.get(ref)
        if entry is None:
            return None
        node, expiry = entry
        if expiry <= self._clock() or not self._up(node):
            del self._homes[ref]
            return None
        self._homes.move_to_end(ref)
        return node

    def remember(self, ref: Ref, node: Node) -> None:
        self._homes[ref] = (node, self._clock() + self.policy.ttl_s)
        self._homes.move_to_end(ref)
        while len(self._homes) > self.policy.entries:
            self._homes.popitem(last=False)

    def forget(self, ref: Ref) -> None:
        self._homes.pop(ref, None)

    def share(self, left_s: float | None) -> float | None:
        """Seconds the next attempt may wait for its node, of ``left_s`` left to the call
        (None: no deadline): an even share over the nodes up, so that a node that hangs
        leaves each other one its turn."""
        if left_s is None or not self.routed:
            return left_s
        return left_s / max(1, sum(self._up(node) for node in self.nodes))

    def failed(self, node: Node, ref: Ref | None) -> None:
        """``node`` answered UNAVAILABLE or not in time: down for the cool-down, no
        session routed to it."""
        if not self.routed:
            return
        node.down_until = self._clock() + self.policy.cooldown_s
        if ref is not None:
            self.forget(ref)
        for stale in [r for r, (home, _) in self._homes.items() if home is node]:
            del self._homes[stale]

    async def route(self, ref: Ref | None, ask: bool, deadline: float | None) -> Node:
        """The node for a call about session ``ref`` (None: about none); ``ask``: ask Stat
        for a home not cached (a spill does not: its node becomes the home); ``deadline``:
        the call's, in ``time.monotonic()`` (None: none)."""
        if ref is None or not self.routed:
            return self.any()
        node = self.cached(ref)
        if node is None:
            node = (await self._look_up(ref, deadline) if ask else None) or self.chosen(ref)
            self.remember(ref, node)
        return node

    async def _look_up(self, ref: Ref, deadline: float | None) -> Node | None:
        """The session's home among the nodes, asked of Stat (None: none is)."""
        request = pb.StatRequest(session=pb.SessionRef(tenant=ref[0], session_id=ref[1]))
        for _ in self.nodes:
            asked = self.chosen(ref)  # spreads the lookups, and learns each node's id
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None  # the routed call then reports the deadline
            try:
                reply = await asked.stub.Stat(request, timeout=self.share(left))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE and not client_deadline_passed(exc):
                    return None  # the routed call itself then says what is wrong
                self.failed(asked, None)
                continue
            asked.node_id = reply.node_id
            return self._home(reply.session)
        return None

    def _home(self, info: pb.SessionInfo) -> Node | None:
        """The node of ``servers`` that Stat's ``info`` names as holding the window, if up."""
        for node in self.nodes:
            if (info.window_node_address and node.address == info.window_node_address) or (
                    info.window_node_id and node.node_id == info.window_node_id):
                return node if self._up(node) else None
        return None
