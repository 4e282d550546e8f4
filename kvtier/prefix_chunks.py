"""``AsyncClient.write_chunks`` and ``read_chunks``: prefix chunks of no session over
the WriteChunks and ReadChunks calls (proto "Prefix chunks"). No retries here
(``kvtier.client`` owns the calls: each is one ``attempt(node)``).

A write keys and digests the encoded chunks it is given (``kvstore.format.keys``, from
token 0 in the caller's domain: the server computes the same keys and refuses others),
and with ``skip_held`` sends only the chunks a Lookup did not find held with the very
digest (``MissingChunks`` if one went meanwhile: the client sends them all). A read
checks every chunk again end to end, its digest against the header's and its codec
header against the tokens (layout hash, start token, token count, tokens hash); one
that fails is reported missing, "corrupt". The checks run over the reply's chunks
together (``kvstore.format.run_checks``: the headers as one numpy array).

The ``*_independent_chunks`` methods send many unrelated chunks in one call: each whole
chunk of ``token_ids`` keyed, written, read and checked alone, as the first chunk of a
sequence of its own tokens (proto "Independent chunks"); an engine's pages, each named by
tokens of its own, then cost one call a batch, not one a page.

Over shared memory a read copies its chunks out of the reply segment, unless the caller
asks to read them in place (``in_place``): the chunks are then views of the segment,
which the client lends the caller until ``ReadChunksResult.release`` (the server writes
into a segment only when the client offers it, and it offers none it has lent).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence

import numpy as np

from kvstore.format.errors import InvalidRequest
from kvstore.format.keys import (
    DIGEST_BYTES,
    block_key,
    chain_keys,
    chunk_digest,
    dedupe_scope,
    independent_keys,
)
from kvstore.format.layout import LayoutSpec
from kvstore.format.run_checks import RunCheck
from kvtier import codec as cc
from kvtier import shm
from kvtier.errors import MissingChunks
from kvtier.routing import Node
from kvtier.types import ReadChunksResult, WriteChunksResult
from kvtier.upload import Item, upload
from proto import kvtier_pb2 as pb


def write_header(spec: LayoutSpec, tenant: str, tokens: np.ndarray, digests: list[bytes], *,
                 first_chunk: int, model_fingerprint: str, dedupe_domain: str, ack: int,
                 independent: bool = False) -> pb.WriteChunksHeader:
    return pb.WriteChunksHeader(
        tenant=tenant, layout_id=spec.layout_id, model_fingerprint=model_fingerprint,
        dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(), first_chunk=first_chunk,
        chunk_digests=digests, ack=ack, independent_chunks=independent)


def keyed(spec: LayoutSpec, tokens: np.ndarray, chunks: Sequence[bytes], first_chunk: int,
          scope: str, model_fingerprint: str, independent: bool = False
          ) -> tuple[list[str], list[bytes]]:
    """(chain keys, digests) of the chunks given, one per whole chunk from first_chunk."""
    keys = (independent_keys if independent else chain_keys)(
        spec.layout_id, tokens, spec.chunk_tokens, scope=scope,
        model_fingerprint=model_fingerprint)[first_chunk:]
    if len(chunks) != len(keys):
        raise InvalidRequest(f"{len(tokens)} tokens make {len(keys)} whole chunks from chunk "
                             f"{first_chunk} on; {len(chunks)} were given")
    return keys, [chunk_digest(c) for c in chunks]


def unheld(lookup: pb.LookupReply, keys: Sequence[str], digests: Sequence[bytes],
           first_chunk: int) -> list[int]:
    """The positions (from first_chunk) of the chunks a Lookup did not find held with
    the same digest: those to send."""
    held = {c.chunk_key: c.digest for c in lookup.chunks}
    return [n for n, key in enumerate(keys) if held.get(key) != digests[n]]


async def write_once(node: Node, header: pb.WriteChunksHeader, keys: Sequence[str],
                     chunks: Sequence[bytes], send: Sequence[int], *, shared_memory: bool,
                     max_message_bytes: int, timeout_s: float | None) -> WriteChunksResult:
    """One WriteChunks call sending ``chunks[n]`` for each ``n`` in ``send``."""
    items = [Item(f"chunk {header.first_chunk + n}", keys[n], chunks[n]) for n in send]
    reply = await upload(
        node, pb.WriteChunksRequest(header=header), items,
        lambda _, payload: pb.WriteChunksRequest(chunk=payload),
        lambda stream: node.stub.WriteChunks(stream, timeout=timeout_s),
        shared_memory=shared_memory, max_message_bytes=max_message_bytes, timeout_s=timeout_s)
    return WriteChunksResult(reply.chunks_written, reply.chunks_deduped, reply.tier,
                             reply.durable, list(reply.chunk_keys))


async def read_once(node: Node, request: pb.ReadChunksRequest, spec: LayoutSpec,
                    tokens: np.ndarray, timeout_s: float | None,
                    check_digests: bool = True, in_place: bool = False) -> ReadChunksResult:
    """One ReadChunks call; on the shared-memory path it offers a segment it holds as
    ``reply_lease``, as a restore does (``kvtier.client.AsyncClient._receive``), and
    with ``in_place`` lends the reply's segment to the result (module docstring)."""
    offered = node.segments.for_reply() if request.use_shared_memory else None
    request.reply_lease = offered.lease_id if offered is not None else ""
    request.refs_in_header = request.use_shared_memory
    used = [offered] if offered is not None else []
    started = time.monotonic()
    call = node.stub.ReadChunks(request, timeout=timeout_s)
    header, got, segment = None, [], None
    try:
        async for reply in call:
            kind = reply.WhichOneof("item")
            if kind == "header":
                header = reply.header
                if header.HasField("reply_segment"):
                    segment = await _reply_segment(node.segments, header.reply_segment, used)
                got += _in_header(header, segment, request.first_chunk, in_place)
            elif header is None:
                raise InvalidRequest(f"a ReadChunks reply sent {kind} before its header")
            elif kind == "missing":
                got.append((reply.missing.index, None, reply.missing.reason))
            else:
                payload = reply.chunk.payload
                if payload.WhichOneof("body") != "shm":
                    data = payload.data
                elif segment is None:
                    raise InvalidRequest("a reply refers to shared memory the header did "
                                         "not name")
                else:
                    data = segment.view(payload.shm) if in_place else segment.read(payload.shm)
                got.append((reply.chunk.index, data, ""))
    except Exception:  # the server may still be writing into them: never reuse them
        call.cancel()
        await node.segments.release(used)
        raise
    except BaseException:  # cancelled: no call to release them, the server reaps them
        call.cancel()
        for held in used:
            held.close()
        raise
    release = None
    if in_place and segment is not None:
        await node.segments.replied([s for s in used if s is not segment], None, started)
        release = node.segments.lend(segment, started)
    else:
        await node.segments.replied(used, segment, started)
    try:
        if header is None:
            raise InvalidRequest("the ReadChunks reply had no header")
        result = checked_result(spec, tokens, request.first_chunk, header, got, check_digests,
                                request.independent_chunks)
    except BaseException:
        if release is not None:
            release()
        raise
    if release is not None:
        result.release = release
    return result


