"""Layout specs: what a model's per-token KV cache is made of, and how big it is.

A spec lists named streams. Each stream has an entry shape, a bit width and a value
format (``FORMATS``: int4 / int8 with fp16 group scales, bf16 / fp16 unscaled, fp8 e4m3
with one float32 scale per layer per chunk, page: an engine's own paged-block bytes,
opaque), a quantization group size, how many tokens
merge into one entry (m), how many layers own a copy, and whether it is persistent
(global KV, stored on every tier) or ephemeral (sliding-window KV, kept only in hbm and
host). Every byte figure is computed from these fields.

A spec also states the model's vocabulary (token ids must lie below it) and its window W
(the most tokens the ephemeral window streams hold), so every size a request can carry is
bounded by the layout before anything is decoded (``chunk_parts.max_chunk_tokens``,
``chunk.max_encoded_bytes``, ``checks.window_bytes_max``). This process's known layouts are
``kvstore.format.registry``'s.

The store needs nothing else from a model: any cache that can be described this way can
be spilled and restored. A spec also names its ``replayer``: what can rebuild its window
streams by bounded replay (``REPLAYERS``), and may state ``replay_tokens``: the replay
length R at which that replayer's window meets the fidelity goal (``bench.fidelity``),
which a Resume uses unless it asks for another; neither shapes any byte.

Canonical encoding (docs/wire-format.md "Layouts"): ``layout_to_json`` writes one JSON
object, and ``layout_id`` is ``name@<16 hex digits>`` of the xxh3-64 (seed 0) of the same
object without ``replayer`` and ``replay_tokens``. The object, its keys sorted by code
point at every level, no whitespace (separators "," and ":"), ASCII only, UTF-8 bytes,
integers, strings, booleans arrays and objects only (no floats, no null)::

    {"baseline":{"head_dim":..,"kv_heads":..,"layers":..},   only when the spec has one
     "chunk_tokens":..,
     "layer_modes":["full",..],                               only when not empty
     "name":"..","replay_tokens":..,                          only when not 0
     "replayer":"..","requires_model_fingerprint":false,
     "streams":[{"bits":..,"entry_shape":[..],
                 "format":"..",                                only when not the default
                 "group_size":..,"layers":..,"name":"..",
                 "pending":false,"persistent":true,"tokens_per_entry":..},..],
     "vocab_size":..,"window_tokens":..}

A stream's ``format`` is encoded only when it is not the default for its bits
(``DEFAULT_FORMAT``: 4 int4, 8 int8, 16 bf16), so a layout of default formats has the
encoding, hence the id, it had before formats existed.
Hashed: every key above but ``replayer`` and ``replay_tokens`` (``notes`` is never
encoded). Names (the
layout's, its streams', its layer modes) are restricted to ``NAME`` (ASCII letters,
digits, ``.``, ``_``, ``-``), so no string in the encoding ever needs an escape.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any, NoReturn

import xxhash

from kvstore.format.errors import InvalidRequest, shown

# R of a replay (docs/wire-format.md section 7), refused past it by the server before any
# work and by a replay worker too: far past any useful one, a bound on what one may cost
MAX_REPLAY_TOKENS = 8192
SCALE_BYTES = 2  # one fp16 scale per quantization group
TENSOR_SCALE_BYTES = 4  # one float32 scale per layer per chunk
BF16_BYTES = 2
# Token ids travel as little-endian uint32: a layout that names no vocabulary takes any.
ANY_TOKEN_ID = 1 << 32
# What can rebuild a layout's window streams by bounded replay: the bundled model
# (model/), the transformers DeepSeek-V4 replayer, or nothing (Resume then answers
# ReplayUnavailable when the window is gone; Restore still works).
REPLAYERS = ("bundled", "transformers-deepseek-v4", "none")
# Layout, stream and layer-mode names: no "@" (the id's separator), nothing to escape
# (\Z, not $: "$" would let a trailing newline through).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidRequest(f"{what} {shown(name)} must match {NAME.pattern}")


@dataclass(frozen=True)
class ValueFormat:
    """How a stream's values are stored (docs/wire-format.md "Value formats")."""

    bits: int
    code_dtype: str  # torch dtype name of the stored codes
    # "group": one fp16 scale per group_size values; "none"; "tensor": one float32
    # scale per (stream, layer) per chunk, the one its codes were made with
    scales: str


