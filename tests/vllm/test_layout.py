"""The layout of a vLLM engine's cache: from its real config, one per TP rank, and refused
for caches it cannot hold exactly; the extra_config is checked."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import ModelConfig, VllmConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
)

from kvstore.format.errors import UnsupportedModel  # noqa: E402
from kvstore.format.layout import layout_to_json  # noqa: E402
from kvtier.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.integrations.vllm.layout import (  # noqa: E402
    CacheShape,
    cache_shape,
    check_arrangement,
    rank_layout,
    rank_session,
)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


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


def kv_config(spec, groups=1) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)] * groups)


def full(dtype=torch.bfloat16, **extra) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=16, dtype=dtype, **extra)


def test_layout_of_a_real_config(vllm_config):
    shape = cache_shape(vllm_config, kv_config(full()))
    # head size 16: CPU_ATTN's vec16 path
    assert shape == CacheShape(layers=3, kv_heads=2, head_size=16, block_size=128,
                               vocab_size=1000, dtype=torch.bfloat16, tp_size=1,
                               arrangement="cpu_attn.vec16", layer_names=tuple(LAYERS))
    spec = rank_layout(shape, 0, "portable")
    assert spec.name == "vllm-3x2x16-b128-bf16-v1000"
    assert spec.chunk_tokens == 128 and spec.vocab_size == 1000
    assert spec.requires_model_fingerprint and spec.replayer == "none"
    assert [(s.name, s.entry_shape, s.format, s.layers, s.persistent) for s in spec.streams] == [
        ("k", (2, 16), "bf16", 3, True), ("v", (2, 16), "bf16", 3, True)]
    # a token's K and V of every layer, bf16
    assert spec.persistent_bytes_per_token == 2 * 3 * 2 * 16 * 2
    # a rank's cache that does not hold the heads the TP rule gives it is refused
    with pytest.raises(UnsupportedModel, match="KV heads"):
        cache_shape(vllm_config, kv_config(FullAttentionSpec(
            block_size=128, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)))


def test_value_formats():
    def shape(dtype):
        return CacheShape(3, 2, 16, 16, 100, dtype, 1)

    fp16 = rank_layout(shape(torch.float16), 0, "portable")
    assert fp16.name == "vllm-3x2x16-b16-fp16-v100" and fp16.stream("v").format == "fp16"
    fp8 = rank_layout(shape(torch.bfloat16), 0, "fp8_e4m3")
    assert fp8.stream("k").format == "fp8_e4m3" and fp8.stream("k").bits == 8
    int8 = rank_layout(shape(torch.bfloat16), 0, "int8")
    assert int8.stream("k").format == "int8" and int8.stream("k").group_size == 16
    int4 = rank_layout(shape(torch.bfloat16), 0, "int4")
    assert int4.name == "vllm-3x2x16-b16-int4-v100"
    assert [(s.format, s.bits, s.group_size) for s in int4.streams] == [("int4", 4, 16)] * 2
    # a token's K and V of every layer: 16 nibbles and one fp16 scale per head
    assert int4.persistent_bytes_per_token == 2 * 3 * 2 * (8 + 2)
    wide = rank_layout(CacheShape(3, 2, 128, 16, 100, torch.bfloat16, 1), 0, "int4")
    assert wide.stream("k").group_size == 32  # 4 scales per head of 128
    assert wide.persistent_bytes_per_token / wide.bf16_baseline_bytes_per_token == 0.28125
    assert len({fp16.layout_id, fp8.layout_id, int8.layout_id, int4.layout_id}) == 4
    with pytest.raises(UnsupportedModel, match="exactly"):
        rank_layout(shape(torch.float32), 0, "portable")
    assert rank_layout(shape(torch.float32), 0, "int8").stream("v").bits == 8


def test_engine_pages_layout_binds_the_block_arrangement(vllm_config):
    """value_format auto: one page stream, a whole block of a layer per entry, and the
    arrangement in the name, so engines whose blocks differ never share a chunk."""
    shape = cache_shape(vllm_config, kv_config(full()))
    spec = rank_layout(shape, 0, "auto")
    assert spec.name == "vllm-cpu_attn.vec16-3x2x16-b128-bf16-v1000"
    (page,) = spec.streams
    assert (page.name, page.format, page.entry_shape, page.tokens_per_entry, page.layers) == (
        "page", "page", (2, 2 * 128 * 16 * 2), 128, 3)
    # the same bytes per token as the token-major K and V
    assert spec.persistent_bytes_per_token == rank_layout(shape, 0, "portable"
                                                          ).persistent_bytes_per_token
    ids = {rank_layout(replace(shape, arrangement=a), 0, "auto").layout_id
           for a in ("cpu_attn.vec", "cpu_attn.amx", "flash_attn")}
    assert len(ids) == 3 and spec.layout_id not in ids
    # float32 KV is held exactly as pages
    assert rank_layout(replace(shape, dtype=torch.float32), 0, "auto").name.endswith("-fp32-v1000")
    with pytest.raises(UnsupportedModel, match="arrangement"):
        rank_layout(replace(shape, arrangement=""), 0, "auto")
    # TP ranks hold their own heads' pages
    tp = [rank_layout(replace(shape, tp_size=2), r, "auto") for r in range(2)]
    assert [s.stream("page").entry_shape for s in tp] == [(1, 2 * 128 * 16 * 2)] * 2


def test_a_worker_runs_the_arrangement_its_layout_names():
    """The worker's attention layers must run the backend (and CPU_ATTN ISA) the layout
    names, else the engine does not start: pages are never read by another arrangement."""
    cpu = SimpleNamespace(get_name=lambda: "CPU_ATTN")
    vec = CacheShape(3, 2, 64, 128, 100, torch.bfloat16, 1, "cpu_attn.vec")
    check_arrangement(vec, [SimpleNamespace(attn_backend=cpu, isa="vec")])
    # not told its ISA yet: its backend alone is checked
    check_arrangement(vec, [SimpleNamespace(attn_backend=cpu)])
    for layer in (SimpleNamespace(attn_backend=cpu, isa="amx"),
                  SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))):
        with pytest.raises(UnsupportedModel, match="lay blocks out"):
            check_arrangement(vec, [layer])


def test_one_layout_per_rank_and_tp_size():
    shape = CacheShape(layers=3, kv_heads=2, head_size=16, block_size=16, vocab_size=100,
                       dtype=torch.bfloat16, tp_size=2)
    ranks = [rank_layout(shape, r, "portable") for r in range(2)]
    single = rank_layout(CacheShape(3, 2, 16, 16, 100, torch.bfloat16, 1), 0, "portable")
    assert len({s.layout_id for s in (*ranks, single)}) == 3
    assert [s.name for s in ranks] == ["vllm-3x2x16-b16-bf16-v100-tp2r0",
                                       "vllm-3x2x16-b16-bf16-v100-tp2r1"]
    assert all(s.stream("k").entry_shape == (1, 16) for s in ranks)
    assert single.stream("k").entry_shape == (2, 16)
    assert layout_to_json(ranks[0]) != layout_to_json(ranks[1])
    assert rank_session("chat", shape, 1) == "chat.tp2r1"
    assert rank_session("chat", CacheShape(3, 2, 16, 16, 100, torch.bfloat16, 1), 0) == "chat"
    with pytest.raises(UnsupportedModel):
        rank_layout(shape, 2, "auto")


def test_caches_it_cannot_hold_are_refused_by_their_spec(vllm_config):
    quantized = full(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    with pytest.raises(UnsupportedModel, match="FullAttentionSpec: quantized"):
        cache_shape(vllm_config, kv_config(quantized))
    local = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=16,
                                      dtype=torch.bfloat16, attention_chunk_size=256)
    with pytest.raises(UnsupportedModel, match="ChunkedLocalAttentionSpec is not supported"):
        cache_shape(vllm_config, kv_config(local))


def test_extra_config_is_checked(tmp_path):
    base = {"model_fingerprint": "m"}
    config = ConnectorConfig.from_extra(base)
    assert (config.server, config.tenant, config.ack, config.value_format) == (
        "127.0.0.1:50051", "default", "memory", "auto")
    token = tmp_path / "token"
    token.write_text("secret\n")
    assert ConnectorConfig.from_extra({**base, "token_file": str(token)}).token == "secret"
    for bad in ({}, {**base, "ack": "never"}, {**base, "value_format": "fp4"},
                {**base, "serverr": "x"}, {**base, "token": "a", "token_file": str(token)},
                {**base, "timeout_s": -1}):
        with pytest.raises(ValueError):
            ConnectorConfig.from_extra(bad)


def test_two_models_alike_but_for_their_vocabulary_have_two_layouts_on_one_server():
    """A server knows one layout by each name: a second model with the same KV shape and
    another vocabulary gets a name of its own, so both engines can share the server."""
    from kvstore.format.registry import register_layout

    small = CacheShape(layers=3, kv_heads=2, head_size=16, block_size=16, vocab_size=100,
                       dtype=torch.bfloat16, tp_size=1, arrangement="cpu_attn.vec16")
    large = replace(small, vocab_size=32000)
    for value_format in ("auto", "portable", "int4"):
        a, b = (rank_layout(s, 0, value_format) for s in (small, large))
        assert a.name != b.name
        assert register_layout(a) == a and register_layout(b) == b  # neither refused
