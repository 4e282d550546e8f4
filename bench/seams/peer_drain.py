"""The fleet half of the ``drain`` event (shared metadata): a live peer node on the same
bucket and Redis, to which ``kvtier drain`` moves the drained node's windows
(``AdoptWindow``, role ``peer``).

Before the drain the peer RPC is called as an attacker would: with a tenant's token
(TLS combinations: PERMISSION_DENIED), and with a peer's credential a window whose bytes
are not the ones its digest names (DATA_LOSS) and a length past the layout's bound
(INVALID_ARGUMENT, refused on the header). After it, every session Stat names the peer
for must resume there without a replay (``replay_tokens`` 0) and with the window the
model holds, judged as any resume (a window a replay built is read back by a Restore:
a Resume asking a longer replay than the one that built it would rebuild it); the sessions so
named are at most ``windowsMoved``, and with the peer up and empty no window is
released. The peer stops (SIGTERM) before the drained node is killed.
"""

from __future__ import annotations

import asyncio
import re
import shutil

import grpc

from bench.seams.verdict import now
from bench.seams.world import Node
from kvstore.format.checks import window_bytes_max
from kvstore.format.errors import KVTierError
from kvstore.format.keys import chunk_digest
from kvtier import AsyncClient
from kvtier.channel import Credentials, open_channel
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc

PEER_SUFFIX = "-peer"


async def start_peer(sim) -> Node | None:
    """A second fleet node over the drained node's config (its own data directory and
    node id), started; None (and a finding) if it does not start."""
    text = sim.config_path.read_text()
    data = sim.root / "peer-data"
    shutil.rmtree(data, ignore_errors=True)
    text = re.sub(r'(?m)^data_dir = .*$', f'data_dir = "{data}"', text)
    text = re.sub(r'(?m)^node_id = "(.*)"$', rf'node_id = "\1{PEER_SUFFIX}"', text)
    config = sim.root / "serve-peer.toml"
    config.write_text(text)
    peer = Node(config, sim.root / "server-peer.log", {}, sim.creds if sim.combo.tls else None)
    if not await asyncio.to_thread(peer.start):
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "drain-peer", "-",
                       "a peer fleet node starts", peer.refusal)
        return None
    return peer


async def stop_peer(sim, peer: Node) -> None:
    await asyncio.to_thread(peer.stop)
    shutil.rmtree(sim.root / "peer-data", ignore_errors=True)


def _node_id(sim) -> str:
    return f"seams-{sim.combo.slug}"


async def _adopt(sim, target: str, who: str | None, header: pb.AdoptWindowHeader,
                 window: bytes) -> grpc.StatusCode:
    """One AdoptWindow call as ``who`` (a token's name; None: no credential)."""
    credentials = Credentials()
    if sim.combo.tls:
        credentials = Credentials(tls_ca=sim.creds.ca,
                                  token=sim.creds.tokens[who] if who else None)

    async def messages():
        yield pb.AdoptWindowRequest(header=header)
        yield pb.AdoptWindowRequest(window=window)

    async with open_channel(target, credentials) as channel:
        try:
            await pb_grpc.KVTierStub(channel).AdoptWindow(messages(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def hostile_calls(sim, peer: Node) -> None:
    """The peer RPC refused to a tenant, and for bytes its header does not describe."""
    sure = [h for h in sorted(sim.model.values(), key=lambda h: (h.tenant, h.sid))
            if not h.uncertain and not h.may_be_absent(now())]
    if not sure:
        return
    held = sure[0]
    garbage = bytes(sim.rng.getrandbits(8) for _ in range(64))
    header = pb.AdoptWindowHeader(
        session=pb.SessionRef(tenant=held.tenant, session_id=held.sid),
        generation=held.current.generation, from_node=_node_id(sim),
        window_digest=chunk_digest(b"other bytes"), window_bytes=len(garbage))
    big = pb.AdoptWindowHeader()
    big.CopyFrom(header)
    big.window_bytes = window_bytes_max(sim.spec(held.current.layout)) + 1
    calls = [("peer-digest", "peer", header, grpc.StatusCode.DATA_LOSS),
             ("peer-oversized", "peer", big, grpc.StatusCode.INVALID_ARGUMENT)]
    if sim.combo.tls:  # without tokens every caller is trusted alike
        calls.append(("peer-as-tenant", held.tenant, header,
                      grpc.StatusCode.PERMISSION_DENIED))
    for op, who, sent, want in calls:
        got = await _adopt(sim, peer.target, who, sent, garbage)
        sim.log(f"step={sim.step} {op} {held.tenant}/{held.sid}: {got.name}")
        if got != want:
            sim.ledger.add("unexpected", sim.combo.name, sim.step, op,
                           f"{held.tenant}/{held.sid}", want.name, got.name)


async def check_moved(sim, peer: Node, last: dict) -> None:
    """Every session Stat names the peer for resumes there as it was, with no replay."""
    peer_id = _node_id(sim) + PEER_SUFFIX
    moved, released = last.get("windowsMoved", 0), last.get("windowsReleased", 0)
    if released:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "drain-moved", "-",
                       "every window moved to the live peer", f"{released} released")
    options: dict = {"timeout_s": 60.0}
    named = 0
    for (tenant, sid), held in sorted(sim.model.items()):
        if held.may_be_absent(now()) or held.uncertain:
            continue
        name = f"{tenant}/{sid}"
        try:
            info = (await sim.client(tenant).stat(tenant, sid)).session
        except KVTierError as exc:
            sim.fail(exc, sim.step, "drained-stat", name, "its Stat")
            continue
        if info.window_node_id == _node_id(sim):
            sim.ledger.add("unexpected", sim.combo.name, sim.step, "drained-stat", name,
                           f"no window on the drained node ({peer_id} or none)",
                           f"window node {info.window_node_id}")
        if info.window_node_id != peer_id:
            continue
        named += 1
        if sim.combo.tls:
            options.update(tls_ca=sim.creds.ca, token=sim.creds.tokens[tenant])
        # The engine's own window is what any Resume returns; a replay's window moved
        # too, but a Resume whose R exceeds that replay's rebuilds it (documented), so
        # that one is read back by a Restore, which returns the stored window as it is.
        op = "moved-restore" if held.window_replayed else "moved-resume"
        try:
            async with AsyncClient(peer.target, **options) as kv:
                got = await (kv.restore(tenant, sid) if held.window_replayed
                             else kv.resume(tenant, sid))
        except KVTierError as exc:
            sim.fail(exc, sim.step, op, name, held.current.describe())
            continue
        if got.window is None or got.replayed or got.replay_tokens:
            sim.wrong(sim.step, op, name, "the moved window, no replay",
                      "no window" if got.window is None
                      else f"replayed {got.replay_tokens} tokens")
        sim.judge(sim.step, op, held, got, replay=None if held.window_replayed else 0)
    sim.log(f"step={sim.step} drain-moved: {named} sessions on {peer_id}, {moved} moved")
    if named > moved:
        sim.ledger.add("unexpected", sim.combo.name, sim.step, "drain-moved", "-",
                       f"at most windowsMoved = {moved} sessions named on the peer",
                       f"{named}")