FORMATS = {
    "int4": ValueFormat(4, "uint8", "group"),  # two's-complement nibbles, two per byte
    "int8": ValueFormat(8, "int8", "group"),
    "bf16": ValueFormat(16, "bfloat16", "none"),
    "fp16": ValueFormat(16, "float16", "none"),
    "fp8_e4m3": ValueFormat(8, "float8_e4m3fn", "tensor"),
    # an engine's own page bytes, opaque: one value is a byte, stored and read back as it
    # is; only an engine of the arrangement the layout names interprets them
    "page": ValueFormat(8, "uint8", "none"),
}
DEFAULT_FORMAT = {4: "int4", 8: "int8", 16: "bf16"}  # a stream that names no format


@dataclass(frozen=True)
class Stream:
    name: str
    entry_shape: tuple[int, ...]  # values per entry, e.g. (kv_heads, head_dim) or (latent,)
    bits: int  # 4, 8 or 16: the width of one stored value (its format's)
    group_size: int = 0  # values per fp16 scale along the last axis; 0 without group scales
    tokens_per_entry: int = 1  # m: tokens merged into one entry
    layers: int = 1  # layers that own a copy; layers that borrow it add nothing
    persistent: bool = True
    # Holds only the tokens not yet merged into an entry (fewer than m): ephemeral, and
    # not a per-token cost of the window.
    pending: bool = False
    format: str = ""  # FORMATS key; "" is DEFAULT_FORMAT[bits], stored as that name

    def __post_init__(self) -> None:  # noqa: C901 - one check per field of a stream
        _check_name("stream name", self.name)
        if self.pending and self.persistent:
            raise InvalidRequest(f"stream {self.name}: a pending stream must be ephemeral")
        if self.bits not in DEFAULT_FORMAT:
            raise InvalidRequest(f"stream {self.name}: bits must be 4, 8 or 16, got {self.bits}")
        if not self.format:
            object.__setattr__(self, "format", DEFAULT_FORMAT[self.bits])
        if self.format not in FORMATS:
            raise InvalidRequest(f"stream {self.name}: format must be one of "
                                 f"{sorted(FORMATS)}, got {shown(self.format)}")
        if FORMATS[self.format].bits != self.bits:
            raise InvalidRequest(f"stream {self.name}: format {self.format} stores "
                                 f"{FORMATS[self.format].bits}-bit values, not {self.bits}")
        if not self.entry_shape or any(d <= 0 for d in self.entry_shape):
            raise InvalidRequest(f"stream {self.name}: bad entry shape {self.entry_shape}")
        if self.tokens_per_entry < 1 or self.layers < 1:
            raise InvalidRequest(f"stream {self.name}: tokens_per_entry and layers must be >= 1")
        last = self.entry_shape[-1]
        if self.value_format.scales != "group":
            if self.group_size != 0:
                raise InvalidRequest(f"stream {self.name}: {self.format} streams have no group "
                                     "scales: group_size must be 0")
        elif self.group_size <= 0 or last % self.group_size:
            raise InvalidRequest(
                f"stream {self.name}: group_size {self.group_size} must divide the last "
                f"entry dimension {last}"
            )
        if self.bits == 4 and last % 2:
            raise InvalidRequest(f"stream {self.name}: int4 needs an even last dimension")

    @property
    def value_format(self) -> ValueFormat:
        return FORMATS[self.format]

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
        """fp16 group scales of one entry; 0 for formats without group scales."""
        if self.value_format.scales != "group":
            return 0
        return self.values_per_entry // self.group_size

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one entry of one layer: codes plus fp16 group scales."""
        return self.values_per_entry * self.bits // 8 + self.scales_per_entry * SCALE_BYTES

    @property
    def bytes_per_token(self) -> float:
        """Per-token bytes of every owning layer (a chunk adds ``bytes_per_chunk``)."""
        return self.layers * self.bytes_per_entry / self.tokens_per_entry

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes a chunk of this stream holds whatever its length: the tensor scales."""
        return self.layers * TENSOR_SCALE_BYTES if self.value_format.scales == "tensor" else 0

    def entries_for(self, tokens: int) -> int:
        """Complete entries covering ``tokens`` tokens (a partial entry is not stored)."""
        return tokens // self.tokens_per_entry


