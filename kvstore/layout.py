"""Layout specs: what a model's per-token KV cache is made of, and how big it is.

A spec lists named streams. Each stream has an entry shape, a bit width, a quantization
group size, how many tokens merge into one entry (m), how many layers own a copy, and
whether it is persistent (global KV, stored on every tier) or ephemeral (sliding-window
KV, kept only in hbm and host). Every byte figure is computed from these fields.

A spec also states the model's vocabulary (token ids must lie below it) and its window W
(the most tokens the ephemeral window streams hold), so every size a request can carry is
bounded by the layout before anything is decoded (``chunk_plan.max_chunk_tokens``,
``codec.max_encoded_bytes``, ``validate.window_bytes_max``).

The store needs nothing else from a model: any cache that can be described this way can
be spilled and restored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import cached_property

import xxhash

from kvstore.errors import InvalidRequest, UnknownLayout, shown

SCALE_BYTES = 2  # one fp16 scale per quantization group
BF16_BYTES = 2
# Token ids travel as little-endian uint32: a layout that names no vocabulary takes any.
ANY_TOKEN_ID = 1 << 32


@dataclass(frozen=True)
class Stream:
    name: str
    entry_shape: tuple[int, ...]  # values per entry, e.g. (kv_heads, head_dim) or (latent,)
    bits: int  # 4 (int4 packed two per byte), 8 (int8) or 16 (bf16, unquantized)
    group_size: int = 0  # values per fp16 scale along the last axis; 0 for 16-bit
    tokens_per_entry: int = 1  # m: tokens merged into one entry
    layers: int = 1  # layers that own a copy; layers that borrow it add nothing
    persistent: bool = True
    # Holds only the tokens not yet merged into an entry (fewer than m): ephemeral, and
    # not a per-token cost of the window.
    pending: bool = False

    def __post_init__(self) -> None:
        if self.pending and self.persistent:
            raise InvalidRequest(f"stream {self.name}: a pending stream must be ephemeral")
        if self.bits not in (4, 8, 16):
            raise InvalidRequest(f"stream {self.name}: bits must be 4, 8 or 16, got {self.bits}")
        if not self.entry_shape or any(d <= 0 for d in self.entry_shape):
            raise InvalidRequest(f"stream {self.name}: bad entry shape {self.entry_shape}")
        if self.tokens_per_entry < 1 or self.layers < 1:
            raise InvalidRequest(f"stream {self.name}: tokens_per_entry and layers must be >= 1")
        last = self.entry_shape[-1]
        if self.bits == 16:
            if self.group_size != 0:
                raise InvalidRequest(f"stream {self.name}: 16-bit streams have no scales")
        elif self.group_size <= 0 or last % self.group_size:
            raise InvalidRequest(
                f"stream {self.name}: group_size {self.group_size} must divide the last "
                f"entry dimension {last}"
            )
        if self.bits == 4 and last % 2:
            raise InvalidRequest(f"stream {self.name}: int4 needs an even last dimension")

    @property
    def values_per_entry(self) -> int:
        return math.prod(self.entry_shape)

    @property
    def codes_shape(self) -> tuple[int, ...]:
        """Per-entry shape of the stored codes: int4 packs two values in one uint8."""
        if self.bits == 4:
            return (*self.entry_shape[:-1], self.entry_shape[-1] // 2)
        return self.entry_shape

    @property
    def scales_per_entry(self) -> int:
        return 0 if self.bits == 16 else self.values_per_entry // self.group_size

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one entry of one layer: codes plus fp16 scales."""
        return self.values_per_entry * self.bits // 8 + self.scales_per_entry * SCALE_BYTES

    @property
    def bytes_per_token(self) -> float:
        return self.layers * self.bytes_per_entry / self.tokens_per_entry

    def entries_for(self, tokens: int) -> int:
        """Complete entries covering ``tokens`` tokens (a partial entry is not stored)."""
        return tokens // self.tokens_per_entry


