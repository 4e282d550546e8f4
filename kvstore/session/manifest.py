"""Session manifests: what a spilled session is made of, serialised for the MetaStore.

A manifest names the session's chunks by block key (chain key and digest of the bytes,
``kvstore.format.keys``; where each chunk lives is the tier manager's business, not the
manifest's), carries the token ids (replay and re-prefill need them), the encoded
partial tail chunk, where the window blob is held if anywhere and how it was made (the
engine's own, or a replay of how many tokens: ``window_coverage``). It also records what
the chunk keys were bound to (model fingerprint, dedupe scope) and, so a retried spill
is answered as the first one was, a digest of the spill's content and its receipt.
Encoding (little-endian)::

    magic "KVSM", u16 version, u32 JSON length
    JSON      every scalar field, the chunk keys and sizes, token and tail lengths, and
              the token width w (1, 2 or 4: the fewest bytes that hold the largest id)
    tokens    token ids as w-byte unsigned integers
    tail      the tail chunk's bytes (codec-encoded) or nothing
    check     xxh3-64 of everything before it

Version 3 added the token width; a version 2 manifest (token ids as uint32, no width) is
read as ever.

A buffer that does not parse whole raises ``ChunkCorrupt``: never a half manifest.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import xxhash

from kvstore.format.errors import ChunkCorrupt, InvalidRequest, UnsupportedVersion, shown
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import token_bytes

MAGIC = b"KVSM"
VERSION = 3  # 2: block keys, model fingerprint, dedupe scope, spill receipt; 3: token width
READS = (2, 3)
_WIDTHS = {1: "<u1", 2: "<u2", 4: "<u4"}
_HEAD = struct.Struct("<4sHI")
_CHECK = struct.Struct("<Q")
MAX_NAME_BYTES = 256
MANIFEST_PREFIX = "manifest/"  # MetaStore key prefix of every manifest


def manifest_key(tenant: str, session_id: str) -> str:
    return f"{MANIFEST_PREFIX}{tenant}/{session_id}"


def check_name(kind: str, value: object) -> str:
    """Tenant and session ids become MetaStore and tier key parts: keep them plain."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{kind} must be a non-empty string, got {shown(value)}")
    if len(value.encode()) > MAX_NAME_BYTES:
        raise InvalidRequest(f"{kind} is longer than {MAX_NAME_BYTES} bytes")
    if "/" in value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidRequest(f"{kind} {shown(value)} may not contain '/' or control characters")
    return value


def window_coverage(replayed: int, num_tokens: int) -> int:
    """The measure by which windows of one session state compare, a larger one never
    replaced by a smaller: ``num_tokens`` for the engine's own window (``replayed`` 0) or
    a replay of every token (exact), else the tokens replayed. A longer replay is the
    closer one (its first tokens' truncated window lies further back); one shorter than
    the layout's window W also leaves the window short of its W tokens (partial)."""
    return num_tokens if replayed == 0 else min(replayed, num_tokens)


def full_window(replayed: int, num_tokens: int, window_tokens: int) -> bool:
    """Whether a window so made holds every row a window of ``window_tokens`` (W) does:
    not partial. A partial one is a Resume's answer, never kept as the session's."""
    return window_coverage(replayed, num_tokens) >= min(window_tokens, num_tokens)


@dataclass(frozen=True)
class SpillReceipt:
    """What the spill that wrote a generation answered; a retry of it gets the same."""

    chunks_written: int
    chunks_deduped: int  # chunks already held, byte for byte, in the session's domain
    tier: str  # the highest tier the chunks (else the window) landed in
    bytes_received: int  # chunk, tail and window bytes sent
    window_kept: bool
    durable: bool