@dataclass(frozen=True)
class BaselineKV:
    """The same model's cache stored the plain way: per-layer K and V in bf16."""

    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) < 1:
            raise InvalidRequest(f"baseline layers, kv_heads and head_dim must be >= 1, got "
                                 f"{self.layers}, {self.kv_heads}, {self.head_dim}")

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
    replayer: str = "none"  # REPLAYERS: what rebuilds the window streams; not hashed
    # R at which the replayer's rebuilt window meets the fidelity goal, a Resume's default
    # (0: none stated, the server's replay_tokens); shapes no byte, not hashed
    replay_tokens: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_name("layout name", self.name)
        for mode in self.layer_modes:
            _check_name(f"layout {self.name}: layer mode", mode)
        if self.chunk_tokens < 1:
            raise InvalidRequest(f"layout {self.name}: chunk_tokens must be >= 1, "
                                 f"got {self.chunk_tokens}")
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
        self._check_replayer(has_window)

    def _check_replayer(self, has_window: bool) -> None:
        """The replayer and the R it states fit the window."""
        if self.replayer not in REPLAYERS:
            raise InvalidRequest(f"layout {self.name}: replayer must be one of {REPLAYERS}, "
                                 f"got {shown(self.replayer)}")
        if self.replayer != "none" and not has_window:
            raise InvalidRequest(f"layout {self.name} has no window streams: nothing to "
                                 f"replay, its replayer must be 'none'")
        if not 0 <= self.replay_tokens <= MAX_REPLAY_TOKENS or (
                self.replay_tokens and self.replayer == "none"):
            raise InvalidRequest(f"layout {self.name}: replay_tokens must lie in [0, "
                                 f"{MAX_REPLAY_TOKENS}], and be 0 without a replayer; got "
                                 f"{self.replay_tokens}")

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
        """Per token of a full chunk: its tensor scales spread over chunk_tokens."""
        return sum(s.bytes_per_token + s.bytes_per_chunk / self.chunk_tokens
                   for s in self.persistent_streams)

    @property
    def ephemeral_bytes_per_token(self) -> float:
        """What each token of the sliding window costs in hbm or host RAM (a full
        window's tensor scales spread over W)."""
        return sum(s.bytes_per_token + s.bytes_per_chunk / self.window_tokens
                   for s in self.ephemeral_streams if not s.pending)

    @property
    def pending_tokens_max(self) -> int:
        """The most tokens not yet merged into an entry: m - 1."""
        return max((s.tokens_per_entry for s in self.persistent_streams), default=1) - 1

    @property
    def pending_bytes_max(self) -> int:
        """The most the not-yet-merged rows (fewer than m tokens) can hold."""
        pending = [s for s in self.ephemeral_streams if s.pending]
        rows = sum(s.bytes_per_token for s in pending) * self.pending_tokens_max
        return int(rows) + sum(s.bytes_per_chunk for s in pending)

    @property
    def bf16_baseline_bytes_per_token(self) -> float:
        if self.baseline is not None:
            return self.baseline.bytes_per_token
        return sum(s.layers * s.values_per_entry * BF16_BYTES for s in self.streams)

    @cached_property
    def layout_hash(self) -> int:
        """xxh3-64 (seed 0) of the canonical encoding without ``replayer`` and
        ``replay_tokens``: everything that shapes the bytes on media (module docstring)."""
        shape = _canonical_object(self)
        del shape["replayer"]
        shape.pop("replay_tokens", None)
        return xxhash.xxh3_64_intdigest(_canonical_bytes(shape))

    @property
    def layout_id(self) -> str:
        return f"{self.name}@{self.layout_hash:016x}"

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layout_id": self.layout_id,
            "chunk_tokens": self.chunk_tokens,
            "vocab_size": self.vocab_size,
            "window_tokens": self.window_tokens,
            "replayer": self.replayer,
            "replay_tokens": self.replay_tokens,
            "persistent_bytes_per_token": self.persistent_bytes_per_token,
            "ephemeral_bytes_per_token": self.ephemeral_bytes_per_token,
            "pending_bytes_max": self.pending_bytes_max,
            "bf16_baseline_bytes_per_token": self.bf16_baseline_bytes_per_token,
            "reduction_vs_bf16": self.bf16_baseline_bytes_per_token
            / self.persistent_bytes_per_token,
            "streams": [{**asdict(s), "bytes_per_token": s.bytes_per_token} for s in self.streams],
            "notes": self.notes,
        }


def cache_difference(spec: LayoutSpec, own: LayoutSpec) -> str | None:
    """How ``spec`` lays out another cache than ``own`` (a replayer's model's), or None
    when it is the same cache: every field a replay decodes, rebuilds, checks tokens or
    encodes by (the streams, chunk_tokens, vocab_size, window_tokens, layer_modes). The
    names, pending marks, baseline, notes, fingerprint rule and replayer shape none of it."""
    def shape(stream: Stream) -> Stream:
        return replace(stream, pending=False)

    if [shape(s) for s in spec.streams] != [shape(s) for s in own.streams]:
        return "its streams (names, shapes, bits, formats, groups, m, layers, lifetimes) differ"
    for name in ("chunk_tokens", "vocab_size", "window_tokens", "layer_modes"):
        if getattr(spec, name) != getattr(own, name):
            return f"its {name} is {getattr(spec, name)!r}, the model's {getattr(own, name)!r}"
    return None


