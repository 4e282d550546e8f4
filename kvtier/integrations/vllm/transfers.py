"""The worker's store I/O, each run in a background thread: load chunks into paged blocks
layer by layer, save full blocks as chunks, spill a finished session. Saves and spills
work on copies of blocks the worker took on the forward path, so they never hold a block.

Every chunk read is checked before a byte of it reaches the cache, by the client's
end-to-end checks (``read_chunks``: header and section table, checksums over every byte,
layout, start token, token count and token hash, all chunks of a load at once); a chunk
that is not a passthrough, uncompressed one is decoded, and checked again while it is. The
first chunk that is missing or fails ends the load: it and every later block of the
request are load errors, so vLLM recomputes them; nothing after a gap is used.

A load is one ReadChunks call; over shared memory its chunks are read where they lie in
the reply segment (lent until the load is written), and each layer's blocks go into the
cache in one call: engine pages as they are (``PagedLayout.put_pages``, one scatter), or
token-major K and V (``PagedLayout.put_blocks``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.logger import init_logger

from kvstore.format.chunk import (
    FLAG_ZSTD,
    FLAGS_BYTES,
    Buffer,
    decode_chunk,
    encode_chunk,
    encode_head,
    head_bytes,
    read_header,
)
from kvstore.format.chunk_parts import PART_CODES, chunk_plan
from kvstore.format.errors import KVTierError
from kvstore.format.layout import LayoutSpec
from kvtier.integrations.vllm import values
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.layout import PAGE, STREAMS, raw_stream
from kvtier.integrations.vllm.metadata import LoadPlan, SavePlan, SpillPlan
from kvtier.integrations.vllm.repack import PagedLayout, block_bytes
from kvtier.integrations.vllm.stats import StatsCounter
from kvtier.sync import Client
from kvtier.types import ReadChunksResult

logger = init_logger("vllm." + __name__)  # under vLLM's logger: its format and level


@dataclass
class Store:
    """What every transfer needs: the client, this rank's layout, the paged cache."""

    client: Client
    config: ConnectorConfig
    spec: LayoutSpec
    paged: PagedLayout
    layers: list[torch.Tensor]  # one per attention layer, in layer order
    dtype: torch.dtype
    stats: StatsCounter

    @property
    def block_size(self) -> int:
        return self.spec.chunk_tokens

    @property
    def streams(self) -> list[str]:
        """The layout's streams: ``page`` (engine pages; a raw layout's one per page
        size: ``page``, ``page1``, ...) or ``k`` and ``v``."""
        return [s.name for s in self.spec.streams]

    @property
    def page_streams(self) -> list[tuple[str, int]]:
        """Per layer, the page stream holding its pages and its index among that
        stream's layers (a raw layout groups layers by page size, in order)."""
        sizes = [block_bytes(layer) for layer in self.layers]
        if self.paged.kind != "raw":
            return [(PAGE, i) for i in range(len(self.layers))]
        order = list(dict.fromkeys(sizes))
        return [(raw_stream(order.index(size)), sizes[:i].count(size))
                for i, size in enumerate(sizes)]

    def block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.layers[0].device)

    def encode_blocks(self, kv: dict[str, torch.Tensor], token_ids: Sequence[int],
                      first_token: int, count: int) -> list[bytes]:
        """Chunks of ``count`` tokens from token ``first_token`` on, of K and V (layers,
        tokens, H, D) or of pages (layers, blocks, page bytes) (``gathered``): one per
        whole block, and one more for a partial last block (no page: a page is whole)."""
        bs = self.block_size
        out = []
        for start in range(0, count, bs):
            stop = min(start + bs, count)
            streams = {}
            for name in self.streams:
                stream = self.spec.stream(name)
                part = kv[name][:, start // bs:stop // bs] if stream.format == PAGE \
                    else kv[name][:, start:stop]
                streams[name] = values.encode(stream, part)
            at = first_token + start
            out.append(encode_chunk(self.spec, at, token_ids[at:at + stop - start], streams))
        return out


def page_chunks(raw: list[torch.Tensor], store: Store, token_ids: Sequence[int],
                first_token: int) -> list[memoryview]:
    """The chunks of whole blocks ``raw`` (per layer, as ``PagedLayout.take`` copied
    them) of an engine-page layout from token ``first_token`` on, as ``encode_blocks``
    makes them, laid out in one buffer (n, chunk bytes) uint8: each layer's pages go to
    their place in every chunk in one copy (a torch copy, the GIL released), then each
    chunk's header is written before its payload; no per-chunk staging."""
    paged, bs = store.paged, store.block_size
    n = raw[0].shape[paged.block_dim]
    plan = chunk_plan(store.spec, bs, False)
    codes = {p.stream.name: p for p in plan.parts if p.part == PART_CODES}
    start = head_bytes(store.spec, bs)
    buffer = torch.empty((n, start + plan.payload_bytes), dtype=torch.uint8)
    for (name, at), blocks in zip(store.page_streams, raw, strict=True):
        part = codes[name]
        offset = start + part.offset + at * part.layer_bytes
        # (n, page bytes): each block's page, opaque
        buffer[:, offset:offset + part.layer_bytes].copy_(paged.as_pages(blocks))
    rows = buffer.numpy()
    out = []
    for i in range(n):
        at = first_token + i * bs
        row = memoryview(rows[i])
        row[:start] = encode_head(store.spec, at, token_ids[at:at + bs], row[start:])
        out.append(row)
    return out


def gathered(raw: list[torch.Tensor], store: Store) -> dict[str, torch.Tensor]:
    """K and V (layers, tokens, H, D) on the CPU of per-layer blocks ``PagedLayout.take``
    returned; for engine pages the pages, per page stream (layers, blocks, page bytes)
    uint8, no repack."""
    paged = store.paged
    if paged.pages:
        pages: dict[str, list[torch.Tensor]] = {}
        for (name, _), blocks in zip(store.page_streams, raw, strict=True):
            pages.setdefault(name, []).append(paged.as_pages(blocks))
        return {name: torch.stack(layers) for name, layers in pages.items()}
    split = [paged.split(blocks.cpu()) for blocks in raw]
    return {"k": torch.stack([k for k, _ in split]), "v": torch.stack([v for _, v in split])}


@dataclass
class LoadJob:
    plan: LoadPlan
    layer_ready: list[threading.Event]
    # a CUDA event after the step's work queued before the load (vLLM zeroes new blocks
    # first): the load writes after it; None on the CPU, where that work is done
    queued: torch.cuda.Event | None = None
    done: threading.Event = field(default_factory=threading.Event)
    loaded_chunks: int = 0  # chunks from plan.first_chunk written into their blocks

    @classmethod
    def of(cls, plan: LoadPlan, layers: int, queued: torch.cuda.Event | None = None
           ) -> LoadJob:
        return cls(plan, [threading.Event() for _ in range(layers)], queued)

    @property
    def failed_blocks(self) -> list[int]:
        return list(self.plan.block_ids[self.loaded_chunks:])

    @property
    def first_failed_chunk(self) -> int | None:
        failed = self.plan.first_chunk + self.loaded_chunks
        return failed if failed < self.plan.end_chunk else None


def run_load(store: Store, job: LoadJob) -> None:
    """Read the plan's chunks, verify them and write the good prefix into the cache layer
    by layer, each layer's event set as soon as it is written (all set at the end, also on
    failure, so no forward waits forever)."""
    plan, bs = job.plan, store.block_size
    started = time.monotonic()
    read_bytes = 0
    try:
        # Digests are not recomputed: every byte is still checked against the chunk's own
        # checksums and token range by ``read_chunks``, all chunks at once. Over shared
        # memory the chunks are views of the reply segment, lent until ``release``.
        with store.client.read_chunks(
                store.config.tenant, store.spec, list(plan.token_ids),
                first_chunk=plan.first_chunk, max_chunks=len(plan.block_ids),
                model_fingerprint=store.config.model_fingerprint,
                dedupe_domain=store.config.dedupe_domain, check_digests=False,
                in_place=True) as result:
            chunks = [result.chunks[plan.first_chunk + n]
                      for n in range(_good_prefix(plan, result))]
            runs = _streams(store, chunks, plan)
            count = sum(_run_length(streams) for _, streams in runs)
            read_bytes = sum(map(len, chunks[:count]))
            if count:
                if job.queued is not None:
                    job.queued.synchronize()
                index = store.block_index(plan.block_ids[:count])
                # Layer by layer, each layer's event set once it is written: the forward
                # pass runs a layer as soon as its blocks are in.
                where = store.page_streams if store.paged.pages else []
                for layer, tensor in enumerate(store.layers):
                    for start, streams in runs:
                        blocks = index[start:start + _run_length(streams)]
                        if store.paged.pages:
                            name, at = where[layer]
                            store.paged.put_pages(tensor, blocks, streams[name][at])
                        else:
                            k, v = (streams[name][layer] for name in STREAMS)
                            store.paged.put_blocks(tensor, blocks, k, v)
                    settle(tensor)
                    job.layer_ready[layer].set()
                job.loaded_chunks = count
    except Exception as exc:  # an outage, a bug: the blocks are recomputed, never used
        logger.warning("kvtier load of request %s failed: %s", plan.req_id, exc)
    finally:
        for event in job.layer_ready:
            event.set()
        failed = len(plan.block_ids) - job.loaded_chunks
        store.stats.add(loads=1, loaded_tokens=job.loaded_chunks * bs,
                        loaded_bytes=read_bytes, load_seconds=time.monotonic() - started,
                        load_error_blocks=failed)
        job.done.set()


def _good_prefix(plan: LoadPlan, result: ReadChunksResult) -> int:
    """How many chunks from ``plan.first_chunk`` on came and passed ``read_chunks``'
    checks before the first that did not (logged): nothing after a gap is used."""
    for n in range(len(plan.block_ids)):
        chunk = plan.first_chunk + n
        if chunk not in result.chunks:
            logger.warning("kvtier chunk %d of request %s not loaded: %s", chunk,
                           plan.req_id, result.missing.get(chunk, "not sent"))
            return n
    return len(plan.block_ids)


def _run_length(streams: dict[str, list[torch.Tensor]]) -> int:
    return int(next(iter(streams.values()))[0].shape[0])


def _streams(store: Store, chunks: list[bytes | memoryview], plan: LoadPlan
             ) -> list[tuple[int, dict[str, list[torch.Tensor]]]]:
    """The first n of ``chunks`` (read and checked by ``read_chunks``) that decode, in
    runs: (index of its first chunk, per stream, per layer, the values (k, block_size, H,
    D) in the cache's dtype (or the pages, (k, ...) uint8)). Uncompressed chunks of a
    passthrough format are views of their bytes, a run per stretch of evenly spaced
    chunks; else they are decoded one by one into one run (the first that fails the
    codec's checks ends it; logged). [] when none."""
    if not chunks:
        return []
    runs = _rows(store, chunks)
    if runs is not None:
        return [(start, _views(store, rows)) for start, rows in runs]
    bs = store.block_size
    decoded = []
    for n, data in enumerate(chunks):
        chunk = plan.first_chunk + n
        try:
            got = decode_chunk(data, store.spec,
                               token_ids=plan.token_ids[chunk * bs:(chunk + 1) * bs]).streams
            decoded.append({name: values.decode(store.spec.stream(name), got[name],
                                                store.dtype) for name in store.streams})
        except KVTierError as exc:
            logger.warning("kvtier chunk %d fails its checks, not loaded: %s", chunk, exc)
            break
    if not decoded:
        return []
    # each (layers, n, block_size, H, D)
    return [(0, {name: list(torch.stack([d[name] for d in decoded], dim=1))
                 for name in store.streams})]


def _rows(store: Store, chunks: list[bytes | memoryview]
          ) -> list[tuple[int, np.ndarray]] | None:
    """The chunks as runs of (k, bytes) uint8 arrays, each a view of a stretch of chunks
    that lie evenly spaced (back to back in a reply segment, consecutive slots of the
    server's host tier): (index of its first chunk, rows). None unless all are
    uncompressed, of one size, of a passthrough format."""
    if not all(s.value_format.scales == "none" for s in store.spec.streams):
        return None
    views = [np.frombuffer(c, np.uint8) for c in chunks]
    size = views[0].size
    if any(v.size != size for v in views):
        return None
    at = [v.ctypes.data for v in views]
    runs, start = [], 0
    for n in range(1, len(views) + 1):
        step = at[start + 1] - at[start] if start + 1 < len(views) else size
        if n < len(views) and at[n] - at[n - 1] == step and step >= size:
            continue
        runs.append((start, np.lib.stride_tricks.as_strided(
            views[start], (n - start, size), (step if n - start > 1 else size, 1),
            writeable=False)))
        start = n
    flags = np.concatenate([rows[:, FLAGS_BYTES].copy().view("<u2").reshape(-1)
                            for _, rows in runs])  # (n,) header flags
    return None if (flags & FLAG_ZSTD).any() else runs


def _views(store: Store, rows: np.ndarray) -> dict[str, list[torch.Tensor]]:
    """Each stream's codes per layer, (n, block_size, H, D) (a page stream's (n, 1, H,
    bytes per head)), as views of ``rows``: (n, bytes) uint8 (rows evenly spaced, not
    always adjacent), uncompressed chunks ``read_chunks`` checked whole."""
    n, size = rows.shape
    step = rows.strides[0]  # from one chunk's start to the next's: size or more
    payload = read_header(rows[0]).payload_offset
    flat = np.lib.stride_tricks.as_strided(rows, ((n - 1) * step + size,), (1,),
                                           writeable=False)
    with warnings.catch_warnings():  # read-only bytes: only ever read from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(flat, dtype=torch.uint8)  # ((n - 1) * step + size,)
    out = {}
    for part in chunk_plan(store.spec, store.block_size, False).parts:
        if part.part != PART_CODES:
            continue
        layers, span = part.shape[0], part.layer_bytes
        raw = whole.as_strided((layers, n, span), (span, step, 1), payload + part.offset)
        codes = raw.view(part.dtype)  # (layers, n, block_size * H * D)
        out[part.stream.name] = list(codes.view(layers, n, *part.shape[1:]))
    return out


def settle(tensor: torch.Tensor) -> None:
    """Wait until this thread's queued writes to ``tensor`` are done: a CUDA copy is
    asynchronous, and the forward pass reads the cache on another stream."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def run_save(store: Store, plan: SavePlan, raw: list[torch.Tensor],
             ready: torch.cuda.Event | None = None) -> bool:
    """Encode the blocks ``raw`` (per layer, as ``PagedLayout.take`` copied them) and write
    them as chunks from ``plan.first_chunk`` (those the store holds are not sent);
    ``ready``: a CUDA event recorded after the copies were queued (None on the CPU).
    Whether it was written."""
    started = time.monotonic()
    try:
        if ready is not None:
            ready.synchronize()
        first_token = plan.first_chunk * store.block_size
        if store.paged.pages:
            chunks: Sequence[Buffer] = page_chunks(raw, store, plan.token_ids, first_token)
        else:
            chunks = store.encode_blocks(gathered(raw, store), plan.token_ids, first_token,
                                         len(plan.block_ids) * store.block_size)
        result = store.client.write_chunks(
            store.config.tenant, store.spec, list(plan.token_ids), chunks,
            first_chunk=plan.first_chunk, model_fingerprint=store.config.model_fingerprint,
            dedupe_domain=store.config.dedupe_domain, ack=store.config.ack, skip_held=True)
        store.stats.add(saves=1, saved_tokens=result.chunks_written * store.block_size,
                        saved_bytes=sum(len(c) for c in chunks),
                        save_seconds=time.monotonic() - started)
        return True
    except Exception as exc:  # a lost save is a later miss, never a wrong block
        logger.warning("kvtier save of request %s failed: %s", plan.req_id, exc)
        store.stats.add(saves=1, save_errors=1, save_seconds=time.monotonic() - started)
        return False


def run_spill(store: Store, plan: SpillPlan, session_id: str, raw: list[torch.Tensor],
              ready: torch.cuda.Event | None = None) -> bool:
    """Spill the session from copies of its blocks ``raw`` (per layer, as
    ``PagedLayout.take`` copied them; ``ready`` as for ``run_save``): whole blocks as
    chunks (held ones go by key and digest), the partial last block as the tail. Whether
    it was spilled."""
    bs = store.block_size
    tokens = list(plan.token_ids)
    try:
        if ready is not None:
            ready.synchronize()
        encoded = store.encode_blocks(gathered(raw, store), tokens, 0, len(tokens))
        full = len(tokens) // bs
        chunks, tail = encoded[:full], b"".join(encoded[full:])
        # learns which chunks the store holds, so the spill names them without bytes
        store.client.lookup(store.config.tenant, store.spec, tokens[:full * bs],
                            model=store.config.model_fingerprint,
                            dedupe_domain=store.config.dedupe_domain)
        store.client.spill(store.config.tenant, session_id, store.spec, tokens, chunks=chunks,
                           tail=tail, generation=plan.generation, ack=store.config.ack,
                           model_fingerprint=store.config.model_fingerprint,
                           dedupe_domain=store.config.dedupe_domain)
        store.stats.add(spills=1)
        return True
    except Exception as exc:
        logger.warning("kvtier spill of session %s failed: %s", session_id, exc)
        store.stats.add(spills=1, spill_errors=1)
        return False