def _in_header(header: pb.ChunksHeader, segment: shm.Segment | None, first_chunk: int,
               in_place: bool) -> list[tuple[int, object, str]]:
    """The chunks the header lists in the reply segment (``chunk_refs``): views of it
    (``in_place``), else copied out in one copy where they lie back to back."""
    refs = list(header.chunk_refs)
    if not refs:
        return []
    if segment is None or len(refs) != len(header.chunk_keys):
        raise InvalidRequest(f"a ReadChunks header lists {len(refs)} chunks in shared memory "
                             f"for {len(header.chunk_keys)} chunks"
                             + ("" if segment is not None else " and names no segment"))
    sent = [(first_chunk + n, ref) for n, ref in enumerate(refs) if ref.length]
    if in_place:
        return [(index, segment.view(ref), "") for index, ref in sent]
    run = segment.read_run([ref for _, ref in sent])
    if run is None:
        return [(index, segment.read(ref), "") for index, ref in sent]
    return [(index, data, "") for (index, _), data in zip(sent, run, strict=True)]


async def _reply_segment(segments: shm.ClientSegments, lease: pb.SharedMemoryLease,
                         used: list[shm.Segment]) -> shm.Segment:
    if used and used[0].lease_id == lease.lease_id:
        return used[0]  # the offered one, written into
    segment = await segments.mapped(lease)
    used.append(segment)
    return segment


