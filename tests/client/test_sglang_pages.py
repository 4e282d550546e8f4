"""How an SGLang page is named and stored (kvtier.integrations.sglang.pages), without
SGLang: which ranks' pages are one object, who writes them, and a page's chunk holding its
bytes verbatim, refused under another name or size."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvstore.format.checks import restored_chunk_check
from kvstore.format.errors import CodecError, UnsupportedModel
from kvtier.integrations.sglang.pages import PageFormat, Shard, key_tokens


@dataclass
class Pool:
    """The one call PageFormat makes of a host pool."""

    values: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "page_first"

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.values, dtype=self.dtype)


def test_mha_pages_are_per_tp_rank_and_mla_kv_one_object_written_by_the_dcp_writer():
    mha = [Shard(tp_rank=r, tp_size=2) for r in range(2)]
    assert mha[0].suffix("kv") != mha[1].suffix("kv")
    assert all(s.writes("kv") for s in mha)
    mla = [Shard(tp_rank=r, tp_size=2, is_mla=True) for r in range(2)]
    assert mla[0].suffix("kv") == mla[1].suffix("kv")
    assert [s.writes("kv") for s in mla] == [True, False]
    # Mamba state is TP-sharded even in an MLA model, and every rank writes its own
    assert mla[0].suffix("mamba") != mla[1].suffix("mamba") and mla[1].writes("mamba")
    # pipeline stages hold other layers; DCP shards other slices of a page
    assert Shard(pp_rank=0, pp_size=2).suffix("kv") != Shard(pp_rank=1, pp_size=2).suffix("kv")
    dcp = [Shard(tp_rank=r, tp_size=4, dcp_rank=r % 2, dcp_size=2, is_mla=True)
           for r in range(4)]
    assert dcp[0].suffix("kv") == dcp[2].suffix("kv") != dcp[1].suffix("kv")
    assert [s.writes("kv") for s in dcp] == [True, True, False, False]
    assert dcp[0].suffix("kv") != Shard(tp_size=8, dcp_size=2, is_mla=True).suffix("kv")


def test_a_page_is_stored_verbatim_and_read_back_only_under_its_name():
    fmt = PageFormat.of("kv", Pool(512))
    page = torch.randint(-(1 << 15), 1 << 15, (512,), dtype=torch.int16).view(torch.bfloat16)
    tokens = key_tokens(fmt.name("abc", Shard()))
    chunk = fmt.encode(page, tokens)
    restored_chunk_check(fmt.spec, tokens, 0, None)(chunk)
    payload = fmt.payload(chunk)
    assert payload is not None
    assert torch.equal(fmt.flat_pages([payload])[0].view(torch.int16), page.view(torch.int16))
    other = key_tokens(fmt.name("abd", Shard()))
    with pytest.raises(CodecError):
        restored_chunk_check(fmt.spec, other, 0, None)(chunk)
    # a chunk of another page size is no page of this pool
    assert PageFormat.of("kv", Pool(256)).payload(chunk) is None


def test_names_bind_pool_dtype_and_memory_layout():
    names = {PageFormat.of(pool, Pool(64, dtype, layout)).name("k", Shard())
             for pool in ("kv", "swa") for dtype in (torch.bfloat16, torch.float16)
             for layout in ("page_first", "layer_first")}
    assert len(names) == 8
    assert len({tuple(key_tokens(n)) for n in names}) == 8


def test_a_page_that_does_not_split_into_key_tokens_is_refused():
    with pytest.raises(UnsupportedModel):
        PageFormat.of("kv", Pool(8))
