"""Checks on every request before it reaches the store; each failure is an
``InvalidRequest`` (INVALID_ARGUMENT) that says what was wrong and what was expected.

The store re-checks what it relies on (``kvstore.format.checks``); these checks exist so a bad
request is refused early (before megabytes are streamed), with a message in the terms of
the request (field names, message order, payload index), and so limits hold. A value
the client sent is echoed through ``shown`` (at most 128 characters of it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar, cast, overload

import numpy as np

from kvstore.format.checks import (
    check_part,
    check_token_ids,
    check_written_version,
    chunk_bytes_max,
    window_bytes_max,
)
from kvstore.format.chunk import checked_header, split_chunks, tokens_hash
from kvstore.format.errors import CodecError, InvalidRequest, PermissionDenied, shown
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import (
    DIGEST_BYTES,
    block_key,
    check_fingerprint,
    chunk_digest,
    dedupe_scope,
    iter_chain_keys,
)
from kvstore.format.layout import MAX_REPLAY_TOKENS, LayoutSpec
from kvstore.format.registry import get_layout
from kvstore.session.spill import Ack, SpillRequest
from proto import kvtier_pb2 as pb

TENANT = re.compile(r"^[a-z0-9_-]{1,64}$")
SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ACKS: dict[int, Ack] = {pb.ACK_MEMORY: "memory", pb.ACK_DURABLE: "durable"}
MAX_PAGE = 1000
T = TypeVar("T")

def session_ref(ref: pb.SessionRef, *, field_name: str = "session") -> tuple[str, str]:
    if not ref.tenant and not ref.session_id:
        raise InvalidRequest(f"{field_name} is required (tenant and session_id)")
    if not TENANT.match(ref.tenant):
        raise InvalidRequest(f"{field_name}.tenant {shown(ref.tenant)} must match "
                             f"{TENANT.pattern}")
    if not SESSION_ID.match(ref.session_id):
        raise InvalidRequest(
            f"{field_name}.session_id {shown(ref.session_id)} must match {SESSION_ID.pattern}")
    return ref.tenant, ref.session_id


def tenant_filter(tenant: str) -> str | None:
    if not tenant:
        return None
    if not TENANT.match(tenant):
        raise InvalidRequest(f"tenant {shown(tenant)} must match {TENANT.pattern}")
    return tenant


def ack_or(ack: int, default: str) -> Ack:
    """The ack a request names, or ``default`` (a ServerConfig's, checked) for none."""
    return ACKS.get(ack, cast(Ack, default))


@overload
def seconds(name: str, value: float, default: float) -> float: ...


@overload
def seconds(name: str, value: float, default: None) -> float | None: ...


def seconds(name: str, value: float, default: float | None) -> float | None:
    """A non-negative finite duration; 0 means ``default``."""
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"{name} must be finite and >= 0, got {value}")
    return value or default


def tier_name(name: str, known: list[str], field_name: str) -> str | None:
    if not name:
        return None
    if name not in known:
        raise InvalidRequest(f"{field_name} {shown(name)} is not a tier of this server: "
                             f"{known}")
    return name


def token_array(raw: bytes, field_name: str = "token_ids") -> np.ndarray:
    if len(raw) % 4:
        raise InvalidRequest(f"{field_name} is {len(raw)} bytes: little-endian uint32 "
                             "needs a multiple of 4")
    return np.frombuffer(raw, dtype="<u4")


