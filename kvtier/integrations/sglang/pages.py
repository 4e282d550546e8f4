"""How one SGLang HiCache page is stored in kvtier: a chunk of a layout of its own, under
a chain key made from the page's key.

SGLang names a page by an opaque string (a hash already chained over the tokens before
it), not by its tokens, and kvtier has no call that stores a blob under a client's key:
a server computes every chain key itself from token ids. So a page is the only chunk of
a sequence of ``KEY_TOKENS`` stand-in token ids, the BLAKE2b-256 of the page's storage
name, 16 bits each. The server keys it as any prefix chunk (the caller's tenant or
dedupe domain, the layout, the model fingerprint), and the chunk's header holds the
xxh3 of those ids: a chunk read back under another name fails its checks.

The storage name is the page key with what makes a page another object: its pool, the
host pool's dtype and memory layout, and the ranks that hold other bytes for the same
key (MHA pages and Mamba state per TP rank; MLA KV one object for every TP rank; pipeline,
attention context-parallel and decode context-parallel shards apart), as SGLang's own
file backend names its files.

The layout holds one stream of raw 16-bit codes, the page's bytes verbatim
(``encode_raw``: no value is converted), ``page_bytes`` of them per chunk.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.format.chunk import FLAG_ZSTD, FLAGS_BYTES, encode_raw, head_bytes
from kvstore.format.errors import UnsupportedModel
from kvstore.format.layout import LayoutSpec, Stream

KEY_TOKENS = 16  # 256 bits of BLAKE2b, 16 bits a token
KV_POOL = "kv"
MAMBA_POOL = "mamba"  # TP-sharded even where the model's KV is MLA (replicated)




@dataclass(frozen=True)
class Shard:
    """The ranks of HiCacheStorageConfig that decide which object a page is."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    is_mla: bool = False

    @classmethod
    def of(cls, storage_config: Any) -> Shard:  # SGLang's HiCacheStorageConfig
        return cls(storage_config.tp_rank, storage_config.tp_size, storage_config.pp_rank,
                   storage_config.pp_size, storage_config.attn_cp_rank,
                   storage_config.attn_cp_size, storage_config.dcp_rank,
                   storage_config.dcp_size, storage_config.is_mla_model)

    def per_tp_rank(self, pool: str) -> bool:
        return not self.is_mla or pool == MAMBA_POOL

    def writes(self, pool: str) -> bool:
        """Whether this rank stores ``pool``'s pages: MLA KV is written by one rank per
        DCP shard (``tp_rank == dcp_rank``), every other page by its own rank."""
        return self.per_tp_rank(pool) or self.tp_rank == self.dcp_rank

    def suffix(self, pool: str) -> str:
        if self.per_tp_rank(pool):
            parts = [f"tp{self.tp_rank}of{self.tp_size}"]
        else:  # replicated, but a DCP shard's slice of a page depends on the TP size
            parts = [f"tpsize{self.tp_size}"] if self.dcp_size > 1 else []
        parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        parts.append(f"cp{self.attn_cp_rank}of{self.attn_cp_size}")
        parts.append(f"dcp{self.dcp_rank}of{self.dcp_size}")
        return ".".join(parts)


@dataclass(frozen=True)
class PageFormat:
    """The pages of one host pool: how many bytes, of what, in which memory layout."""

    pool: str
    page_bytes: int
    dtype: torch.dtype
    memory_layout: str
    spec: LayoutSpec
    payload_offset: int  # where a chunk's page bytes start (header, section table, check)

    @classmethod
    def of(cls, pool: str, host_pool: Any) -> PageFormat:  # an SGLang host pool
        page = host_pool.get_dummy_flat_data_page()  # (page values,) of the pool's dtype
        page_bytes = page.numel() * page.element_size()
        if page_bytes % (2 * KEY_TOKENS):
            raise UnsupportedModel(f"kvtier sglang storage: a {pool} page of {page_bytes} B "
                                   f"is not a whole number of 16-bit values per each of "
                                   f"{KEY_TOKENS} key tokens")
        memory_layout = str(getattr(host_pool, "layout", "") or "flat")
        values = page_bytes // 2 // KEY_TOKENS
        spec = LayoutSpec(f"sglang-page-{page_bytes}B",
                          (Stream("page", (values,), bits=16, format="fp16"),),
                          chunk_tokens=KEY_TOKENS, vocab_size=1 << 16,
                          requires_model_fingerprint=True,
                          notes="one SGLang HiCache page, its bytes verbatim")
        return cls(pool, page_bytes, page.dtype, memory_layout, spec,
                   head_bytes(spec, KEY_TOKENS))

    def name(self, key: str, shard: Shard) -> str:
        """The storage name of page ``key`` (a KV key; ``"{key}.{pool}"`` for other
        pools, as SGLang names them)."""
        return key + self.name_suffix(shard)

    def name_suffix(self, shard: Shard) -> str:
        """What follows the key in each of this pool's storage names on ``shard``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"|{self.pool}|{dtype}|{self.memory_layout}|{shard.suffix(self.pool)}"

    def encode(self, page: torch.Tensor | None, tokens: np.ndarray) -> bytes:
        """The chunk of one flat page (page values,) of the pool's dtype."""
        if page is None:
            raise ValueError(f"no {self.pool} page to store")
        raw = page.contiguous().view(torch.uint8).numpy().data  # no copy: read once
        if len(raw) != self.page_bytes:
            raise ValueError(f"a {self.pool} page of {len(raw)} B; the pool's pages are "
                             f"{self.page_bytes} B")
        return encode_raw(self.spec, 0, tokens, raw)

    def payload(self, chunk: bytes | memoryview) -> memoryview | None:
        """The page bytes of a chunk ``read_chunks`` checked, or None: it is not an
        uncompressed chunk of exactly one page (never written here). Its header and
        section table were checked against this layout's, so the payload starts at the
        layout's offset; only the flags and the length are left to look at."""
        view = memoryview(chunk).cast("B")
        if len(view) != self.payload_offset + self.page_bytes or \
                int.from_bytes(view[FLAGS_BYTES], "little") & FLAG_ZSTD:
            return None
        return view[self.payload_offset:]

    def flat_pages(self, payloads: Sequence[memoryview]) -> list[torch.Tensor]:
        """Pages' bytes as flat pages (page values,) of the pool's dtype, views of
        ``payloads`` (no copy: the host pool copies them in)."""
        with warnings.catch_warnings():  # read-only bytes: only ever read from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return [torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
                    for payload in payloads]


def key_tokens(name: str) -> np.ndarray:
    """The ``KEY_TOKENS`` stand-in token ids of a storage name (uint32)."""
    return names_tokens([name])


def names_tokens(names: Iterable[str]) -> np.ndarray:
    """Every storage name's stand-in token ids end to end: (names * KEY_TOKENS,) uint32."""
    digests = b"".join(hashlib.blake2b(name.encode(), digest_size=2 * KEY_TOKENS).digest()
                       for name in names)
    return np.frombuffer(digests, dtype="<u2").astype(np.uint32)
