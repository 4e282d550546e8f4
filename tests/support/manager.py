"""Shared builders for the tier manager tests: a tiny layout and real encoded sessions,
and managers that are closed however a test ends.

Chunks are made only through ``kvstore.format.chunk``; nothing here stores or decodes bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import numpy as np
import torch

from kvstore.format.chunk import StreamData, encode_chunk
from kvstore.format.keys import block_keys, dedupe_scope
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.format.registry import register_layout
from kvstore.session.manager import TierManager
from kvstore.tiers.base import MetaStore, Tier
from tests.support.closing import Opened

TINY = register_layout(
    LayoutSpec(
        name="test-manager-tiny",
        streams=(
            Stream("lat", (32,), bits=4, group_size=32, tokens_per_entry=4, layers=2),
            Stream("idx", (8,), bits=8, group_size=8, tokens_per_entry=4, layers=1),
            Stream("win.k", (2, 16), bits=8, group_size=16, layers=2, persistent=False),
        ),
        chunk_tokens=16,
        window_tokens=8,
    )
)
WINDOW_TOKENS = TINY.window_tokens


def _stream_data(stream: Stream, num_tokens: int, gen: torch.Generator) -> StreamData:
    entries = stream.entries_for(num_tokens)
    # codes (layers, entries, *codes_shape), scales (layers, entries, scales_per_entry)
    shape = (stream.layers, entries, *stream.codes_shape)
    if stream.bits == 4:
        codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    else:
        codes = torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    scales = torch.rand((stream.layers, entries, stream.scales_per_entry), generator=gen)
    return StreamData(codes, scales.to(torch.float16))


def encode(start: int, tokens: np.ndarray, *, ephemeral: bool = False, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + start)
    streams = TINY.ephemeral_streams if ephemeral else TINY.persistent_streams
    data = {s.name: _stream_data(s, len(tokens), gen) for s in streams}
    return encode_chunk(TINY, start, tokens, data, ephemeral=ephemeral)


def make_session(tokens, *, seed: int = 0, window: bool = True, tenant: str = "t",
                 dedupe_domain: str | None = None) -> dict:
    """spill() keyword arguments for a session of these token ids (chunk data by seed),
    keyed for ``tenant``'s own dedupe domain or the shared ``dedupe_domain``."""
    tokens = np.asarray(tokens, dtype=np.uint32)
    size = TINY.chunk_tokens
    datas = [encode(i * size, tokens[i * size : (i + 1) * size], seed=seed)
             for i in range(len(tokens) // size)]
    keys = block_keys(TINY.layout_id, tokens, size, datas,
                      scope=dedupe_scope(tenant, dedupe_domain))
    chunks = list(zip(keys, datas, strict=True))
    covered = len(keys) * size
    tail = encode(covered, tokens[covered:], seed=seed) if covered < len(tokens) else b""
    blob = None
    if window:
        start = max(0, len(tokens) - WINDOW_TOKENS)
        blob = encode(start, tokens[start:], ephemeral=True, seed=seed)
    return dict(layout_id=TINY.layout_id, token_ids=tokens, chunks=chunks, tail=tail,
                window=blob, **({"dedupe_domain": dedupe_domain} if dedupe_domain else {}))


async def tier_keys(tier) -> set[str]:
    """Every key the tier really holds (asked of the medium, not the manager)."""
    listing = tier.keys()
    return {key async for key in listing}


def random_tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint32)


@contextlib.asynccontextmanager
async def running_manager(tiers: Sequence[Tier], meta: MetaStore, **options
                          ) -> AsyncIterator[TierManager]:
    """``TierManager.open(tiers, meta, **options)``, closed when the block ends, whatever
    it raised."""
    manager = await TierManager.open(tiers, meta, **options)
    try:
        yield manager
    finally:
        await manager.close()


class Managers(Opened):
    """The ``managers`` fixture: opens a test's managers (or adopts one a test opened, as
    ``open_manager`` does), and closes each one still open when the test ends."""

    async def open(self, tiers: Sequence[Tier], meta: MetaStore, **options) -> TierManager:
        return self.adopt(await TierManager.open(tiers, meta, **options))