@dataclass
class IncomingSpill:
    """A validated Spill header and what the stream after it may still carry."""

    tenant: str
    session_id: str
    spec: LayoutSpec
    tokens: np.ndarray  # (num_tokens,) uint32
    keys: list[str]
    generation: int
    ack: Ack
    hint: ResumeHint | None
    ttl_s: float | None
    digests: list[bytes] = field(default_factory=list)  # per chunk key, as stated
    tail_digest: bytes = b""
    window_digest: bytes = b""
    model_fingerprint: str = ""
    dedupe_domain: str | None = None  # a shared domain the tenant may use; None: its own
    chunks: dict[int, bytes] = field(default_factory=dict)  # index -> encoded, as received
    tail: bytes | None = None
    window: bytes | None = None
    bytes_received: int = 0

    def __post_init__(self) -> None:
        self._index = {key: i for i, key in enumerate(self.keys)}
        # Every limit comes from the layout, never from what a payload's header claims.
        self._chunk_limit = chunk_bytes_max(self.spec, self.spec.chunk_tokens)
        remaining = len(self.tokens) - len(self.keys) * self.spec.chunk_tokens
        self._tail_limit = chunk_bytes_max(self.spec, max(remaining, 1))
        # Window K/V over at most W tokens plus the pending rows of an unfinished entry.
        self._window_limit = window_bytes_max(self.spec)

    def payload_limit(self, kind: str) -> int:
        """The most bytes the layout encodes a ``kind`` payload (chunk, tail, window) in."""
        return {"chunk": self._chunk_limit, "tail": self._tail_limit,
                "window": self._window_limit}[kind]

    @property
    def block_keys(self) -> list[str]:
        """What the store names the chunks by: chain key and stated digest (its bytes are
        checked against the digest by the store, ``kvstore.format.checks.check_spill``)."""
        return [block_key(k, d) for k, d in zip(self.keys, self.digests, strict=True)]

    def add_chunk(self, key: str, data: bytes) -> None:
        index = self._index.get(key)
        if index is None:
            raise InvalidRequest(f"chunk payload with key {shown(key)} is not in "
                                 "header.chunk_keys")
        if index in self.chunks:
            raise InvalidRequest(f"chunk {index} ({key}) was sent twice")
        self._check_size(f"chunk {index}", data, self._chunk_limit)
        start = index * self.spec.chunk_tokens
        self._check_header(f"chunk {index}", data, start, self.spec.chunk_tokens, False)
        self.chunks[index] = data

    def add_tail(self, key: str, data: bytes) -> None:
        if self.tail is not None:
            raise InvalidRequest("the tail was sent twice")
        if key:
            raise InvalidRequest("the tail payload carries no key")
        self._check_size("the tail", data, self._tail_limit)
        covered = len(self.keys) * self.spec.chunk_tokens
        if len(data) and covered == len(self.tokens):
            raise InvalidRequest("a tail was sent but the tokens fill whole chunks")
        if len(data):
            _check_digest("the tail", data, self.tail_digest, "header.tail_digest")
            header = self._check_header("the tail", data, covered, None, False)
            if not 0 < header.num_tokens <= len(self.tokens) - covered:
                raise InvalidRequest(f"the tail covers {header.num_tokens} tokens; "
                                     f"{len(self.tokens) - covered} follow the last chunk")
        self.tail = data

    def add_window(self, key: str, data: bytes) -> None:
        if self.window is not None:
            raise InvalidRequest("the window was sent twice")
        if key:
            raise InvalidRequest("the window payload carries no key")
        if not self.spec.ephemeral_streams:
            raise InvalidRequest(f"layout {self.spec.name} has no window streams")
        self._check_size("the window", data, self._window_limit)
        _check_digest("the window", data, self.window_digest, "header.window_digest")
        try:
            parts = split_chunks(data)
        except CodecError as exc:
            raise InvalidRequest(f"the window is not a valid chunk sequence: {exc}") from exc
        if not parts:
            raise InvalidRequest("the window payload is empty")
        for i, part in enumerate(parts):  # window K/V, then any pending rows
            header = self._check_header(f"window part {i}", part, None, None, True)
            try:
                check_part(self.spec, len(self.tokens), header)
            except InvalidRequest as exc:
                raise InvalidRequest(f"window part {i}: {exc}") from exc
        self.window = data

    def _check_size(self, what: str, data: bytes, limit: int) -> None:
        if len(data) > limit:
            raise InvalidRequest(f"{what} is {len(data)} B; layout {self.spec.name} encodes "
                                 f"it in at most {limit} B")
        self.bytes_received += len(data)

    def _check_header(self, what: str, data: bytes | memoryview, start: int | None,
                      count: int | None,
                      ephemeral: bool):
        try:
            # the layout's section table for its token count, nothing decompressed yet
            header = checked_header(data, self.spec)
        except (CodecError, InvalidRequest) as exc:  # corrupt, or another layout's
            raise InvalidRequest(f"{what} is not a valid chunk of layout {self.spec.name}: "
                                 f"{exc}") from exc
        check_written_version(what, header)
        if header.ephemeral != ephemeral:
            kind = "window (ephemeral)" if ephemeral else "persistent"
            raise InvalidRequest(f"{what} must hold the {kind} streams")
        start = header.start_token if start is None else start
        count = header.num_tokens if count is None else count
        if header.start_token != start or header.num_tokens != count:
            raise InvalidRequest(f"{what} covers tokens {header.start_token}+"
                                 f"{header.num_tokens}, expected {start}+{count}")
        if start + count > len(self.tokens) or header.tokens_hash != tokens_hash(
                self.tokens[start : start + count]):
            raise InvalidRequest(f"{what} was encoded for other token ids than "
                                 f"header.token_ids[{start}:{start + count}]")
        return header

    def finish(self) -> SpillRequest:
        """The store's request once the stream ended. Chunks it did not carry go by key
        only: the store confirms it holds that key with that digest, unread."""
        if self.tail_digest and not self.tail:
            raise InvalidRequest("header.tail_digest is set but no tail was sent")
        if self.window_digest and self.window is None:
            raise InvalidRequest("header.window_digest is set but no window was sent")
        return SpillRequest(
            tenant=self.tenant, session_id=self.session_id, layout_id=self.spec.layout_id,
            generation=self.generation, token_ids=self.tokens,
            chunks=[(key, self.chunks.get(i)) for i, key in enumerate(self.block_keys)],
            tail=self.tail or b"", window=self.window, ack=self.ack, hint=self.hint,
            ttl_s=self.ttl_s, model_fingerprint=self.model_fingerprint,
            dedupe_domain=self.dedupe_domain)