def checked_result(spec: LayoutSpec, tokens: np.ndarray, first_chunk: int,
                   header: pb.ChunksHeader, got: list, check_digests: bool = True,
                   independent: bool = False) -> ReadChunksResult:
    """The reply's chunks, each checked end to end (with ``check_digests``, against the
    header's digest too; else against its own checksums); one failing is "corrupt".
    ``independent``: each checked as the first chunk of its own tokens."""
    keys = list(header.chunk_keys)
    digests = list(header.chunk_digests)
    if len(digests) != len(keys):
        raise InvalidRequest(f"a ReadChunks header names {len(keys)} chunks and "
                             f"{len(digests)} digests")
    result = ReadChunksResult(first_chunk, keys, {}, {})
    sent: dict[int, object] = {}
    for index, data, reason in got:
        n = index - first_chunk
        if not 0 <= n < len(keys) or index in sent or index in result.missing:
            raise InvalidRequest(f"a ReadChunks reply sent chunk {index} twice or out of "
                                 f"the range asked for ({first_chunk}+{len(keys)})")
        if data is None:
            result.missing[index] = reason
        else:
            sent[index] = data
    if first_chunk + len(keys) > len(tokens) // spec.chunk_tokens:
        raise InvalidRequest(f"a ReadChunks header names {len(keys)} chunks from chunk "
                             f"{first_chunk}; the tokens asked for have "
                             f"{len(tokens) // spec.chunk_tokens} whole chunks")
    block_keys: list[str | None] = [None] * len(keys)  # None: checked without a digest
    if check_digests:
        for index in list(sent):
            n = index - first_chunk
            if len(digests[n]) == DIGEST_BYTES:
                block_keys[n] = block_key(keys[n], digests[n])
            else:  # no digest to check it against: not a chunk to use
                del sent[index]
                result.missing[index] = "corrupt"
    run = RunCheck(spec, tokens, first_chunk, block_keys, independent)
    errors = run.many(list(sent), list(sent.values()), [False] * len(sent))
    for (index, data), error in zip(sent.items(), errors, strict=True):
        if error is None:
            result.chunks[index] = data
        else:
            result.missing[index] = "corrupt"
    for index in range(first_chunk, first_chunk + len(keys)):
        if index not in result.chunks:  # one the reply left out is no chunk to use either
            result.missing.setdefault(index, "not_held")
    return result