@dataclass(frozen=True)
class BaselineKV:
    """The same model's cache stored the plain way: per-layer K and V in bf16."""

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    streams: tuple[Stream, ...]
    chunk_tokens: int  # tokens per chunk; a multiple of every persistent stream's m
    baseline: BaselineKV | None = None  # None: the streams already are the plain cache
    layer_modes: tuple[str, ...] = ()  # e.g. ("full", "reuse", ...): who owns, who borrows
    vocab_size: int = ANY_TOKEN_ID  # token ids lie in [0, vocab_size)
    window_tokens: int = 0  # W: tokens the window streams hold at most; 0 without them
    # Spills must state a model fingerprint (weights/version id): chunk keys bind it, so
    # two models sharing this layout (a base model and its fine-tune) never share chunks.
    requires_model_fingerprint: bool = False
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"layout {self.name}: duplicate stream names {names}")
        for s in self.persistent_streams:
            if self.chunk_tokens % s.tokens_per_entry:
                raise InvalidRequest(
                    f"layout {self.name}: chunk_tokens {self.chunk_tokens} is not a multiple "
                    f"of m={s.tokens_per_entry} of stream {s.name}"
                )
        if not 1 <= self.vocab_size <= ANY_TOKEN_ID:
            raise InvalidRequest(f"layout {self.name}: vocab_size must be in 1..2^32, "
                                 f"got {self.vocab_size}")
        has_window = any(not s.pending for s in self.ephemeral_streams)
        if has_window != (self.window_tokens > 0) or self.window_tokens < 0:
            raise InvalidRequest(f"layout {self.name}: window_tokens (W) must be > 0 exactly "
                                 f"when it has window streams, got {self.window_tokens}")

    @property
    def persistent_streams(self) -> tuple[Stream, ...]:
        return tuple(s for s in self.streams if s.persistent)

    @property
    def ephemeral_streams(self) -> tuple[Stream, ...]:
        return tuple(s for s in self.streams if not s.persistent)

    def stream(self, name: str) -> Stream:
        for s in self.streams:
            if s.name == name:
                return s
        raise InvalidRequest(f"layout {self.name} has no stream {name!r}")

    @property
    def persistent_bytes_per_token(self) -> float:
        return sum(s.bytes_per_token for s in self.persistent_streams)

    @property
    def ephemeral_bytes_per_token(self) -> float:
        """What each token of the sliding window costs in hbm or host RAM."""
        return sum(s.bytes_per_token for s in self.ephemeral_streams if not s.pending)

    @property
    def pending_tokens_max(self) -> int:
        """The most tokens not yet merged into an entry: m - 1."""
        return max((s.tokens_per_entry for s in self.persistent_streams), default=1) - 1

    @property
    def pending_bytes_max(self) -> int:
        """The most the not-yet-merged rows (fewer than m tokens) can hold."""
        pending = sum(s.bytes_per_token for s in self.ephemeral_streams if s.pending)
        return int(pending * self.pending_tokens_max)

    @property
    def bf16_baseline_bytes_per_token(self) -> float:
        if self.baseline is not None:
            return self.baseline.bytes_per_token
        return sum(s.layers * s.values_per_entry * BF16_BYTES for s in self.streams)

    @cached_property
    def layout_hash(self) -> int:
        """64-bit hash of everything that shapes the bytes on media (not the notes), and
        of ``requires_model_fingerprint`` when set (layouts without it keep their ids)."""
        shape = {k: v for k, v in asdict(self).items() if k != "notes"}
        if not self.requires_model_fingerprint:
            del shape["requires_model_fingerprint"]
        return xxhash.xxh3_64_intdigest(json.dumps(shape, sort_keys=True).encode())

    @property
    def layout_id(self) -> str:
        return f"{self.name}@{self.layout_hash:016x}"

    def summary(self) -> dict:
        return {
            "name": self.name,
            "layout_id": self.layout_id,
            "chunk_tokens": self.chunk_tokens,
            "vocab_size": self.vocab_size,
            "window_tokens": self.window_tokens,
            "persistent_bytes_per_token": self.persistent_bytes_per_token,
            "ephemeral_bytes_per_token": self.ephemeral_bytes_per_token,
            "pending_bytes_max": self.pending_bytes_max,
            "bf16_baseline_bytes_per_token": self.bf16_baseline_bytes_per_token,
            "reduction_vs_bf16": self.bf16_baseline_bytes_per_token
            / self.persistent_bytes_per_token,
            "streams": [{**asdict(s), "bytes_per_token": s.bytes_per_token} for s in self.streams],
            "notes": self.notes,
        }


_REGISTRY: dict[str, LayoutSpec] = {}


def _registry() -> dict[str, LayoutSpec]:
    # The shipped presets register themselves on import; importing them lazily keeps
    # kvstore.presets free to import this module.
    import kvstore.presets  # noqa: F401

    return _REGISTRY


def register_layout(spec: LayoutSpec) -> LayoutSpec:
    known = _REGISTRY.get(spec.name)
    if known is not None and known.layout_hash != spec.layout_hash:
        raise InvalidRequest(f"layout name {spec.name!r} is already registered with other streams")
    _REGISTRY[spec.name] = spec
    return spec


def get_layout(name_or_id: str) -> LayoutSpec:
    """Look a spec up by name or by full layout id (``name@hash``)."""
    name, _, wanted_hash = name_or_id.partition("@")
    registry = _registry()
    spec = registry.get(name)
    if spec is None:
        raise UnknownLayout(f"unknown layout {shown(name_or_id)}; known: {sorted(registry)}")
    if wanted_hash and wanted_hash != f"{spec.layout_hash:016x}":
        raise UnknownLayout(
            f"layout {name!r} is known as {spec.layout_id}, not {shown(name_or_id)} "
            "(spec changed?)"
        )
    return spec


def layout_by_hash(layout_hash: int) -> LayoutSpec:
    for spec in _registry().values():
        if spec.layout_hash == layout_hash:
            return spec
    raise UnknownLayout(f"no registered layout has hash {layout_hash:016x}")


def all_layouts() -> list[LayoutSpec]:
    return list(_registry().values())
