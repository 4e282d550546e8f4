"""Checks on WriteChunks and ReadChunks requests (proto "Prefix chunks") before the
store sees them, each failure an ``InvalidRequest`` in the request's terms (or
``PermissionDenied`` for a dedupe domain the tenant may not use), as
``services.server.validate`` does for the other RPCs.

Bounds, known before a byte is read or sent: a chunk payload is at most the layout's
largest chunk (``chunk_bytes_max``); a ReadChunks reads at most as many chunks as
``max_spill_bytes`` holds of the layout's largest (what one Spill stream may hold), so a
reply's bytes are bounded like a spill's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvstore.format.checks import check_token_ids, check_written_version, chunk_bytes_max
from kvstore.format.chunk import checked_header, tokens_hash
from kvstore.format.errors import CodecError, InvalidRequest, shown
from kvstore.format.hints import ResumeHint
from kvstore.format.keys import (
    DIGEST_BYTES,
    check_fingerprint,
    chunk_tokens_of,
    dedupe_scope,
    independent_keys,
    iter_chain_keys,
)
from kvstore.format.layout import LayoutSpec
from kvstore.format.registry import get_layout
from kvstore.session.prefix_chunks import ChunkWrite
from kvstore.session.spill import Ack
from proto import kvtier_pb2 as pb
from services.server import validate as check


@dataclass(frozen=True)
class Scope:
    """What both requests name: whose chunks, of which layout and model."""

    tenant: str
    spec: LayoutSpec
    tokens: np.ndarray  # (num_tokens,) uint32
    fingerprint: str
    domain: str | None  # a shared domain the tenant may use; None: its own
    independent: bool  # each whole chunk keyed alone (proto "Independent chunks")


def tenant_of(request: pb.WriteChunksHeader | pb.ReadChunksRequest, where: str = "") -> str:
    """The tenant a request names (required)."""
    tenant = check.tenant_filter(request.tenant)
    if tenant is None:
        raise InvalidRequest(f"{where}tenant is required")
    return tenant


def _scope(request: pb.WriteChunksHeader | pb.ReadChunksRequest, where: str, max_tokens: int,
           domains: Mapping[str, tuple[str, ...]]) -> Scope:
    tenant = tenant_of(request, where)
    domain = check.dedupe_domain(tenant, request.dedupe_domain, domains)
    fingerprint = check_fingerprint(request.model_fingerprint)
    if not request.layout_id:
        raise InvalidRequest(f"{where}layout_id is required")
    spec = get_layout(request.layout_id)
    tokens = check.token_array(request.token_ids, f"{where}token_ids")
    if len(tokens) > max_tokens:
        raise InvalidRequest(f"{len(tokens)} tokens exceed the limit of {max_tokens}")
    check_token_ids(spec, tokens)
    if spec.requires_model_fingerprint and not fingerprint:
        raise InvalidRequest(f"layout {spec.layout_id} requires {where}model_fingerprint "
                             "(the weights/version id of the model whose KV this is)")
    return Scope(tenant, spec, tokens, fingerprint, domain, request.independent_chunks)


def _digests(values, count: int, name: str) -> list[bytes]:
    digests = list(values)
    if len(digests) != count:
        raise InvalidRequest(f"{name} has {len(digests)} entries; one per chunk ({count}) is "
                             "required")
    if any(len(d) != DIGEST_BYTES for d in digests):
        raise InvalidRequest(f"{name}: a digest is {DIGEST_BYTES} bytes (BLAKE2b-256)")
    return digests


@dataclass
class IncomingChunks:
    """A validated WriteChunks header and the payloads received after it."""

    scope: Scope
    first: int
    digests: list[bytes]  # one per chunk from first on
    ack: Ack
    hint: ResumeHint | None
    index: dict[str, int]  # chain key -> chunk index, for the chunks from first on
    chunks: dict[int, bytes] = field(default_factory=dict)
    bytes_received: int = 0

    @property
    def payload_limit(self) -> int:
        """The most bytes the layout encodes one chunk in."""
        spec = self.scope.spec
        return chunk_bytes_max(spec, spec.chunk_tokens)

    def add_chunk(self, key: str, data: bytes) -> None:
        index = self.index.get(key)
        if index is None:
            raise InvalidRequest(f"chunk payload with key {shown(key)} is not the chain key "
                                 f"of a chunk from first_chunk {self.first} on of these "
                                 "token ids (layout, model fingerprint, dedupe domain)")
        if index in self.chunks:
            raise InvalidRequest(f"chunk {index} ({key}) was sent twice")
        if self.chunks and index < max(self.chunks):
            raise InvalidRequest(f"chunk {index} came after chunk {max(self.chunks)}: chunks "
                                 "are sent in index order")
        spec = self.scope.spec
        if len(data) > self.payload_limit:
            raise InvalidRequest(f"chunk {index} is {len(data)} B; layout {spec.name} encodes "
                                 f"it in at most {self.payload_limit} B")
        try:  # the layout's section table for its token count, nothing decompressed yet
            header = checked_header(data, spec)
        except (CodecError, InvalidRequest) as exc:
            raise InvalidRequest(f"chunk {index} is not a valid chunk of layout {spec.name}: "
                                 f"{exc}") from exc
        check_written_version(f"chunk {index}", header)
        size = spec.chunk_tokens
        tokens, at = chunk_tokens_of(self.scope.tokens, index, size, self.scope.independent)
        start = at * size
        if header.ephemeral or header.start_token != start or header.num_tokens != size:
            raise InvalidRequest(f"chunk {index} must hold the persistent streams of tokens "
                                 f"{start}+{size}, not {header.start_token}+{header.num_tokens}"
                                 + (" (ephemeral)" if header.ephemeral else "")
                                 + (" (independent chunks: each starts at token 0)"
                                    if self.scope.independent else ""))
        if header.tokens_hash != tokens_hash(tokens[start : start + size]):
            raise InvalidRequest(f"chunk {index} was encoded for other token ids than "
                                 f"header.token_ids[{start}:{start + size}]")
        self.bytes_received += len(data)
        self.chunks[index] = data

    def finish(self) -> ChunkWrite:
        s = self.scope
        return ChunkWrite(tenant=s.tenant, layout_id=s.spec.layout_id, token_ids=s.tokens,
                          first_chunk=self.first, digests=self.digests, chunks=self.chunks,
                          model_fingerprint=s.fingerprint, dedupe_domain=s.domain,
                          ack=self.ack, hint=self.hint, independent=s.independent)


def write_header(header: pb.WriteChunksHeader, default_ack: str, max_tokens: int,
                 domains: Mapping[str, tuple[str, ...]]) -> IncomingChunks:
    """The header checked, every chain key from token 0 computed (the key of a chunk is
    the server's, never the client's). Hashes every token: call it off the event loop
    for a long sequence."""
    scope = _scope(header, "header.", max_tokens, domains)
    size = scope.spec.chunk_tokens
    if len(scope.tokens) % size:
        raise InvalidRequest(f"header.token_ids holds {len(scope.tokens)} tokens, not whole "
                             f"chunks of {size}: only whole chunks are stored (the partial "
                             f"last one of {len(scope.tokens) % size} tokens is not)")
    chunks = len(scope.tokens) // size
    if header.first_chunk > chunks:
        raise InvalidRequest(f"header.first_chunk {header.first_chunk} is past the "
                             f"{chunks} chunks of header.token_ids")
    digests = _digests(header.chunk_digests, chunks - header.first_chunk,
                       "header.chunk_digests")
    if header.ack not in (pb.ACK_UNSPECIFIED, *check.ACKS):
        raise InvalidRequest(f"unknown ack {header.ack}")
    hint = None
    if header.HasField("hint"):
        pause = check.seconds("hint.expected_pause_s", header.hint.expected_pause_s, None)
        hint = ResumeHint(pause, header.hint.priority)
    chains = (independent_keys if scope.independent else iter_chain_keys)(
        scope.spec.layout_id, scope.tokens, size, scope=dedupe_scope(scope.tenant, scope.domain),
        model_fingerprint=scope.fingerprint)
    index: dict[str, int] = {}
    for i, chain in enumerate(chains):
        if i >= header.first_chunk and index.setdefault(chain, i) != i:
            raise InvalidRequest(f"independent chunks {index[chain]} and {i} have the same "
                                 "tokens: send each chunk once")
    return IncomingChunks(scope, header.first_chunk, digests,
                          check.ack_or(header.ack, default_ack), hint, index)




@dataclass(frozen=True)
class ChunksToRead:
    scope: Scope
    first: int
    count: int
    digests: list[bytes]  # expected, one per chunk; empty: any held version


def read_request(request: pb.ReadChunksRequest, max_tokens: int,
                 domains: Mapping[str, tuple[str, ...]], max_bytes: int) -> ChunksToRead:
    """``max_bytes``: what the chunks read may take at most (``max_spill_bytes``)."""
    scope = _scope(request, "", max_tokens, domains)
    spec = scope.spec
    whole = len(scope.tokens) // spec.chunk_tokens
    if request.first_chunk > whole:
        raise InvalidRequest(f"first_chunk {request.first_chunk} is past the {whole} whole "
                             "chunks of token_ids")
    left = whole - request.first_chunk
    count = min(request.max_chunks, left) if request.max_chunks else left
    largest = chunk_bytes_max(spec, spec.chunk_tokens)
    most = max(1, max_bytes // largest)
    if count > most:
        raise InvalidRequest(f"{count} chunks of layout {spec.name} may take {count * largest} "
                             f"B, over the server's bound (max_spill_bytes = {max_bytes} B): "
                             f"ask at most {most} (max_chunks)")
    digests = (_digests(request.chunk_digests, count, "chunk_digests")
               if request.chunk_digests else [])
    return ChunksToRead(scope, request.first_chunk, count, digests)