def _check_digest(what: str, data: bytes, stated: bytes, field_name: str) -> None:
    if not stated:
        raise InvalidRequest(f"{what} was sent without {field_name} (BLAKE2b-256 of its "
                             "bytes, kvstore.format.keys.chunk_digest)")
    if chunk_digest(data) != stated:
        raise InvalidRequest(f"{what}'s bytes do not have the digest {field_name} states")


def dedupe_domain(tenant: str, name: str, domains: Mapping[str, tuple[str, ...]]
                  ) -> str | None:
    """The shared dedupe domain a spill names, if the server lets this tenant use it
    (``ServerConfig.dedupe_domains``); "" is the tenant's own (None)."""
    if not name:
        return None
    if tenant not in domains.get(name, ()):  # unknown and forbidden read alike
        raise PermissionDenied(f"tenant {tenant!r} may not use dedupe domain {shown(name)}: "
                               "the server's dedupe_domains does not list it for the tenant")
    return name


def stream_item(message, started: bool) -> str:
    """Which item a message of a client-streamed call (Spill, WriteChunks) carries, checked
    to come in order: the header once and first (``started``: it came), then payloads."""
    kind = message.WhichOneof("item")
    if kind is None:
        *first, last = [f.name for f in message.DESCRIPTOR.oneofs_by_name["item"].fields]
        raise InvalidRequest(f"a {message.DESCRIPTOR.name} must carry "
                             f"{', '.join(first)} or {last}")
    if kind == "header" and started:
        raise InvalidRequest("the header was sent twice")
    if kind != "header" and not started:
        raise InvalidRequest(f"the first message must be the header, got {kind}")
    return kind


def stream_ended(incoming: T | None, call: str) -> T:
    """What the header of a client-streamed ``call`` that has ended began: it must have
    had one."""
    if incoming is None:
        raise InvalidRequest(f"empty {call} stream: the header is required")
    return incoming


