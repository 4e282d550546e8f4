"""Layer-by-layer Restore: sections in the stated order, the tail as sections of
``chunk_index == len(chunk_keys)`` (no tail message), each section the bytes its
chunk's table (``SessionHeader.chunk_tables``) describes, digests of uncompressed chunks
(``kvstore.format.layer_sections``)."""

from __future__ import annotations

from kvstore.format.chunk import read_table
from kvstore.format.errors import CodecError, DataLoss
from kvstore.format.layer_sections import EMPTY_XXH3, LayerCheck
from kvtier.conformance.harness import Context, Failed, expect
from kvtier.conformance.sessions import LAYOUT, build


async def _layer_restore(ctx: Context, what: str, zstd_level: int | None) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 3, zstd_level=zstd_level)
    sid = ctx.session_id(what)
    await ctx.spill(session.messages(session.header(ctx.ref(sid))))
    got = await ctx.restore(sid, layer_by_layer=True, want_window=True)
    h = got.head()
    want = ["header", *["section"] * len(got.sections), "window", "summary"]
    expect(got.kinds == want, f"reply order {got.kinds[:4]}...: expected the header, "
                              "sections only (the tail too), the window, the summary")
    expect(len(h.chunk_tables) == 3, f"{len(h.chunk_tables)} chunk tables for 2 chunks "
                                     "and a tail")
    check = LayerCheck(LAYOUT, session.tokens, h.chunk_tables, h.chunk_digests,
                       h.tail_digest)
    try:
        for s in got.sections:
            check.add(s.stream, s.layer, s.chunk_index, s.codes, s.scales, s.codes_xxh3,
                      s.scales_xxh3)
        check.finish()
    except (CodecError, DataLoss) as exc:
        raise Failed(str(exc)) from exc
    # what the sections hold is the raw payload the spill encoded, zstd or not
    for i, raw in enumerate(session.raw):
        header = read_table(h.chunk_tables[i])
        expect(header.compressed == (zstd_level is not None),
               f"chunk table {i} has flags {header.flags}")
        parts = {(s.stream, s.layer): s for s in got.sections if s.chunk_index == i}
        rebuilt = b"".join(
            (parts[(LAYOUT.persistent_streams[st].name, layer)].codes if p == 0 else
             parts[(LAYOUT.persistent_streams[st].name, layer)].scales)
            for st, layer, p in zip(header.sections["stream"].tolist(),
                                    header.sections["layer"].tolist(),
                                    header.sections["part"].tolist(), strict=True))
        expect(rebuilt == raw, f"the sections of block {i} are not its raw payload")
    bf16 = [s for s in got.sections if s.stream == "c.bf16"]
    expect(all(s.scales == b"" and s.scales_xxh3 == EMPTY_XXH3 for s in bf16),
           "a bf16 section's scales_xxh3 is not xxh3_64 of no bytes")
    return (f"{len(got.sections)} sections in order, the tail's with chunk_index 2, each "
            "its table's bytes" + ("" if zstd_level else "; chunk digests hold"))


async def layer_restore(ctx: Context) -> str:
    return await _layer_restore(ctx, "layers", None)


async def layer_restore_zstd(ctx: Context) -> str:
    return await _layer_restore(ctx, "layers-zstd", 3)


CHECKS = [("layer-by-layer restore: order, tail sections, checksums, digests", layer_restore),
          ("layer-by-layer restore of zstd chunks", layer_restore_zstd)]
