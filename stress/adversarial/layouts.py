"""The attacks on layouts at run time and prefix reuse (RegisterLayout, Lookup, Fork), one
coroutine each, as ``stress.adversarial.cases``' (``stress.adversarial`` runs both):

9a a tenant registers a layout under another tenant's layout name, and under a shipped
   preset's, with another shape; 9b a tenant's credential registers on a server whose
   ``register_layouts`` is ``admin``; 9c a tenant looks up another tenant's prompt (its
   own domain, and the victim's named as a dedupe domain); 9d a tenant forks another
   tenant's session, held and not. 9b and 9d run against a second server, with TLS and
   tokens (``Context.secured``). Each returns what it saw and ``held``.
"""

from __future__ import annotations

import json

from kvstore.format.layout import layout_from_json
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from stress.adversarial.cases import Context, status
from stress.fuzz.pool import LAYOUT, encode, random_streams, token_ids
from testing.live_server import Credentials, channel, client


def _layout(name: str, dim: int) -> str:
    return json.dumps({"name": name, "chunk_tokens": 16,
                       "streams": [{"name": "kv", "entry_shape": [dim], "bits": 16}]})


async def _register(stub, text: str, metadata=None) -> tuple[str, str]:
    return await status(stub.RegisterLayout(pb.RegisterLayoutRequest(layout_json=text),
                                            metadata=metadata))


async def _listed(stub, metadata=None) -> dict[str, str]:
    """Layout name -> id, as ListLayouts answers."""
    reply = await stub.ListLayouts(pb.ListLayoutsRequest(), metadata=metadata)
    return {info.layout_id.partition("@")[0]: info.layout_id for info in reply.layouts}


async def layout_name_collision(ctx: Context) -> dict:
    """acme registers a layout and spills a session of it; evil registers the same name
    with another shape, and kvtier-bundled's name with another shape: both refused,
    acme's layout, the preset and acme's session as they were. evil sending acme's very
    JSON is answered as a retry (created false): a layout is a shape, not a secret."""
    name, sid = f"acme-model-{ctx.n}", ctx.sid("own")
    tokens = token_ids(2 * 16, 31)
    streams = random_streams(layout_from_json(_layout(name, 8)), len(tokens), 31)
    async with channel(ctx.live.target, 1) as ch, client(ctx.live.target) as kv:
        stub = pb_grpc.KVTierStub(ch)
        first = await stub.RegisterLayout(pb.RegisterLayoutRequest(
            layout_json=_layout(name, 8)))
        spec_id = first.layout.layout_id
        await kv.spill("acme", sid, name, tokens, streams, generation=1)
        theirs = await _register(stub, _layout(name, 16))
        builtin = await _register(stub, _layout(LAYOUT.name, 16))
        same = await stub.RegisterLayout(pb.RegisterLayoutRequest(layout_json=_layout(name, 8)))
        listed = await _listed(stub)
        got = await kv.restore("acme", sid)
    intact = listed.get(name) == spec_id and listed.get(LAYOUT.name) == LAYOUT.layout_id
    restored = bool(got.persistent["kv"].codes.equal(streams["kv"].codes))
    held = (theirs[0] == builtin[0] == "INVALID_ARGUMENT" and intact and restored
            and not same.created and same.layout.layout_id == spec_id)
    return {"held": held, "other_shape_same_name": theirs[0], "builtin_name": builtin[0],
            "same_json_created": same.created, "layouts_intact": intact,
            "session_restored": restored}


async def register_admin_only(ctx: Context) -> dict:
    """register_layouts = "admin": a tenant's token, no token and a forged one are
    refused (PERMISSION_DENIED, UNAUTHENTICATED) and list nothing new; an admin's
    registers."""
    live = ctx.secured()
    tokens = live.creds.tokens
    name = f"tenant-made-{ctx.n}"
    async with channel(live.target, 1, live.creds) as ch:
        stub = pb_grpc.KVTierStub(ch)
        codes = {who: (await _register(stub, _layout(name, 8), metadata))[0]
                 for who, metadata in (("tenant", Credentials.bearer(tokens["acme"])),
                                       ("none", None),
                                       ("forged", Credentials.bearer(tokens["acme"] + "x")))}
        listed = await _listed(stub, Credentials.bearer(tokens["acme"]))
        admin = (await _register(stub, _layout(f"admin-made-{ctx.n}", 8),
                                 Credentials.bearer(tokens["admin"])))[0]
    held = (codes == {"tenant": "PERMISSION_DENIED", "none": "UNAUTHENTICATED",
                      "forged": "UNAUTHENTICATED"} and name not in listed and admin == "OK")
    return {"held": held, "codes": codes, "listed_after_refusals": name in listed,
            "admin": admin}


