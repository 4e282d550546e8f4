"""Prefix chunks of no session in a simulation: ``write`` (WriteChunks), ``read``
(ReadChunks, then Lookup's held count), each judged against the model of what each
tenant wrote (``Prefix``). Half the reads are in place (host-tier chunks read where they
lie in the server's shared memory, pinned under a read lease); a few of those are kept
open across later steps (``HeldRead``: deletes, evictions, writes and restarts run
meanwhile) and judged again before they are released. A prefix may be independent
chunks (proto "Independent chunks": an engine's pages, each chunk 0 of its own tokens):
written a random subset a call, read in one call, and Lookup answers each page's held
state, judged page by page.

The promise (proto "Prefix chunks", ``kvstore.session.prefix_chunks``): a server whose
``retain_unreferenced`` is off refuses every write (FAILED_PRECONDITION); otherwise the
chunks are retained cache of the tenant's domain. A chunk read back is the very bytes
written, always. One may be gone, and only then: idle past ``retain_ttl_s`` (counted
from its first write: a read makes it recent only in this life), under the tenant's
``durable_bytes`` quota (the least recently used are freed for a write), on a full
medium, after a compaction (it collects unreferenced chunks) or a migrate, or after a
kill -9 when its ack was "memory". A write that was not acknowledged is not visible:
Lookup counts only chunks a write acknowledged. A durable ack survives kill -9; a
memory ack survives a graceful stop (its write-back drains).

Chunk bytes: ``kvtier.codec.encode_chunks`` over random streams of the layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from bench.seams.layouts import BUNDLED
from bench.seams.model import random_streams
from bench.seams.switches import RETAIN_TTL_S
from kvstore.format.errors import KVTierError, PreconditionFailed, QuotaExceeded, TierFull
from kvstore.format.keys import dedupe_scope, independent_keys
from kvtier import codec as cc

MAX_CHUNKS = 3  # per write: a chunk of the bundled layout is about 18 KiB
MAX_HELD_READS = 3  # in-place reads kept open across later steps, the oldest judged first
MAX_PREFIXES = 4  # per tenant; the oldest is forgotten past it
TTL_MARGIN_S = 1.0


@dataclass
class HeldRead:
    """An in-place read kept open (its read lease live) across later steps: deletes,
    evictions, overwrites and restarts meanwhile must not change what it shows."""

    step: int
    name: str
    op: str
    result: object  # kvtier.types.ReadChunksResult; its chunks are views of shared memory
    expected: dict[int, bytes]  # each chunk it showed, as written


@dataclass
class Prefix:
    """One token sequence a tenant wrote chunks of."""

    tenant: str
    pid: str  # names it in the log and the findings
    tokens: np.ndarray  # uint32, whole chunks only
    chunks: list[bytes]  # every whole chunk's encoded bytes, by index
    written: dict[int, float] = field(default_factory=dict)  # index -> wall time, first ack
    durable: set[int] = field(default_factory=set)  # indices acked durable
    drained: set[int] = field(default_factory=set)  # memory-acked, then a graceful stop
    maybe_gone: set[int] = field(default_factory=set)  # indices an event may have freed
    unacked: set[int] = field(default_factory=set)  # sent, the write failed: must not show
    independent: bool = False  # every chunk keyed alone (pages), not a chain

    def may_be_absent(self, index: int, sim) -> bool:
        return (sim.combo.quota or sim.full or index in self.maybe_gone
                or time.time() > self.written[index] + RETAIN_TTL_S - TTL_MARGIN_S)


def new_prefix(sim, tenant: str, independent: bool = False) -> Prefix:
    spec = sim.spec(BUNDLED)
    count = sim.rng.randint(1, MAX_CHUNKS)
    tokens = sim.tokens(spec, count * spec.chunk_tokens).numpy().astype("uint32")
    if independent:  # each page chunk 0 of its own tokens
        c = spec.chunk_tokens
        chunks = [cc.encode_chunks(spec, tokens[i * c:(i + 1) * c], random_streams(
            spec, c, sim.rng))[0] for i in range(count)]
    else:
        chunks = cc.encode_chunks(spec, tokens, random_streams(spec, len(tokens), sim.rng))
    mine = [p for p in sim.prefixes if p.tenant == tenant]
    if len(mine) >= MAX_PREFIXES:
        sim.prefixes.remove(mine[0])
    prefix = Prefix(tenant, f"{'pages' if independent else 'prefix'}-{sim.new_sid()}", tokens,
                    chunks, independent=independent)
    sim.prefixes.append(prefix)
    return prefix


def choose(sim, tenant: str, busy: set, *, written: bool, independent: bool = False
           ) -> Prefix | None:
    """One of the tenant's prefixes (or pages) no running operation uses (``written``:
    with chunks acked), marked busy."""
    mine = [p for p in sim.prefixes if p.tenant == tenant and (tenant, p.pid) not in busy
            and (p.written or not written) and p.independent == independent]
    if not mine:
        return None
    prefix = sim.rng.choice(mine)
    busy.add((tenant, prefix.pid))
    return prefix


async def write(sim, step: int, prefix: Prefix, ack: str | None = None) -> None:
    """WriteChunks of ``prefix``: from its first unwritten chunk, or again from 0 (a
    dedupe of those written); of pages, a random subset of them."""
    spec = sim.spec(BUNDLED)
    tenant = prefix.tenant
    first = 0 if sim.rng.random() < 0.5 else min(len(prefix.written), len(prefix.chunks) - 1)
    ack = ack or sim.rng.choice(("memory", "durable"))
    send = list(range(first, len(prefix.chunks)))
    if prefix.independent:
        send = sorted(sim.rng.sample(range(len(prefix.chunks)),
                                     sim.rng.randint(1, len(prefix.chunks))))
    name = f"{tenant}/{prefix.pid}"
    op = "write-pages" if prefix.independent else "write-chunks"
    sim.log(f"step={step} op={op} s={name} first={first} chunks={len(send)} ack={ack}")
    skip_held = sim.rng.random() < 0.5
    c = spec.chunk_tokens
    try:
        if prefix.independent:
            tokens = np.concatenate([prefix.tokens[i * c:(i + 1) * c] for i in send])
            reply = await sim.client(tenant).write_independent_chunks(
                tenant, spec, tokens, [prefix.chunks[i] for i in send], ack=ack,
                skip_held=skip_held)
        else:
            reply = await sim.client(tenant).write_chunks(
                tenant, spec, prefix.tokens, prefix.chunks[first:], first_chunk=first,
                ack=ack, skip_held=skip_held)
    except PreconditionFailed as exc:
        if sim.combo.ret:
            sim.fail(exc, step, op, name, f"{len(send)} chunks written")
        prefix.unacked.update(i for i in send if i not in prefix.written)
        return
    except KVTierError as exc:
        if not (isinstance(exc, QuotaExceeded) and sim.combo.quota
                or isinstance(exc, TierFull) and sim.full):
            sim.fail(exc, step, op, name, f"{len(send)} chunks written ({ack})")
        prefix.unacked.update(i for i in send if i not in prefix.written)
        await check_unacked(sim, step, prefix, name)
        return
    except Exception as exc:  # noqa: BLE001 - a client crash is a finding
        sim.fail(exc, step, op, name, f"{len(send)} chunks written")
        return
    if not sim.combo.ret:
        sim.ledger.add("unexpected", sim.combo.name, step, op, name,
                       "PreconditionFailed (retain_unreferenced is off)",
                       f"{reply.chunks_written} written")
    if reply.chunks_written + reply.chunks_deduped != len(send) \
            or len(reply.chunk_keys) != len(send):
        sim.wrong(step, op, name, f"{len(send)} chunks written or deduped, "
                  f"{len(send)} keys", f"{reply.chunks_written}+{reply.chunks_deduped}, "
                  f"{len(reply.chunk_keys)} keys")
    elif prefix.independent and reply.chunk_keys != _page_keys(spec, prefix, tenant, send):
        sim.wrong(step, op, name, "each page's key: chunk 0 of its own tokens",
                  "other keys")
    if ack == "durable" and not reply.durable:
        sim.ledger.add("unexpected", sim.combo.name, step, op, name,
                       "a durable ack says durable", "durable=False")
    now = time.time()
    for i in send:
        prefix.written.setdefault(i, now)
        prefix.unacked.discard(i)
        prefix.maybe_gone.discard(i)
        if reply.durable:
            prefix.durable.add(i)


def _page_keys(spec, prefix: Prefix, tenant: str, pages: list[int]) -> list[str]:
    """The keys of ``pages`` of ``prefix``, each computed alone (chunk 0 of its tokens)."""
    c = spec.chunk_tokens
    return [independent_keys(spec.layout_id, prefix.tokens[i * c:(i + 1) * c], c,
                             scope=dedupe_scope(tenant))[0] for i in pages]


async def check_unacked(sim, step: int, prefix: Prefix, name: str) -> None:
    """A write that failed stored nothing a later call may see: Lookup counts no chunk
    past the acknowledged prefix (of pages: finds no page whose write failed)."""
    spec = sim.spec(BUNDLED)
    kv = sim.client(prefix.tenant)
    try:
        if prefix.independent:
            pages = await kv.lookup_independent_chunks(prefix.tenant, spec, prefix.tokens)
        else:
            held = await kv.lookup(prefix.tenant, spec, prefix.tokens)
    except KVTierError as exc:
        sim.fail(exc, step, "lookup-chunks", name, "tokens held")
        return
    if prefix.independent:
        shown = {i for i in prefix.unacked if pages[i] and i not in prefix.written}
        if shown:
            sim.wrong(step, "lookup-after-failed-write", name,
                      f"pages {sorted(shown)} not held (their write failed)", "held")
            tolerate(prefix, shown)
        return
    acked = _acked_run(prefix)
    if held > acked * spec.chunk_tokens:
        sim.wrong(step, "lookup-after-failed-write", name,
                  f"<= {acked * spec.chunk_tokens} tokens held (a failed write stores "
                  "nothing visible)", f"{held} tokens held")
        tolerate(prefix, prefix.unacked)


def tolerate(prefix: Prefix, indices) -> None:
    """Chunks a finding showed visible though unacked: one finding per cause, so from
    now on they may be held or not (their bytes still judged)."""
    for i in list(indices):
        prefix.written.setdefault(i, time.time())
        prefix.maybe_gone.add(i)
        prefix.unacked.discard(i)


def _acked_run(prefix: Prefix) -> int:
    """Whole chunks from the first that were acked."""
    n = 0
    while n in prefix.written:
        n += 1
    return n


async def read(sim, step: int, prefix: Prefix, op: str = "read-chunks") -> None:
    """ReadChunks of the whole sequence, every chunk byte for byte against the model;
    then Lookup's held count against the chunks that must be held."""
    spec = sim.spec(BUNDLED)
    name = f"{prefix.tenant}/{prefix.pid}"
    in_place = sim.rng.random() < 0.5  # host-tier chunks then read where they lie, pinned
    sim.log(f"step={step} op={op} s={name} chunks={len(prefix.chunks)} in_place={in_place}")
    kv = sim.client(prefix.tenant)
    try:
        if prefix.independent:
            got = await kv.read_independent_chunks(prefix.tenant, spec, prefix.tokens,
                                                   in_place=in_place)
            pages = await kv.lookup_independent_chunks(prefix.tenant, spec, prefix.tokens)
        else:
            got = await kv.read_chunks(prefix.tenant, spec, prefix.tokens, in_place=in_place)
            held = await kv.lookup(prefix.tenant, spec, prefix.tokens)
    except KVTierError as exc:
        sim.fail(exc, step, op, name, "chunks read")
        return
    except Exception as exc:  # noqa: BLE001
        sim.fail(exc, step, op, name, "chunks read")
        return
    for i, data in sorted(got.chunks.items()):
        if i not in prefix.written and i not in prefix.unacked:
            sim.wrong(step, op, name, f"chunk {i} not held (never written)", "read back")
        elif bytes(data) != prefix.chunks[i]:
            sim.wrong(step, op, name, f"chunk {i} as written", "other bytes")
        elif i in prefix.unacked and i not in prefix.written:
            sim.wrong(step, op, name, f"chunk {i} not visible (its write failed)",
                      "read back")
            tolerate(prefix, {i})
    for i, reason in sorted(got.missing.items()):
        if reason != "not_held":
            sim.ledger.add("lost", sim.combo.name, step, op, name, f"chunk {i} intact",
                           f"missing: {reason}")
        elif i in prefix.written and not prefix.may_be_absent(i, sim):
            how = ("durable ack" if i in prefix.durable else
                   "memory ack, then a graceful stop" if i in prefix.drained else "memory ack")
            sim.ledger.add("lost", sim.combo.name, step, op, name, f"chunk {i} held ({how})",
                           "missing: not_held")
            prefix.maybe_gone.add(i)  # one finding per loss
    if prefix.independent:
        _judge_pages(sim, step, op, name, prefix, pages)
    else:
        _judge_prefix(sim, step, op, name, prefix, held)
    present = set(got.chunks)
    for i in list(prefix.written):  # what a read shows gone stays gone
        if i not in present:
            prefix.maybe_gone.add(i)
    if in_place:
        sim.held_reads.append(HeldRead(step, name, op, got, {
            i: prefix.chunks[i] for i in got.chunks if bytes(got.chunks[i]) == prefix.chunks[i]}))
        while len(sim.held_reads) > MAX_HELD_READS:
            judge_held(sim, sim.held_reads.pop(0))


