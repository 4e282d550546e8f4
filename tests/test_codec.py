import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore.format.chunk import StreamData, decode_chunk, encode_chunk, read_header, verify_chunk
from kvstore.format.errors import (
    ChunkCorrupt,
    ChunkTruncated,
    CodecError,
    LayoutMismatch,
    UnsupportedVersion,
)
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.format.registry import get_layout

BUNDLED = get_layout("kvtier-bundled")
MIXED = LayoutSpec(
    "codec-test",
    (
        Stream("lat", (48,), bits=4, group_size=16, tokens_per_entry=4, layers=3),
        Stream("idx", (2, 10), bits=8, group_size=10, tokens_per_entry=2),
        Stream("raw", (6,), bits=16, layers=2),
        Stream("win", (3, 8), bits=8, group_size=8, layers=2, persistent=False),
    ),
    chunk_tokens=12,
    window_tokens=30,
)
_DTYPES = {4: torch.uint8, 8: torch.int8, 16: torch.bfloat16}


def make_streams(spec, num_tokens, seed=0, ephemeral=False):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in spec.ephemeral_streams if ephemeral else spec.persistent_streams:
        e = s.entries_for(num_tokens)
        if s.bits == 16:
            codes = torch.randn(s.layers, e, *s.codes_shape, generator=g).to(torch.bfloat16)
            scales = None
        else:
            codes = torch.randint(
                0, 256, (s.layers, e, *s.codes_shape), generator=g, dtype=torch.uint8
            ).view(_DTYPES[s.bits])
            scales = torch.rand(s.layers, e, s.scales_per_entry, generator=g).half()
        out[s.name] = StreamData(codes, scales)
    return out


def assert_same(decoded, original):
    assert decoded.keys() == original.keys()
    for name, data in original.items():
        assert torch.equal(decoded[name].codes.view(torch.uint8), data.codes.view(torch.uint8))
        if data.scales is None:
            assert decoded[name].scales is None
        else:
            assert torch.equal(
                decoded[name].scales.view(torch.uint8), data.scales.view(torch.uint8)
            )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_tokens=st.integers(0, 30),
    start=st.integers(0, 2**40),
    seed=st.integers(0, 2**31),
    zstd=st.sampled_from([None, 1, 9]),
    ephemeral=st.booleans(),
)
def test_round_trip_is_exact(num_tokens, start, seed, zstd, ephemeral):
    tokens = np.random.default_rng(seed).integers(0, 256, num_tokens)
    streams = make_streams(MIXED, num_tokens, seed, ephemeral)
    buf = encode_chunk(MIXED, start, tokens, streams, ephemeral=ephemeral, zstd_level=zstd)
    if not ephemeral and num_tokens > MIXED.chunk_tokens:  # more than one chunk's worth
        with pytest.raises(ChunkCorrupt, match="at most 12"):
            decode_chunk(buf, MIXED, token_ids=tokens)
        return
    chunk = decode_chunk(buf, MIXED, token_ids=tokens)
    assert chunk.header.start_token == start and chunk.header.num_tokens == num_tokens
    assert chunk.header.ephemeral == ephemeral
    assert_same(chunk.streams, streams)
    assert verify_chunk(buf).encoded_len == len(buf)


def test_one_layer_of_one_stream_decodes_alone():
    streams = make_streams(BUNDLED, 512)
    buf = encode_chunk(BUNDLED, 0, np.arange(512), streams)
    part = decode_chunk(buf, BUNDLED, streams=["enc.latent"], layers=[1]).streams
    assert list(part) == ["enc.latent"]
    assert torch.equal(part["enc.latent"].codes[0], streams["enc.latent"].codes[1])
    assert torch.equal(part["enc.latent"].scales[0], streams["enc.latent"].scales[1])


@settings(max_examples=60, deadline=None)
@given(position=st.integers(min_value=0), bit=st.integers(0, 7), zstd=st.booleans())
@example(position=2612, bit=2, zstd=True)  # a zstd frame bit whose frame decompresses the same
def test_any_flipped_bit_is_detected(position, bit, zstd):
    buf = bytearray(
        encode_chunk(
            MIXED, 7, np.arange(12), make_streams(MIXED, 12), zstd_level=3 if zstd else None
        )
    )
    buf[position % len(buf)] ^= 1 << bit
    with pytest.raises(CodecError):
        decode_chunk(bytes(buf), MIXED)


@pytest.mark.parametrize("cut", [0, 5, 40, 200, -1])
def test_truncated_buffers_raise_truncated(cut):
    buf = encode_chunk(MIXED, 0, np.arange(12), make_streams(MIXED, 12))
    with pytest.raises(ChunkTruncated):
        read_header(buf[:cut])


