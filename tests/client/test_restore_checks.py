"""What the client checks in a restore beyond each chunk's digest: the window against
the digest its reply states, pending rows of n mod m tokens, and (layer by layer) every
section against its chunk's table and every uncompressed chunk's digest. Against a real
server whose restore stream is modified off the spec."""

from __future__ import annotations

import pytest

from kvstore.format.chunk import encode_chunk
from kvstore.format.errors import ChunkCorrupt, DataLoss
from kvtier import AsyncClient
from kvtier.codec import as_tokens, decode_window, encode_window
from services.server.restore_stream import RestoreStreamer
from tests.client.test_conformance import DropsTheTail, broken
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for, window_for

TOKENS = 2 * LAYOUT.chunk_tokens + 102  # two chunks, a tail, 2 pending rows (m = 4)


class FlipsTheWindow(RestoreStreamer):
    """One bit of the window flipped on its way out."""

    def payload(self, key, data, writer, refused=""):
        payload = super().payload(key, data, writer, refused)
        if not key and payload.WhichOneof("body") == "data" and data[:4] == b"KVTC" and \
                data[6] & 2:  # flags: EPHEMERAL
            flipped = bytearray(payload.data)
            flipped[-1] ^= 1
            payload.data = bytes(flipped)
        return payload


class SendsAnotherSection(RestoreStreamer):
    """Layer by layer, chunk 0's sections carry chunk 1's codes (and their checksums)."""

    async def _sections(self, spec, buffers):
        sections = [s async for s in super()._sections(spec, buffers)]
        by_place = {(s.stream, s.layer, s.chunk_index): s for s in sections}
        for section in sections:
            if section.chunk_index == 0:
                other = by_place[(section.stream, section.layer, 1)]
                section.codes, section.codes_xxh3 = other.codes, other.codes_xxh3
            yield section


async def spilled(kv: AsyncClient) -> None:
    await kv.spill("acme", "s1", LAYOUT.name, tokens_for(TOKENS), streams_for(LAYOUT, TOKENS),
                   window=window_for(LAYOUT, TOKENS), generation=1)


async def test_a_window_that_is_not_the_stated_one_is_data_loss(tmp_path):
    async with running_server(tmp_path) as (server, target), \
            AsyncClient(target, shared_memory=False) as kv:
        await spilled(kv)
        assert (await kv.restore("acme", "s1")).window is not None
        broken(server, FlipsTheWindow)
        with pytest.raises(DataLoss, match="window does not have the digest"):
            await kv.restore("acme", "s1")


@pytest.mark.parametrize("kind", [DropsTheTail, SendsAnotherSection])
async def test_layer_sections_off_their_tables_are_refused(tmp_path, kind):
    async with running_server(tmp_path) as (server, target), AsyncClient(target) as kv:
        await spilled(kv)
        assert len([s async for s in kv.restore_layers("acme", "s1")]) == 5
        broken(server, kind)
        with pytest.raises(ChunkCorrupt):
            [s async for s in kv.restore_layers("acme", "s1")]


def test_a_restored_window_with_pending_rows_of_another_count_is_refused():
    tokens = as_tokens(tokens_for(TOKENS))
    window = {k: v for k, v in window_for(LAYOUT, TOKENS).items()
              if not LAYOUT.stream(k).pending}
    three = {k: v for k, v in window_for(LAYOUT, TOKENS + 1).items()
             if LAYOUT.stream(k).pending}
    blob = encode_window(LAYOUT, tokens, window) + encode_chunk(
        LAYOUT, TOKENS - 3, tokens[-3:], three, ephemeral=True)
    with pytest.raises(ChunkCorrupt, match="pending rows"):
        decode_window(LAYOUT, tokens, blob)
