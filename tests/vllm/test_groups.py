"""How the connector keeps each kind of vLLM KV cache group, on vLLM's real spec objects
and scheduler types (no engine): full groups whole, sliding groups only the trailing
window vLLM's ``SlidingWindowManager`` needs for a hit, groups the engine rebuilds never,
MLA latents as the engine's page bytes; one layout per group."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    generate_scheduler_kv_cache_config,
)
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import Request  # noqa: E402

from kvstore.format.errors import UnsupportedModel  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.layout import (  # noqa: E402
    FULL,
    REBUILT,
    SLIDING,
    cache_groups,
    hit_alignment,
    rank_layout,
    with_worker_pages,
    worker_pages,
)
from kvtier.integrations.vllm.metadata import KVTierHandshake  # noqa: E402
from kvtier.integrations.vllm.scheduler import SchedulerSide, _Match, window_hit  # noqa: E402

BS = 16
WINDOW = 64


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 3, "vocab_size": 1000,
        "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}))
    model = ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True,
                        max_model_len=2048)
    return VllmConfig(model_config=model)


def attention(cls=FullAttentionSpec, **extra):
    return cls(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, **extra)


def hybrid() -> KVCacheConfig:
    """A full group, a sliding one and one the engine replays (DeepSeek-V4.1's)."""
    replayed = SlidingWindowMLASpec(block_size=BS, num_kv_heads=1, head_size=64,
                                    dtype=torch.uint8, sliding_window=WINDOW,
                                    bounded_replay=True)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.2.self_attn.attn"], attention()),
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                         attention(SlidingWindowSpec, sliding_window=WINDOW)),
        KVCacheGroupSpec(["model.layers.3.attn"], replayed)])


def test_each_group_is_kept_as_its_kind_needs(vllm_config):
    groups = cache_groups(vllm_config, hybrid())
    assert [(g.group, g.kind, g.layers, g.window) for g in groups] == [
        (0, FULL, 1, 0), (1, SLIDING, 2, WINDOW), (2, REBUILT, 1, WINDOW)]
    assert [g.stored for g in groups] == [True, True, False]
    names = [rank_layout(g, 0, "auto").name for g in groups[:2]]
    # one layout per group, the kind and window in its name
    assert names[0].startswith("vllm-cpu_attn.") and names[0].endswith("-1x2x16-b16-bf16-v1000")
    assert names[1].startswith("vllm-g1-swa64-cpu_attn.")
    assert names[1].endswith("-2x2x16-b16-bf16-v1000")
    assert hit_alignment(groups) == BS
    # a sliding window with vLLM's hybrid manager off: the engine keeps every block, so
    # it is a full group (no contradictory refusal)
    off = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention(sliding_window=WINDOW))])
    assert cache_groups(vllm_config, off)[0].kind == FULL


def test_an_mla_group_is_stored_as_its_pages(vllm_config):
    latent = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                              dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(3)], latent)])
    (group,) = cache_groups(vllm_config, config)
    layout = rank_layout(group, 0, "auto")
    assert group.arrangement == "raw" and group.page_bytes == (latent.page_size_bytes,) * 3
    assert layout.name == f"vllm-mlaattentionspec-3x{latent.page_size_bytes}-b16-bf16-v1000"
    (page,) = layout.streams
    assert (page.entry_shape, page.layers, page.tokens_per_entry) == (
        (1, BS * 576 * 2), 3, BS)
    # the engine's bytes per token, nothing more
    assert layout.persistent_bytes_per_token == 3 * 576 * 2


def test_a_group_of_latent_layers_of_three_page_sizes_has_one_layout_on_both_sides(
        vllm_config):
    """DeepSeek-V4's compressed global group: the worker's spec is every layer's
    (UniformTypeKVCacheSpecs), the scheduler's its first layer's alone; with the page sizes
    the worker sends (real content, not vLLM's padded page; 1,168 B per 256-token block is
    no whole number of bytes per token) both derive the same layout."""
    def compressed(tokens_per_state: int, record: int) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512,
                                dtype=torch.uint8, tokens_per_state=tokens_per_state,
                                state_content_bytes=record, alignment=576,
                                model_version="deepseek_v4", cache_dtype_str="fp8_ds_mla")

    names = ["model.layers.1.attn.indexer.k_cache", "model.layers.1.attn",
             "model.layers.2.attn"]
    specs = dict(zip(names, (compressed(4, 132), compressed(4, 584), compressed(128, 584)),
                     strict=True))
    assert [s.page_size_bytes for s in specs.values()] == [8640, 37440, 1728]  # padded
    worker = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(specs))])
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert type(scheduler.kv_cache_groups[0].kv_cache_spec) is MLAAttentionSpec
    (theirs,) = cache_groups(vllm_config, worker)
    assert theirs.page_bytes == (8448, 37376, 1168)
    handshake = KVTierHandshake(worker_pages([theirs]))
    mine = with_worker_pages(cache_groups(vllm_config, scheduler), handshake.page_bytes)
    layout = rank_layout(theirs, 0, "auto")
    assert rank_layout(mine[0], 0, "auto") == layout
    assert layout.name == "vllm-mlaattentionspec-3x8448_37376_1168-b256-uint8-v1000"
    assert [(s.name, s.entry_shape, s.layers, s.tokens_per_entry) for s in layout.streams] == [
        ("page", (1, 8448), 1, 256), ("page1", (1, 37376), 1, 256),
        ("page2", (1, 1168), 1, 256)]
    with pytest.raises(UnsupportedModel, match="page sizes"):  # the workers said nothing
        with_worker_pages(cache_groups(vllm_config, scheduler), {})