def judge_held(sim, held: HeldRead) -> None:
    """An in-place read judged again after the steps it was kept open across (its chunks
    pinned), then released: every chunk still the bytes written."""
    sim.log(f"step={sim.step} judged in-place read of step {held.step} s={held.name} "
            f"chunks={len(held.expected)}")
    for i, expected in sorted(held.expected.items()):
        if bytes(held.result.chunks[i]) != expected:  # type: ignore[attr-defined]
            sim.wrong(held.step, f"{held.op}-in-place-held", held.name,
                      f"chunk {i} as written, while its read lease is live", "other bytes")
    held.result.release()  # type: ignore[attr-defined]


def judge_all_held(sim) -> None:
    held, sim.held_reads = sim.held_reads, []
    for read_held in held:
        judge_held(sim, read_held)


def _judge_pages(sim, step: int, op: str, name: str, prefix: Prefix, pages: list[bool]
                 ) -> None:
    """Lookup of independent chunks: one answer a page, each against the model."""
    if len(pages) != len(prefix.chunks):
        sim.wrong(step, f"{op}-lookup", name, f"{len(prefix.chunks)} answers",
                  f"{len(pages)} answers")
        return
    for i, held in enumerate(pages):
        if held and i not in prefix.written:
            sim.wrong(step, f"{op}-lookup", name, f"page {i} not held (never acked)", "held")
            tolerate(prefix, {i})
        elif not held and i in prefix.written and not prefix.may_be_absent(i, sim):
            sim.wrong(step, f"{op}-lookup", name, f"page {i} held", "not held")
            prefix.maybe_gone.add(i)


