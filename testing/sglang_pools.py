"""SGLang's real HiCache host pools and storage backends on CPU tensors, for
tests/sglang and bench.sglang (in .venv-sglang, ``make sglang``).

``host_pool("mha" | "mla", layout)`` builds ``MHATokenToKVPoolHost`` or
``MLATokenToKVPoolHost`` over device buffers that are plain CPU tensors; ``backend``
builds a storage backend by SGLang's own ``StorageBackendFactory.create_backend`` (the
``dynamic`` one for kvtier, ``file`` for its ``HiCacheFile``), which also wraps it in
SGLang's fault injector when its test variables are set.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LAYOUTS = ("page_first", "layer_first", "page_first_direct")
KINDS = ("mha", "mla")
KVTIER = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang.storage",
          "class_name": "KVTierStorage", "interface_v1": 1}


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def host_pool(kind: str, layout: str, *, layers: int = 2, heads: int = 2, head_dim: int = 16,
              latent: int = 48, page_size: int = 4, device_tokens: int = 64,
              dtype: torch.dtype = torch.bfloat16):
    """A host pool of twice ``device_tokens`` slots; MHA pages hold K and V (tokens, heads,
    head_dim) of every layer, MLA pages one (tokens, 1, latent) row per layer."""
    cpu = torch.device("cpu")
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=device_tokens,
                  start_layer=0, end_layer=layers)
    if kind == "mha":
        k = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(device_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
        info = MHABufferInfo(
            buffers=KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v),
                              layout=KVBufferLayout.NHD),
            page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
            dtype=dtype, device=cpu)
        return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, **common)
    if kind == "mla":
        rows = tuple(torch.zeros(device_tokens, 1, latent, dtype=dtype) for _ in range(layers))
        info = MLABufferInfo(
            buffers=rows, data_ptrs=_pointers(rows), layer_indices=tuple(range(layers)),
            device_layer_num=layers, page_size=page_size, kv_lora_rank=latent - 16,
            qk_rope_head_dim=16, kv_cache_dim=latent, dtype=dtype, device=cpu)
        return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, target_layer_num=layers,
                                    **common)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def fill_random(pool, pages: int, seed: int = 0) -> list[torch.Tensor]:
    """Random bytes in the pool's first ``pages`` pages; each page's flat copy."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(pages):
        page = pool.get_dummy_flat_data_page()
        page.view(torch.uint8).copy_(torch.randint(0, 256, (page.numel() * page.element_size(),),
                                                   dtype=torch.uint8, generator=generator))
        pool.set_from_flat_data_page(i * pool.page_size, page)
        out.append(page.clone())
    return out


def page_indices(pool, pages: list[int]) -> torch.Tensor:
    """The host indices of whole pages (``page_size`` slots each), as SGLang passes them."""
    ps = pool.page_size
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)


def storage_config(kind: str, layout: str, extra: dict, *, tp_rank: int = 0, tp_size: int = 1,
                   model_name: str = "test-model") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=False,
        is_page_first_layout=layout.startswith("page_first"), model_name=model_name,
        extra_config=extra)


def backend(name: str, pool, config: HiCacheStorageConfig) -> HiCacheStorage:
    """SGLang's factory's backend ``name`` ("dynamic", "file") with ``pool`` registered,
    as SGLang's cache controller does."""
    made = StorageBackendFactory.create_backend(name, config, pool)
    made.register_mem_pool_host(pool)
    return made