def spill_header(header: pb.SpillHeader, default_ack: str, max_tokens: int,  # noqa: C901 - one check per header field
                 domains: Mapping[str, tuple[str, ...]] | None = None) -> IncomingSpill:
    """``domains``: the shared dedupe domains and the tenants that may use each."""
    tenant, session_id = session_ref(header.session, field_name="header.session")
    domain = dedupe_domain(tenant, header.dedupe_domain, domains or {})
    fingerprint = check_fingerprint(header.model_fingerprint)
    if not header.layout_id:
        raise InvalidRequest("header.layout_id is required")
    spec = get_layout(header.layout_id)
    tokens = token_array(header.token_ids, "header.token_ids")
    if len(tokens) > max_tokens:
        raise InvalidRequest(f"{len(tokens)} tokens exceed the limit of {max_tokens}")
    check_token_ids(spec, tokens)
    if spec.requires_model_fingerprint and not fingerprint:
        raise InvalidRequest(f"layout {spec.layout_id} requires header.model_fingerprint "
                             "(the weights/version id of the model whose KV this is)")
    keys = list(header.chunk_keys)
    # Counted before anything is hashed, and hashed only while the keys agree: the work
    # is bounded by the keys the client sent, not by its token count.
    if len(keys) != len(tokens) // spec.chunk_tokens:
        raise InvalidRequest(f"{len(tokens)} tokens make {len(tokens) // spec.chunk_tokens} "
                             f"chunks of {spec.chunk_tokens}; header.chunk_keys names "
                             f"{len(keys)}")
    expected = iter_chain_keys(spec.layout_id, tokens, spec.chunk_tokens,
                               scope=dedupe_scope(tenant, domain), model_fingerprint=fingerprint)
    for i, (got, want) in enumerate(zip(keys, expected, strict=True)):
        if got != want:
            raise InvalidRequest(f"header.chunk_keys[{i}] is {shown(got)}; the token ids chain "
                                 f"to {want!r} under {spec.layout_id}, this model fingerprint "
                                 "and dedupe domain (kvstore.format.keys.chain_keys)")
    digests = list(header.chunk_digests)
    if len(digests) != len(keys):
        raise InvalidRequest(f"header.chunk_digests has {len(digests)} entries; one per "
                             f"chunk key ({len(keys)}) is required")
    for name, values in (("chunk_digests", digests), ("tail_digest", [header.tail_digest]),
                         ("window_digest", [header.window_digest])):
        if any(v and len(v) != DIGEST_BYTES or (not v and name == "chunk_digests")
               for v in values):
            raise InvalidRequest(f"header.{name}: a digest is {DIGEST_BYTES} bytes "
                                 "(BLAKE2b-256)")
    if header.ack not in (pb.ACK_UNSPECIFIED, *ACKS):
        raise InvalidRequest(f"unknown ack {header.ack}")
    hint = None
    if header.HasField("hint"):
        pause = seconds("hint.expected_pause_s", header.hint.expected_pause_s, None)
        hint = ResumeHint(pause, header.hint.priority)
    return IncomingSpill(
        tenant=tenant, session_id=session_id, spec=spec, tokens=tokens, keys=keys,
        generation=header.generation, ack=ack_or(header.ack, default_ack), hint=hint,
        ttl_s=seconds("header.ttl_s", header.ttl_s, None), digests=digests,
        tail_digest=header.tail_digest, window_digest=header.window_digest,
        model_fingerprint=fingerprint, dedupe_domain=domain,
    )


def replay_tokens(value: int) -> int:
    """R a Resume asks for (0: the store's default, ``kvstore.session.resume``), refused
    before the session is read when no replay worker would take it (a worker also checks
    it against the session)."""
    if value > MAX_REPLAY_TOKENS:
        raise InvalidRequest(f"replay_tokens {value} exceeds {MAX_REPLAY_TOKENS}")
    return value


def drain_interval(value: float) -> float:
    """Seconds between a Drain's progress messages: (0, 60]; 0 asks for the default 1."""
    if value == 0:
        return 1.0
    if not 0 < value <= 60:  # NaN fails too
        raise InvalidRequest(f"progress_interval_s must lie in (0, 60], got {value}")
    return value


def page_size(value: int, default: int = 100) -> int:
    if value > MAX_PAGE:
        raise InvalidRequest(f"page_size {value} exceeds {MAX_PAGE}")
    return value or default


def page_token(token: str, tenant: str | None) -> str:
    """The ``<tenant>/<session_id>`` a List page token says the previous page ended at
    (the server's next_page_token; "" for the first page). A token of no session's
    shape, or of another tenant than the one listed, is InvalidRequest."""
    if not token:
        return ""
    owner, _, session_id = token.partition("/")
    if not TENANT.fullmatch(owner) or not SESSION_ID.fullmatch(session_id) or \
            tenant not in (None, owner):
        raise InvalidRequest(f"page_token {shown(token)} is not one this server gave for "
                             "this listing: pass next_page_token back unchanged, or \"\" for "
                             "the first page")
    return token


def lookup_request(request: pb.LookupRequest, max_tokens: int,
                   domains: Mapping[str, tuple[str, ...]]
                   ) -> tuple[str, str, np.ndarray, str, str | None]:
    """(tenant, layout id, token ids, model fingerprint, shared domain or None)."""
    tenant = tenant_filter(request.tenant)
    if tenant is None:
        raise InvalidRequest("tenant is required")
    domain = dedupe_domain(tenant, request.dedupe_domain, domains)
    if not request.layout_id:
        raise InvalidRequest("layout_id is required")
    spec = get_layout(request.layout_id)
    tokens = token_array(request.token_ids)
    if len(tokens) > max_tokens:
        raise InvalidRequest(f"{len(tokens)} tokens exceed the limit of {max_tokens}")
    return (tenant, spec.layout_id, tokens, check_fingerprint(request.model_fingerprint),
            domain)


def fork_request(request: pb.ForkRequest) -> tuple[str, str, str, int]:
    """(tenant, source session id, new session id, upto_tokens)."""
    tenant, source = session_ref(request.source, field_name="source")
    _, new = session_ref(pb.SessionRef(tenant=tenant, session_id=request.new_session_id),
                         field_name="new_session_id")
    return tenant, source, new, request.upto_tokens
