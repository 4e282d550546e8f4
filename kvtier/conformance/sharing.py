"""Prefix reuse: Lookup tells what the caller's domain holds, a Spill may name those
chunks by key and digest alone (never another digest), Fork shares them."""

from __future__ import annotations

import grpc

from kvtier.conformance.harness import Context, expect
from kvtier.conformance.sessions import LAYOUT, build
from proto import kvtier_pb2 as pb


async def lookup_and_dedupe(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 6)
    await ctx.spill(session.messages(session.header(ctx.ref(ctx.session_id("lookup")))))
    found = await ctx.stub.Lookup(pb.LookupRequest(
        tenant=ctx.tenant, layout_id=LAYOUT.layout_id, token_ids=session.tokens.tobytes()))
    expect(found.tokens_held == 8 and found.chunks_held == 2
           and [c.chunk_key for c in found.chunks] == session.keys
           and [c.digest for c in found.chunks] == session.digests,
           f"Lookup of the spilled tokens: {found.tokens_held} tokens, "
           f"{found.chunks_held} chunks")
    other = build(LAYOUT, 11, ctx.tenant, 7)
    none = await ctx.stub.Lookup(pb.LookupRequest(
        tenant=ctx.tenant, layout_id=LAYOUT.layout_id, token_ids=other.tokens.tobytes()))
    expect(none.tokens_held == 0, f"Lookup of unknown tokens holds {none.tokens_held}")
    named = await ctx.spill(session.messages(
        session.header(ctx.ref(ctx.session_id("named"))), send=set()))
    expect(named.chunks_deduped == 2, f"chunks named by key: {named.chunks_deduped} "
                                      "deduped, expected 2")
    wrong = session.header(ctx.ref(ctx.session_id("wrong")),
                           chunk_digests=[bytes(32), *session.digests[1:]])
    await ctx.refused(ctx.spill(session.messages(wrong, send={1})),
                      grpc.StatusCode.FAILED_PRECONDITION, "MissingChunks")
    return "Lookup finds 2 chunks; named by key they dedupe; another digest is MissingChunks"


async def fork(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 8)
    source = ctx.session_id("fork-source")
    await ctx.spill(session.messages(session.header(ctx.ref(source))))
    prefix = ctx.session_id("fork-prefix")
    reply = await ctx.stub.Fork(pb.ForkRequest(source=ctx.ref(source), new_session_id=prefix,
                                               upto_tokens=9))
    expect(reply.generation == 1 and reply.num_tokens == 8 and reply.chunks == 2,
           f"Fork up to 9 tokens: {reply}")
    got = await ctx.restore(prefix)
    expect([c.payload.data for c in got.chunks] == session.chunks and not got.tails,
           "the fork's chunks are not the source's")
    whole = ctx.session_id("fork-whole")
    await ctx.stub.Fork(pb.ForkRequest(source=ctx.ref(source), new_session_id=whole,
                                       upto_tokens=11))
    got = await ctx.restore(whole)
    expect(got.tails == [session.tail], "a fork at the source's length lacks its tail")
    await ctx.refused(ctx.stub.Fork(pb.ForkRequest(source=ctx.ref(source),
                                                   new_session_id=whole, upto_tokens=4)),
                      grpc.StatusCode.FAILED_PRECONDITION, "PreconditionFailed")
    return "forks share the chunks (and the tail at full length); an existing id refused"


CHECKS = [("lookup and dedupe by key and digest", lookup_and_dedupe), ("fork", fork)]
