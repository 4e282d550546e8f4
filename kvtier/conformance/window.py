"""The window blob: its digest in the Restore header, and the pending rows' token count
(``n mod m`` of a persistent stream's m, ending at the last token) enforced on a Spill
(docs/wire-format.md section 3)."""

from __future__ import annotations

import grpc

from kvstore.format.keys import chunk_digest
from kvtier.conformance.harness import Context, expect
from kvtier.conformance.sessions import LAYOUT, build


async def window_digest(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 9, ctx.tenant, 4)
    sid = ctx.session_id("window")
    await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    got = await ctx.restore(sid, want_window=True)
    expect(got.windows == [session.window], "the restored window differs")
    expect(session.window is not None
           and got.head().window_digest == chunk_digest(session.window),
           "SessionHeader.window_digest is not the digest of the window sent")
    without = await ctx.restore(sid)
    expect(not without.windows and not without.head().window_digest,
           "a Restore without want_window sent a window or its digest")
    return "the header states the digest of the window it carries, and none without one"


async def pending_rows(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    # 12 tokens at m = 2: no pending row; a window carrying one is refused
    session = build(LAYOUT, 12, ctx.tenant, 5, pending=1)
    sid = ctx.session_id("pending")
    await ctx.refused(ctx.spill(session.messages(session.header(ctx.ref(sid)))),
                      grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest")
    await ctx.refused(ctx.restore(sid), grpc.StatusCode.NOT_FOUND, "SessionNotFound")
    return "a pending part of 1 token in a 12-token session (m = 2) is INVALID_ARGUMENT"


CHECKS = [("window digest", window_digest), ("pending rows: n mod m", pending_rows)]
