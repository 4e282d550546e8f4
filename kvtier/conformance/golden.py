"""The golden vectors (``tests/vectors``: ``chunks.json``, ``layers.json``) through the
server: their session spilled as the vectors' bytes comes back byte for byte, whole and
layer by layer (every section, checksum and chunk table as the vectors state them), and
its zstd chunk 0 with the very frame spilled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.format.keys import chain_keys, dedupe_scope
from kvtier.conformance.harness import Context, Failed, expect
from proto import kvtier_pb2 as pb

SOURCE_VECTORS = Path(__file__).resolve().parents[2] / "tests" / "vectors"


def load_vectors(ctx: Context, name: str) -> dict[str, Any]:
    path = (ctx.vectors or SOURCE_VECTORS) / name
    if not path.is_file():
        raise Failed(f"no golden vectors at {path}: give --vectors DIR (tests/vectors of "
                     "the kvtier source)")
    vectors: dict[str, Any] = json.loads(path.read_text())
    return vectors


async def _spill(ctx: Context, vectors: dict[str, Any], layout_id: str, what: str,
                 chunk: dict[str, Any]) -> str:
    tokens = np.array(vectors["token_ids"], "<u4")
    size = vectors["layout"]["chunk_tokens"]
    sid = ctx.session_id(what)
    header = pb.SpillHeader(
        session=ctx.ref(sid), layout_id=layout_id, generation=1, token_ids=tokens.tobytes(),
        chunk_keys=chain_keys(layout_id, tokens, size, scope=dedupe_scope(ctx.tenant)),
        chunk_digests=[bytes.fromhex(chunk["digest"])],
        tail_digest=bytes.fromhex(vectors["tail"]["digest"]),
        window_digest=bytes.fromhex(vectors["window"]["digest"]))
    await ctx.spill([
        pb.SpillRequest(header=header),
        pb.SpillRequest(chunk=pb.Payload(key=header.chunk_keys[0],
                                         data=bytes.fromhex(chunk["bytes"]))),
        pb.SpillRequest(tail=pb.Payload(data=bytes.fromhex(vectors["tail"]["bytes"]))),
        pb.SpillRequest(window=pb.Payload(data=bytes.fromhex(vectors["window"]["bytes"])))])
    return sid


async def golden(ctx: Context) -> str:
    vectors, layers = load_vectors(ctx, "chunks.json"), load_vectors(ctx, "layers.json")
    layout_id = await ctx.register_json(vectors["layout"])
    expect(layout_id == vectors["layout_id"], f"the vectors' layout registers as "
                                              f"{layout_id}, not {vectors['layout_id']}")
    chunk = vectors["chunks"][0]
    sid = await _spill(ctx, vectors, layout_id, "golden", chunk)
    got = await ctx.restore(sid, want_window=True)
    expect([c.payload.data.hex() for c in got.chunks] == [chunk["bytes"]]
           and [t.hex() for t in got.tails] == [vectors["tail"]["bytes"]]
           and [w.hex() for w in got.windows] == [vectors["window"]["bytes"]],
           "the vectors' chunk 0, tail or window did not come back byte for byte")
    h = got.head()
    expect([d.hex() for d in h.chunk_digests] == [chunk["digest"]]
           and h.tail_digest.hex() == vectors["tail"]["digest"]
           and h.window_digest.hex() == vectors["window"]["digest"],
           "the header's digests are not the vectors'")
    got = await ctx.restore(sid, layer_by_layer=True)
    expect([t.hex() for t in got.head().chunk_tables] == layers["chunk_tables"],
           "the header's chunk_tables are not the vectors'")
    sections = [{"stream": s.stream, "layer": s.layer, "chunk_index": s.chunk_index,
                 "codes": s.codes.hex(), "scales": s.scales.hex(),
                 "codes_xxh3": f"{s.codes_xxh3:016x}", "scales_xxh3": f"{s.scales_xxh3:016x}"}
                for s in got.sections]
    for i, (have, want) in enumerate(zip(sections, layers["sections"], strict=False)):
        expect(have == want, f"section {i} is {have}, the vectors say {want}")
    expect(len(sections) == len(layers["sections"]),
           f"{len(sections)} sections, the vectors have {len(layers['sections'])}")
    zstd = vectors["chunks_zstd"][0]
    sid = await _spill(ctx, vectors, layout_id, "golden-zstd", zstd)
    got = await ctx.restore(sid)
    expect([c.payload.data.hex() for c in got.chunks] == [zstd["bytes"]],
           "the vectors' zstd chunk 0 did not come back as its very frame")
    return (f"chunk 0, tail, window, zstd chunk 0 and {len(sections)} sections as the "
            "vectors state them")


CHECKS = [("golden vectors", golden)]
