"""Spill and Restore of whole chunks: every byte back as sent, in the stated order, with
the digests the spill stated (docs/wire-format.md sections 3, 4 and 6)."""

from __future__ import annotations

from kvstore.format.keys import chunk_digest
from kvtier.conformance.harness import Context, Replies, expect
from kvtier.conformance.sessions import LAYOUT, Session, build


def check_whole(session: Session, got: Replies, *, window: bool) -> None:
    """A whole-chunk restore of ``session``: order, bytes, keys and digests."""
    h = got.head()
    n = len(session.chunks)
    want = ["header", *["chunk"] * n, *(["tail"] if session.tail else []),
            *(["window"] if window else []), "summary"]
    expect(got.kinds == want, f"reply order {got.kinds}, expected {want}")
    expect(h.layout_id == session.spec.layout_id and h.num_tokens == len(session.tokens)
           and h.token_ids == session.tokens.tobytes(),
           "the header's layout_id, num_tokens or token_ids are not the session's")
    expect(list(h.chunk_keys) == session.keys and list(h.chunk_digests) == session.digests,
           "the header's chunk_keys / chunk_digests are not the spill's")
    expect(h.tail_digest == (chunk_digest(session.tail) if session.tail else b""),
           "the header's tail_digest is not the spill's")
    for i, chunk in enumerate(got.chunks):
        expect(chunk.index == i and chunk.payload.key == session.keys[i],
               f"restored chunk {i} has index {chunk.index} and key {chunk.payload.key!r}")
        expect(chunk.payload.data == session.chunks[i], f"restored chunk {i} differs")
    expect(not session.tail or got.tails == [session.tail], "the restored tail differs")
    if window:
        expect(got.windows == [session.window], "the restored window differs")
        expect(session.window is not None and h.window_digest == chunk_digest(session.window),
               "the header's window_digest is not the window's")


async def round_trip(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 1)
    sid = ctx.session_id("roundtrip")
    reply = await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    expect(reply.generation == 1, f"SpillReply.generation {reply.generation}, expected 1")
    check_whole(session, await ctx.restore(sid, want_window=True), window=True)
    again = await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    expect(again == reply, "a retried Spill (same generation and content) was not "
                           f"answered as the first: {again} vs {reply}")
    return "2 chunks, tail, window back byte for byte; a retry answered as the first"


async def zstd_round_trip(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 10, ctx.tenant, 2, zstd_level=3, window=False)
    sid = ctx.session_id("zstd")
    await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    check_whole(session, await ctx.restore(sid), window=False)
    return "zstd chunks and tail back byte for byte"


CHECKS = [("spill/restore round trip", round_trip),
          ("zstd chunks round trip", zstd_round_trip)]