def _judge_prefix(sim, step: int, op: str, name: str, prefix: Prefix, held: int) -> None:
    """Lookup of a chain: the held prefix against the model's acked run."""
    spec = sim.spec(BUNDLED)
    run = _acked_run(prefix)
    must = 0
    while must < run and not prefix.may_be_absent(must, sim):
        must += 1
    c = spec.chunk_tokens
    if held > run * c or held < must * c:
        sim.wrong(step, f"{op}-lookup", name, f"{must * c}..{run * c} tokens held",
                  f"{held} tokens held")


def after_stop(sim, how: str) -> None:
    """The server stopped: SIGTERM drains every ack (durable now); a kill -9 may lose
    the memory-acked ones."""
    for prefix in sim.prefixes:
        for i in prefix.written:
            if how == "term":
                prefix.drained.add(i)
            elif i not in prefix.durable and i not in prefix.drained:
                prefix.maybe_gone.add(i)


def forget_all(sim, why: str) -> None:
    """An event that may free unreferenced chunks (compaction, migrate, a restored
    backup): every chunk may be gone."""
    sim.log(f"step={sim.step} prefix chunks may be gone after {why}")
    for prefix in sim.prefixes:
        prefix.maybe_gone.update(prefix.written)


async def verify(sim, why: str) -> None:
    judge_all_held(sim)
    for prefix in list(sim.prefixes):
        if prefix.written:
            sim.step += 1
            await read(sim, sim.step, prefix, f"verify-chunks-{why}")
