"""Prefix chunks of no session in a simulation: ``write`` (WriteChunks), ``read``
(ReadChunks, then Lookup's held count), each judged against the model of what each
tenant wrote (``Prefix``).

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
from kvtier import codec as cc

MAX_CHUNKS = 3  # per write: a chunk of the bundled layout is about 18 KiB
MAX_PREFIXES = 4  # per tenant; the oldest is forgotten past it
TTL_MARGIN_S = 1.0


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

    def may_be_absent(self, index: int, sim) -> bool:
        return (sim.combo.quota or sim.full or index in self.maybe_gone
                or time.time() > self.written[index] + RETAIN_TTL_S - TTL_MARGIN_S)


def new_prefix(sim, tenant: str) -> Prefix:
    spec = sim.spec(BUNDLED)
    count = sim.rng.randint(1, MAX_CHUNKS)
    tokens = sim.tokens(spec, count * spec.chunk_tokens).numpy().astype("uint32")
    streams = random_streams(spec, len(tokens), sim.rng)
    chunks = cc.encode_chunks(spec, tokens, streams)
    mine = [p for p in sim.prefixes if p.tenant == tenant]
    if len(mine) >= MAX_PREFIXES:
        sim.prefixes.remove(mine[0])
    prefix = Prefix(tenant, f"prefix-{sim.new_sid()}", tokens, chunks)
    sim.prefixes.append(prefix)
    return prefix


def choose(sim, tenant: str, busy: set, *, written: bool) -> Prefix | None:
    """One of the tenant's prefixes no running operation uses (``written``: with chunks
    acked), marked busy."""
    mine = [p for p in sim.prefixes if p.tenant == tenant and (tenant, p.pid) not in busy
            and (p.written or not written)]
    if not mine:
        return None
    prefix = sim.rng.choice(mine)
    busy.add((tenant, prefix.pid))
    return prefix


async def write(sim, step: int, prefix: Prefix, ack: str | None = None) -> None:
    """WriteChunks of ``prefix``: from its first unwritten chunk, or again from 0 (a
    dedupe of those written)."""
    spec = sim.spec(BUNDLED)
    tenant = prefix.tenant
    first = 0 if sim.rng.random() < 0.5 else min(len(prefix.written), len(prefix.chunks) - 1)
    ack = ack or sim.rng.choice(("memory", "durable"))
    send = list(range(first, len(prefix.chunks)))
    name = f"{tenant}/{prefix.pid}"
    sim.log(f"step={step} op=write-chunks s={name} first={first} chunks={len(send)} ack={ack}")
    try:
        reply = await sim.client(tenant).write_chunks(
            tenant, spec, prefix.tokens, prefix.chunks[first:], first_chunk=first, ack=ack,
            skip_held=sim.rng.random() < 0.5)
    except PreconditionFailed as exc:
        if sim.combo.ret:
            sim.fail(exc, step, "write-chunks", name, f"{len(send)} chunks written")
        prefix.unacked.update(i for i in send if i not in prefix.written)
        return
    except KVTierError as exc:
        if not (isinstance(exc, QuotaExceeded) and sim.combo.quota
                or isinstance(exc, TierFull) and sim.full):
            sim.fail(exc, step, "write-chunks", name, f"{len(send)} chunks written ({ack})")
        prefix.unacked.update(i for i in send if i not in prefix.written)
        await check_unacked(sim, step, prefix, name)
        return
    except Exception as exc:  # noqa: BLE001 - a client crash is a finding
        sim.fail(exc, step, "write-chunks", name, f"{len(send)} chunks written")
        return
    if not sim.combo.ret:
        sim.ledger.add("unexpected", sim.combo.name, step, "write-chunks", name,
                       "PreconditionFailed (retain_unreferenced is off)",
                       f"{reply.chunks_written} written")
    if reply.chunks_written + reply.chunks_deduped != len(send) \
            or len(reply.chunk_keys) != len(send):
        sim.wrong(step, "write-chunks", name, f"{len(send)} chunks written or deduped, "
                  f"{len(send)} keys", f"{reply.chunks_written}+{reply.chunks_deduped}, "
                  f"{len(reply.chunk_keys)} keys")
    if ack == "durable" and not reply.durable:
        sim.ledger.add("unexpected", sim.combo.name, step, "write-chunks", name,
                       "a durable ack says durable", "durable=False")
    now = time.time()
    for i in send:
        prefix.written.setdefault(i, now)
        prefix.unacked.discard(i)
        prefix.maybe_gone.discard(i)
        if reply.durable:
            prefix.durable.add(i)


async def check_unacked(sim, step: int, prefix: Prefix, name: str) -> None:
    """A write that failed stored nothing a later call may see: Lookup counts no chunk
    past the acknowledged prefix."""
    spec = sim.spec(BUNDLED)
    try:
        held = await sim.client(prefix.tenant).lookup(prefix.tenant, spec, prefix.tokens)
    except KVTierError as exc:
        sim.fail(exc, step, "lookup-chunks", name, "tokens held")
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
    sim.log(f"step={step} op={op} s={name} chunks={len(prefix.chunks)}")
    kv = sim.client(prefix.tenant)
    try:
        got = await kv.read_chunks(prefix.tenant, spec, prefix.tokens)
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
    run = _acked_run(prefix)
    must = 0
    while must < run and not prefix.may_be_absent(must, sim):
        must += 1
    c = spec.chunk_tokens
    if held > run * c or held < must * c:
        sim.wrong(step, f"{op}-lookup", name, f"{must * c}..{run * c} tokens held",
                  f"{held} tokens held")
    present = set(got.chunks)
    for i in list(prefix.written):  # what a read shows gone stays gone
        if i not in present:
            prefix.maybe_gone.add(i)


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
    for prefix in list(sim.prefixes):
        if prefix.written:
            sim.step += 1
            await read(sim, sim.step, prefix, f"verify-chunks-{why}")
