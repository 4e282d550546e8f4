"""Sliding-window models with seeded random weights, for vLLM's tests and benchmarks of
hybrid KV caches: a Gemma3-like model (sliding layers with a window, and full-attention
layers) and a Mistral whose every layer has a sliding window.

As ``testing.vllm_models``: nothing is downloaded, a model is built from its config with
weights drawn from a fixed seed, saved once into ``root/<name>-<hash of its spec>``.
Random weights repeat one greedy token: compare top-k logprobs, not token ids alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from testing.vllm_models import DEFAULT_ROOT


@dataclass(frozen=True)
class SlidingSpec:
    name: str
    # "gemma3" (sliding and full layers), "mistral" (every layer sliding) or "gpt_oss"
    # (sliding and full layers alternating, attention sinks, a small MoE)
    family: str
    layers: int
    window: int
    full_every: int = 0  # gemma3: every n-th layer is full attention (0: none)
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 2048
    seed: int = 0
    init_std: float = 0.1  # wide, so outputs depend on the context (testing.vllm_models)

    @property
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()

    def layer_types(self) -> list[str]:
        return ["full_attention" if self.full_every and (i + 1) % self.full_every == 0
                else "sliding_attention" for i in range(self.layers)]


# 5 sliding layers with a 128-token window, then one full layer (Gemma3's pattern)
GEMMA3 = SlidingSpec("gemma3-like", "gemma3", layers=6, window=128, full_every=6)
# sliding and full layers alternating, window 128, attention sinks, 4 experts top-2
GPT_OSS = SlidingSpec("gpt-oss-like", "gpt_oss", layers=4, window=128, full_every=2)
# every layer sliding, window 128
MISTRAL = SlidingSpec("mistral-sliding", "mistral", layers=4, window=128)


def build(spec: SlidingSpec, root: Path | str = DEFAULT_ROOT) -> Path:
    """The folder of ``spec``'s model under ``root``, built and saved on first use."""
    folder = Path(root) / f"{spec.name}-{spec.digest}"
    if (folder / "config.json").exists():
        return folder
    import torch

    common = dict(num_hidden_layers=spec.layers, hidden_size=spec.hidden,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, intermediate_size=spec.intermediate,
                  vocab_size=spec.vocab, max_position_embeddings=8192,
                  sliding_window=spec.window, tie_word_embeddings=False,
                  initializer_range=spec.init_std)
    if spec.family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(layer_types=spec.layer_types(),
                                  query_pre_attn_scalar=spec.head_dim, **common)
        model_class = Gemma3ForCausalLM
    elif spec.family == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(layer_types=spec.layer_types(), num_local_experts=4,
                              num_experts_per_tok=2, **common)
        model_class = GptOssForCausalLM
    else:
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(**common)
        model_class = MistralForCausalLM
    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.bfloat16)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    partial.rename(folder)
    return folder