class PrefixChunkMethods:
    """``AsyncClient``'s prefix-chunk methods (it supplies ``_call``, ``layout``,
    ``shared_memory``, ``timeout_s`` and ``max_message_bytes``). A write is safe to send
    again on another node: its chunks are content-addressed, a second copy a dedupe."""

    async def write_chunks(self, tenant: str, layout: str | LayoutSpec, token_ids,
                           chunks: Sequence[bytes], *, first_chunk: int = 0,
                           model_fingerprint: str = "", dedupe_domain: str = "",
                           ack: str = "memory", skip_held: bool = True) -> WriteChunksResult:
        """Store encoded ``chunks`` (one per whole chunk of ``token_ids`` from ``first_chunk``)
        as cache of no session; ``skip_held``: send only those a Lookup does not find held
        with the same digest (``kvtier.prefix_chunks``)."""
        return await self._write(tenant, layout, token_ids, chunks, first_chunk,
                                 model_fingerprint, dedupe_domain, ack, skip_held, False)

    async def write_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                       token_ids: Sequence[int] | np.ndarray,
                                       chunks: Sequence[bytes], *, model_fingerprint: str = "",
                                       dedupe_domain: str = "", ack: str = "memory",
                                       skip_held: bool = False) -> WriteChunksResult:
        """``write_chunks`` of unrelated chunks in one call: ``chunks[i]`` is chunk 0 of the
        sequence ``token_ids[i * chunk_tokens:(i + 1) * chunk_tokens]`` (encoded at start
        token 0), keyed alone (module docstring)."""
        return await self._write(tenant, layout, token_ids, chunks, 0, model_fingerprint,
                                 dedupe_domain, ack, skip_held, True)

    async def _write(self, tenant: str, layout: str | LayoutSpec, token_ids,
                     chunks: Sequence[bytes], first_chunk: int, model_fingerprint: str,
                     dedupe_domain: str, ack: str, skip_held: bool, independent: bool
                     ) -> WriteChunksResult:
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        scope = dedupe_scope(tenant, dedupe_domain or None)
        keys, digests = keyed(spec, tokens, chunks, first_chunk, scope, model_fingerprint,
                              independent)
        header = write_header(spec, tenant, tokens, digests, first_chunk=first_chunk,
                              model_fingerprint=model_fingerprint, dedupe_domain=dedupe_domain,
                              ack=pb.Ack.Value(f"ACK_{ack.upper()}"), independent=independent)
        send = list(range(len(chunks)))
        started = time.monotonic()  # the lookup, the write and its resend: one deadline
        if skip_held and chunks:
            lookup = pb.LookupRequest(tenant=tenant, layout_id=spec.layout_id,
                                      model_fingerprint=model_fingerprint,
                                      dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(),
                                      independent_chunks=independent)
            held = await self._call(lambda node: node.stub.Lookup(lookup,
                                                                  timeout=self.timeout_s),
                                    started=started)
            send = unheld(held, keys, digests, first_chunk)

        def attempt(node: Node, send=send) -> Awaitable[WriteChunksResult]:
            return write_once(node, header, keys, chunks, send,
                              shared_memory=self.shared_memory, timeout_s=self.timeout_s,
                              max_message_bytes=self.max_message_bytes)

        try:
            return await self._call(attempt, started=started)
        except MissingChunks:  # one went since the lookup: send every chunk
            return await self._call(lambda node: attempt(node, range(len(chunks))),
                                    started=started)

    async def read_chunks(self, tenant: str, layout: str | LayoutSpec, token_ids, *,
                          first_chunk: int = 0, max_chunks: int = 0, model_fingerprint: str = "",
                          dedupe_domain: str = "", digests: Sequence[bytes] | None = None,
                          use_shared_memory: bool | None = None,
                          check_digests: bool = True, in_place: bool = False
                          ) -> ReadChunksResult:
        """Chunks of ``token_ids`` by position (``max_chunks`` 0: every whole one), each
        verified again here; ``digests``: the expected ones, one per chunk read.
        ``check_digests`` False: each chunk's bytes are still checked whole against its own
        checksums (header, section table, xxh3 of the payload) and its token range, but its
        BLAKE2b digest is not recomputed: a caller that only needs intact KV of these tokens
        (the vLLM connector) skips the costliest check, which only another version of the
        same tokens' chunk would fail. ``in_place``: over shared memory the chunks are
        views of the reply segment, valid until the caller calls the result's ``release``
        (it must, once done with them); inline they are the reply's bytes."""
        return await self._read(tenant, layout, token_ids, first_chunk, max_chunks,
                                model_fingerprint, dedupe_domain, digests, use_shared_memory,
                                check_digests, in_place, False)

    async def read_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                      token_ids: Sequence[int] | np.ndarray, *,
                                      model_fingerprint: str = "", dedupe_domain: str = "",
                                      use_shared_memory: bool | None = None,
                                      check_digests: bool = True, in_place: bool = False
                                      ) -> ReadChunksResult:
        """``read_chunks`` of unrelated chunks in one call: chunk ``i`` of the result is
        chunk 0 of the sequence ``token_ids[i * chunk_tokens:(i + 1) * chunk_tokens]``, read
        and checked alone (module docstring); a missing or corrupt one is missing alone."""
        return await self._read(tenant, layout, token_ids, 0, 0, model_fingerprint,
                                dedupe_domain, None, use_shared_memory, check_digests,
                                in_place, True)

    async def _read(self, tenant: str, layout: str | LayoutSpec, token_ids, first_chunk: int,
                    max_chunks: int, model_fingerprint: str, dedupe_domain: str,
                    digests: Sequence[bytes] | None, use_shared_memory: bool | None,
                    check_digests: bool, in_place: bool, independent: bool
                    ) -> ReadChunksResult:
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        request = pb.ReadChunksRequest(
            tenant=tenant, layout_id=spec.layout_id, model_fingerprint=model_fingerprint,
            dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(), first_chunk=first_chunk,
            max_chunks=max_chunks, chunk_digests=digests or [],
            independent_chunks=independent)

        def attempt(node: Node) -> Awaitable[ReadChunksResult]:
            request.use_shared_memory = (self.shared_memory if use_shared_memory is None
                                         else use_shared_memory and self.shared_memory)
            return read_once(node, request, spec, tokens, self.timeout_s, check_digests,
                             in_place)

        return await self._call(attempt)

    async def lookup_independent_chunks(self, tenant: str, layout: str | LayoutSpec,
                                        token_ids: Sequence[int] | np.ndarray, *,
                                        model_fingerprint: str = "", dedupe_domain: str = ""
                                        ) -> list[bool]:
        """Whether the server holds each whole chunk of ``token_ids``, each keyed alone
        (as ``write_independent_chunks`` wrote it) in the caller's domain: one Lookup."""
        spec = layout if isinstance(layout, LayoutSpec) else await self.layout(layout)
        tokens = cc.as_tokens(token_ids)
        request = pb.LookupRequest(tenant=tenant, layout_id=spec.layout_id,
                                   model_fingerprint=model_fingerprint,
                                   dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(),
                                   independent_chunks=True)
        reply = await self._call(lambda node: node.stub.Lookup(request, timeout=self.timeout_s))
        held = [False] * (len(tokens) // spec.chunk_tokens)
        for chunk in reply.chunks:
            if chunk.index >= len(held):
                raise InvalidRequest(f"a Lookup reply names chunk {chunk.index} of "
                                     f"{len(held)}")
            held[chunk.index] = True
        return held
