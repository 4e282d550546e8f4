"""Session manifests (kvstore.session.manifest): any manifest round-trips through its encoding
exactly, and any changed byte of an encoding is refused as corrupt."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.format.errors import ChunkCorrupt
from kvstore.format.hints import ResumeHint
from kvstore.session.manifest import SessionManifest

# Tenant and session ids are plain: no '/', no control characters, at most 256 bytes.
names = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/"),
                min_size=1, max_size=40)
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
times = st.floats(0, 4e9, allow_nan=False)
hints = st.none() | st.builds(ResumeHint, st.none() | st.floats(0, 1e7),
                              st.integers(-2**31, 2**31))


@st.composite
def manifests(draw) -> SessionManifest:
    chunks = draw(st.integers(0, 5))
    return SessionManifest(
        tenant=draw(names), session_id=draw(names), layout_id=draw(texts),
        generation=draw(st.integers(0, 2**53)),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=64)),
        chunk_keys=tuple(draw(st.lists(texts, min_size=chunks, max_size=chunks))),
        chunk_sizes=tuple(draw(st.lists(st.integers(0, 2**40), min_size=chunks,
                                        max_size=chunks))),
        tail=draw(st.binary(max_size=64)),
        window_tier=draw(st.none() | texts), window_key=draw(st.none() | texts),
        window_replayed=draw(st.integers(0, 2**32)),
        created_at=draw(times), updated_at=draw(times), last_access=draw(times),
        ttl_s=draw(st.none() | st.floats(1e-3, 1e9)), hint=draw(hints))


FIELDS = [f.name for f in dataclasses.fields(SessionManifest) if f.name != "token_ids"]


@settings(max_examples=80, deadline=None)
@given(manifests())
def test_a_manifest_round_trips_exactly(manifest):
    encoded = manifest.encode()
    back = SessionManifest.decode(encoded)
    for name in FIELDS:
        assert getattr(back, name) == getattr(manifest, name), name
    assert back.token_ids.tobytes() == manifest.token_ids.tobytes()
    assert back.encode() == encoded


@settings(max_examples=80, deadline=None)
@given(manifests(), st.data())
def test_any_changed_byte_is_refused(manifest, data):
    encoded = bytearray(manifest.encode())
    at = data.draw(st.integers(0, len(encoded) - 1))
    encoded[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ChunkCorrupt):
        SessionManifest.decode(bytes(encoded))
    with pytest.raises(ChunkCorrupt):
        SessionManifest.decode(bytes(encoded[:at]))


@pytest.mark.parametrize(("top", "width"), [(0, 1), (255, 1), (256, 2), (65535, 2),
                                            (65536, 4), (2**32 - 1, 4)])
def test_token_ids_take_the_fewest_bytes_that_hold_them(top, width):
    ids = [7, top, 3] * 100
    manifest = SessionManifest(tenant="t", session_id="s", layout_id="l", generation=1,
                               token_ids=ids, chunk_keys=(), chunk_sizes=())
    encoded = manifest.encode()
    body_len = int.from_bytes(encoded[6:10], "little")
    assert len(encoded) == 10 + body_len + width * len(ids) + 8  # head, JSON, ids, check
    decoded = SessionManifest.decode(encoded)
    assert decoded.token_ids.dtype == "<u4" and decoded.token_ids.tolist() == ids


def test_a_version_2_manifest_with_uint32_token_ids_is_still_read():
    import json
    import struct

    import xxhash

    head = {"tenant": "t", "session_id": "s", "layout_id": "l", "generation": 4,
            "chunk_keys": ["k"], "chunk_sizes": [9], "num_tokens": 3, "tail_len": 2,
            "window_tier": None, "window_key": None, "window_replayed": 0,
            "created_at": 1.0, "updated_at": 2.0, "last_access": 3.0, "ttl_s": None,
            "hint": None, "model_fingerprint": "", "dedupe_scope": "tenant:t",
            "spill_digest": "", "receipt": None}
    body = json.dumps(head).encode()
    out = (struct.pack("<4sHI", b"KVSM", 2, len(body)) + body
           + struct.pack("<3I", 1, 70000, 2**32 - 1) + b"tl")
    manifest = SessionManifest.decode(out + struct.pack("<Q", xxhash.xxh3_64_intdigest(out)))
    assert manifest.token_ids.tolist() == [1, 70000, 2**32 - 1]
    assert manifest.tail == b"tl" and manifest.generation == 4 and manifest.chunk_keys == ("k",)
