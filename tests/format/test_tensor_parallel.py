"""One layout per tensor-parallel rank: each rank's heads under its own layout id, so the
ranks' chunk keys never collide and no rank (of its TP size or another) reads another's
chunks."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.format.chunk import decode_chunk, encode_chunk
from kvstore.format.errors import InvalidRequest, LayoutMismatch
from kvstore.format.keys import chain_keys
from kvstore.format.layout import BaselineKV, LayoutSpec, Stream
from kvstore.format.tensor_parallel import shard_heads, tp_shard_layout
from tests.support.chunks import make_streams

GQA = LayoutSpec("gqa", (Stream("k", (8, 16), bits=8, format="fp8_e4m3", layers=2),
                         Stream("v", (8, 16), bits=16, format="fp16", layers=2),
                         Stream("latent", (32,), bits=4, group_size=16)),
                 chunk_tokens=16, baseline=BaselineKV(2, 8, 16))


def test_each_rank_holds_its_share_of_the_heads_under_its_own_name():
    ranks = [tp_shard_layout(GQA, 4, r) for r in range(4)]
    assert [r.name for r in ranks] == [f"gqa-tp4r{r}" for r in range(4)]
    for spec in ranks:
        assert spec.stream("k").entry_shape == spec.stream("v").entry_shape == (2, 16)
        assert spec.stream("k").format == "fp8_e4m3"
        assert spec.stream("latent") == GQA.stream("latent")  # unsharded: whole on every rank
        assert spec.baseline == BaselineKV(2, 2, 16)
    ids = {spec.layout_id for spec in ranks} | {tp_shard_layout(GQA, 2, r).layout_id
                                                for r in range(2)}
    assert len(ids) == 6 and GQA.layout_id not in ids
    assert tp_shard_layout(GQA, 1, 0) is GQA
    assert [shard_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4),
                                                       range(4, 6), range(6, 8)]


def test_more_ranks_than_heads_replicate_one_head_per_rank():
    assert [shard_heads(2, 8, r) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    spec = tp_shard_layout(GQA, 16, 5)
    assert spec.stream("k").entry_shape == (1, 16) and spec.name == "gqa-tp16r5"


@pytest.mark.parametrize("tp_size,rank,sharded", [(3, 0, None), (4, 4, None), (0, 0, None),
                                                  (2, 0, ("latent",)), (2, 0, ("nope",))])
def test_a_bad_sharding_is_refused(tp_size, rank, sharded):
    with pytest.raises(InvalidRequest):
        tp_shard_layout(GQA, tp_size, rank, sharded)


def test_ranks_keys_differ_and_a_rank_cannot_read_anothers_chunk():
    tokens = np.arange(16)
    r0, r1, other = tp_shard_layout(GQA, 2, 0), tp_shard_layout(GQA, 2, 1), \
        tp_shard_layout(GQA, 4, 0)
    keys = [chain_keys(spec.layout_id, tokens, 16, scope="t") for spec in (r0, r1, other)]
    assert len({k[0] for k in keys}) == 3
    buf = encode_chunk(r0, 0, tokens, make_streams(r0, 16))
    decode_chunk(buf, r0)
    for spec in (r1, other, GQA):
        with pytest.raises(LayoutMismatch):
            decode_chunk(buf, spec)
