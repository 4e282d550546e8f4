"""The worker's store I/O, each run in a background thread: load chunks into paged blocks
layer by layer, save full blocks as chunks, spill a finished session. Saves and spills
work on copies of blocks the worker took on the forward path, so they never hold a block.

Every chunk read is checked before a byte of it reaches the cache: the store's digest and
the client's end-to-end checks (``read_chunks``), then the codec's (checksums, layout, token
count and token hash) and its start token here. The first chunk that is missing or fails
ends the load: it and every later block of the request are load errors, so vLLM recomputes
them; nothing after a gap is used.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from kvstore.format.chunk import StreamData, decode_chunk, encode_chunk, read_header
from kvstore.format.chunk_parts import PART_CODES, chunk_plan
from kvstore.format.errors import KVTierError
from kvstore.format.layout import LayoutSpec
from kvtier.integrations.vllm import values
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.layout import STREAMS
from kvtier.integrations.vllm.metadata import LoadPlan, SavePlan, SpillPlan
from kvtier.integrations.vllm.repack import PagedLayout
from kvtier.integrations.vllm.stats import StatsCounter
from kvtier.sync import Client

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

    def block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64, device=self.layers[0].device)

    def encode_blocks(self, kv: dict[str, torch.Tensor], token_ids: Sequence[int],
                      first_token: int) -> list[bytes]:
        """Chunks of K and V (layers, tokens, H, D) from token ``first_token`` on: one per
        whole block, and one more for a partial last block."""
        bs = self.block_size
        count = kv["k"].shape[1]
        out = []
        for start in range(0, count, bs):
            stop = min(start + bs, count)
            streams = {name: values.encode(self.spec.stream(name), kv[name][:, start:stop])
                       for name in STREAMS}
            at = first_token + start
            out.append(encode_chunk(self.spec, at, token_ids[at:at + stop - start], streams))
        return out


def gathered(raw: list[torch.Tensor], paged: PagedLayout) -> dict[str, torch.Tensor]:
    """K and V (layers, tokens, H, D) on the CPU of per-layer blocks ``PagedLayout.take``
    returned."""
    split = [paged.split(blocks.cpu()) for blocks in raw]
    return {"k": torch.stack([k for k, _ in split]), "v": torch.stack([v for _, v in split])}


@dataclass
class LoadJob:
    plan: LoadPlan
    layer_ready: list[threading.Event]
    # a CUDA event after the step's work queued before the load (vLLM zeroes new blocks
    # first): the load writes after it; None on the CPU, where that work is done
    queued: object = None
    done: threading.Event = field(default_factory=threading.Event)
    loaded_chunks: int = 0  # chunks from plan.first_chunk written into their blocks

    @classmethod
    def of(cls, plan: LoadPlan, layers: int, queued=None) -> LoadJob:
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
        # checksums and token range, twice (the client's check, then the decode's).
        result = store.client.read_chunks(
            store.config.tenant, store.spec, list(plan.token_ids), first_chunk=plan.first_chunk,
            max_chunks=len(plan.block_ids), model_fingerprint=store.config.model_fingerprint,
            dedupe_domain=store.config.dedupe_domain, check_digests=False)
        decoded = []
        for chunk in range(plan.first_chunk, plan.end_chunk):
            data = result.chunks.get(chunk)
            if data is None:
                logger.warning("kvtier chunk %d of request %s not loaded: %s", chunk,
                               plan.req_id, result.missing.get(chunk, "not sent"))
                break
            streams = _checked(store, data, chunk, plan.token_ids)
            if streams is None:
                break
            decoded.append(streams)
            read_bytes += len(data)
        if decoded:
            if job.queued is not None:
                job.queued.synchronize()
            # Layer by layer, each layer's event set once it is written: the forward pass
            # runs a layer as soon as its blocks are in.
            for layer, tensor in enumerate(store.layers):
                for block_id, streams in zip(plan.block_ids, decoded, strict=False):
                    k, v = (_layer_values(store, name, streams[name], layer) for name in STREAMS)
                    store.paged.put_block(tensor, block_id, k.to(tensor.device),
                                          v.to(tensor.device))
                settle(tensor)
                job.layer_ready[layer].set()
            job.loaded_chunks = len(decoded)
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


def _checked(store: Store, data, chunk: int, token_ids: Sequence[int]
             ) -> dict[str, StreamData] | None:
    """The streams of chunk ``chunk`` if every check passes, else None (logged). An
    uncompressed chunk of a passthrough format gives views of its bytes (``read_chunks``
    checked every one of them against the chunk's checksums and this token range); any
    other is decoded, and checked again while it is."""
    bs = store.block_size
    try:
        header = read_header(data)
        if header.start_token != chunk * bs or header.num_tokens != bs:
            raise KVTierError(f"it covers tokens from {header.start_token} "
                              f"({header.num_tokens}), not block {chunk}")
        if not header.compressed and all(store.spec.stream(n).value_format.scales == "none"
                                         for n in STREAMS):
            return _views(store, data, header.payload_offset)
        return decode_chunk(data, store.spec,
                            token_ids=token_ids[chunk * bs:(chunk + 1) * bs]).streams
    except KVTierError as exc:
        logger.warning("kvtier chunk %d fails its checks, not loaded: %s", chunk, exc)
        return None


def _views(store: Store, data, payload_offset: int) -> dict[str, StreamData]:
    """Each stream's codes (layers, block_size, H, D) as a view of the chunk's bytes."""
    out = {}
    with warnings.catch_warnings():  # read-only bytes: only ever read from
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for part in chunk_plan(store.spec, store.block_size, False).parts:
            if part.part != PART_CODES:
                continue
            raw = torch.frombuffer(data, dtype=torch.uint8, offset=payload_offset + part.offset,
                                   count=part.layer_bytes * part.shape[0])
            out[part.stream.name] = StreamData(raw.view(part.dtype).view(part.shape), None)
    return out


def _layer_values(store: Store, name: str, data: StreamData, layer: int) -> torch.Tensor:
    """(block_size, H, D) values in the cache's dtype of one layer of one chunk's stream."""
    one = StreamData(data.codes[layer:layer + 1],
                     None if data.scales is None else data.scales[layer:layer + 1])
    return values.decode(store.spec.stream(name), one, store.dtype)[0]


def settle(tensor: torch.Tensor) -> None:
    """Wait until this thread's queued writes to ``tensor`` are done: a CUDA copy is
    asynchronous, and the forward pass reads the cache on another stream."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def run_save(store: Store, plan: SavePlan, raw: list[torch.Tensor], ready=None) -> bool:
    """Encode the blocks ``raw`` (per layer, as ``PagedLayout.take`` copied them) and write
    them as chunks from ``plan.first_chunk`` (those the store holds are not sent);
    ``ready``: a CUDA event recorded after the copies were queued (None on the CPU).
    Whether it was written."""
    started = time.monotonic()
    try:
        if ready is not None:
            ready.synchronize()
        kv = gathered(raw, store.paged)
        chunks = store.encode_blocks(kv, plan.token_ids, plan.first_chunk * store.block_size)
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
              ready=None) -> bool:
    """Spill the session from copies of its blocks ``raw`` (per layer, as
    ``PagedLayout.take`` copied them; ``ready`` as for ``run_save``): whole blocks as
    chunks (held ones go by key and digest), the partial last block as the tail. Whether
    it was spilled."""
    bs = store.block_size
    tokens = list(plan.token_ids)
    try:
        if ready is not None:
            ready.synchronize()
        kv = gathered(raw, store.paged)
        kv = {name: tensor[:, :len(tokens)] for name, tensor in kv.items()}
        encoded = store.encode_blocks(kv, tokens, 0)
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