def test_the_window_is_what_vllms_sliding_manager_needs_for_a_hit(vllm_config):
    sliding = cache_groups(vllm_config, hybrid())[1]
    need = SlidingWindowManager._contiguous_blocks_for_hit(WINDOW, BS, False)
    for end in range(WINDOW, 20 * BS, BS):
        assert end // BS - sliding.window_start(end) == need
    assert sliding.window_start(BS) == 0  # a hit shorter than the window needs every block
    groups = cache_groups(vllm_config, hybrid())
    assert window_hit(groups, {1: {6, 7, 8, 9}}, 10 * BS, BS) == 10 * BS
    assert window_hit(groups, {1: {2, 3, 4, 5, 8}}, 10 * BS, BS) == 6 * BS
    assert window_hit(groups, {1: {6, 8, 9}}, 10 * BS, BS) == 0


def plans(side: SchedulerSide, req: Request, ids: tuple[list[int], ...], external: int):
    side.update_state_after_alloc(req, KVCacheBlocks(tuple(
        [KVCacheBlock(i) for i in group] for group in ids)), external)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, ids)]
    out.num_scheduled_tokens = {req.request_id: len(req.all_token_ids) - external}
    return side.build_connector_meta(out)


def test_a_sliding_group_saves_and_loads_only_its_trailing_window(vllm_config):
    groups = cache_groups(vllm_config, hybrid())
    config = ConnectorConfig.from_extra({"model_fingerprint": "m"})
    layouts = {g.group: [rank_layout(g, 0, "auto")] for g in groups if g.stored}
    # no lookups here: the plans alone
    link = SimpleNamespace(up=True, close=lambda: None)
    side = SchedulerSide(config, groups, layouts, link, alignment=BS)
    try:
        tokens = list(range(1, 10 * BS + 6))  # 10 whole blocks and 5 tokens
        ids = (list(range(1, 12)), list(range(21, 32)), list(range(41, 52)))
        meta = plans(side, Request("r", tokens, SamplingParams(max_tokens=4), None), ids, 0)
        saved = {(s.group, s.first_chunk, s.block_ids) for s in meta.saves}
        # the full group every whole block; the sliding group the window at 160 (the
        # prompt's longest hit): blocks 6-9; the replayed group nothing
        assert saved == {(0, 0, tuple(range(1, 11))), (1, 6, tuple(range(27, 31)))}
        # a hit of 160 tokens past vLLM's own 32: the sliding group's blocks below the
        # window are null (0) and never loaded
        req = Request("h", tokens, SamplingParams(max_tokens=4), None)
        side._matches["h"] = _Match(len(tokens), 2 * BS, 10 * BS, None, 0)
        ids = (list(range(1, 12)), [0] * 6 + list(range(27, 32)), [0] * 11)
        meta = plans(side, req, ids, 8 * BS)
        loaded = {(p.group, p.first_chunk, p.block_ids) for p in meta.loads}
        assert loaded == {(0, 2, tuple(range(3, 11))), (1, 6, (27, 28, 29, 30))}
        stats = side.take_stats().data
        assert (stats["hits"], stats["window_loads"], stats["window_replays"]) == (1, 1, 1)
    finally:
        side.shutdown()


def test_strided_views_of_one_allocation_round_trip_as_pages():
    """DeepSeek-V4 hands over several strided uint8 and fp32 views of one buffer: each
    layer's pages go out and back byte for byte, into those views, and layers of two page
    sizes go in two streams."""
    from kvtier.integrations.vllm.repack import PagedLayout
    from kvtier.integrations.vllm.stats import StatsCounter
    from kvtier.integrations.vllm.transfers import Store, gathered

    def views(buffer: torch.Tensor) -> list[torch.Tensor]:
        # per block: 512 B of latent, 256 fp32 of state, 512 B of latent: one page of 2048 B
        return [buffer[:, :512], buffer[:, 512:1536].view(torch.float32), buffer[:, 1536:]]

    g = torch.Generator().manual_seed(3)
    source = torch.randint(0, 256, (8, 2048), generator=g, dtype=torch.uint8)
    target = torch.zeros_like(source)
    paged = PagedLayout("raw", 1, 16, BS, pages=True)  # a raw page's heads: not read
    for layer, size in zip(views(source), (512, 1024, 512), strict=True):
        paged.check(layer, size)
    store = Store(None, None, None, paged, views(source), torch.uint8, StatsCounter())
    assert store.page_streams == [("page", 0), ("page1", 0), ("page", 1)]
    index = store.block_index([5, 2])
    pages = gathered([paged.take(layer, index) for layer in store.layers], store)
    assert {name: tuple(t.shape) for name, t in pages.items()} == {
        "page": (2, 2, 512), "page1": (1, 2, 1024)}
    for layer, (name, at) in zip(views(target), store.page_streams, strict=True):
        paged.put_pages(layer, store.block_index([1, 6]), pages[name][at])
    assert torch.equal(target[1], source[5]) and torch.equal(target[6], source[2])
    assert not target[[0, 2, 3, 4, 5, 7]].any()
