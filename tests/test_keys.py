"""Chained chunk keys (kvstore.keys): a prefix's keys are a prefix of the longer
sequence's keys, which is what dedupe of shared prefixes relies on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidRequest
from kvstore.keys import ROOT_PARENT, chain_keys, chunk_key

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@settings(max_examples=60, deadline=None)
@given(ids=tokens, cut=st.integers(0, 80), chunk=st.integers(1, 9),
       layout=st.sampled_from(["a@1", "b@2"]))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(ids, cut, chunk, layout):
    whole = chain_keys(layout, ids, chunk)
    part = chain_keys(layout, ids[:cut], chunk)
    assert len(whole) == len(ids) // chunk and len(part) == min(cut, len(ids)) // chunk
    assert whole[:len(part)] == part
    assert len(set(whole)) == len(whole)  # each key names its whole prefix: no repeats


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80),
       chunk=st.integers(1, 9), data=st.data())
def test_a_changed_token_changes_its_chunk_key_and_every_later_one(ids, chunk, data):
    whole = chain_keys("a@1", ids, chunk)
    at = data.draw(st.integers(0, len(ids) - 1))
    other = list(ids)
    other[at] = (other[at] + 1) % 2**32
    changed = chain_keys("a@1", other, chunk)
    first = at // chunk  # the chunk holding the changed token
    assert changed[:first] == whole[:first]
    assert all(a != b for a, b in zip(changed[first:], whole[first:], strict=True))
    assert len(changed) == len(whole)
    assert chain_keys("b@2", ids, chunk) != whole or not whole  # the layout is in every key


def test_the_first_key_chains_from_the_root_and_keys_are_16_bytes_of_hex():
    ids = np.arange(8)
    keys = chain_keys("a@1", ids, 4)
    assert keys[0] == chunk_key("a@1", ROOT_PARENT, ids[:4])
    assert keys[1] == chunk_key("a@1", keys[0], ids[4:])
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    with pytest.raises(InvalidRequest):
        chain_keys("a@1", ids, 0)
