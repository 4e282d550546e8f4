"""List pages: every session exactly once, in code point order of
``<tenant>/<session_id>``, following
opaque ``next_page_token``s; a token the server did not give is INVALID_ARGUMENT
(docs/wire-format.md section 6)."""

from __future__ import annotations

import grpc

from kvtier.conformance.harness import Context, expect
from kvtier.conformance.sessions import LAYOUT, build
from proto import kvtier_pb2 as pb


async def pages(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 8, ctx.tenant, 14, window=False)
    ours = [ctx.session_id(f"list-{i}") for i in range(3)]
    for sid in ours:
        await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    listed, token, calls = [], "", 0
    while True:
        reply = await ctx.stub.List(pb.ListRequest(tenant=ctx.tenant, page_size=2,
                                                   page_token=token))
        calls += 1
        expect(len(reply.sessions) <= 2, f"a page of {len(reply.sessions)} for page_size 2")
        listed += [f"{s.session.tenant}/{s.session.session_id}" for s in reply.sessions]
        token = reply.next_page_token
        if not token or calls > 10_000:
            break
    expect(listed == sorted(set(listed)), "List pages repeat or are out of order")
    expect(all(f"{ctx.tenant}/{sid}" in listed for sid in ours), "List pages lost a session")
    return f"{len(listed)} sessions in {calls} pages, each once, in order"


async def bad_token(ctx: Context) -> str:
    for token in ("not a token", "other-tenant/s1"):
        await ctx.refused(ctx.stub.List(pb.ListRequest(tenant=ctx.tenant, page_token=token)),
                          grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest")
    return "a page_token the server did not give is INVALID_ARGUMENT"


CHECKS = [("List pages", pages), ("List: bad page_token", bad_token)]
