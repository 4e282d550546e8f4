"""transformers models with sliding windows and attention patterns through kvtier: each
either resumes to a cache whose continuation is bit-identical at bf16 to the never-spilled
cache (also past the window, get_seq_length included), or is refused with
``UnsupportedModel`` naming its model type (and window) before anything reaches the server.

Tiny models with seeded random weights, built from their configs (no download); a real
server on loopback. The survey test walks every config class of the installed transformers
and checks kvtier's per-layer view against the cache transformers itself builds."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    CONFIG_MAPPING,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.cache_utils import DynamicCache  # noqa: E402

from kvstore.format.errors import (  # noqa: E402
    InvalidRequest,
    KVTierError,
    ReplayUnavailable,
    SessionNotFound,
)
from kvtier import AsyncClient, UnsupportedModel  # noqa: E402
from kvtier.integrations.transformers import (  # noqa: E402
    async_resume_cache,
    async_spill_cache,
    model_layout,
)
from tests.support.service import running_server  # noqa: E402

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _model(cls, config):
    torch.manual_seed(0)
    return cls(config).to(torch.bfloat16).eval()


# name -> (model factory, prompt length); the prompt plus 10 generated tokens runs past
# every tiny window (16 or 24) and stays inside the default ones (4096, 2047)
WORKING = {
    "mistral-default-window": (lambda: _model(MistralForCausalLM, MistralConfig(**SMALL)), 60),
    "mistral-window-16": (lambda: _model(MistralForCausalLM, MistralConfig(
        **SMALL, sliding_window=16)), 60),
    "phi3-window-2047": (lambda: _model(Phi3ForCausalLM, Phi3Config(
        **SMALL, sliding_window=2047, pad_token_id=0)), 60),
    "phi3-window-24": (lambda: _model(Phi3ForCausalLM, Phi3Config(
        **SMALL, sliding_window=24, pad_token_id=0)), 60),
    "mixtral-window-16": (lambda: _model(MixtralForCausalLM, MixtralConfig(
        **SMALL, sliding_window=16, num_local_experts=2, num_experts_per_tok=1)), 60),
    "qwen2-top-layer-sliding": (lambda: _model(Qwen2ForCausalLM, Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=2)), 60),
    "gemma2-alternating": (lambda: _model(Gemma2ForCausalLM, Gemma2Config(
        **SMALL, head_dim=16, sliding_window=16)), 60),
    "gemma3-pattern": (lambda: _model(Gemma3ForCausalLM, Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=16, layer_types=[
            "sliding_attention", "sliding_attention", "full_attention"])), 60),
    "llama4-chunked-16": (lambda: _model(Llama4ForCausalLM, Llama4TextConfig(
        **SMALL, head_dim=16, intermediate_size_mlp=128, num_local_experts=2,
        num_experts_per_tok=1, attention_chunk_size=16, no_rope_layers=[1, 1, 0],
        layer_types=["chunked_attention", "chunked_attention", "full_attention"])), 60),
    "gpt2": (lambda: _model(GPT2LMHeadModel, GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512)), 60),
}


@torch.no_grad()
def _generated(model, prompt: torch.Tensor, count: int):
    out = model.generate(prompt[None], max_new_tokens=count, min_new_tokens=count,
                         do_sample=False, return_dict_in_generate=True)
    return out.sequences[0], out.past_key_values


@torch.no_grad()
def _continued(model, sequence: torch.Tensor, cache, count: int) -> torch.Tensor:
    out = model.generate(sequence[None], past_key_values=cache, max_new_tokens=count,
                         min_new_tokens=count, do_sample=False)
    return out[0, len(sequence):]


@torch.no_grad()
def _follow_logits(model, cache, follow: torch.Tensor) -> torch.Tensor:
    return model(follow[None], past_key_values=cache, use_cache=True).logits[0]


@pytest.mark.parametrize("case", sorted(WORKING))
async def test_a_windowed_cache_resumes_bit_exact(tmp_path, case):
    factory, length = WORKING[case]
    model = factory()
    prompt = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(1))
    sequence, cache = _generated(model, prompt, 10)  # the cache holds all but the last token
    n = len(sequence) - 1
    want = _continued(model, sequence, copy.deepcopy(cache), 24)
    follow = torch.cat([sequence[-1:], want[:-1]])
    want_logits = _follow_logits(model, copy.deepcopy(cache), follow)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await async_spill_cache(kv, "acme", case, model, cache, sequence[:-1], generation=1,
                                ack="durable")
        restored, tokens = await async_resume_cache(kv, "acme", case, model)
    assert torch.equal(tokens, sequence[:-1])
    assert restored.get_seq_length() == n
    kinds = [type(layer) for layer in restored.layers]
    assert kinds == [type(layer) for layer in cache.layers]  # transformers' own classes
    for got, kept in zip(restored.layers, cache.layers, strict=True):
        assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)
        assert got.get_seq_length() == kept.get_seq_length()
    assert torch.equal(_follow_logits(model, copy.deepcopy(restored), follow), want_logits)
    assert torch.equal(_continued(model, sequence, restored, 24), want)


async def test_a_windowed_cache_at_int8_keeps_its_window_and_close_logits(tmp_path):
    model = WORKING["gemma2-alternating"][0]()
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3))
    sequence, cache = _generated(model, prompt, 10)
    follow = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(4))
    want = _follow_logits(model, copy.deepcopy(cache), follow).float()
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        await async_spill_cache(kv, "acme", "g8", model, cache, sequence[:-1], generation=1,
                                bits=8)
        restored, _ = await async_resume_cache(kv, "acme", "g8", model)
    assert restored.get_seq_length() == len(sequence) - 1
    for got, kept in zip(restored.layers, cache.layers, strict=True):
        assert type(got) is type(kept) and got.keys.shape == kept.keys.shape
    got = _follow_logits(model, restored, follow).float()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1),
                                    log_target=True, reduction="batchmean")
    assert kl.item() < 1e-3


async def test_sliding_layers_store_only_their_last_rows(tmp_path):
    # Gemma3-like: two sliding layers of window 16, one full. The model's own cache holds
    # 15 rows of each sliding layer and every row of the full one; kvtier stores those
    # (full: persistent chunks; sliding: the window blob), not zeros for the older rows.
    model = WORKING["gemma3-pattern"][0]()
    spec = model_layout(model)
    assert [(s.name, s.layers, s.persistent) for s in spec.streams] == [
        ("k", 1, True), ("v", 1, True), ("window.k", 2, False), ("window.v", 2, False)]
    assert spec.window_tokens == 15
    prompt = torch.randint(0, VOCAB, (190,), generator=torch.Generator().manual_seed(5))
    sequence, cache = _generated(model, prompt, 10)
    own = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        result = await async_spill_cache(kv, "acme", "g3", model, cache, sequence[:-1],
                                         generation=1)
        assert result.window_kept
        assert own < result.bytes_received <= 1.1 * own  # was 2.6x: zeros for every row
        restored, _ = await async_resume_cache(kv, "acme", "g3", model)
    for got, kept in zip(restored.layers, cache.layers, strict=True):
        assert type(got) is type(kept) and got.get_seq_length() == kept.get_seq_length()
        assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)


async def test_an_all_sliding_model_stores_its_last_rows_and_token_ids_only(tmp_path):
    # Mistral, every layer sliding: no persistent stream, the chunks carry token ids
    model = _model(MistralForCausalLM, MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=64,
        max_position_embeddings=1024))
    spec = model_layout(model)
    assert [(s.name, s.persistent) for s in spec.streams] == [("window.k", False),
                                                               ("window.v", False)]
    prompt = torch.randint(0, VOCAB, (600,), generator=torch.Generator().manual_seed(8))
    sequence, cache = _generated(model, prompt, 10)
    own = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    follow = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(9))
    want = _follow_logits(model, copy.deepcopy(cache), follow)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        result = await async_spill_cache(kv, "acme", "m", model, cache, sequence[:-1],
                                         generation=1)
        assert own < result.bytes_received <= 1.1 * own  # was 10x: zeros for every row
        restored, tokens = await async_resume_cache(kv, "acme", "m", model)
    assert torch.equal(tokens, sequence[:-1])
    for got, kept in zip(restored.layers, cache.layers, strict=True):
        assert type(got) is type(kept) and got.get_seq_length() == kept.get_seq_length()
        assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)
    assert torch.equal(_follow_logits(model, restored, follow), want)


def _topk_logprobs(logits: torch.Tensor, k: int = 8) -> torch.Tensor:
    return logits.float().log_softmax(-1).topk(k, dim=-1).values


@pytest.mark.parametrize("case", ["gemma2-alternating", "mistral-window-16"])
async def test_a_dropped_window_is_refused_or_rebuilt_by_a_bounded_replay(tmp_path, case):
    # gemma2: sliding 16, full, sliding 16; mistral: three sliding layers of 16, so the
    # session holds token ids only and the replay rebuilds every layer
    model = WORKING[case][0]()
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(6))
    sequence, cache = _generated(model, prompt, 10)
    n = len(sequence) - 1
    follow = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(7))
    want = _follow_logits(model, copy.deepcopy(cache), follow)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        result = await async_spill_cache(kv, "acme", "g2", model, cache, sequence[:-1],
                                         generation=1, window="replay")
        assert not result.window_kept  # only the full layer's rows were sent
        with pytest.raises(ReplayUnavailable, match="window='replay'"):
            await async_resume_cache(kv, "acme", "g2", model)  # never a wrong window
        with pytest.raises(InvalidRequest, match="at least 15"):
            await async_resume_cache(kv, "acme", "g2", model, window="replay",
                                     replay_tokens=14)
        truncated, _ = await async_resume_cache(kv, "acme", "g2", model, window="replay")
        whole, _ = await async_resume_cache(kv, "acme", "g2", model, window="replay",
                                            replay_tokens=n)
    for rebuilt in (truncated, whole):
        for got, kept in zip(rebuilt.layers, cache.layers, strict=True):
            assert type(got) is type(kept) and got.keys.shape == kept.keys.shape
            assert got.get_seq_length() == n
        for got, kept in zip(rebuilt.layers, cache.layers, strict=True):
            if not kept.is_sliding:  # the full layer is the stored one, not the replay's
                assert torch.equal(got.keys, kept.keys)
    # replaying every token rebuilds the window as a prefill would (bf16 rounding aside);
    # the default R = W - 1 is the truncated-window approximation: close, not equal
    got_whole = _follow_logits(model, whole, follow)
    assert torch.allclose(_topk_logprobs(got_whole), _topk_logprobs(want), atol=0.05)
    got_truncated = _follow_logits(model, truncated, follow)
    assert not torch.equal(truncated.layers[0].keys, cache.layers[0].keys)
    assert (got_truncated.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5


def test_the_tiny_windows_really_run_past_the_window():
    # the cases above cover a cache that dropped rows, not only one inside its window
    model = WORKING["mistral-window-16"][0]()
    _, cache = _generated(model, torch.arange(60) % VOCAB, 10)
    assert cache.layers[0].keys.shape[-2] == 15 and cache.get_seq_length() == 69


def _gemma3n():
    return _model(Gemma3nForCausalLM, Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64,
        hidden_size_per_layer_input=8, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention"] * 2))


def _qwen3_next():
    return _model(Qwen3NextForCausalLM, Qwen3NextConfig(
        **SMALL, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "linear_attention", "full_attention"]))


def _t5():
    return _model(T5ForConditionalGeneration, T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))


# name -> (model factory, what the refusal must say: the model type, and the window)
REFUSED = {"gemma3n": (_gemma3n, r"gemma3n_text: .*dummy.*sliding windows \[16\]"),
           "qwen3_next": (_qwen3_next, "qwen3_next: .*linear_attention"),
           "t5": (_t5, "t5: encoder-decoder")}


@pytest.mark.parametrize("case", sorted(REFUSED))
async def test_an_unsupported_model_is_refused_before_anything_is_sent(tmp_path, case):
    factory, says = REFUSED[case]
    model = factory()
    with pytest.raises(UnsupportedModel, match=says):
        model_layout(model)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        before = {info.layout_id for info in await kv.layouts()}
        with pytest.raises(UnsupportedModel, match=says):
            await async_spill_cache(kv, "acme", case, model, DynamicCache(), [1, 2, 3],
                                    generation=1)
        with pytest.raises(UnsupportedModel, match=says):
            await async_resume_cache(kv, "acme", case, model)
        assert {info.layout_id for info in await kv.layouts()} == before
        with pytest.raises(SessionNotFound):
            await kv.restore("acme", case)


async def test_a_cache_transformers_would_not_build_for_the_config_is_refused(tmp_path):
    model = WORKING["mistral-window-16"][0]()
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # every layer a full DynamicLayer: not the model's own cache
        plain = model(ids[None], past_key_values=DynamicCache(), use_cache=True).past_key_values
        batch = model(torch.stack([ids, ids]), use_cache=True).past_key_values
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        with pytest.raises(InvalidRequest, match="sliding"):
            await async_spill_cache(kv, "acme", "plain", model, plain, ids, generation=1)
        with pytest.raises(InvalidRequest, match="batch"):
            await async_spill_cache(kv, "acme", "batch", model, batch, ids, generation=1)
        with pytest.raises(SessionNotFound):
            await kv.restore("acme", "plain")


class _Model:
    """What ``model_layout`` reads of a model: its config (no weights are built)."""

    def __init__(self, config):
        self.config = config


def test_unsupported_model_names_the_window_and_maps_to_invalid_argument():
    from kvstore.format.errors import status_name

    assert issubclass(UnsupportedModel, KVTierError)
    assert status_name(UnsupportedModel("x")) == "INVALID_ARGUMENT"
    config = MistralConfig(**SMALL, sliding_window=16)
    config.layer_types = ["sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModel, match=r"mistral.*linear_attention"):
        model_layout(_Model(config))


def _configs():
    """Every config class of the installed transformers whose text config transformers
    builds a cache of anything but full-attention layers for, or that states a window."""
    for name in sorted(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[name]()
            text = config.get_text_config(decoder=True)
        except Exception:  # noqa: BLE001  configs that need arguments: nothing to survey
            continue
        if any(_stated(text, key) for key in (
                "sliding_window", "layer_types", "attention_chunk_size", "kv_sharing_modes",
                "layers_block_type", "sliding_window_size")):
            yield name, config


def _stated(config, key: str) -> bool:
    try:
        return bool(getattr(config, key, None))
    except Exception:  # noqa: BLE001  a per-layer value of a heterogeneous config
        return True


def test_every_windowed_or_patterned_config_agrees_with_transformers_or_is_refused():
    assert transformers.__version__ == "5.23.0"
    seen, refused = 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, config in _configs():
            seen += 1
            try:
                spec = model_layout(_Model(config))
            except UnsupportedModel as exc:
                refused += 1
                types = {config.model_type, config.get_text_config(decoder=True).model_type}
                assert any(t in str(exc) for t in types), name
                continue
            except KVTierError as exc:
                pytest.fail(f"{name}: {type(exc).__name__} instead of UnsupportedModel: {exc}")
            if spec.replayer != "none":  # DeepseekV4: its own cache classes
                continue
            layers = DynamicCache(config=config).layers
            windows = [getattr(layer, "sliding_window", 0) for layer in layers]
            modes = spec.layer_modes or ("full",) * len(layers)
            assert modes == tuple("full" if w == 0 else f"sliding-{w}" for w in windows), name
    assert seen > 100 and 0 < refused < seen
