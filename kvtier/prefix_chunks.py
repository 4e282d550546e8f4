"""Prefix chunks of no session over the WriteChunks and ReadChunks calls (proto "Prefix
chunks"), for ``AsyncClient.write_chunks`` and ``read_chunks``. No retries here
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
into a segment only when the client offers it, and it offers none it has lent). In place,
the chunks the server's host tier holds are not copied into the segment at all: they are
views of its slabs (``shm.ArenaSlab``, read-only), pinned by the server under a read
lease that the same ``release`` ends. Either way every chunk is checked as any reply's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.format.chunk import Buffer
from kvstore.format.errors import InvalidRequest
from kvstore.format.keys import (
    DIGEST_BYTES,
    block_key,
    chain_keys,
    chunk_digest,
    independent_keys,
)
from kvstore.format.layout import LayoutSpec
from kvstore.format.run_checks import RunCheck
from kvtier import shm
from kvtier.replies import reply_segment
from kvtier.routing import Node
from kvtier.types import ReadChunksResult, WriteChunksResult
from kvtier.upload import Item, upload
from proto import kvtier_pb2 as pb

# a chunk of a reply: (chunk index, its bytes or None when missing, why missing)
Got = tuple[int, bytes | memoryview | None, str]


def write_header(spec: LayoutSpec, tenant: str, tokens: np.ndarray, digests: list[bytes], *,
                 first_chunk: int, model_fingerprint: str, dedupe_domain: str, ack: str,
                 independent: bool = False) -> pb.WriteChunksHeader:  # ack: an Ack name
    return pb.WriteChunksHeader(
        tenant=tenant, layout_id=spec.layout_id, model_fingerprint=model_fingerprint,
        dedupe_domain=dedupe_domain, token_ids=tokens.tobytes(), first_chunk=first_chunk,
        chunk_digests=digests, ack=ack, independent_chunks=independent)


def keyed(spec: LayoutSpec, tokens: np.ndarray, chunks: Sequence[Buffer], first_chunk: int,
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
                     chunks: Sequence[Buffer], send: Sequence[int], *, shared_memory: bool,
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


async def read_once(node: Node, request: pb.ReadChunksRequest, spec: LayoutSpec,  # noqa: C901 - one reply stream; every exit settles its segments
                    tokens: np.ndarray, timeout_s: float | None,
                    check_digests: bool = True, in_place: bool = False) -> ReadChunksResult:
    """One ReadChunks call; on the shared-memory path it offers a segment it holds as
    ``reply_lease``, as a restore does (``kvtier.client.AsyncClient._receive``), and
    with ``in_place`` lends the reply's segment to the result (module docstring)."""
    offered = node.segments.for_reply() if request.use_shared_memory else None
    request.reply_lease = offered.lease_id if offered is not None else ""
    request.refs_in_header = request.use_shared_memory
    request.in_place = in_place and request.use_shared_memory
    used = [offered] if offered is not None else []
    started = time.monotonic()
    call = node.stub.ReadChunks(request, timeout=timeout_s)
    header: pb.ChunksHeader | None = None
    got: list[Got] = []
    segment: shm.Segment | None = None
    end_read: Callable[[], None] | None = None  # unpins the chunks read in the server's slabs
    try:
        async for reply in call:
            kind = reply.WhichOneof("item")
            if kind == "header":
                header = reply.header
                if header.read_lease:
                    end_read = node.segments.end_read(header.read_lease)
                if header.HasField("reply_segment"):
                    segment = await reply_segment(node.segments, header.reply_segment, used)
                slabs = node.segments.slabs(header.arena_slabs)
                got += _in_header(header, segment, slabs, request.first_chunk, in_place)
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
        if end_read is not None:
            end_read()
        await node.segments.release(used)
        raise
    except BaseException:  # cancelled: no call to release them, the server reaps them
        call.cancel()
        for held in used:
            held.close()
        raise
    release = end_read
    if in_place and segment is not None:
        await node.segments.replied([s for s in used if s is not segment], None, started)
        release = _both(node.segments.lend(segment, started), end_read)
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


def _both(give_back: Callable[[], None], end_read: Callable[[], None] | None
          ) -> Callable[[], None]:
    """One release for a lent reply segment and a read lease."""
    if end_read is None:
        return give_back

    def release() -> None:
        give_back()
        end_read()

    return release


def _in_header(header: pb.ChunksHeader, segment: shm.Segment | None,
               slabs: dict[str, shm.ArenaSlab], first_chunk: int, in_place: bool
               ) -> list[Got]:
    """The chunks the header lists in shared memory (``chunk_refs``): those in the
    server's slabs and, with ``in_place``, those in the reply segment as views of where
    they lie; the others copied out of the segment, in one copy where they lie back to
    back."""
    refs = list(header.chunk_refs)
    if not refs:
        return []
    if (segment is None and not slabs) or len(refs) != len(header.chunk_keys):
        raise InvalidRequest(f"a ReadChunks header lists {len(refs)} chunks in shared memory "
                             f"for {len(header.chunk_keys)} chunks"
                             + ("" if segment or slabs else " and names no segment"))
    sent = [(first_chunk + n, ref) for n, ref in enumerate(refs) if ref.length]
    got: list[Got] = [(index, slabs[ref.lease_id].view(ref) if in_place
                       else slabs[ref.lease_id].view(ref).tobytes(), "")
                      for index, ref in sent if ref.lease_id in slabs]
    sent = [(index, ref) for index, ref in sent if ref.lease_id not in slabs]
    if not sent:
        return got
    if segment is None:
        raise InvalidRequest("a ReadChunks header refers to a reply segment it does not name")
    if in_place:
        return got + [(index, segment.view(ref), "") for index, ref in sent]
    run = segment.read_run([ref for _, ref in sent])
    if run is None:
        return got + [(index, segment.read(ref), "") for index, ref in sent]
    return got + [(index, data, "") for (index, _), data in zip(sent, run, strict=True)]


def checked_result(spec: LayoutSpec, tokens: np.ndarray, first_chunk: int,  # noqa: C901 - every check of a reply's chunks, in order
                   header: pb.ChunksHeader, got: list[Got], check_digests: bool = True,
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
    sent: dict[int, bytes | memoryview] = {}
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
