"""Attacks on spills, chunks, shared memory, ids and streams, one coroutine each,
against a live server (``stress.adversarial`` runs them). Each returns what it measured
and ``held``: whether the server stood."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import stat
import time
from pathlib import Path

import grpc
import numpy as np

from kvstore.format.chunk_parts import chunk_plan
from kvstore.format.keys import chunk_digest
from kvtier import shm
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from stress import forge
from stress.fuzz.pool import LAYOUT, Encoded, encode, token_ids
from testing.live_server import Credentials, LiveServer, channel, client

MiB = 1 << 20
RSS_SLACK = 100 * MiB  # the most a refused attack may raise the server's peak RSS
STALL_S = 0.5  # the longest a Stat may take beside an attack (normally milliseconds)
IDLE_RSS_BUDGET = 512 * MiB  # 300 idle streams' share of RSS
SERVICES = [pb.DESCRIPTOR.services_by_name[n] for n in ("KVTier", "Replay")]


class Context:
    def __init__(self, live: LiveServer, data_dir: Path, sizes: dict) -> None:
        self.live, self.data_dir, self.sizes = live, data_dir, sizes
        self.n = 0
        self._secured: LiveServer | None = None

    def sid(self, name: str) -> str:
        self.n += 1
        return f"{name}-{self.n}"

    def secured(self) -> LiveServer:
        """A second server, started on first use: TLS, the development tokens and
        register_layouts = "admin" (no replay worker)."""
        if self._secured is None:
            root = self.data_dir.parent / "secured"
            creds = Credentials.write(root / "certs")
            self._secured = LiveServer(root / "data", root, replay=False, creds=creds,
                                       env={"KVTIER_REGISTER_LAYOUTS": "admin"}).__enter__()
        return self._secured

    def close(self) -> None:
        if self._secured is not None:
            self._secured.close()


async def status(awaitable, live: LiveServer | None = None) -> tuple[str, str]:
    """(code name, details) of a call, draining a reply stream. A client stream the server
    refused while the client was still writing reads, on the client, as gRPC's own INTERNAL
    (grpc/grpc#36066); with ``live`` (and no other call of it in flight) the server's own
    status is then taken from its request counters."""
    before = live.rpc_errors() if live is not None else None
    try:
        result = await awaitable if not hasattr(awaitable, "__aiter__") else \
            [r async for r in awaitable]
        return "OK", str(result)[:0]
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code().name, exc.details() or ""
        if (live is None or before is None or code != "INTERNAL"
                or "SendMessageOperation" not in (exc.debug_error_string() or "")):
            return code, details
        for _ in range(50):  # the server counts the call as it ends it
            rose = live.rpc_errors() - before
            if rose:
                break
            await asyncio.sleep(0.02)
        if len(rose) != 1 or sum(rose.values()) != 1:
            return code, details
        return next(iter(rose)), "the server's own status (the client was still writing)"


async def stream(messages):
    for m in messages:
        yield m


async def stored(stub, tenant: str) -> int:
    return len((await stub.List(pb.ListRequest(tenant=tenant))).sessions)


async def with_stat_watch(live: LiveServer, ch, attack) -> tuple[object, dict]:
    """Run ``attack`` while Stat is called in a loop on ``ch``; the attack's result, the
    slowest Stat (the event loop's stall) and the server's peak RSS growth."""
    stub = pb_grpc.KVTierStub(ch)
    await stub.Stat(pb.StatRequest())
    live.server.reset_peak()
    base = live.rss()["rss"]
    done, slowest = asyncio.Event(), 0.0

    async def watch() -> None:
        nonlocal slowest
        while not done.is_set():
            started = time.perf_counter()
            await stub.Stat(pb.StatRequest())
            slowest = max(slowest, time.perf_counter() - started)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        result = await attack()
    finally:
        done.set()
        await watcher
    return result, {"stat_max_s": round(slowest, 4),
                    "peak_rss_growth_mib": round((live.rss()["peak"] - base) / MiB, 1)}


# ---- 1. chunk identity ---------------------------------------------------------------

async def victim_prefix(ctx: Context) -> dict:
    """Evil spills the victim's prompt tokens with its own KV first; the victim then
    spills and restores: it must get its own bytes and no dedupe count."""
    tokens = token_ids(2 * LAYOUT.chunk_tokens + 40, 11)
    evil, victim = encode(tokens, 1, window=False), encode(tokens, 2, window=False)
    async with client(ctx.live.target) as kv:
        await kv.spill("evil", ctx.sid("bait"), LAYOUT.name, tokens, chunks=list(evil.chunks),
                       tail=evil.tail, generation=1)
        sid = ctx.sid("s")
        reply = await kv.spill("victim", sid, LAYOUT.name, tokens, chunks=list(victim.chunks),
                               tail=victim.tail, generation=1)
        got = await kv.restore("victim", sid, decode=False)
    own = [bytes(c) for c in got.chunks] == list(victim.chunks) and bytes(got.tail) == victim.tail
    return {"held": own and reply.chunks_deduped == 0, "restored_victims_bytes": own,
            "victim_chunks_deduped": reply.chunks_deduped}


async def fine_tunes(ctx: Context) -> dict:
    tokens = token_ids(2 * LAYOUT.chunk_tokens, 12)
    base, tuned = encode(tokens, 3, window=False), encode(tokens, 4, window=False)
    async with client(ctx.live.target) as kv:
        sids = ctx.sid("base"), ctx.sid("tuned")
        for sid, enc, fingerprint in ((sids[0], base, "base-v1"), (sids[1], tuned, "base-v1-ft")):
            reply = await kv.spill("acme", sid, LAYOUT.name, tokens, chunks=list(enc.chunks),
                                   generation=1, model_fingerprint=fingerprint)
        own = [[bytes(c) for c in (await kv.restore("acme", sid, decode=False)).chunks]
               for sid in sids] == [list(base.chunks), list(tuned.chunks)]
    return {"held": own and reply.chunks_deduped == 0, "each_restores_its_own": own,
            "tuned_chunks_deduped": reply.chunks_deduped}


async def dedupe_count_leak(ctx: Context) -> dict:
    """Evil spills the very bytes the victim holds: a dedupe count would tell evil
    what the victim holds."""
    tokens = token_ids(2 * LAYOUT.chunk_tokens, 13)
    enc = encode(tokens, 5, window=False)
    async with client(ctx.live.target) as kv:
        await kv.spill("victim", ctx.sid("s"), LAYOUT.name, tokens, chunks=list(enc.chunks),
                       generation=1)
        probe = await kv.spill("evil", ctx.sid("probe"), LAYOUT.name, tokens,
                               chunks=list(enc.chunks), generation=1)
    return {"held": probe.chunks_deduped == 0, "evil_chunks_deduped": probe.chunks_deduped}


# ---- 2. unbounded decoding -------------------------------------------------------------

async def _forged_spill(ctx: Context, tenant: str, tokens: np.ndarray, chunk: bytes | None,
                        window: bytes | None = None) -> dict:
    enc = Encoded(tokens, (), b"", window)
    keys = enc.keys(tenant)
    header = enc.header(tenant, ctx.sid("bomb"), 1,
                        chunk_digests=[chunk_digest(chunk or b"")] * len(keys))
    messages = [pb.SpillRequest(header=header)]
    if chunk is not None:
        messages.append(pb.SpillRequest(chunk=pb.Payload(key=keys[0], data=chunk)))
    if window is not None:
        messages.append(pb.SpillRequest(window=pb.Payload(data=window)))
    async with channel(ctx.live.target, 1) as attacker, channel(ctx.live.target, 2) as watcher:
        stub = pb_grpc.KVTierStub(attacker)
        (code, details), watched = await with_stat_watch(
            ctx.live, watcher, lambda: status(stub.Spill(stream(messages))))
        kept = await stored(stub, tenant)
    held = (code == "INVALID_ARGUMENT" and not kept and watched["stat_max_s"] < STALL_S
            and watched["peak_rss_growth_mib"] * MiB < RSS_SLACK)
    return {"held": held, "code": code, "details": details[:160],
            "wire_bytes": len(chunk or window), "sessions_stored": kept, **watched}


async def section_table(ctx: Context) -> dict:
    tokens = token_ids(LAYOUT.chunk_tokens, 14)
    honest = encode(tokens, 6, window=False).chunks[0]
    return await _forged_spill(ctx, "acme-table", tokens,
                               forge.one_section_chunk(LAYOUT, tokens, honest))


async def zstd_bomb(ctx: Context) -> dict:
    """A small zstd chunk that would expand to bomb_mib: its table claiming it all, and
    the layout's own table over a frame holding it (content size undeclared)."""
    tokens = token_ids(LAYOUT.chunk_tokens, 15)
    size = ctx.sizes["bomb_mib"] * MiB
    table = await _forged_spill(ctx, "acme-bomb", tokens, forge.table_bomb(LAYOUT, tokens, size))
    frame = await _forged_spill(ctx, "acme-bomb", tokens,
                                forge.frame_bomb(LAYOUT, tokens, size, declare=False))
    return {"held": table.pop("held") and frame.pop("held"),
            "expands_to_mib": ctx.sizes["bomb_mib"], "table": table, "frame": frame}


async def window_bomb(ctx: Context) -> dict:
    # a 65 KB window part claiming 2 GiB of window K/V (about a million tokens)
    names = tuple(s.name for s in LAYOUT.ephemeral_streams if not s.pending)
    per_chunk = chunk_plan(LAYOUT, LAYOUT.chunk_tokens, True, names).payload_bytes
    n = ctx.sizes["window_bomb_mib"] * MiB // per_chunk * LAYOUT.chunk_tokens
    tokens = token_ids(n, 16)
    out = await _forged_spill(ctx, "acme-window", tokens, None, forge.window_bomb(LAYOUT, tokens))
    return {**out, "tokens_claimed": n}


# ---- 3. shared memory ------------------------------------------------------------------

@contextlib.contextmanager
def planted(content: bytes, mode: int):
    """A file of the caller's own in /dev/shm, named like a kvtier segment."""
    path = shm.SHM_DIR / f"kvtier-planted-{secrets.token_hex(6)}"
    path.write_bytes(content)
    path.chmod(mode)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


async def _spill_small(ctx: Context, tenant: str, sid: str) -> Encoded:
    enc = encode(token_ids(LAYOUT.chunk_tokens + 40, 17), 7, window=False)
    async with client(ctx.live.target, shared_memory=False) as kv:
        await kv.spill(tenant, sid, LAYOUT.name, enc.tokens, chunks=list(enc.chunks),
                       tail=enc.tail, generation=1)
    return enc


def _old_reply_buffer(name: str) -> bytes:
    """Field 5 as the client-named design sent it: SharedMemoryRef{name, 0, 1 MiB}."""
    ref = bytes([0x0A, len(name)]) + name.encode() + bytes([0x18]) + b"\x80\x80\x40"
    return bytes([0x2A, len(ref)]) + ref


async def shm_overwrite(ctx: Context) -> dict:
    sid = ctx.sid("s")
    await _spill_small(ctx, "acme", sid)
    secret = secrets.token_bytes(22_293)
    ref = pb.SessionRef(tenant="acme", session_id=sid)
    codes = []
    async with channel(ctx.live.target, 3) as ch:
        stub = pb_grpc.KVTierStub(ch)
        with planted(secret, 0o400) as victim:
            for name in (victim.name, str(victim)):
                request = pb.RestoreRequest(session=ref, use_shared_memory=True,
                                            reply_lease=name)
                codes.append((await status(stub.Restore(request)))[0])
            request = pb.RestoreRequest(session=ref, use_shared_memory=True)
            request.MergeFromString(_old_reply_buffer(victim.name))
            codes.append((await status(stub.Restore(request)))[0])
            intact = victim.read_bytes() == secret and \
                stat.S_IMODE(victim.stat().st_mode) == 0o400
    held = intact and codes == ["INVALID_ARGUMENT", "INVALID_ARGUMENT", "OK"]
    return {"held": held, "planted_file_intact": intact, "codes": codes}


async def shm_planted_read(ctx: Context) -> dict:
    enc = encode(token_ids(LAYOUT.chunk_tokens, 18), 8, window=False)
    codes = []
    async with channel(ctx.live.target, 3) as ch:
        stub = pb_grpc.KVTierStub(ch)
        with planted(enc.chunks[0], 0o600) as plant:
            for lease_id in (plant.name, str(plant)):
                header = enc.header("acme-plant", ctx.sid("s"), 1)
                ref = pb.SharedMemoryRef(lease_id=lease_id, offset=0, length=len(enc.chunks[0]))
                messages = [pb.SpillRequest(header=header), pb.SpillRequest(
                    chunk=pb.Payload(key=header.chunk_keys[0], shm=ref))]
                codes.append((await status(stub.Spill(stream(messages)), ctx.live))[0])
        kept = await stored(stub, "acme-plant")
    return {"held": codes == ["INVALID_ARGUMENT"] * 2 and not kept, "codes": codes,
            "sessions_stored": kept}


async def shm_dot_names(ctx: Context) -> dict:
    sid = ctx.sid("s")
    await _spill_small(ctx, "acme", sid)
    ref = pb.SessionRef(tenant="acme", session_id=sid)
    codes = {}
    async with channel(ctx.live.target, 3) as ch:
        stub = pb_grpc.KVTierStub(ch)
        for name in (".", "..", "/", "../.."):
            codes[name] = (await status(stub.Restore(pb.RestoreRequest(
                session=ref, use_shared_memory=True, reply_lease=name))))[0]
    return {"held": set(codes.values()) == {"INVALID_ARGUMENT"}, "codes": codes}


async def shm_unmapped_pinning(ctx: Context) -> dict:
    """Restores whose segments the client never maps: bounded per client and in all,
    and a third client still restores (inline)."""
    sid = ctx.sid("s")
    enc = await _spill_small(ctx, "acme", sid)
    ref = pb.SessionRef(tenant="acme", session_id=sid)
    prefix = f"{shm.PREFIX}{ctx.live.server.pid}-"
    before = sum(1 for p in shm.SHM_DIR.iterdir() if p.name.startswith(prefix))
    leased = []
    for connection in (4, 5):
        async with channel(ctx.live.target, connection) as ch:
            stub = pb_grpc.KVTierStub(ch)
            count = 0
            for _ in range(ctx.sizes["unmapped_restores"]):
                replies = [r async for r in stub.Restore(pb.RestoreRequest(
                    session=ref, use_shared_memory=True))]
                count += replies[0].header.HasField("reply_segment")
            leased.append(count)
    segments = sum(1 for p in shm.SHM_DIR.iterdir() if p.name.startswith(prefix)) - before
    async with client(ctx.live.target) as kv:
        got = await kv.restore("acme", sid, decode=False)
    served = [bytes(c) for c in got.chunks] == list(enc.chunks)
    per_client, total = ctx.sizes["shm_per_client_mib"], ctx.sizes["shm_total_mib"]
    held = leased[0] <= per_client and sum(leased) <= total and served
    return {"held": held, "segments_leased_per_client": leased, "segments_in_dev_shm": segments,
            "bound_per_client_mib": per_client, "bound_total_mib": total,
            "third_client_restored": served}


# ---- 4, 5, 6. what reaches the boundary --------------------------------------------------

async def out_of_vocab(ctx: Context) -> dict:
    enc = encode(token_ids(LAYOUT.chunk_tokens + 40, 19), 9, window=False)
    tokens = enc.tokens.copy()
    tokens[7] = LAYOUT.vocab_size
    bad = Encoded(tokens, enc.chunks, enc.tail, None)
    sid = ctx.sid("s")
    async with channel(ctx.live.target) as ch:
        stub = pb_grpc.KVTierStub(ch)
        spill = await status(stub.Spill(stream(bad.spill("acme", sid, 1))), ctx.live)
        resume = await status(stub.Resume(pb.ResumeRequest(
            session=pb.SessionRef(tenant="acme", session_id=sid))))
    return {"held": spill[0] == "INVALID_ARGUMENT" and resume[0] == "NOT_FOUND",
            "spill": spill[0], "spill_details": spill[1][:160], "resume": resume[0]}


async def huge_session_id(ctx: Context) -> dict:
    ref = pb.SessionRef(tenant="acme", session_id="s" * 20_000)
    enc = encode(token_ids(100, 20), 10, window=False)
    async with channel(ctx.live.target) as ch:
        stub = pb_grpc.KVTierStub(ch)
        codes = {"Restore": await status(stub.Restore(pb.RestoreRequest(session=ref))),
                 "Spill": await status(stub.Spill(stream(enc.spill("acme", "s" * 20_000, 1))),
                                        ctx.live),
                 "Delete": await status(stub.Delete(pb.DeleteRequest(session=ref)))}
    longest = max(len(d) for _, d in codes.values())
    held = all(c == "INVALID_ARGUMENT" for c, _ in codes.values()) and longest < 2048
    return {"held": held, "codes": {k: c for k, (c, _) in codes.items()},
            "longest_details": longest}


async def data_loss_paths(ctx: Context) -> dict:
    """A session whose only copy (object tier) is corrupted: DATA_LOSS naming no path."""
    sid = ctx.sid("s")
    await _spill_small(ctx, "acme-loss", sid)
    ref = pb.SessionRef(tenant="acme-loss", session_id=sid)
    async with channel(ctx.live.target) as ch:
        stub = pb_grpc.KVTierStub(ch)
        await stub.Evict(pb.EvictRequest(session=ref, target_tier="object"))
        for path in (ctx.data_dir / "objects").rglob("*"):
            if path.is_file() and path.stat().st_size > 4096:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        code, details = await status(stub.Restore(pb.RestoreRequest(session=ref)))
    leaks = [p for p in (str(ctx.data_dir), "/tmp", "objects/", ".zst", "offset")
             if p in details]
    return {"held": code == "DATA_LOSS" and not leaks, "code": code, "details": details[:200],
            "paths_in_details": leaks}


GARBAGE = [b"\x0a\x05ab", b"\x08" + b"\xff" * 11, b"\x0f"]


async def undecodable(ctx: Context) -> dict:
    codes: dict[str, int] = {}
    for service in SERVICES:
        target = ctx.live.target if service.name == "KVTier" else ctx.live.replay_target
        async with channel(target) as ch:
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                for raw in GARBAGE:
                    if method.client_streaming:
                        call = ch.stream_unary(path)(stream([raw]))
                    elif method.server_streaming:
                        call = ch.unary_stream(path)(raw)
                    else:
                        call = ch.unary_unary(path)(raw)
                    code, _ = await status(call)
                    codes[code] = codes.get(code, 0) + 1
    return {"held": set(codes) == {"INVALID_ARGUMENT"}, "codes": codes,
            "methods": sum(len(s.methods) for s in SERVICES)}


# ---- 7, 8. streams held open, retries ----------------------------------------------------

async def idle_streams(ctx: Context) -> dict:
    """300 Spill streams that send a header of 65,536 token ids and then nothing, over
    six connections: RSS and Stat latency while they are open; they are cut at the
    server's stream_idle_s."""
    count, tokens = ctx.sizes["idle_streams"], token_ids(65_536, 21)
    enc = Encoded(tokens, (), b"", None)
    connections = [channel(ctx.live.target, 10 + i) for i in range(6)]
    try:
        stubs = [pb_grpc.KVTierStub(ch) for ch in connections]
        for stub in stubs:
            await stub.Stat(pb.StatRequest())
        before = ctx.live.rss()["rss"]

        async def silent(i: int):
            header = enc.header(f"idle{i % 3}", f"s{i}", 1,
                                chunk_digests=[bytes(32)] * (len(tokens) // 512))
            yield pb.SpillRequest(header=header)
            await asyncio.Event().wait()

        calls = [stubs[i % 6].Spill(silent(i)) for i in range(count)]
        await asyncio.sleep(ctx.sizes["idle_settle_s"])
        started = time.perf_counter()
        await stubs[0].Stat(pb.StatRequest())
        stat_s = time.perf_counter() - started
        grown = ctx.live.rss()["rss"] - before
        outcomes: dict[str, int] = {}
        for code, _ in await asyncio.gather(*(status(c) for c in calls)):
            outcomes[code] = outcomes.get(code, 0) + 1
    finally:
        for ch in connections:
            await ch.close()
    held = grown < IDLE_RSS_BUDGET and stat_s < STALL_S and set(outcomes) == {"RESOURCE_EXHAUSTED"}
    return {"held": held, "streams": count, "rss_growth_mib": round(grown / MiB, 1),
            "header_bytes_each": enc.header("idle0", "s0", 1).ByteSize(),
            "stat_s": round(stat_s, 4), "outcomes": outcomes}


async def spill_retry(ctx: Context) -> dict:
    enc = encode(token_ids(2 * LAYOUT.chunk_tokens + 3, 22), 11, window=False)
    other = encode(enc.tokens, 12, window=False)
    sid = ctx.sid("s")
    async with channel(ctx.live.target) as ch:
        stub = pb_grpc.KVTierStub(ch)
        first = await stub.Spill(stream(enc.spill("acme", sid, 1)))
        again = await stub.Spill(stream(enc.spill("acme", sid, 1)))
        conflict, _ = await status(stub.Spill(stream(other.spill("acme", sid, 1))), ctx.live)
    async with client(ctx.live.target) as kv:
        got = await kv.restore("acme", sid, decode=False)
    original = [bytes(c) for c in got.chunks] == list(enc.chunks)
    held = again == first and conflict == "FAILED_PRECONDITION" and original
    return {"held": held, "retry_got_first_reply": again == first,
            "other_content_same_generation": conflict, "restores_first_content": original}


CASES = {
    "1a_victim_prefix": victim_prefix, "1b_fine_tunes": fine_tunes,
    "1c_dedupe_count_leak": dedupe_count_leak,
    "2a_wrong_section_table": section_table, "2b_zstd_bomb": zstd_bomb,
    "2c_window_bomb": window_bomb,
    "3a_shm_overwrite_0400": shm_overwrite, "3b_shm_planted_read": shm_planted_read,
    "3c_shm_dot_names": shm_dot_names, "3d_shm_unmapped_pinning": shm_unmapped_pinning,
    "4_out_of_vocab": out_of_vocab, "5a_huge_session_id": huge_session_id,
    "5b_data_loss_paths": data_loss_paths, "6_undecodable_protobuf": undecodable,
    "7_idle_streams": idle_streams, "8_spill_retry": spill_retry,
}
