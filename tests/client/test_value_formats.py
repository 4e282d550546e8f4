"""fp16 and fp8 sessions through a real server: spilled with a scale per chunk, restored
whole, layer by layer and (fp8 window) with their window, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.format.chunk import StreamData, encode_chunk
from kvstore.format.errors import InvalidRequest, SessionNotFound
from kvstore.format.layout import LayoutSpec, Stream
from kvtier import AsyncClient
from tests.support.chunks import make_streams, resealed
from tests.support.service import running_server

SPEC = LayoutSpec("formats-e2e", (
    Stream("k", (2, 8), bits=8, format="fp8_e4m3", layers=3),
    Stream("v", (2, 8), bits=16, format="fp16", layers=3),
    Stream("w", (2, 8), bits=8, format="fp8_e4m3", layers=3, persistent=False),
), chunk_tokens=16, window_tokens=8)
TOKENS = np.arange(40, dtype="<u4")  # two chunks and a tail of 8


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


async def test_fp8_and_fp16_sessions_restore_bit_exact_with_each_chunks_scale(tmp_path):
    persistent = make_streams(SPEC, len(TOKENS), seed=1)
    scales = torch.tensor([[0.5, 1.0, 2.0], [0.25, 4.0, 8.0], [1.5, 0.75, 3.0]])
    persistent["k"] = StreamData(persistent["k"].codes, scales)  # chunk 0, 1, the tail
    window = make_streams(SPEC, 8, seed=2, ephemeral=True)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.register_layout(SPEC)
        await kv.spill("acme", "s", SPEC, TOKENS, persistent, window=window, generation=1)
        session = await kv.restore("acme", "s")
        slices = [piece async for piece in kv.restore_layers("acme", "s")]
    for name, data in persistent.items():
        assert same(session.persistent[name].codes, data.codes), name
    assert torch.equal(session.persistent["k"].scales, scales)
    assert session.persistent["v"].scales is None
    assert same(session.window["w"].codes, window["w"].codes)
    assert torch.equal(session.window["w"].scales, window["w"].scales)
    assert len(slices) == 6
    for piece in slices:
        whole = persistent[piece.stream]
        assert same(piece.data.codes, whole.codes[piece.layer])
        if piece.stream == "k":  # (chunks,) float32: each chunk's scale of this layer
            assert torch.equal(piece.data.scales, scales[piece.layer])
        else:
            assert piece.data.scales is None


async def test_the_server_refuses_a_chunk_whose_fp8_scale_is_not_positive(tmp_path):
    spec = LayoutSpec("formats-e2e-k", SPEC.streams[:1], chunk_tokens=16)
    data = make_streams(spec, 16)
    bad = resealed(encode_chunk(spec, 0, TOKENS[:16], data), spec, -1.0)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await kv.register_layout(spec)
        with pytest.raises(InvalidRequest, match="finite and > 0"):
            await kv.spill("acme", "bad", spec, TOKENS[:16], chunks=[bad], generation=1)
        with pytest.raises(SessionNotFound):
            await kv.restore("acme", "bad")
