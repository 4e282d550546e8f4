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
