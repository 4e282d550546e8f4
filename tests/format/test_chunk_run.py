"""decode_chunks: a run of a session's chunks decoded into one tensor per stream equals
decode_chunk of each chunk concatenated; bad runs raise the specific error."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.format import chunk as codec
from kvstore.format.chunk import StreamData, decode_chunk, encode_chunk
from kvstore.format.chunk_run import PackedRun, decode_chunks
from kvstore.format.errors import ChunkCorrupt, CodecError, InvalidRequest, LayoutMismatch
from kvstore.format.layout import LayoutSpec, Stream
from tests.support.chunks import BUNDLED, MIXED, assert_same, layouts, make_streams


def session(spec, counts, zstd=None, seed=0):
    """(chunk bytes, token ids, the streams each chunk was encoded from)."""
    ids = np.random.default_rng(seed).integers(0, 256, sum(counts))
    bufs, streams, start = [], [], 0
    for i, count in enumerate(counts):
        data = make_streams(spec, count, seed=seed + i)
        bufs.append(encode_chunk(spec, start, ids[start:start + count], data,
                                 zstd_level=zstd))
        streams.append(data)
        start += count
    return bufs, ids, streams


def concatenated(spec, streams):
    out = {}
    for s in spec.persistent_streams:
        codes = torch.cat([d[s.name].codes for d in streams], 1)
        scales = (None if streams[0][s.name].scales is None
                  else torch.cat([d[s.name].scales for d in streams], 1))
        out[s.name] = StreamData(codes, scales)
    return out


@pytest.mark.parametrize("spec,counts,zstd", [
    (MIXED, [12, 12, 12, 7], None),  # entries of m = 4 and 2; a tail of 7 tokens
    (MIXED, [12, 5], 3),
    (MIXED, [3], None),
    (BUNDLED, [512, 512, 100], None),
])
def test_a_run_equals_each_chunk_decoded_and_concatenated(spec, counts, zstd):
    bufs, ids, streams = session(spec, counts, zstd)
    got = decode_chunks(bufs, spec, ids, counts)
    assert_same(got, concatenated(spec, streams))
    one_by_one = [decode_chunk(buf, spec).streams for buf in bufs]
    assert_same(got, concatenated(spec, one_by_one))
    # the tensors own their memory: writing to them leaves the chunk bytes alone
    before = bytes(bufs[0])
    for data in got.values():
        data.codes.view(torch.uint8).fill_(0)
    assert bytes(bufs[0]) == before


def test_an_empty_run_gives_empty_tensors_of_each_stream():
    got = decode_chunks([], MIXED, np.array([], dtype=np.int64), [])
    for s in MIXED.persistent_streams:
        assert got[s.name].codes.shape == (s.layers, 0, *s.codes_shape)


def test_bad_runs_raise_their_specific_error():
    bufs, ids, _ = session(MIXED, [12, 12, 5])
    with pytest.raises(InvalidRequest, match="chunk of tokens 0..11, got one of 12 tokens "
                                             "from 12"):
        decode_chunks([bufs[1], bufs[0], bufs[2]], MIXED, ids, [12, 12, 5])
    with pytest.raises(InvalidRequest, match="tokens 24..29, got one of 5"):
        decode_chunks(bufs, MIXED, ids, [12, 12, 6])
    with pytest.raises(InvalidRequest, match="3 chunks but 2 token counts"):
        decode_chunks(bufs, MIXED, ids, [12, 12])
    with pytest.raises(LayoutMismatch, match="other token ids"):
        decode_chunks(bufs, MIXED, ids[::-1], [12, 12, 5])
    with pytest.raises(LayoutMismatch):
        decode_chunks(bufs, BUNDLED, ids, [12, 12, 5])
    for position in (40, len(bufs[1]) // 2, len(bufs[1]) - 1):  # header, payload, last byte
        broken = bytearray(bufs[1])
        broken[position] ^= 0x10
        with pytest.raises(ChunkCorrupt):
            decode_chunks([bufs[0], bytes(broken), bufs[2]], MIXED, ids, [12, 12, 5])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=layouts(), full=st.integers(0, 3), tail=st.integers(1, 11),
       zstd=st.sampled_from([None, 1]), seed=st.integers(0, 2**31))
def test_a_run_of_a_random_layout_equals_each_chunk_decoded(spec, full, tail, zstd, seed):
    counts = [spec.chunk_tokens] * full + ([tail] if tail else [])
    bufs, ids, _ = session(spec, counts, zstd, seed)
    one_by_one = [decode_chunk(buf, spec).streams for buf in bufs]
    assert_same(decode_chunks(bufs, spec, ids, counts), concatenated(spec, one_by_one))


def test_decode_chunk_reads_a_part_at_an_odd_offset():
    # One int4 entry of 2 values is 1 byte, so its fp16 scales start at payload offset 1.
    spec = LayoutSpec("odd-offset", (Stream("a", (2,), bits=4, group_size=2),),
                      chunk_tokens=12)
    bufs, ids, streams = session(spec, [1])
    assert_same(decode_chunks(bufs, spec, ids, [1]), concatenated(spec, streams))
    assert_same(decode_chunk(bufs[0], spec).streams, streams[0])


@pytest.mark.parametrize("zstd", [None, 1])
def test_a_flipped_byte_anywhere_in_any_chunk_of_a_run_is_detected(zstd):
    counts = [12, 12, 12, 7]
    bufs, ids, _ = session(MIXED, counts, zstd)
    rng = np.random.default_rng(1)
    for which in range(len(bufs)):
        # every byte of a small chunk would take long; header bytes, then a sample
        positions = list(range(80)) + rng.integers(0, len(bufs[which]), 60).tolist()
        for position in positions:
            broken = list(bufs)
            flipped = bytearray(bufs[which])
            flipped[position] ^= 1 << int(rng.integers(8))
            broken[which] = bytes(flipped)
            with pytest.raises(CodecError):
                decode_chunks(broken, MIXED, ids, counts)


def as_version_1(buf: bytes) -> bytes:
    """The chunk as version 1 wrote it: no payload checksum in the header."""
    head = codec._HEADER.unpack_from(buf)
    v1 = codec._HEADER_V1.pack(head[0], 1, *head[2:-1])
    table_end = codec._HEADER.size + head[6] * codec._SECTION.size
    body = v1 + buf[codec._HEADER.size:table_end]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + buf[table_end + 8:]


@pytest.mark.parametrize("zstd", [None, 3])
def test_version_1_chunks_are_still_read_and_checked_per_section(zstd):
    counts = [12, 12, 5]
    bufs, ids, streams = session(MIXED, counts, zstd)
    old = [as_version_1(b) for b in bufs]
    assert decode_chunk(old[0], MIXED).header.version == 1
    assert_same(decode_chunks(old, MIXED, ids, counts), concatenated(MIXED, streams))
    mixed = [old[0], bufs[1], old[2]]
    assert_same(decode_chunks(mixed, MIXED, ids, counts), concatenated(MIXED, streams))
    broken = bytearray(old[1])
    broken[-1] ^= 1
    with pytest.raises(ChunkCorrupt):
        decode_chunks([old[0], bytes(broken), old[2]], MIXED, ids, counts)


@pytest.mark.parametrize("spec,counts", [(MIXED, [12, 12, 12, 7]), (BUNDLED, [512, 512, 100])])
def test_a_packed_run_decodes_as_its_chunks_do_and_is_verified(spec, counts):
    bufs, ids, streams = session(spec, counts)
    packed = b"".join(bufs)
    run = PackedRun(packed, [len(b) for b in bufs])
    assert [bytes(c) for c in run] == bufs and bytes(run[-1]) == bufs[-1]
    assert_same(decode_chunks(run, spec, ids, counts), concatenated(spec, streams))
    for position in (40, len(bufs[0]) + len(bufs[1]) // 2, len(packed) - 1):
        broken = bytearray(packed)
        broken[position] ^= 0x04
        with pytest.raises(CodecError):
            decode_chunks(PackedRun(bytes(broken), run.lengths), spec, ids, counts)
    with pytest.raises(InvalidRequest, match="do not fit"):
        PackedRun(packed[:-1], run.lengths)


def test_a_payload_flipped_in_a_later_slab_is_caught_after_earlier_slabs_were_copied():
    """A run larger than a slab (checked and copied slab by slab): a bad payload in the
    last chunk still raises, and a packed run decodes as the joined one does."""
    from kvstore.format import chunk_run

    counts = [512] * 80  # about 1.5 MB of bundled chunks: more than one slab
    bufs, ids, streams = session(BUNDLED, counts, seed=5)
    assert sum(map(len, bufs)) > chunk_run.SLAB_BYTES
    packed = PackedRun(b"".join(bufs), [len(b) for b in bufs])
    assert_same(decode_chunks(packed, BUNDLED, ids, counts), concatenated(BUNDLED, streams))
    broken = bytearray(bufs[-1])
    broken[-3] ^= 0x10
    with pytest.raises(ChunkCorrupt):
        decode_chunks([*bufs[:-1], bytes(broken)], BUNDLED, ids, counts)
    with pytest.raises(ChunkCorrupt):
        decode_chunks(PackedRun(b"".join(bufs[:-1]) + bytes(broken), packed.lengths),
                      BUNDLED, ids, counts)