@dataclass(frozen=True)
class SessionManifest:
    tenant: str
    session_id: str
    layout_id: str
    generation: int  # strictly increasing per session; see TierManager.spill
    token_ids: np.ndarray  # (num_tokens,) uint32, read-only
    chunk_keys: tuple[str, ...]  # complete chunks, in token order
    chunk_sizes: tuple[int, ...]  # encoded bytes of each chunk
    tail: bytes = b""  # codec-encoded partial last chunk, or empty
    window_tier: str | None = None  # tier holding the window blob; None: replay needed
    window_key: str | None = None
    # Tokens the replay that built the named window ran through the model (R, at most
    # num_tokens); 0: the engine's own window, as spilled. Kept while the window is in
    # another node's memory (remote_window); 0 when no window is named.
    window_replayed: int = 0
    created_at: float = field(default_factory=time.time)  # wall clock, seconds
    updated_at: float = field(default_factory=time.time)
    last_access: float = field(default_factory=time.time)
    ttl_s: float | None = None  # idle time after which the session may be collected
    hint: ResumeHint | None = None
    model_fingerprint: str = ""  # the weights/version id the chunk keys bind
    dedupe_scope: str = ""  # the dedupe domain they bind (kvstore.format.keys.dedupe_scope)
    spill_digest: str = ""  # content digest of the spill that wrote this generation
    receipt: SpillReceipt | None = None  # what that spill answered
    # A write-back of a memory-acked chunk failed: the session may not survive a restart
    # (kvstore.session.durability). Absent from older manifests: False.
    writeback_failed: bool = False
    # The node that wrote this generation, where metadata is shared by a fleet
    # (docs/fleet.md): its window lives in that node's memory only. "" on a single node.
    node_id: str = ""
    # Where routers reach node_id (its advertise_address when it wrote this generation:
    # the process whose memory holds the window). Absent from older manifests: "".
    node_address: str = ""
    # Set on load, never stored: (window_tier, window_key) as node_id stored them, where
    # node_id is another node; kvstore.session.catalog clears both fields here (a resume here
    # replays) and puts them back on a write that does not replace the window.
    remote_window: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        check_name("tenant", self.tenant)
        check_name("session_id", self.session_id)
        if not isinstance(self.generation, int) or self.generation < 0:
            raise InvalidRequest(f"generation must be an int >= 0, got {self.generation!r}")
        if len(self.chunk_keys) != len(self.chunk_sizes):
            raise InvalidRequest("chunk_keys and chunk_sizes differ in length")
        if not isinstance(self.window_replayed, int) or self.window_replayed < 0:
            raise InvalidRequest(f"window_replayed must be an int >= 0, got "
                                 f"{self.window_replayed!r}")
        if self.window_key is None and self.remote_window is None:
            object.__setattr__(self, "window_replayed", 0)  # describes no window
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise InvalidRequest(f"ttl_s must be > 0, got {self.ttl_s}")
        tokens = np.frombuffer(token_bytes(self.token_ids), dtype="<u4")  # read-only copy
        object.__setattr__(self, "token_ids", tokens)
        object.__setattr__(self, "chunk_keys", tuple(self.chunk_keys))
        object.__setattr__(self, "chunk_sizes", tuple(int(s) for s in self.chunk_sizes))
        object.__setattr__(self, "tail", bytes(self.tail))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stored_bytes(self) -> int:
        """Bytes of persistent KV the session references (shared chunks included)."""
        return sum(self.chunk_sizes) + len(self.tail)

    @property
    def window_coverage(self) -> int:
        """How much of the session the named window's making saw (``window_coverage``)."""
        return window_coverage(self.window_replayed, self.num_tokens)

    def expired(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.ttl_s is not None and now > self.last_access + self.ttl_s

    def evolve(self, **changes) -> SessionManifest:
        return replace(self, **changes)

    def encode(self) -> bytes:
        head = {
            "tenant": self.tenant,
            "session_id": self.session_id,
            "layout_id": self.layout_id,
            "generation": self.generation,
            "chunk_keys": list(self.chunk_keys),
            "chunk_sizes": list(self.chunk_sizes),
            "num_tokens": self.num_tokens,
            "tail_len": len(self.tail),
            "window_tier": self.window_tier,
            "window_key": self.window_key,
            "window_replayed": self.window_replayed,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "last_access": self.last_access,
            "ttl_s": self.ttl_s,
            "hint": None
            if self.hint is None
            else [self.hint.expected_pause_s, self.hint.priority],
            "model_fingerprint": self.model_fingerprint,
            "dedupe_scope": self.dedupe_scope,
            "spill_digest": self.spill_digest,
            "receipt": None if self.receipt is None else asdict(self.receipt),
            "writeback_failed": self.writeback_failed,
            "node_id": self.node_id,
            "node_address": self.node_address,
        }
        width = _token_width(self.token_ids)
        head["token_width"] = width
        body = json.dumps(head, separators=(",", ":")).encode()
        tokens = self.token_ids.astype(_WIDTHS[width], copy=False).tobytes()
        out = _HEAD.pack(MAGIC, VERSION, len(body)) + body + tokens + self.tail
        return out + _CHECK.pack(xxhash.xxh3_64_intdigest(out))

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> SessionManifest:
        view = memoryview(buf).cast("B")
        if len(view) < _HEAD.size + _CHECK.size:
            raise ChunkCorrupt(f"manifest of {len(view)} bytes is too short")
        magic, version, body_len = _HEAD.unpack_from(view)
        if magic != MAGIC:
            raise ChunkCorrupt(f"bad manifest magic {bytes(magic)!r}")
        (check,) = _CHECK.unpack_from(view, len(view) - _CHECK.size)
        if xxhash.xxh3_64_intdigest(view[: len(view) - _CHECK.size]) != check:
            raise ChunkCorrupt("manifest checksum mismatch")
        if version not in READS:
            raise UnsupportedVersion(f"manifest version {version}; this build reads {READS}")
        try:
            head = json.loads(bytes(view[_HEAD.size : _HEAD.size + body_len]))
            width = head["token_width"] if version >= 3 else 4
            tokens_at = _HEAD.size + body_len
            tail_at = tokens_at + width * head["num_tokens"]
            if tail_at + head["tail_len"] != len(view) - _CHECK.size:
                raise ChunkCorrupt("manifest lengths do not add up")
            hint = head["hint"]
            return cls(
                tenant=head["tenant"],
                session_id=head["session_id"],
                layout_id=head["layout_id"],
                generation=head["generation"],
                token_ids=np.frombuffer(view[tokens_at:tail_at], dtype=_WIDTHS[width]),
                chunk_keys=tuple(head["chunk_keys"]),
                chunk_sizes=tuple(head["chunk_sizes"]),
                tail=bytes(view[tail_at : tail_at + head["tail_len"]]),
                window_tier=head["window_tier"],
                window_key=head["window_key"],
                window_replayed=head.get("window_replayed", 0),
                created_at=head["created_at"],
                updated_at=head["updated_at"],
                last_access=head["last_access"],
                ttl_s=head["ttl_s"],
                hint=None if hint is None else ResumeHint(hint[0], hint[1]),
                model_fingerprint=str(head.get("model_fingerprint", "")),  # "": none stated
                dedupe_scope=head["dedupe_scope"],
                spill_digest=head["spill_digest"],
                receipt=None if head["receipt"] is None else SpillReceipt(**head["receipt"]),
                writeback_failed=bool(head.get("writeback_failed", False)),
                node_id=str(head.get("node_id", "")),
                node_address=str(head.get("node_address", "")),
            )
        except ChunkCorrupt:
            raise
        except (ValueError, KeyError, TypeError, InvalidRequest) as exc:
            raise ChunkCorrupt(f"manifest does not parse: {exc}") from exc


def _token_width(tokens: np.ndarray) -> int:
    """The fewest bytes (1, 2 or 4) that hold every id of ``tokens`` (uint32)."""
    top = int(tokens.max()) if len(tokens) else 0
    return 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