async def lookup_foreign_prefix(ctx: Context) -> dict:
    """victim spills a prompt; evil looks it up in its own domain (0 held), names the
    victim's tenant as a dedupe domain (PERMISSION_DENIED); after evil spills the same
    tokens itself, it finds its own chunks and the victim still restores its bytes."""
    tokens = token_ids(3 * LAYOUT.chunk_tokens, 32)
    victim, evil = encode(tokens, 33, window=False), encode(tokens, 34, window=False)
    sid = ctx.sid("prompt")

    def lookup(stub, tenant: str, domain: str = ""):
        return status(stub.Lookup(pb.LookupRequest(tenant=tenant, layout_id=LAYOUT.name,
                                                   token_ids=tokens.tobytes(),
                                                   dedupe_domain=domain)))

    async with client(ctx.live.target) as kv, channel(ctx.live.target, 1) as ch:
        stub = pb_grpc.KVTierStub(ch)
        await kv.spill("victim", sid, LAYOUT.name, tokens, chunks=list(victim.chunks),
                       generation=1)
        own = await stub.Lookup(pb.LookupRequest(tenant="victim", layout_id=LAYOUT.name,
                                                 token_ids=tokens.tobytes()))
        probe = await stub.Lookup(pb.LookupRequest(tenant="evil", layout_id=LAYOUT.name,
                                                   token_ids=tokens.tobytes()))
        as_domain = (await lookup(stub, "evil", "victim"))[0]
        await kv.spill("evil", ctx.sid("copy"), LAYOUT.name, tokens, chunks=list(evil.chunks),
                       generation=1)
        after = await stub.Lookup(pb.LookupRequest(tenant="evil", layout_id=LAYOUT.name,
                                                   token_ids=tokens.tobytes()))
        got = await kv.restore("victim", sid, decode=False)
    victims = [bytes(c) for c in got.chunks] == list(victim.chunks)
    held = (own.tokens_held == len(tokens) and probe.tokens_held == 0 and not probe.chunks
            and as_domain == "PERMISSION_DENIED" and after.tokens_held == len(tokens)
            and victims)
    return {"held": held, "victim_held": own.tokens_held, "evil_held": probe.tokens_held,
            "victim_as_domain": as_domain, "evil_held_after_its_spill": after.tokens_held,
            "victim_restores_its_bytes": victims}


async def fork_foreign_session(ctx: Context) -> dict:
    """With identities, beta forks acme's session (held, and one that does not exist):
    PERMISSION_DENIED both, no session made; acme forks its own (OK)."""
    live = ctx.secured()
    tokens = token_ids(2 * LAYOUT.chunk_tokens + 9, 35)
    enc = encode(tokens, 36, window=False)
    sid = ctx.sid("s")
    async with client(live.target, live.creds, "acme") as acme:
        await acme.spill("acme", sid, LAYOUT.name, tokens, chunks=list(enc.chunks),
                         tail=enc.tail, generation=1)
        beta = Credentials.bearer(live.creds.tokens["beta"])
        async with channel(live.target, 1, live.creds) as ch:
            stub = pb_grpc.KVTierStub(ch)
            codes = {}
            for what, source in (("held", sid), ("missing", "no-such-session")):
                codes[what] = await status(stub.Fork(pb.ForkRequest(
                    source=pb.SessionRef(tenant="acme", session_id=source),
                    new_session_id=f"stolen-{ctx.n}", upto_tokens=LAYOUT.chunk_tokens),
                    metadata=beta))
            own = (await status(stub.Fork(pb.ForkRequest(
                source=pb.SessionRef(tenant="acme", session_id=sid),
                new_session_id=f"mine-{ctx.n}", upto_tokens=LAYOUT.chunk_tokens),
                metadata=Credentials.bearer(live.creds.tokens["acme"]))))[0]
        sessions = sorted(s.session.session_id for s in await acme.list())
    stolen = [s for s in sessions if s.startswith("stolen")]
    denied = {what: code for what, (code, _) in codes.items()}
    no_data = all(str(len(tokens)) not in details for _, details in codes.values())
    held = (denied == {"held": "PERMISSION_DENIED", "missing": "PERMISSION_DENIED"}
            and not stolen and own == "OK" and no_data)
    return {"held": held, "codes": denied, "sessions_made_by_beta": stolen,
            "details_name_no_length": no_data, "own_fork": own}


CASES = {
    "9a_layout_name_collision": layout_name_collision,
    "9b_register_admin_only": register_admin_only,
    "9c_lookup_foreign_prefix": lookup_foreign_prefix,
    "9d_fork_foreign_session": fork_foreign_session,
}