def test_wrong_version_is_named():
    buf = bytearray(encode_chunk(MIXED, 0, np.arange(12), make_streams(MIXED, 12)))
    buf[4:6] = (99).to_bytes(2, "little")
    with pytest.raises(UnsupportedVersion, match="99"):
        decode_chunk(bytes(buf), MIXED)


def test_layout_and_token_mismatch_are_refused():
    buf = encode_chunk(MIXED, 0, np.arange(12), make_streams(MIXED, 12))
    with pytest.raises(LayoutMismatch):
        decode_chunk(buf, BUNDLED)
    with pytest.raises(LayoutMismatch, match="token"):
        decode_chunk(buf, MIXED, token_ids=np.arange(1, 13))


def test_encode_refuses_shapes_that_do_not_match_the_spec():
    streams = make_streams(MIXED, 12)
    streams["lat"] = StreamData(streams["lat"].codes[:, :2], streams["lat"].scales)
    with pytest.raises(LayoutMismatch, match="lat"):
        encode_chunk(MIXED, 0, np.arange(12), streams)
    with pytest.raises(LayoutMismatch, match="expects persistent streams"):
        encode_chunk(MIXED, 0, np.arange(12), {})


def test_section_larger_than_buffer_is_corrupt_not_a_crash():
    buf = bytearray(encode_chunk(MIXED, 0, np.arange(12), make_streams(MIXED, 12)))
    # Claim a huge payload in the header; the header checksum catches the edit.
    buf[40:48] = (2**40).to_bytes(8, "little")
    with pytest.raises(ChunkCorrupt):
        read_header(bytes(buf))


def test_fuzz_random_and_mutated_buffers_only_decode_or_raise_codec_errors():
    rng = random.Random(1234)
    good = [
        encode_chunk(MIXED, 0, np.arange(n), make_streams(MIXED, n, n), zstd_level=z)
        for n, z in ((12, None), (11, 3), (5, None))
    ]
    decoded_ok = unchanged = 0
    for i in range(3000):
        if i % 3 == 0:
            buf = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        else:
            buf = bytearray(rng.choice(good))
            for _ in range(rng.randint(1, 4)):
                op = rng.randint(0, 2)
                pos = rng.randrange(len(buf)) if buf else 0
                if op == 0 and buf:
                    buf[pos] = rng.getrandbits(8)
                elif op == 1:
                    del buf[pos : pos + rng.randint(1, 16)]
                else:
                    buf[pos:pos] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
            buf = bytes(buf)
        unchanged += buf in good
        try:
            decode_chunk(buf, MIXED)
        except CodecError:
            assert buf not in good  # an original that survived its "mutation" must decode
            continue
        # Whatever decodes must be exactly one of the originals (a no-op mutation).
        assert buf in good
        decoded_ok += 1
    # Exactly the no-op mutations decode; every real edit and every random buffer is refused.
    assert decoded_ok == unchanged
    assert unchanged < 30  # the campaign is made of real edits, not no-ops


def test_window_blob_carries_stream_subsets_back_to_back():
    from kvstore.format.chunk import split_chunks

    full = make_streams(MIXED2, 9, ephemeral=True)
    window = {"win": full["win"]}
    pending = {"pend": make_streams(MIXED2, 3, 1, ephemeral=True)["pend"]}
    blob = encode_chunk(MIXED2, 0, np.arange(9), window, ephemeral=True) + encode_chunk(
        MIXED2, 9, np.arange(3), pending, ephemeral=True, zstd_level=1
    )
    parts = [decode_chunk(p, MIXED2) for p in split_chunks(blob)]
    assert [list(p.streams) for p in parts] == [["win"], ["pend"]]
    assert_same(parts[0].streams, window)
    assert_same(parts[1].streams, pending)
    with pytest.raises(ChunkCorrupt, match="trailing"):
        verify_chunk(blob)


def test_persistent_chunks_must_carry_every_stream():
    streams = make_streams(MIXED, 12)
    del streams["raw"]
    with pytest.raises(LayoutMismatch):
        encode_chunk(MIXED, 0, np.arange(12), streams)


MIXED2 = LayoutSpec(
    "codec-test-2",
    (
        Stream("lat", (8,), bits=4, group_size=8, tokens_per_entry=4),
        Stream("win", (2, 8), bits=8, group_size=8, persistent=False),
        Stream("pend", (6,), bits=16, persistent=False, pending=True),
    ),
    chunk_tokens=8,
    window_tokens=9,
)
