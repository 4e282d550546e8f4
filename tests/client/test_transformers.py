"""kvtier.integrations.transformers against a real server: a registered GQA layout and a
tiny Llama's DynamicCache round trip (bit-exact greedy continuation at bf16, close at
int8), and a tiny DeepseekV4 (seeded random weights) resumed through the server's
transformers replayer. Fidelity figures belong to bench.hf; the bounds here are loose."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.cache_utils import DynamicCache  # noqa: E402

from bench.hf import compare, follow_logits, tiny_model  # noqa: E402
from kvstore.format.errors import (  # noqa: E402
    InvalidRequest,
    LayoutMismatch,
    ModelMismatch,
    UnsupportedModel,
)
from kvstore.format.hf import deepseek_v4  # noqa: E402
from kvtier import AsyncClient  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    async_resume_cache,
    async_spill_cache,
    cache_streams,
    model_layout,
)
from tests.support.service import running_server  # noqa: E402


def tiny_llama(dtype=torch.bfloat16):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()


@torch.no_grad()
def generated(model, prompt: torch.Tensor, count: int):
    out = model.generate(prompt[None], max_new_tokens=count, min_new_tokens=count,
                         do_sample=False, return_dict_in_generate=True)
    return out.sequences[0], out.past_key_values


@torch.no_grad()
def continued(model, sequence: torch.Tensor, cache, count: int) -> torch.Tensor:
    out = model.generate(sequence[None], past_key_values=cache, max_new_tokens=count,
                         min_new_tokens=count, do_sample=False)
    return out[0, len(sequence):]


async def test_a_llama_cache_round_trips_with_a_bit_exact_greedy_continuation(tmp_path):
    model = tiny_llama()
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(1))
    sequence, cache = generated(model, prompt, 10)  # the cache holds all but the last token
    want = continued(model, sequence, copy.deepcopy(cache), 24)
    spec = model_layout(model)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        assert spec.layout_id not in {info.layout_id for info in await kv.layouts()}
        result = await async_spill_cache(kv, "acme", "llama", model, cache, sequence[:-1],
                                         generation=1, ack="durable")
        assert result.chunks_written == 1  # 99 tokens: one chunk of 64 and a tail
        assert spec.layout_id in {info.layout_id for info in await kv.layouts()}
        restored, tokens = await async_resume_cache(kv, "acme", "llama", model)
        assert torch.equal(tokens, sequence[:-1])
        for got, kept in zip(restored.layers, cache.layers, strict=True):
            assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)
        assert torch.equal(continued(model, sequence, restored, 24), want)

        # int8: every layer persistent at half the bytes, the next logits close
        await async_spill_cache(kv, "acme", "llama8", model, cache, sequence[:-1],
                                generation=1, bits=8)
        restored8, _ = await async_resume_cache(kv, "acme", "llama8", model)
        follow = torch.cat([sequence[-1:], want[:-1]])
        figures = compare(follow_logits(model, copy.deepcopy(cache), follow),
                          follow_logits(model, restored8, follow))
        assert figures["kl_nats"] < 1e-3 and figures["top1_agreement"] >= 0.9

        # a model of another shape refuses the session instead of misreading it
        other = LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)).eval()
        # (its weights are not the session's; unchecked, its layout is not either)
        with pytest.raises(ModelMismatch):
            await async_resume_cache(kv, "acme", "llama", other)
        with pytest.raises(LayoutMismatch):
            await async_resume_cache(kv, "acme", "llama", other, model_fingerprint="")


async def test_an_fp16_llama_is_stored_as_fp16_and_resumes_bit_exact(tmp_path):
    model = tiny_llama(torch.float16)
    spec = model_layout(model)
    assert [s.format for s in spec.streams] == ["fp16", "fp16"] and "-fp16-" in spec.name
    assert model_layout(tiny_llama()).stream("k").format == "bf16"  # a bf16 model's own
    with pytest.raises(InvalidRequest, match="would round"):  # never a silent rounding
        model_layout(model, format="bf16")
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(4))
    sequence, cache = generated(model, prompt, 10)
    want = continued(model, sequence, copy.deepcopy(cache), 16)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await async_spill_cache(kv, "acme", "fp16", model, cache, sequence[:-1], generation=1)
        restored, _ = await async_resume_cache(kv, "acme", "fp16", model)
        for got, kept in zip(restored.layers, cache.layers, strict=True):
            assert got.keys.dtype == torch.float16
            assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)
        assert torch.equal(continued(model, sequence, restored, 16), want)

        # fp8 e4m3, one scale per layer per chunk: close, not exact
        await async_spill_cache(kv, "acme", "fp8", model, cache, sequence[:-1], generation=1,
                                format="fp8_e4m3")
        restored8, _ = await async_resume_cache(kv, "acme", "fp8", model)
        assert not torch.equal(restored8.layers[0].keys, cache.layers[0].keys)
        follow = torch.cat([sequence[-1:], want[:-1]])
        figures = compare(follow_logits(model, copy.deepcopy(cache), follow),
                          follow_logits(model, restored8, follow))
        assert figures["kl_nats"] < 1e-2 and figures["top1_agreement"] >= 0.8, figures


async def test_a_trained_llama_resumes_from_int4_within_its_stated_bound(tmp_path):
    """bits=4 on the trained Llama test model, held-out text: every restored K and V within
    half a step of its group (section 2.3's bound), 0.28x the bf16 bytes, and the next
    logits close to the bf16 cache's; int8 of the same cache closer still. (bench.hf
    measures the fidelity; the bounds here are loose.)"""
    from model.data import corpus
    from model.train_llama import load_llama_test

    model = load_llama_test(dtype=torch.bfloat16)
    text = torch.tensor(list(corpus(held_out=True)[5000:5000 + 512 + 64]))
    context, follow = text[:512], text[512:]
    with torch.no_grad():
        cache = model(context[None], use_cache=True).past_key_values
    spec = model_layout(model, 4)
    assert [(s.format, s.group_size) for s in spec.streams] == [("int4", 32)] * 2
    assert spec.persistent_bytes_per_token / model_layout(model).persistent_bytes_per_token \
        == 0.28125
    ref = follow_logits(model, copy.deepcopy(cache), follow)
    figures = {}
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        for bits in (8, 4):
            await async_spill_cache(kv, "acme", f"trained{bits}", model, cache, context,
                                    generation=1, bits=bits)
            restored, tokens = await async_resume_cache(kv, "acme", f"trained{bits}", model)
            assert torch.equal(tokens, context)
            figures[bits] = compare(ref, follow_logits(model, restored, follow))
    for got, kept in zip(restored.layers, cache.layers, strict=True):
        for x, y in ((kept.keys, got.keys), (kept.values, got.values)):
            y = y[:, :, :512]  # the restored rows, before the follow appended its own
            x, y = x.float().unflatten(-1, (-1, 32)), y.float().unflatten(-1, (-1, 32))
            step = x.abs().amax(-1, keepdim=True) / 7
            assert ((y - x).abs() <= step / 2 * 1.01 + x.abs() * 2.0 ** -8).all()
            assert not torch.equal(x, y)
    assert figures[4]["kl_nats"] < 0.2 and figures[4]["top1_agreement"] >= 0.8, figures
    assert figures[8]["kl_nats"] < figures[4]["kl_nats"], figures


async def test_a_deepseek_v4_cache_resumes_through_the_servers_replay(tmp_path):
    model = tiny_model(seed=3)
    config_json = tmp_path / "config.json"
    model.config.to_json_file(config_json)
    n = 300  # 75 CSA entries, 2 HCA entries and 44 tokens of an unfinished HCA block
    ids = torch.randint(0, model.config.vocab_size, (n + 17,),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids[None, :n], use_cache=True).past_key_values
    ref = follow_logits(model, copy.deepcopy(cache), ids[n:])
    async with running_server(tmp_path / "data", replay_hf_model=str(config_json),
                              replay_hf_seed=3) as (_, target), AsyncClient(target) as kv:
        result = await async_spill_cache(kv, "acme", "v4", model, cache, ids[:n],
                                         generation=1, ack="durable")
        assert not result.window_kept  # the window is dropped
        session = await kv.restore("acme", "v4", want_window=False)
        assert session.replay_needed
        resumed, tokens = await async_resume_cache(kv, "acme", "v4", model, replay="server")
        await async_spill_cache(kv, "acme", "v4-full", model, cache, ids[:n], generation=1)
        full_cache, _ = await async_resume_cache(kv, "acme", "v4-full", model, replay="local",
                                                 replay_tokens=n)
    full = compare(ref, follow_logits(model, full_cache, ids[n:]))
    assert torch.equal(tokens, ids[:n])
    assert resumed.get_seq_length() == n
    kinds = [type(layer).__name__ for layer in resumed.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "DeepseekV4CSACache", "DeepseekV4HCACache",
                     "DeepseekV4CSACache"]
    for got, kept in zip(resumed.layers, cache.layers, strict=True):
        assert got.keys.shape == kept.keys.shape  # the window rebuilt, W - 1 rows
        for name in getattr(kept, "entry_count", {}):
            assert got.entry_count[name] == kept.entry_count[name]  # nothing appended twice
            assert got.compressed_kv[name].shape == kept.compressed_kv[name].shape
            assert got.buffer_kv[name].shape == kept.buffer_kv[name].shape
    # Random weights give flat next-token distributions, so top-1 flips easily (and a
    # truncated window can even do worse than none): loose bounds for R = 128, and
    # replaying every token leaves only the 4-bit entries' error.
    replayed = compare(ref, follow_logits(model, resumed, ids[n:]))
    assert replayed["kl_nats"] < 0.1
    assert full["kl_nats"] < 0.01 and full["top1_agreement"] >= 0.8


def test_replay_starts_early_enough_for_the_window_and_every_compressor():
    config = tiny_model().config
    assert deepseek_v4.replay_start(config, 300, 128) == 172  # R tokens
    assert deepseek_v4.replay_start(config, 300, 5) == 173  # at least W - 1 = 127
    assert deepseek_v4.replay_start(config, 100, 128) == 0
    # a window shorter than m: the HCA block's start (1024), then the CSA's last
    # complete window (1100 // 4 * 4 - 4 = 1096) bind
    small = tiny_model(sliding_window=8).config
    assert deepseek_v4.replay_start(small, 1100, 1) == 1024
    csa_only = tiny_model(sliding_window=4, layer_types=["sliding_attention"] + [
        "compressed_sparse_attention"] * 3).config
    assert deepseek_v4.replay_start(csa_only, 1102, 1) == 1096


async def test_a_latent_mla_cache_is_stored_as_its_own_streams(tmp_path):
    # DeepseekV3 caches one shared head per token: the compressed latent (kv_lora_rank)
    # as its keys and the rope key (qk_rope_head_dim) as its values
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        first_k_dense_replace=1, max_position_embeddings=512)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    spec = model_layout(model)
    assert [(s.name, s.entry_shape, s.layers) for s in spec.streams] == [
        ("latent", (1, 32), 2), ("rope", (1, 16), 2)]
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5))
    sequence, cache = generated(model, prompt, 10)
    want = continued(model, sequence, copy.deepcopy(cache), 16)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        result = await async_spill_cache(kv, "acme", "v3", model, cache, sequence[:-1],
                                         generation=1)
        own = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert result.bytes_received <= 1.1 * own
        restored, _ = await async_resume_cache(kv, "acme", "v3", model)
    for got, kept in zip(restored.layers, cache.layers, strict=True):
        assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)
    assert torch.equal(continued(model, sequence, restored, 16), want)


def test_a_latent_cache_the_layout_does_not_describe_is_refused_by_its_kind():
    # a Llama config but MLA-shaped layers (one head; keys and values of other widths)
    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        layer.update(torch.zeros(1, 1, 5, 32), torch.zeros(1, 1, 5, 16))
    with pytest.raises(UnsupportedModel, match=r"a latent \(MLA\) cache"):
        cache_streams(model_layout(model), model, cache, 5)
