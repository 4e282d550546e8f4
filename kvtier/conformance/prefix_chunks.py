"""WriteChunks and ReadChunks (docs/wire-format.md section 6, "WriteChunks and
ReadChunks"; proto "Prefix chunks"): chain keys the server computes from token 0 in the
caller's scope, reads in index order with the bytes of the header's digests, a chunk not
held or not of the expected digest missing while the others arrive, refusals that store
nothing, dedupe with sessions both ways, and the golden vectors' messages as sent.

The checks of this suite's layout write chunks of tokens drawn from this run's id, so a
chunk an earlier run left retained on the server is never one a check expects absent.
The golden vectors' messages are sent as they are: tenant ``acme`` (the caller must be
allowed it); their shared domain may be refused PERMISSION_DENIED, as a server that does
not configure it for ``acme`` must.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvstore.format.errors import ERROR_KEY
from kvstore.format.keys import chain_keys, chunk_digest, dedupe_scope
from kvtier.conformance.golden import load_vectors
from kvtier.conformance.harness import Context, Failed, expect
from kvtier.conformance.roundtrip import check_whole
from kvtier.conformance.sessions import LAYOUT, Session, build
from proto import kvtier_pb2 as pb

C = LAYOUT.chunk_tokens
FINGERPRINT = "kvtier-conformance-model@1"
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@dataclass
class ChunkReplies:
    """A ReadChunks stream as it came: ``items`` after the header, in order, each
    (index, the RestoredChunk or the MissingChunk's reason)."""

    kinds: list[str] = field(default_factory=list)
    header: pb.ChunksHeader | None = None
    items: list[tuple[int, pb.RestoredChunk | str]] = field(default_factory=list)

    def head(self) -> pb.ChunksHeader:
        """The header; ``Failed`` when the stream sent none."""
        if self.header is None:
            raise Failed("the ReadChunks stream sent no header")
        return self.header


def _prefix(ctx: Context, what: int, num_tokens: int) -> Session:
    return build(LAYOUT, num_tokens, ctx.tenant, (int(ctx.run, 16), what), window=False)


def _keys(ctx: Context, session: Session, fingerprint: str = "", tenant: str = "") -> list[str]:
    return chain_keys(LAYOUT.layout_id, session.tokens, C,
                      scope=dedupe_scope(tenant or ctx.tenant), model_fingerprint=fingerprint)


def _header(ctx: Context, session: Session, first: int, count: int, fingerprint: str = "",
            **changes: Any) -> pb.WriteChunksHeader:
    """A header for the first ``count`` chunks of ``session``, from ``first`` on."""
    fields: dict[str, Any] = dict(tenant=ctx.tenant, layout_id=LAYOUT.layout_id,
                  model_fingerprint=fingerprint, token_ids=session.tokens[:count * C].tobytes(),
                  first_chunk=first, chunk_digests=session.digests[first:count])
    fields.update(changes)
    return pb.WriteChunksHeader(**fields)


async def _write(ctx: Context, header: pb.WriteChunksHeader,
                 payloads: list[tuple[str, bytes]]) -> pb.WriteChunksReply:
    async def messages() -> AsyncIterator[pb.WriteChunksRequest]:
        yield pb.WriteChunksRequest(header=header)
        for key, data in payloads:
            yield pb.WriteChunksRequest(chunk=pb.Payload(key=key, data=data))
    reply: pb.WriteChunksReply = await ctx.stub.WriteChunks(messages())
    return reply


async def _write_chunks(ctx: Context, session: Session, first: int, count: int,
                        fingerprint: str = "") -> pb.WriteChunksReply:
    """Chunks ``first`` .. ``count - 1`` of ``session``, every payload sent."""
    keys = _keys(ctx, session, fingerprint)
    return await _write(ctx, _header(ctx, session, first, count, fingerprint),
                        [(keys[i], session.chunks[i]) for i in range(first, count)])


async def _read(ctx: Context, tokens: bytes, fingerprint: str = "", **fields: Any
                ) -> ChunkReplies:
    request = pb.ReadChunksRequest(tenant=ctx.tenant, layout_id=LAYOUT.layout_id,
                                   model_fingerprint=fingerprint, token_ids=tokens, **fields)
    return await _collect(ctx.stub.ReadChunks(request))


async def _collect(call: AsyncIterator[pb.ReadChunksReply]) -> ChunkReplies:
    out = ChunkReplies()
    async for reply in call:
        kind = reply.WhichOneof("item")
        out.kinds.append(kind)
        if kind == "header":
            out.header = reply.header
        elif kind == "chunk":
            out.items.append((reply.chunk.index, reply.chunk))
        elif kind == "missing":
            out.items.append((reply.missing.index, reply.missing.reason))
    return out


def _check_read(got: ChunkReplies, keys: list[str], first: int,
                want: Sequence[bytes | str]) -> None:
    """``got`` reads chunks ``first`` on: ``want`` holds each one's bytes, or the reason
    it is missing."""
    kinds = ["header", *("chunk" if isinstance(w, bytes) else "missing" for w in want)]
    expect(got.kinds == kinds, f"reply order {got.kinds}, expected {kinds}")
    h = got.head()
    expect(list(h.chunk_keys) == keys[first:first + len(want)],
           f"ChunksHeader.chunk_keys {list(h.chunk_keys)} are not the chain keys of chunks "
           f"{first}+{len(want)}")
    digests = [chunk_digest(w) if isinstance(w, bytes) else b"" for w in want]
    expect(list(h.chunk_digests) == digests,
           "ChunksHeader.chunk_digests are not those of the chunks sent (empty for a missing "
           "one)")
    for offset, ((index, item), expected) in enumerate(zip(got.items, want, strict=True)):
        i = first + offset
        expect(index == i, f"item {offset} has index {index}, expected {i} (index order)")
        if isinstance(expected, str):
            expect(item == expected, f"chunk {i} is missing as {item!r}, expected {expected!r}")
            continue
        if isinstance(item, str):
            raise Failed(f"chunk {i} is missing as {item!r}, expected its bytes")
        expect(item.payload.key == keys[i] and item.tier,
               f"chunk {i} came with key {item.payload.key!r} and tier {item.tier!r}")
        expect(chunk_digest(item.payload.data) == h.chunk_digests[offset],
               f"chunk {i}'s bytes are not of the header's digest")
        expect(item.payload.data == expected, f"chunk {i} differs from the bytes written")


async def chain_keys_check(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 1, 4 * C)
    keys = _keys(ctx, session, FINGERPRINT)
    first = await _write_chunks(ctx, session, 0, 1, FINGERPRINT)
    expect(list(first.chunk_keys) == keys[:1] and first.chunks_written == 1,
           f"chunk 0 written as {list(first.chunk_keys)} ({first.chunks_written} written), "
           f"expected {keys[:1]}")
    later = await _write_chunks(ctx, session, 2, 4, FINGERPRINT)
    expect(list(later.chunk_keys) == keys[2:] and later.chunks_written == 2,
           f"chunks 2 and 3 written as {list(later.chunk_keys)} ({later.chunks_written} "
           f"written), expected {keys[2:]}, chained from token 0")
    again = await _write_chunks(ctx, session, 2, 4, FINGERPRINT)
    expect(list(again.chunk_keys) == keys[2:]
           and (again.chunks_written, again.chunks_deduped) == (0, 2),
           f"the same chunks written again: {again.chunks_written} written, "
           f"{again.chunks_deduped} deduped, expected 0 and 2")
    other = await _read(ctx, session.tokens.tobytes())  # no fingerprint: other keys
    _check_read(other, _keys(ctx, session), 0, ["not_held"] * 4)
    return "the reply's chunk_keys are key_i from token 0 (first_chunk 0 and 2), with the " \
           "fingerprint in them; a second write dedupes"


async def read_order(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 2, 4 * C + 2)  # a partial last chunk: not read
    await _write_chunks(ctx, session, 0, 1)
    await _write_chunks(ctx, session, 2, 4)
    got = await _read(ctx, session.tokens.tobytes())
    c = session.chunks
    _check_read(got, session.keys, 0, [c[0], "not_held", c[2], c[3]])
    return "header, chunk 0, MissingChunk 1 not_held, chunks 2 and 3; bytes of the " \
           "header's digests; the partial last chunk not read"


async def ranges(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 3, 4 * C)
    await _write_chunks(ctx, session, 0, 4)
    tokens, c = session.tokens.tobytes(), session.chunks
    for first, most, want in ((1, 2, c[1:3]), (3, 5, c[3:]), (0, 0, c), (4, 0, [])):
        got = await _read(ctx, tokens, first_chunk=first, max_chunks=most)
        _check_read(got, session.keys, first, list(want))
    await ctx.refused(_read(ctx, tokens, first_chunk=5), INVALID, "InvalidRequest")
    return "first_chunk 1 max 2, 3 max 5 (fewer left), 0 max 0 (all), 4 (none left); " \
           "first_chunk past the chunks INVALID_ARGUMENT"


async def partial_last_chunk(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 4, 2 * C)
    header = _header(ctx, session, 0, 2, token_ids=session.tokens.tobytes()
                     + session.tokens[:1].tobytes())
    await ctx.refused(_write(ctx, header, list(zip(session.keys, session.chunks, strict=True))),
                      INVALID, "InvalidRequest")
    _check_read(await _read(ctx, session.tokens.tobytes()), session.keys, 0, ["not_held"] * 2)
    return "token_ids of 2 chunks and 1 token: INVALID_ARGUMENT InvalidRequest, nothing stored"


async def wrong_key(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 5, 2 * C)
    cases = [("chunk 1's key", "", session.keys[1]),
             ("another tenant's key", "", _keys(ctx, session, tenant=f"{ctx.tenant}-x")[0]),
             ("the key without the header's fingerprint", FINGERPRINT, session.keys[0])]
    for _, fingerprint, key in cases:
        await ctx.refused(_write(ctx, _header(ctx, session, 0, 1, fingerprint),
                                 [(key, session.chunks[0])]), INVALID, "InvalidRequest")
    return "chunk 0 under " + ", ".join(what for what, _, _ in cases) + \
        ": INVALID_ARGUMENT InvalidRequest"


async def unheld_digest(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 6, 2 * C)
    await ctx.refused(_write(ctx, _header(ctx, session, 0, 2),
                             [(session.keys[0], session.chunks[0])]),
                      PRECONDITION, "MissingChunks")
    _check_read(await _read(ctx, session.tokens.tobytes()), session.keys, 0, ["not_held"] * 2)
    await _write_chunks(ctx, session, 0, 1)
    reply = await _write(ctx, _header(ctx, session, 0, 2),
                         [(session.keys[1], session.chunks[1])])
    expect((reply.chunks_written, reply.chunks_deduped) == (1, 1),
           f"chunk 0 held, named by digest alone: {reply.chunks_written} written, "
           f"{reply.chunks_deduped} deduped, expected 1 and 1")
    return "chunk 1 not held and not sent: FAILED_PRECONDITION MissingChunks, nothing " \
           "stored; once held, naming it by digest dedupes"


async def sessions_share(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    written = build(LAYOUT, 11, ctx.tenant, (int(ctx.run, 16), 7))
    await _write_chunks(ctx, written, 0, 2)
    sid = ctx.session_id("chunks-written")
    spilled = await ctx.spill(written.messages(written.header(ctx.ref(sid)), send=set()))
    expect(spilled.chunks_deduped == 2, f"a Spill naming the 2 written chunks by key and "
                                        f"digest: {spilled.chunks_deduped} deduped")
    check_whole(written, await ctx.restore(sid, want_window=True), window=True)
    session = build(LAYOUT, 11, ctx.tenant, (int(ctx.run, 16), 8))
    await ctx.spill(session.messages(session.header(ctx.ref(ctx.session_id("chunks-read")))))
    _check_read(await _read(ctx, session.tokens.tobytes()), session.keys, 0, session.chunks)
    again = await _write_chunks(ctx, session, 0, 2)
    expect(list(again.chunk_keys) == session.keys
           and (again.chunks_written, again.chunks_deduped) == (0, 2),
           f"the session's chunks written: keys {list(again.chunk_keys)}, "
           f"{again.chunks_written} written, {again.chunks_deduped} deduped")
    return "a Spill sending no chunk dedupes against written ones and restores; a " \
           "session's chunks read and written back under the same keys"


async def expected_digests(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = _prefix(ctx, 9, 2 * C)
    await _write_chunks(ctx, session, 0, 2)
    tokens = session.tokens.tobytes()
    got = await _read(ctx, tokens, chunk_digests=[session.digests[0], chunk_digest(b"other")])
    _check_read(got, session.keys, 0, [session.chunks[0], "digest_mismatch"])
    await ctx.refused(_read(ctx, tokens, chunk_digests=session.digests[:1]), INVALID,
                      "InvalidRequest")
    return "an expected digest not held: MissingChunk digest_mismatch, the other sent; " \
           "digests not one per chunk: INVALID_ARGUMENT"


async def golden(ctx: Context) -> str:
    vectors = load_vectors(ctx, "prefix_chunks.json")
    layout_id = await ctx.register_json(load_vectors(ctx, "chunks.json")["layout"])
    expect(layout_id == vectors["layout_id"], f"the vectors' layout registers as "
                                              f"{layout_id}, not {vectors['layout_id']}")
    chunk = vectors["chunks"][0]
    seen = []
    for case in vectors["cases"]:
        header = pb.WriteChunksHeader.FromString(bytes.fromhex(case["write_header"]["bytes"]))
        payloads = [(key, bytes.fromhex(c["bytes"]))
                    for key, c in zip(case["payload_keys"], vectors["chunks"], strict=True)]
        try:
            reply = await _write(ctx, header, payloads)
        except grpc.aio.AioRpcError as exc:
            # a shared domain the server does not let the tenant use: refused as the spec says
            trailer = dict(exc.trailing_metadata() or ()).get(ERROR_KEY)
            if not case["dedupe_domain"] or exc.code() != grpc.StatusCode.PERMISSION_DENIED \
                    or trailer != "PermissionDenied":
                raise
            seen.append(f"{case['scope']}: PERMISSION_DENIED")
            continue
        expect(list(reply.chunk_keys) == case["reply_chunk_keys"] and reply.durable,
               f"{case['scope']}: reply chunk_keys {list(reply.chunk_keys)} (durable "
               f"{reply.durable}), the vectors say {case['reply_chunk_keys']} (ACK_DURABLE)")
        request = pb.ReadChunksRequest.FromString(bytes.fromhex(case["read_request"]["bytes"]))
        got = await _collect(ctx.stub.ReadChunks(request))
        read_header = got.header
        expect(got.kinds == ["header", "chunk"] and read_header is not None
               and list(read_header.chunk_keys) == case["read_chunk_keys"]
               and [d.hex() for d in read_header.chunk_digests] == [chunk["digest"]],
               f"{case['scope']}: the read came as {got.kinds}, header "
               f"{list(got.header.chunk_keys) if got.header else None}")
        index, item = got.items[0]
        expect(index == 1 and not isinstance(item, str)
               and item.payload.data.hex() == chunk["bytes"],
               f"{case['scope']}: chunk {index} did not come back as the vectors' chunk 1")
        seen.append(f"{case['scope']}: the stated keys, chunk 1 read back")
    first = pb.WriteChunksHeader.FromString(
        bytes.fromhex(vectors["cases"][0]["write_header"]["bytes"]))
    for refused in vectors["refused"]:
        first.token_ids = b"".join(t.to_bytes(4, "little") for t in refused["token_ids"])
        await ctx.refused(_write(ctx, first, []), grpc.StatusCode[refused["status"]],
                          "InvalidRequest")
        seen.append(f"{refused['why']}: {refused['status']}")
    return "; ".join(seen)


CHECKS = [("WriteChunks: chain keys from token 0 in the caller's scope", chain_keys_check),
          ("ReadChunks: header, then chunks or MissingChunks in index order", read_order),
          ("ReadChunks: first_chunk and max_chunks", ranges),
          ("WriteChunks: a partial last chunk refused", partial_last_chunk),
          ("WriteChunks: a payload under a key not its own refused", wrong_key),
          ("WriteChunks: a chunk named by digest, not held, refused", unheld_digest),
          ("prefix chunks and sessions dedupe both ways", sessions_share),
          ("ReadChunks: expected digests", expected_digests),
          ("prefix chunk golden vectors", golden)]
