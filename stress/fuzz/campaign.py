"""Fuzz every RPC of a real kvtier server and replay worker.

``python -m stress.fuzz [--requests 10000] [--seed 0] [--json] [--auth]``

Starts ``kvtier serve --preset test`` and ``kvtier replay-worker`` as child processes
(``testing.live_server``), spills a few sessions through the real client (``kvtier``) and
records their restored bytes, then sends ``--requests`` requests from
``stress.fuzz.cases`` over raw stubs (bytes in, bytes out; several connections, several
calls in flight), each bounded by ``--deadline-s``. Between them, probes spill and
restore sessions through the client under the tenants the fuzzer attacks.

Counted: ``crashes`` (a child process died: it is restarted and the run goes on),
``hangs`` (a request ran past its deadline), ``by_code`` (status code name -> count;
CANCELLED is the fuzzer abandoning a stream; ``by_method`` the same per method),
``internal_or_unknown``, ``wrong_tensors`` (a restore, by a probe or of a pre-existing
session, whose bytes differ from what was acknowledged for that session),
``preexisting_sessions_intact`` (every pre-existing session restores bit-exact after the
fuzz), ``prefix_leaks`` (a Lookup by another tenant found some of a session's tokens
that only its tenant spilled), ``path_leaks`` (an answer's details named the server's
data directory or code), ``stalls`` (a Stat sent every 50 ms on a connection of its
own took over ``STALL_S``: the event loop was blocked; ``stat_max_s`` the slowest).
Every non-zero figure but by_code, by_method, stat_max_s and layouts_registered (new
layouts the server took) is a bug.

``--auth`` (or ``--secure``): the server serves TLS and checks tokens (a development
set of ``services.server.devcerts`` in a temporary directory); every KVTier request
carries acme's token, except the credential attacks, one in ``ATTACK_EVERY``: no token
or a wrong one (must be UNAUTHENTICATED), a valid token naming another tenant's
session in a Restore, Fork or Lookup (must be PERMISSION_DENIED, with no data); a
RegisterLayout carries the admin's token or, half the time, acme's (a tenant's: must be
PERMISSION_DENIED under the default register_layouts). ``credential_breaches`` counts
those answered otherwise. The protected sessions and probes use the tenants acme and beta.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from proto import kvtier_pb2 as pb
from stress.fuzz.cases import CONNECTIONS, METHODS, Case, CaseGenerator, Spilled, State
from stress.fuzz.pool import LAYOUT, build_pool, encode, token_ids
from testing.live_server import ROOT, Credentials, LiveServer, channel, client

PROTECTED = (("acme", (0, "b")), ("victim", (1, "b")), ("acme", (3, "b")), ("victim", (2, "b")))
PROTECTED_GENERATION = 5
IDLE_S = 2.0  # the server's stream_idle_s: silent streams are cut well within a deadline
EXAMPLES = 20  # kept per bad outcome, for the report
ATTACK_EVERY = 5  # with --auth: one KVTier request in this many is a credential attack
CALLER = "acme"  # with --auth: whose token the fuzzed requests carry
AUTH_TENANTS = {"victim": "beta"}  # with --auth, tenants need a token: victim is beta
STALL_S = 5.0  # a Stat slower than this: the server's event loop was blocked
SECRET_TOKENS = 3 * LAYOUT.chunk_tokens  # the secret session's (tokens no case spills)


def snapshot(got) -> tuple:
    """What a restore must give back bit-exact: token ids, chunks, tail."""
    return (bytes(got.token_ids.tobytes()), tuple(bytes(c) for c in got.chunks),
            bytes(got.tail))


def acknowledged(enc) -> tuple:
    return (enc.tokens.tobytes(), tuple(enc.chunks), enc.tail)


class Messages:
    """A client stream's messages, then (``hold``) neither more nor an end. An iterator,
    not an async generator: gRPC cancelling the call cannot aclose() it mid-wait."""

    def __init__(self, messages: list[bytes], hold: bool) -> None:
        self.messages, self.hold, self.at = messages, hold, 0
        self.sent = asyncio.Event()

    def __aiter__(self) -> Messages:
        return self

    async def __anext__(self) -> bytes:
        if self.at < len(self.messages):
            self.at += 1
            return self.messages[self.at - 1]
        self.sent.set()
        if self.hold:
            await asyncio.Event().wait()  # cancelled with the call
        raise StopAsyncIteration


class Campaign:
    def __init__(self, live: LiveServer, seed: int, deadline_s: float, concurrency: int,
                 rng: random.Random | None = None) -> None:
        self.live = live
        self.creds = live.creds
        self.deadline_s = deadline_s
        self.concurrency = concurrency
        self.pool = build_pool(seed)
        self.state = State()
        self.cases = CaseGenerator(rng or random.Random(seed), self.pool, self.state)
        self.by_code: Counter[str] = Counter()
        self.counts = Counter(crashes=0, hangs=0, wrong_tensors=0, probes=0, probe_errors=0,
                              credential_attacks=0, credential_breaches=0, prefix_leaks=0,
                              path_leaks=0, stalls=0, layouts_registered=0)
        self.by_method: dict[str, Counter[str]] = {}
        self.stat_max_s = 0.0
        # what no answer may name: the server's data directory and code
        data_dir = live.server.argv[live.server.argv.index("--data-dir") + 1]
        self.server_paths = (data_dir, str(ROOT))
        self.examples: dict[str, list] = {}
        self.acked: dict[tuple[str, str], tuple] = {}  # session -> bytes it must restore
        self.channels: list[grpc.aio.Channel] = []
        self.replay_channel: grpc.aio.Channel | None = None
        self._reviving = asyncio.Lock()
        self.probe_rng = random.Random(seed + 1)
        self.attack_rng = random.Random(seed + 2)

    def tenant(self, name: str) -> str:
        """The tenant a protected session or probe uses (one with a token, with --auth)."""
        return AUTH_TENANTS.get(name, name) if self.creds else name

    def client(self, tenant: str, **options):
        return client(self.live.target, self.creds, tenant, **options)

    # -- connections --

    def connect(self) -> None:
        self.channels = [channel(self.live.target, i, self.creds) for i in range(CONNECTIONS)]
        self.replay_channel = channel(self.live.replay_target, CONNECTIONS)

    async def disconnect(self) -> None:
        for ch in [*self.channels, self.replay_channel]:
            if ch is not None:
                await ch.close()

    async def check_alive(self) -> None:
        """Count and restart a child that died (once, however many calls noticed)."""
        async with self._reviving:
            if self.live.server.alive() and (self.live.worker is None
                                             or self.live.worker.alive()):
                return
            died = await asyncio.to_thread(self.live.revive)
            self.counts["crashes"] += died
            await self.disconnect()
            self.connect()

    def note(self, outcome: str, case, details: str) -> None:
        self.examples.setdefault(outcome, [])
        if len(self.examples[outcome]) < EXAMPLES:
            self.examples[outcome].append({"method": case.method, "family": case.family,
                                           "details": details[:300]})

    # -- one request --

    def credentials(self, case) -> tuple[object, tuple, str | None]:
        """(the case to send, its call metadata, the code a credential attack must get:
        None for an ordinary request)."""
        if self.creds is None or METHODS[case.method].containing_service.name == "Replay":
            return case, (), None  # the replay worker is not the authenticated server
        token = Credentials.bearer(self.creds.tokens[CALLER])
        if case.method == "AdoptWindow":  # a fleet peer's call only
            return case, token, "PERMISSION_DENIED"
        if case.method == "RegisterLayout":  # an admin's call; a tenant's is refused
            if self.attack_rng.random() < 0.5:
                return case, Credentials.bearer(self.creds.tokens["admin"]), None
            return case, token, "PERMISSION_DENIED"
        if self.attack_rng.randrange(ATTACK_EVERY):
            return case, token, None
        self.counts["credential_attacks"] += 1
        whole = dataclasses.replace(case, abandon=False, silent=False)  # ends with a status
        attack = self.attack_rng.randrange(3)
        if attack == 0:
            return whole, (), "UNAUTHENTICATED"
        if attack == 1:
            forged = self.attack_rng.choice([self.creds.tokens[CALLER][::-1], "x" * 43,
                                             self.creds.tokens[CALLER] + "A"])
            return whole, Credentials.bearer(forged), "UNAUTHENTICATED"
        # another tenant's session, named with a valid token of this one
        tenant, sid = self.attack_rng.choice(
            [ref for ref in self.state.protected if ref[0] != CALLER])
        ref = pb.SessionRef(tenant=tenant, session_id=sid)
        method, request = self.attack_rng.choice((
            ("Restore", pb.RestoreRequest(session=ref)),
            ("Fork", pb.ForkRequest(source=ref, new_session_id="stolen", upto_tokens=0)),
            ("Lookup", pb.LookupRequest(tenant=tenant, layout_id=LAYOUT.name,
                                        token_ids=self.pool[1, "b"].tokens.tobytes()))))
        return (Case(method, "cross-tenant", [request.SerializeToString()],
                     case.connection), token, "PERMISSION_DENIED")

    async def send(self, case) -> None:
        case, metadata, expected = self.credentials(case)
        method = METHODS[case.method]
        ch = self.replay_channel if method.containing_service.name == "Replay" \
            else self.channels[case.connection]
        path = f"/{method.containing_service.full_name}/{method.name}"
        code, details, reply = "OK", "", None
        try:
            reply = await self._call(ch, path, method, case, metadata)
            if reply is None:
                code = "CANCELLED"
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details() or ""
            if code == "INTERNAL" and method.client_streaming and \
                    "SendMessageOperation" in (exc.debug_error_string() or ""):
                # grpc/grpc#36066: the server ended the call while this client was still
                # writing; the aio client reports its failed write, not the server's
                # status. What the server answered is in its own metrics (below).
                code = "CLIENT_WRITE_RACE"
        self.by_code[code] += 1
        self.by_method.setdefault(case.method, Counter())[code] += 1
        if any(path in details for path in self.server_paths):
            self.counts["path_leaks"] += 1
            self.note("path_leak", case, details)
        if code == "OK":
            self.check_reply(case, reply)
        # A write race is a refusal too: the server ended the stream before reading all of
        # it, which it does only to refuse (an accepted Spill is answered after its end).
        # Bytes that are no request are refused before anyone's rights matter, and so is a
        # message over the transport's limit: gRPC drops it before any handler runs.
        undecodable = code == "INVALID_ARGUMENT" and details.startswith("the request is not")
        oversized = code == "RESOURCE_EXHAUSTED" and "larger than max" in details
        if expected is not None and code not in (expected, "CLIENT_WRITE_RACE") and not (
                expected == "PERMISSION_DENIED" and undecodable) and not oversized:
            self.counts["credential_breaches"] += 1
            self.note("credential_breach", case, f"expected {expected}, got {code}: {details}")
        if code == "DEADLINE_EXCEEDED":
            self.counts["hangs"] += 1
            self.note("hang", case, details)
        elif code in ("INTERNAL", "UNKNOWN", "DATA_LOSS"):
            self.note(code, case, details)
        elif code == "UNAVAILABLE":
            self.note(code, case, details)
            await self.check_alive()
        if case.method == "LeaseSegment" and reply:
            lease = pb.SharedMemoryLease.FromString(reply)
            self.state.seen_leases.setdefault(case.connection, []).append(lease.lease_id)

    def check_reply(self, case, reply: bytes | None) -> None:
        if case.check == "no_prefix":
            found = pb.LookupReply.FromString(reply)
            if found.tokens_held or found.chunks:
                self.counts["prefix_leaks"] += 1
                self.note("prefix_leak", case, f"{found.tokens_held} tokens held")
        elif case.method == "RegisterLayout":
            self.counts["layouts_registered"] += pb.RegisterLayoutReply.FromString(reply).created

    async def _call(self, ch, path: str, method, case, metadata: tuple) -> bytes | None:
        timeout, metadata = self.deadline_s, metadata or None
        if method.client_streaming:
            messages = Messages(case.messages, hold=case.abandon or case.silent)
            sent = messages.sent
            call = ch.stream_unary(path)(messages, timeout=timeout, metadata=metadata)
            if not case.abandon:
                return await call
            waiter, reply = asyncio.ensure_future(sent.wait()), asyncio.ensure_future(call)
            await asyncio.wait([waiter, reply], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if reply.done():
                return reply.result()
            call.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            return None
        if method.server_streaming:
            call = ch.unary_stream(path)(case.messages[0], timeout=timeout, metadata=metadata)
            async for _ in call:
                if case.abandon:
                    call.cancel()
                    return None
            return b"streamed"
        return await ch.unary_unary(path)(case.messages[0], timeout=timeout,
                                          metadata=metadata)

    # -- sessions through the real client --

    async def spill_protected(self) -> None:
        for i, (name, key) in enumerate(PROTECTED):
            tenant = self.tenant(name)
            async with self.client(tenant) as kv:
                enc = self.pool[key]
                sid = f"keep-{i}"
                await kv.spill(tenant, sid, LAYOUT.name, enc.tokens, chunks=list(enc.chunks),
                               tail=enc.tail, window=enc.window,
                               generation=PROTECTED_GENERATION, ack="durable")
                self.state.protected[tenant, sid] = Spilled(tenant, sid, PROTECTED_GENERATION,
                                                            enc, True)
                self.acked[tenant, sid] = acknowledged(enc)
            await self.check_restore(tenant, sid)
        # tokens no case spills: another tenant's Lookup of them must find nothing
        tenant, enc = self.tenant("victim"), encode(token_ids(SECRET_TOKENS, 99), 99)
        async with self.client(tenant) as kv:
            await kv.spill(tenant, "secret", LAYOUT.name, enc.tokens, chunks=list(enc.chunks),
                           tail=enc.tail, generation=1, ack="durable")
        self.state.secret = (tenant, enc.tokens.tobytes())

    async def watch_stat(self, done: asyncio.Event) -> None:
        """Stat every 50 ms on a connection of its own: how long the event loop kept it."""
        metadata = Credentials.bearer(self.creds.tokens[CALLER]) if self.creds else None
        async with channel(self.live.target, CONNECTIONS + 1, self.creds) as ch:
            stat = ch.unary_unary("/kvtier.v1.KVTier/Stat")
            while not done.is_set():
                started = time.perf_counter()
                # a restart is counted as a crash, a deadline is the slowest below
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stat(pb.StatRequest().SerializeToString(), timeout=self.deadline_s,
                               metadata=metadata)
                took = time.perf_counter() - started
                self.stat_max_s = max(self.stat_max_s, took)
                self.counts["stalls"] += took > STALL_S
                await asyncio.sleep(0.05)

    async def check_restore(self, tenant: str, sid: str) -> bool:
        """Restore (or resume) through the client, as ``tenant``; a restore giving other
        bytes than were acknowledged is a wrong tensor. True if it gave the acknowledged
        bytes."""
        use_resume = self.probe_rng.random() < 0.3
        try:
            async with self.client(tenant, timeout_s=self.deadline_s) as kv:
                got = await (kv.resume if use_resume else kv.restore)(tenant, sid,
                                                                      decode=False)
        except Exception as exc:  # noqa: BLE001 - recorded: a probe must not fail
            self.counts["probe_errors"] += 1
            self.examples.setdefault("probe_error", []).append(
                f"{tenant}/{sid}: {type(exc).__name__}: {str(exc)[:200]}")
            return False
        if snapshot(got) != self.acked[tenant, sid]:
            self.counts["wrong_tensors"] += 1
            self.examples.setdefault("wrong_tensor", []).append(f"{tenant}/{sid}")
            return False
        return True

    async def probe(self, index: int, rng: random.Random) -> None:
        """A legit spill and restore under an attacked tenant, with tokens the fuzzer
        spills too; then every protected session and the last probes again."""
        self.counts["probes"] += 1
        tenant = self.tenant(rng.choice(("acme", "victim", "beta") if self.creds
                                        else ("acme", "victim", "evil", "beta")))
        enc = self.pool[rng.randrange(4), rng.choice("ab")]
        sid = f"probe-{index}"
        try:
            async with self.client(tenant, timeout_s=self.deadline_s) as kv:
                await kv.spill(tenant, sid, LAYOUT.name, enc.tokens, chunks=list(enc.chunks),
                               tail=enc.tail, window=enc.window, generation=1)
            self.acked[tenant, sid] = acknowledged(enc)
            for ref in [*self.state.protected, *list(self.acked)[-5:]]:
                await self.check_restore(*ref)
        except Exception as exc:  # noqa: BLE001 - recorded: a probe must not fail
            self.counts["probe_errors"] += 1
            self.examples.setdefault("probe_error", []).append(
                f"spill {tenant}/{sid}: {type(exc).__name__}: {str(exc)[:200]}")
            await self.check_alive()

    # -- the campaign --

    async def run(self, requests: int, probe_every: int = 250) -> dict:
        self.connect()
        started = time.perf_counter()
        tasks: list[asyncio.Task] = []
        try:
            await self.spill_protected()
            queue: asyncio.Queue = asyncio.Queue(maxsize=self.concurrency * 2)

            async def worker() -> None:
                while (case := await queue.get()) is not None:
                    await self.send(case)

            workers = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
            watched = asyncio.Event()
            watcher = asyncio.create_task(self.watch_stat(watched))
            probes, probe_rng = [], random.Random(1)
            tasks += [*workers, watcher]
            for i in range(requests):
                await queue.put(self.cases.next())
                if i % probe_every == probe_every - 1:
                    probes.append(asyncio.create_task(self.probe(i, probe_rng)))
                    tasks.append(probes[-1])
            for _ in workers:
                await queue.put(None)
            await asyncio.gather(*workers, *probes)
            watched.set()
            await watcher
            await self.check_alive()
            intact = True
            for tenant, sid in self.state.protected:
                intact &= await self.check_restore(tenant, sid)
        finally:
            # A run cut short (Hypothesis abandons an example by raising from its random
            # source) leaves requests in flight: ended before their channels close.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.disconnect()
        server_errors = self.live.rpc_errors()
        by_code = dict(sorted(self.by_code.items()))
        return {"requests": sum(by_code.values()), "crashes": self.counts["crashes"],
                "hangs": self.counts["hangs"], "by_code": by_code,
                "internal_or_unknown": by_code.get("INTERNAL", 0) + by_code.get("UNKNOWN", 0),
                # the server's own count (since its last start): no client-side artifact
                "server_internal_or_unknown": server_errors["INTERNAL"]
                + server_errors["UNKNOWN"],
                "wrong_tensors": self.counts["wrong_tensors"],
                "preexisting_sessions_intact": intact, "probes": self.counts["probes"],
                "auth": self.creds is not None,
                "credential_attacks": self.counts["credential_attacks"],
                "credential_breaches": self.counts["credential_breaches"],
                "probe_errors": self.counts["probe_errors"],
                **{key: self.counts[key] for key in ("prefix_leaks", "path_leaks", "stalls",
                                                     "layouts_registered")},
                "stat_max_s": round(self.stat_max_s, 3),
                "by_method": {m: dict(sorted(codes.items()))
                              for m, codes in sorted(self.by_method.items())},
                "seconds": round(time.perf_counter() - started, 1),
                "server_peak_rss_mib": round(self.live.rss().get("peak", 0) / 2**20, 1),
                "examples": self.examples}


def run_fuzz(requests: int, seed: int = 0, *, deadline_s: float = 20.0, concurrency: int = 8,
             rng: random.Random | None = None, auth: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtier-fuzz-") as tmp:
        tmp = Path(tmp)
        creds = Credentials.write(tmp / "certs") if auth else None
        with LiveServer(tmp / "data", tmp, env={"KVTIER_STREAM_IDLE_S": str(IDLE_S)},
                        creds=creds) as live:
            campaign = Campaign(live, seed, deadline_s, concurrency, rng)
            result = asyncio.run(campaign.run(requests))
        result["server_log_errors"] = _log_errors(tmp / "server.log")
        result["seed"] = seed
        return result


def _log_errors(log: Path) -> int:
    """Lines the server logged at ERROR (or tracebacks): each is worth reading."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(" ERROR " in line or line.startswith("Traceback") for line in text.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress.fuzz",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-s", type=float, default=20.0,
                        help="a request running longer counts as a hang")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--auth", "--secure", action="store_true",
                        help="against a server with TLS and tokens, with credential attacks")
    args = parser.parse_args(argv)
    result = run_fuzz(args.requests, args.seed, deadline_s=args.deadline_s,
                      concurrency=args.concurrency, auth=args.auth)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key in ("requests", "crashes", "hangs", "internal_or_unknown", "wrong_tensors",
                    "preexisting_sessions_intact", "prefix_leaks", "path_leaks", "stalls",
                    "stat_max_s", "layouts_registered", "seconds"):
            print(f"{key}: {result[key]}")
        print(f"by_code: {result['by_code']}")
    bad = (result["crashes"] or result["hangs"] or result["internal_or_unknown"]
           or result["server_internal_or_unknown"] or result["wrong_tensors"]
           or result["credential_breaches"] or not result["preexisting_sessions_intact"]
           or result["prefix_leaks"] or result["path_leaks"] or result["stalls"])
    return 1 if bad else 0

