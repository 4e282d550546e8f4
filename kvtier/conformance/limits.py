"""Message limits (docs/wire-format.md section 7): a restored chunk over gRPC's default
4 MiB receive limit reaches a client that raised it and fails, gRPC's RESOURCE_EXHAUSTED,
at one that did not; a request over the server's ``max_message_bytes`` is
RESOURCE_EXHAUSTED without a trailer."""

from __future__ import annotations

import grpc

from kvtier.conformance.harness import GRPC_DEFAULT_RECEIVE, Context, expect
from kvtier.conformance.sessions import LARGE, build
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc


async def receive_limit(ctx: Context) -> str:
    await ctx.register(LARGE)
    session = build(LARGE, LARGE.chunk_tokens, ctx.tenant, 15)
    size = len(session.chunks[0])
    expect(GRPC_DEFAULT_RECEIVE < size < ctx.max_message_bytes - 4096,
           f"the large chunk ({size} B) does not lie between the limits")
    sid = ctx.session_id("large")
    await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    got = await ctx.restore(sid)
    expect([c.payload.data for c in got.chunks] == session.chunks,
           "the large chunk did not come back byte for byte")
    channel = ctx.channel(GRPC_DEFAULT_RECEIVE)
    try:
        await ctx.refused(ctx.restore(sid, stub=pb_grpc.KVTierStub(channel)),
                          grpc.StatusCode.RESOURCE_EXHAUSTED, None)
    finally:
        await channel.close()
    over = pb.SpillRequest(chunk=pb.Payload(key=session.keys[0],
                                            data=bytes(ctx.max_message_bytes + 1)))
    await ctx.refused(ctx.spill([pb.SpillRequest(header=session.header(
        ctx.ref(ctx.session_id("over")))), over]), grpc.StatusCode.RESOURCE_EXHAUSTED, None)
    return (f"a {size} B chunk restores with the receive limit raised, not with gRPC's "
            f"4 MiB; a {ctx.max_message_bytes + 1} B message is RESOURCE_EXHAUSTED")


CHECKS = [("receive limit", receive_limit)]
