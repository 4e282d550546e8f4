"""Every size is bounded by the layout before anything is decoded.

Each measured failure has a test here over a real server on loopback: a chunk whose
section table is not the layout's, zstd bombs (small bytes, a huge declared or
undeclared content size), a window part claiming the whole session, and token ids
outside the vocabulary. Each is refused at Spill with INVALID_ARGUMENT and a specific
message, nothing is stored, and the server's peak RSS (this process: the server runs
in-process) grows by far less than the bomb would take. Valid traffic still round-trips
bit-exact. The client, replay and object-tier decoders refuse the same bombs.
"""

from __future__ import annotations

import contextlib
import functools
import re
import struct

import grpc
import numpy as np
import pytest
import xxhash
import zstandard

from kvstore.format.checks import check_spill, check_token_ids, window_bytes_max
from kvstore.format.chunk import (
    FLAG_EPHEMERAL,
    FLAG_ZSTD,
    MAGIC,
    SECTION_DTYPE,
    VERSION,
    decode_chunk,
    encode_chunk,
    tokens_hash,
)
from kvstore.format.chunk_parts import chunk_plan, max_chunk_tokens
from kvstore.format.errors import ChunkCorrupt, InvalidRequest
from kvstore.format.keys import chain_keys, chunk_digest, dedupe_scope
from kvstore.format.layout import LayoutSpec, Stream
from kvstore.tiers.object import ObjectTier, ObjectTierConfig
from kvtier import AsyncClient
from kvtier.codec import as_tokens, encode_session, encode_window
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from tests.support.service import (
    LAYOUT,
    assert_streams_equal,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

HEADER = struct.Struct("<4sHHQQIIQQQQ")  # the chunk header, as kvstore/format/chunk.py documents it
BOMB = 512 << 20  # what a bomb expands to: far above any peak the refusal may add
RSS_SLACK = 100 << 20  # the most a refused request may raise the server's peak RSS
WINDOW_KV = ("enc.window.k", "enc.window.v")
REF = pb.SessionRef(tenant="acme", session_id="bomb")
SCOPE = dedupe_scope(REF.tenant)


# ---- forging chunks byte by byte ---------------------------------------------------------

def forge(spec: LayoutSpec, start: int, ids: np.ndarray, rows: list[tuple], raw_len: int,
          stored: bytes, *, flags: int = 0) -> bytes:
    """A chunk with the given section table (stream, layer, part, offset, length, xxh3)
    and stored payload; its header and table checksums are right, so only the layout
    can tell it is wrong."""
    table = np.zeros(len(rows), SECTION_DTYPE)
    for i, (stream, layer, part, offset, length, checksum) in enumerate(rows):
        table[i] = (stream, layer, part, b"\0" * 3, offset, length, checksum)
    head = HEADER.pack(MAGIC, VERSION, flags, spec.layout_hash, start, len(ids), len(rows),
                       tokens_hash(ids), len(stored), raw_len,
                       xxhash.xxh3_64_intdigest(stored)) + table.tobytes()
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + stored


def honest_rows(spec: LayoutSpec, tokens: int, ephemeral: bool, names=None) -> list[tuple]:
    """The table encode_chunk writes for these streams, with the checksums of zeros."""
    plan = chunk_plan(spec, tokens, ephemeral, names)
    rows = []
    for ids, offset, length in plan.table_head.tolist():
        rows.append((ids & 0xFFFF, (ids >> 16) & 0xFFFF, ids >> 32, offset, length,
                     zeros_xxh3(length)))
    return rows


@functools.lru_cache
def zeros_xxh3(length: int) -> int:
    hasher, block = xxhash.xxh3_64(), bytes(1 << 20)
    for at in range(0, length, len(block)):
        hasher.update(block[: min(len(block), length - at)])
    return hasher.intdigest()


@functools.lru_cache
def zeros_frame(length: int, declare: bool) -> bytes:
    """A zstd frame of ``length`` zero bytes, its content size declared or not."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declare)
    frame = compressor.compressobj(size=length if declare else -1)
    block, out = bytes(1 << 20), []
    for at in range(0, length, len(block)):
        out.append(frame.compress(block[: min(len(block), length - at)]))
    out.append(frame.flush())
    return b"".join(out)


def test_forged_chunks_are_byte_exact_encodings():
    """The forger writes what encode_chunk writes, so a refusal below is the layout's."""
    ids = np.arange(LAYOUT.chunk_tokens) % 256
    streams = streams_for(LAYOUT, LAYOUT.chunk_tokens)
    real = encode_chunk(LAYOUT, 0, ids, streams)
    plan = chunk_plan(LAYOUT, LAYOUT.chunk_tokens, False)
    raw = real[-plan.payload_bytes:]
    rows = [(i & 0xFFFF, (i >> 16) & 0xFFFF, i >> 32, off, n,
             xxhash.xxh3_64_intdigest(raw[off:off + n])) for i, off, n in plan.table_head.tolist()]
    assert forge(LAYOUT, 0, ids, rows, len(raw), raw) == real


# ---- peak RSS of this process (the in-process server's) ----------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        status = f.read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))


@contextlib.contextmanager
def peak_rss_growth():
    """Yields a list that receives how far the peak RSS rose above the RSS at entry
    (writing 5 to clear_refs resets the kernel's high-water mark to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base, growth = _status_kib("VmRSS"), []
    yield growth
    growth.append((_status_kib("VmHWM") - base) << 10)


def test_peak_rss_growth_sees_an_allocation_the_size_of_a_bomb():
    with peak_rss_growth() as growth:
        touched = np.ones(BOMB, np.uint8)
        del touched
    assert growth[0] > BOMB - RSS_SLACK


# ---- the server refuses each of them at Spill --------------------------------------------

def _spill_messages(tokens: np.ndarray, chunk0: bytes | None = None, tail: bytes = b"",
                    window: bytes | None = None):
    keys = chain_keys(LAYOUT.layout_id, tokens, LAYOUT.chunk_tokens, scope=SCOPE)
    # The digests of what is sent: the bounds, not the digests, must refuse these.
    yield pb.SpillRequest(header=pb.SpillHeader(
        session=REF, layout_id=LAYOUT.name, generation=1, token_ids=tokens.tobytes(),
        chunk_keys=keys, chunk_digests=[chunk_digest(chunk0 or b"")] * len(keys),
        tail_digest=chunk_digest(tail) if tail else b"",
        window_digest=chunk_digest(window) if window is not None else b""))
    if chunk0 is not None:
        yield pb.SpillRequest(chunk=pb.Payload(key=keys[0], data=chunk0))
    if tail:
        yield pb.SpillRequest(tail=pb.Payload(data=tail))
    if window is not None:
        yield pb.SpillRequest(window=pb.Payload(data=window))


async def _refused(tmp_path, messages) -> tuple[grpc.StatusCode, str, int]:
    """(status, details, peak RSS growth) of a Spill that must fail; nothing may be stored."""
    async with running_server(tmp_path) as (_, target), \
            grpc.aio.insecure_channel(target, options=[
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.KVTierStub(channel)
        with peak_rss_growth() as growth, pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Spill(messages)
        assert not (await stub.List(pb.ListRequest())).sessions
        assert (await stub.Stat(pb.StatRequest())).sessions == 0
    return info.value.code(), info.value.details(), growth[0]


def _one_chunk_session():
    tokens = as_tokens(tokens_for(LAYOUT.chunk_tokens))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, LAYOUT.chunk_tokens), scope=SCOPE)
    return tokens, enc.chunks[0]


async def test_a_chunk_with_one_zstd_section_is_refused_and_nothing_stored(tmp_path):
    tokens, honest = _one_chunk_session()
    raw = honest[-chunk_plan(LAYOUT, LAYOUT.chunk_tokens, False).payload_bytes:]
    # The measured case: the whole payload as one zstd-compressed section. Its header and
    # checksums are right; only the layout says a bundled chunk has 10 sections.
    one = forge(LAYOUT, 0, tokens, [(0, 0, 0, 0, len(raw), xxhash.xxh3_64_intdigest(raw))],
                len(raw), zstandard.ZstdCompressor().compress(raw), flags=FLAG_ZSTD)
    code, details, _ = await _refused(tmp_path, _spill_messages(tokens, one))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chunk 0" in details and "section table does not match layout" in details


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
async def test_a_chunk_claiming_a_huge_payload_is_refused_without_allocating(tmp_path,
                                                                             declare):
    tokens, _ = _one_chunk_session()
    # ~16 KB on the wire, a header and table that say 512 MiB of raw payload.
    bomb = forge(LAYOUT, 0, tokens, [(0, 0, 0, 0, BOMB, zeros_xxh3(BOMB))], BOMB,
                 zeros_frame(BOMB, declare), flags=FLAG_ZSTD)
    assert len(bomb) < 32 << 10
    code, details, growth = await _refused(tmp_path, _spill_messages(tokens, bomb))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "section table does not match layout" in details
    assert growth < RSS_SLACK


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
async def test_a_frame_bigger_than_its_layout_table_is_refused_without_allocating(
        tmp_path, declare):
    tokens, _ = _one_chunk_session()
    plan = chunk_plan(LAYOUT, LAYOUT.chunk_tokens, False)
    # The layout's own table, but the zstd frame holds 512 MiB (declared or not).
    bomb = forge(LAYOUT, 0, tokens, honest_rows(LAYOUT, LAYOUT.chunk_tokens, False),
                 plan.payload_bytes, zeros_frame(BOMB, declare), flags=FLAG_ZSTD)
    code, details, growth = await _refused(tmp_path, _spill_messages(tokens, bomb))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    want = f"declares {BOMB} bytes" if declare else "does not declare its content size"
    assert want in details, details
    assert growth < RSS_SLACK


async def test_a_window_part_claiming_the_whole_session_is_refused(tmp_path):
    n = 200 * LAYOUT.chunk_tokens  # 102,400 tokens: the old limit grew with them
    tokens = as_tokens(tokens_for(n))
    raw = chunk_plan(LAYOUT, n, True, WINDOW_KV).payload_bytes  # 216 MB of window K/V
    bomb = forge(LAYOUT, 0, tokens, honest_rows(LAYOUT, n, True, WINDOW_KV), raw,
                 zeros_frame(raw, True), flags=FLAG_ZSTD | FLAG_EPHEMERAL)
    assert len(bomb) < window_bytes_max(LAYOUT)  # small: only the token count gives it away
    code, details, growth = await _refused(tmp_path, _spill_messages(tokens, window=bomb))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"covers {n} tokens" in details and "at most 128" in details, details
    assert growth < RSS_SLACK


async def test_a_window_blob_over_the_layouts_bound_is_refused_by_size(tmp_path):
    tokens, chunk0 = _one_chunk_session()
    blob = b"\0" * (window_bytes_max(LAYOUT) + 1)
    code, details, _ = await _refused(tmp_path, _spill_messages(tokens, chunk0, window=blob))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {window_bytes_max(LAYOUT)} B" in details


async def test_token_ids_outside_the_vocabulary_are_refused_at_spill(tmp_path):
    tokens, _ = _one_chunk_session()
    tokens = tokens.copy()
    tokens[7] = LAYOUT.vocab_size  # 256: one past the bundled model's byte vocabulary
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, LAYOUT.chunk_tokens), scope=SCOPE)
    code, details, _ = await _refused(tmp_path, _spill_messages(tokens, enc.chunks[0]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "token id 256 at position 7" in details and "vocab_size 256" in details


async def test_valid_sessions_still_round_trip_bit_exact(tmp_path):
    n = 2 * LAYOUT.chunk_tokens + 102  # two chunks, a tail, 2 pending rows
    tokens = as_tokens(tokens_for(n)).copy()
    tokens[-1] = LAYOUT.vocab_size - 1  # the largest id is accepted
    persistent, window = streams_for(LAYOUT, n), window_for(LAYOUT, n)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        for zstd, session in ((None, "plain"), (3, "zstd")):
            enc = encode_session(LAYOUT, tokens, persistent, zstd_level=zstd, scope=SCOPE)
            blob = encode_window(LAYOUT, tokens, window)
            await kv.spill("acme", session, LAYOUT.name, tokens, chunks=list(enc.chunks.values()),
                           tail=enc.tail, window=blob, generation=1)
            got = await kv.restore("acme", session)
            assert got.token_ids.tolist() == tokens.tolist()
            assert_streams_equal(got.persistent, persistent)
            assert_streams_equal(got.window, window)


# ---- the same bounds hold in the store, the client, replay and the object tier -----------

def test_the_store_refuses_out_of_vocabulary_ids_itself():
    tokens = np.array([0, 255, 256], dtype="<u4")
    check_token_ids(LAYOUT, tokens[:2])
    with pytest.raises(InvalidRequest, match="token id 256 at position 2.*vocab_size 256"):
        check_spill(LAYOUT, tokens, [], b"", None, scope=SCOPE)


def test_decoders_refuse_a_window_bomb_without_allocating():
    from kvtier.codec import decode_window as client_decode_window
    from replay.state_codec import decode_window as replay_decode_window

    n = 200 * LAYOUT.chunk_tokens
    ids = np.asarray(as_tokens(tokens_for(n)))
    raw = chunk_plan(LAYOUT, n, True, WINDOW_KV).payload_bytes
    bomb = forge(LAYOUT, 0, ids, honest_rows(LAYOUT, n, True, WINDOW_KV), raw,
                 zeros_frame(raw, True), flags=FLAG_ZSTD | FLAG_EPHEMERAL)
    with peak_rss_growth() as growth:
        with pytest.raises(ChunkCorrupt, match="at most 128"):
            client_decode_window(LAYOUT, ids, bomb)
        with pytest.raises(ChunkCorrupt, match="at most 128"):
            replay_decode_window(LAYOUT, ids, bomb, 4)
    assert growth[0] < RSS_SLACK


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
def test_decode_chunk_refuses_a_frame_bomb_without_allocating(declare):
    ids = np.arange(LAYOUT.chunk_tokens) % 256
    plan = chunk_plan(LAYOUT, LAYOUT.chunk_tokens, False)
    bomb = forge(LAYOUT, 0, ids, honest_rows(LAYOUT, LAYOUT.chunk_tokens, False),
                 plan.payload_bytes, zeros_frame(BOMB, declare), flags=FLAG_ZSTD)
    with peak_rss_growth() as growth, pytest.raises(ChunkCorrupt, match="declare"):
        decode_chunk(bomb, LAYOUT)
    assert growth[0] < RSS_SLACK


@pytest.mark.parametrize("declare", [True, False], ids=["declared", "undeclared"])
async def test_the_object_tier_refuses_an_object_that_expands_past_its_bound(tmp_path,
                                                                             declare):
    tier = ObjectTier(tmp_path, 1 << 30, ObjectTierConfig(compression_level=1,
                                                          max_value_bytes=64 << 20))
    await tier.put("k", b"v" * 1000)
    assert bytes(await tier.get("k")) == b"v" * 1000
    [path] = list(tmp_path.rglob("k.zst"))
    path.write_bytes(zeros_frame(BOMB, declare))
    with peak_rss_growth() as growth, pytest.raises(ChunkCorrupt, match="declares"):
        await tier.get("k")
    assert growth[0] < RSS_SLACK
    with pytest.raises(InvalidRequest, match="max_value_bytes"):
        await tier.put("big", bytes((64 << 20) + 1))


# ---- the bounds themselves come from the layout -------------------------------------------

def test_chunk_token_bounds_come_from_the_layout():
    assert max_chunk_tokens(LAYOUT, False) == LAYOUT.chunk_tokens == 512
    assert max_chunk_tokens(LAYOUT, True, WINDOW_KV) == LAYOUT.window_tokens == 128
    assert max_chunk_tokens(LAYOUT, True, ("enc.tail", "dec.tail")) == 3  # m - 1
    assert max_chunk_tokens(LAYOUT, True) == 3  # one chunk of all of them: both bounds
    # W = 128 tokens x 2,112 B of window K/V, 3 pending rows x 1,536 B, two chunk headers
    # and zstd's room: about 277 KB whatever the session's length.
    assert 128 * 2_112 + 3 * 1_536 < window_bytes_max(LAYOUT) < 128 * 2_112 + 3 * 1_536 + 8_192


def test_layouts_state_their_vocabulary_and_window():
    from kvstore.format.registry import get_layout

    assert (LAYOUT.vocab_size, LAYOUT.window_tokens) == (256, 128)
    assert get_layout("deepseek-v3").vocab_size == 129_280
    assert get_layout("deepseek-llm-67b").vocab_size == 102_400
    assert get_layout("deepseek-v3").window_tokens == 0  # no window streams
    window = Stream("w", (8,), bits=8, group_size=8, persistent=False)
    latent = Stream("a", (8,), bits=4, group_size=8)
    with pytest.raises(InvalidRequest, match="window_tokens"):
        LayoutSpec("no-w", (latent, window), chunk_tokens=4)
    with pytest.raises(InvalidRequest, match="window_tokens"):
        LayoutSpec("w-without-window", (latent,), chunk_tokens=4, window_tokens=8)
    with pytest.raises(InvalidRequest, match="vocab_size"):
        LayoutSpec("no-vocab", (latent,), chunk_tokens=4, vocab_size=0)
    spec = LayoutSpec("ok", (latent, window), chunk_tokens=4, window_tokens=8, vocab_size=9)
    assert spec.layout_hash != LayoutSpec("ok", (latent, window), chunk_tokens=4,
                                          window_tokens=8, vocab_size=10).layout_hash