def _canonical_object(spec: LayoutSpec) -> dict[str, Any]:
    out = {
        "name": spec.name,
        "chunk_tokens": spec.chunk_tokens,
        "vocab_size": spec.vocab_size,
        "window_tokens": spec.window_tokens,
        "requires_model_fingerprint": spec.requires_model_fingerprint,
        "replayer": spec.replayer,
        "streams": [_canonical_stream(s) for s in spec.streams],
    }
    if spec.baseline is not None:
        out["baseline"] = asdict(spec.baseline)
    if spec.layer_modes:
        out["layer_modes"] = list(spec.layer_modes)
    if spec.replay_tokens:
        out["replay_tokens"] = spec.replay_tokens
    return out


def _canonical_stream(stream: Stream) -> dict[str, Any]:
    out = {**asdict(stream), "entry_shape": list(stream.entry_shape)}
    if stream.format == DEFAULT_FORMAT[stream.bits]:
        del out["format"]  # so layouts of default formats keep their ids
    return out


def _canonical_bytes(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def layout_to_json(spec: LayoutSpec) -> str:
    """The canonical encoding of ``spec`` (module docstring); notes are not encoded."""
    return _canonical_bytes(_canonical_object(spec)).decode()


_STREAM_KEYS = {"name": str, "entry_shape": list, "bits": int, "group_size": int,
                "tokens_per_entry": int, "layers": int, "persistent": bool, "pending": bool,
                "format": str}
_LAYOUT_KEYS = {"name": str, "streams": list, "chunk_tokens": int, "baseline": dict,
                "layer_modes": list, "vocab_size": int, "window_tokens": int,
                "requires_model_fingerprint": bool, "replayer": str, "replay_tokens": int,
                "notes": str}
_REQUIRED_STREAM = {"name", "entry_shape", "bits"}
_REQUIRED_LAYOUT = {"name", "streams", "chunk_tokens"}
_BASELINE_KEYS = ("layers", "kv_heads", "head_dim")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise InvalidRequest("layout JSON repeats a key in one object")
    return out


def _not_allowed(text: str) -> NoReturn:
    raise InvalidRequest(f"layout JSON holds {shown(text)}: only integers are allowed")


def _fields(what: str, obj: object, kinds: dict[str, type], required: set[str]
            ) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    unknown = sorted(set(obj) - set(kinds))
    if unknown:
        raise InvalidRequest(f"{what}: unknown keys {shown(unknown)}; known: {sorted(kinds)}")
    missing = sorted(required - set(obj))
    if missing:
        raise InvalidRequest(f"{what}: missing keys {missing}")
    for key, value in obj.items():
        kind = kinds[key]
        # JSON true is not an integer here, nor an integer a boolean
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidRequest(f"{what}: {key} must be a JSON {kind.__name__}, "
                                 f"got {shown(value)}")
    return obj


def _ints(what: str, values: list[Any]) -> tuple[int, ...]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidRequest(f"{what} must list integers, got {shown(values)}")
    return tuple(values)


def layout_from_json(text: str | bytes) -> LayoutSpec:
    """A spec from any JSON encoding of the canonical object (keys in any order, spaces,
    optional keys left out, ``notes`` allowed); InvalidRequest naming what is wrong.
    Left out: group_size 0, tokens_per_entry 1, layers 1, persistent true, pending false,
    format the default for its bits;
    vocab_size 2^32, window_tokens 0, requires_model_fingerprint false, replayer "none",
    replay_tokens 0, no baseline, no layer modes."""
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_not_allowed,
                         parse_constant=_not_allowed)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequest(f"layout JSON does not parse: {shown(str(exc))}") from exc
    fields = dict(_fields("layout", obj, _LAYOUT_KEYS, _REQUIRED_LAYOUT))
    streams = []
    for i, raw in enumerate(fields.pop("streams")):
        stream = dict(_fields(f"layout stream #{i}", raw, _STREAM_KEYS, _REQUIRED_STREAM))
        stream["entry_shape"] = _ints(f"stream #{i} entry_shape", stream["entry_shape"])
        streams.append(Stream(**stream))
    if "baseline" in fields:
        base = _fields("layout baseline", fields["baseline"], dict.fromkeys(_BASELINE_KEYS, int),
                       set(_BASELINE_KEYS))
        fields["baseline"] = BaselineKV(**base)
    if "layer_modes" in fields:
        modes = fields["layer_modes"]
        if not all(isinstance(m, str) for m in modes):
            raise InvalidRequest(f"layer_modes must list strings, got {shown(modes)}")
        fields["layer_modes"] = tuple(modes)
    return LayoutSpec(streams=tuple(streams), **fields)
