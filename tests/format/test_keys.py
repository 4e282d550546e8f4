"""Chunk identity (kvstore.format.keys): chained keys bind the dedupe domain, layout, model
fingerprint and a chunk's whole prefix; block keys add the digest of the bytes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.format.errors import InvalidRequest
from kvstore.format.keys import (
    ROOT_PARENT,
    block_key,
    block_keys,
    chain_keys,
    chunk_digest,
    chunk_key,
    dedupe_scope,
    independent_keys,
    shared_domain,
    split_block_key,
    token_bytes,
)

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)
SCOPE = dedupe_scope("acme")


@settings(max_examples=60, deadline=None)
@given(ids=tokens, cut=st.integers(0, 80), chunk=st.integers(1, 9),
       layout=st.sampled_from(["a@1", "b@2"]))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(ids, cut, chunk, layout):
    whole = chain_keys(layout, ids, chunk, scope=SCOPE)
    part = chain_keys(layout, ids[:cut], chunk, scope=SCOPE)
    assert len(whole) == len(ids) // chunk and len(part) == min(cut, len(ids)) // chunk
    assert whole[:len(part)] == part
    assert len(set(whole)) == len(whole)  # each key names its whole prefix: no repeats


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
       chunk=st.integers(1, 9), data=st.data())
def test_a_changed_token_changes_its_chunk_key_and_every_later_one(ids, chunk, data):
    whole = chain_keys("a@1", ids, chunk, scope=SCOPE)
    at = data.draw(st.integers(0, len(ids) - 1))
    other = list(ids)
    other[at] = (other[at] + 1) % 2**32
    changed = chain_keys("a@1", other, chunk, scope=SCOPE)
    first = at // chunk  # the chunk holding the changed token
    assert changed[:first] == whole[:first]
    assert all(a != b for a, b in zip(changed[first:], whole[first:], strict=True))
    assert len(changed) == len(whole)
    # the layout is in every key
    assert chain_keys("b@2", ids, chunk, scope=SCOPE) != whole or not whole


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=40),
       change=st.sampled_from(["tenant", "shared", "fingerprint"]))
def test_the_domain_and_the_model_fingerprint_are_in_every_key(ids, change):
    whole = chain_keys("a@1", ids, 4, scope=SCOPE, model_fingerprint="base-v1")
    other = {
        "tenant": dict(scope=dedupe_scope("beta"), model_fingerprint="base-v1"),
        "shared": dict(scope=dedupe_scope("acme", "acme"), model_fingerprint="base-v1"),
        "fingerprint": dict(scope=SCOPE, model_fingerprint="finetune-v1"),
    }[change]
    keys = chain_keys("a@1", ids, 4, **other)
    assert all(a != b for a, b in zip(keys, whole, strict=True))


def test_fields_are_length_prefixed_so_moving_a_boundary_changes_the_key():
    ids = np.arange(4)
    # The same bytes split differently between domain, layout and fingerprint.
    assert chunk_key("ab", "c", "", ROOT_PARENT, ids) != chunk_key("a", "bc", "", ROOT_PARENT, ids)
    assert chunk_key("s", "l", "fp", ROOT_PARENT, ids) != chunk_key("s", "lf", "p", ROOT_PARENT,
                                                                    ids)


def test_the_key_is_the_documented_blake2b_128_over_length_prefixed_fields():
    ids = np.arange(4, dtype="<u4")
    h = hashlib.blake2b(digest_size=16, person=b"kvtier-chunk-v2")
    for part in (b"tenant:acme", b"a@1", b"fp", b""):
        h.update(len(part).to_bytes(4, "little") + part)
    h.update(ids.tobytes())
    assert chunk_key(SCOPE, "a@1", "fp", ROOT_PARENT, ids) == h.hexdigest()


def test_the_first_key_chains_from_the_root_and_keys_are_16_bytes_of_hex():
    ids = np.arange(8)
    keys = chain_keys("a@1", ids, 4, scope=SCOPE)
    assert keys[0] == chunk_key(SCOPE, "a@1", "", ROOT_PARENT, ids[:4])
    assert keys[1] == chunk_key(SCOPE, "a@1", "", keys[0], ids[4:])
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    with pytest.raises(InvalidRequest):
        chain_keys("a@1", ids, 0, scope=SCOPE)


def test_scopes_keep_tenants_and_shared_domains_apart():
    assert dedupe_scope("acme") != dedupe_scope("x", "acme")
    assert shared_domain(dedupe_scope("x", "public")) == "public"
    assert shared_domain(dedupe_scope("acme")) == ""


def test_block_keys_bind_the_digest_of_the_bytes_and_split_back():
    ids = np.arange(8)
    chunks = [b"first chunk", b"second chunk"]
    keys = block_keys("a@1", ids, 4, chunks, scope=SCOPE)
    chains = chain_keys("a@1", ids, 4, scope=SCOPE)
    assert [split_block_key(k) for k in keys] == [(c, chunk_digest(d))
                                                 for c, d in zip(chains, chunks, strict=True)]
    assert len(chunk_digest(b"x")) == 32 and chunk_digest(b"x") != chunk_digest(b"y")
    other = block_keys("a@1", ids, 4, [b"first chunk", b"other bytes"], scope=SCOPE)
    assert other[0] == keys[0] and other[1] != keys[1]  # other bytes: another version
    for bad in (chains[0], chains[0] + ".zz", chains[0] + "." + "00" * 16):
        with pytest.raises(InvalidRequest):
            split_block_key(bad)
    with pytest.raises(InvalidRequest):
        block_key(chains[0], b"short")
    with pytest.raises(InvalidRequest):
        block_keys("a@1", ids, 4, chunks[:1], scope=SCOPE)


def test_token_bytes_takes_any_ids_that_fit_in_uint32_and_refuses_the_rest():
    for dtype in (np.uint8, np.uint16, np.uint32, np.int64):
        assert token_bytes(np.array([0, 7, 255], dtype)) == \
            np.array([0, 7, 255], "<u4").tobytes()
    for bad in (np.array([-1], np.int64), np.array([1 << 32], np.int64),
                np.array([1 << 32], np.uint64)):
        with pytest.raises(InvalidRequest, match="uint32"):
            token_bytes(bad)


def test_independent_keys_are_each_chunks_first_key_alone():
    ids = np.arange(12, dtype=np.uint32)
    assert independent_keys("l@1", ids, 4, scope=SCOPE, model_fingerprint="m") == [
        chain_keys("l@1", ids[i:i + 4], 4, scope=SCOPE, model_fingerprint="m")[0]
        for i in (0, 4, 8)]
    assert independent_keys("l@1", ids[:11], 4, scope=SCOPE)[1] != \
        chain_keys("l@1", ids[:11], 4, scope=SCOPE)[1]  # not chained, and no partial chunk
    assert len(independent_keys("l@1", ids[:11], 4, scope=SCOPE)) == 2
