"""The fuzz campaign's requests: one ``Case`` per request to any method of the KVTier and
Replay services (proto/kvtier.proto), as raw bytes, from a seeded ``random.Random``
(``stress.fuzz`` seeds it; ``stress/fuzz/test_fuzz.py`` hands in Hypothesis's).

Families: ``garbage`` (random bytes, or a valid message with bytes flipped), ``truncated``
(a valid message cut short), ``random`` (every field drawn from edge values, from the
descriptors, so every method and field is covered) and named adversarial cases (bombs,
wrong section tables, huge ids and token counts, bad digests, foreign and path-like
lease ids, out-of-vocabulary ids, stale and duplicate generations, Spill messages out of
order, streams abandoned or left silent; and, in ``stress.fuzz.layouts``, hostile and
flooding RegisterLayout bodies, Lookups of huge or unaligned token arrays, under
registered one-token-chunk layouts, in other tenants' domains and of another tenant's
prompt, Forks past the source, onto itself, onto protected sessions and across tenants).

Sessions named in ``protected`` are never spilled over or deleted (the campaign checks
them bit-exact afterwards); they are read, prefetched, evicted, forked from and onto,
and spilled at stale or equal generations, which must leave them as they were. Lease
ids come from what the runner saw (``seen_leases``), so which ids a case names depends
on the run; the sequence of cases does not.
"""

from __future__ import annotations

import math
import random

import numpy as np
from google.protobuf.descriptor import FieldDescriptor as F

from kvstore.format.keys import chunk_digest
from proto import kvtier_pb2 as pb
from stress import forge
from stress.fuzz.chunk_cases import ChunkCases
from stress.fuzz.layouts import HUGE_TOKENS, LayoutCases
from stress.fuzz.messages import DOUBLES, INTS, STRINGS, U32, U64, random_message
from stress.fuzz.pool import LAYOUT, Encoded, token_ids
from stress.fuzz.state import SESSIONS, TENANTS, Case, Spilled, State, ser

SERVICES = [pb.DESCRIPTOR.services_by_name[name] for name in ("KVTier", "Replay")]
METHODS = {m.name: m for s in SERVICES for m in s.methods}
CONNECTIONS = 3
BOMB = 512 << 20
METHOD_WEIGHTS = {"Spill": 30, "Restore": 12, "Resume": 8, "Prefetch": 5, "Evict": 5,
                  "Delete": 5, "Stat": 5, "List": 5, "LeaseSegment": 6,
                  "ReleaseSegments": 4, "Rebuild": 8, "Lookup": 7, "Fork": 7,
                  "RegisterLayout": 14, "ListLayouts": 2, "WriteChunks": 8, "ReadChunks": 7,
                  "Drain": 2, "AdoptWindow": 4}


class CaseGenerator(LayoutCases, ChunkCases):
    def __init__(self, rng: random.Random, pool: dict[tuple[int, str], Encoded],
                 state: State | None = None) -> None:
        self.rng = rng
        self.pool = pool
        self.state = state or State()
        self._bombs: dict[str, bytes] = {}
        names = list(METHOD_WEIGHTS)
        self._methods, self._weights = names, [METHOD_WEIGHTS[n] for n in names]

    # -- drawing --

    def next(self) -> Case:
        rng = self.rng
        method = rng.choices(self._methods, self._weights)[0]
        roll = rng.random()
        if method == "Drain":  # only refused ones: a drained server takes no more spills
            case = self.adv_Drain()
        elif roll < 0.12:
            case = self.garbage(method)
        elif roll < 0.24:
            case = self.truncated(method)
        elif roll < 0.42:
            case = self.random_case(method)
        else:
            case = getattr(self, f"adv_{method}")()
        case.connection = rng.randrange(CONNECTIONS)
        return case

    def _tenant(self) -> str:
        return self.rng.choice(TENANTS)

    def _sid(self) -> str:
        return self.rng.choice(SESSIONS)

    def _enc(self) -> Encoded:
        return self.pool[self.rng.randrange(4), self.rng.choice("ab")]

    def _ref(self, *, readonly: bool) -> pb.SessionRef:
        """A session ref: one spilled before, a protected one (``readonly`` calls only),
        one never spilled, or a malformed one."""
        rng, s = self.rng, self.state
        roll = rng.random()
        if roll < 0.45 and s.spilled:
            got = rng.choice(s.spilled[-50:])
            return pb.SessionRef(tenant=got.tenant, session_id=got.session_id)
        if roll < 0.65 and readonly and s.protected:
            tenant, sid = rng.choice(sorted(s.protected))
            return pb.SessionRef(tenant=tenant, session_id=sid)
        if roll < 0.85:
            return pb.SessionRef(tenant=self._tenant(), session_id=self._sid())
        return pb.SessionRef(tenant=rng.choice(STRINGS), session_id=rng.choice(STRINGS))

    def _lease_id(self, connection: int | None = None) -> str:
        """A lease id seen on ``connection`` (None: any), or a made-up one."""
        rng = self.rng
        pools = [ids for c, ids in self.state.seen_leases.items()
                 if connection is None or c == connection]
        ids = [i for p in pools for i in p[-20:]]
        if ids and rng.random() < 0.7:
            return rng.choice(ids)
        return rng.choice(("", ".", "..", "/dev/shm/x", "kvtier-0", "0" * 32, "x" * 5000))

    # -- generic families --

    def garbage(self, method: str) -> Case:
        rng = self.rng
        if rng.random() < 0.5:
            raw = rng.randbytes(rng.choice((1, 2, 3, 7, 16, 100, 1000)))
        else:
            raw = bytearray(self._valid(method)[0])
            for _ in range(rng.randint(1, 4)):
                if raw:
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
            raw = bytes(raw)
        messages = [raw]
        if METHODS[method].client_streaming and rng.random() < 0.5:
            messages = [self._valid(method)[0], raw]  # garbage after a valid first message
        return Case(method, "garbage", messages)

    def truncated(self, method: str) -> Case:
        messages = self._valid(method)
        at = self.rng.randrange(len(messages))
        raw = messages[at]
        messages = messages[:at] + [raw[:self.rng.randrange(max(1, len(raw)))]]
        return Case(method, "truncated", messages)

    def random_case(self, method: str) -> Case:
        descriptor = METHODS[method].input_type
        count = self.rng.randint(1, 4) if METHODS[method].client_streaming else 1
        return Case(method, "random", ser(random_message(self.rng, descriptor)
                                           for _ in range(count)))

    def _valid(self, method: str) -> list[bytes]:
        """A well-formed request (the start of the adversarial family's honest cases)."""
        if method == "Spill":
            return ser(self._enc().spill(self._tenant(), self._sid(), 1))
        if method == "Rebuild":
            return ser([self._rebuild_request(self._enc())])
        return getattr(self, f"adv_{method}")().messages

    # -- adversarial: Spill --

    def adv_Spill(self) -> Case:
        rng = self.rng
        name = rng.choice(("honest", "honest", "honest", "retry", "stale_protected",
                           "victim_prefix", "section_table", "bomb", "window_bomb",
                           "huge_ids", "huge_tokens", "odd_tokens", "out_of_vocab",
                           "bad_digest", "order", "abandon", "silent", "shm", "fields",
                           "registered_layout"))
        return Case("Spill", f"spill:{name}", *getattr(self, f"_spill_{name}")())

    def _spill_honest(self):
        rng = self.rng
        tenant, sid, enc = self._tenant(), self._sid(), self._enc()
        previous = [s for s in self.state.spilled if (s.tenant, s.session_id) == (tenant, sid)]
        generation = (previous[-1].generation if previous else 0) + rng.randint(1, 3)
        window = rng.random() < 0.3
        self.state.spilled.append(Spilled(tenant, sid, generation, enc, window))
        return (ser(enc.spill(tenant, sid, generation, window=window)),)

    def _spill_retry(self):
        """Stale, equal (identical: a retry; or other content) generations of a spill."""
        if not self.state.spilled:
            return self._spill_honest()
        got = self.rng.choice(self.state.spilled[-30:])
        generation = got.generation - self.rng.randint(0, 1)
        enc = got.enc if self.rng.random() < 0.5 else self._enc()
        return (ser(enc.spill(got.tenant, got.session_id, generation, window=got.window)),)

    def _spill_stale_protected(self):
        if not self.state.protected:
            return self._spill_honest()
        (tenant, sid), kept = self.rng.choice(sorted(self.state.protected.items()))
        generation = self.rng.randint(0, kept.generation)  # never past the stored one
        enc = kept.enc if generation == kept.generation and self.rng.random() < 0.5 \
            else self._enc()
        return (ser(enc.spill(tenant, sid, generation, window=kept.window)),)

    def _spill_victim_prefix(self):
        """A protected session's tokens with other KV under another tenant or session;
        or claiming its chunks by the victim's keys and digests, sending no bytes."""
        if not self.state.protected:
            return self._spill_honest()
        (tenant, _), kept = self.rng.choice(sorted(self.state.protected.items()))
        other = self.pool[next(k for k, v in self.pool.items() if v is kept.enc)[0],
                          self.rng.choice("ab")]
        attacker = self.rng.choice(("evil", tenant))
        sid = self._sid()
        if self.rng.random() < 0.5:
            return (ser(other.spill(attacker, sid, 1)),)
        header = kept.enc.header(attacker, sid, 1, chunk_keys=kept.enc.keys(tenant))
        return (ser([pb.SpillRequest(header=header)]),)

    def _one_chunk(self) -> Encoded:
        return self.pool[2, self.rng.choice("ab")]

    def _forged_spill(self, chunk: bytes) -> list[bytes]:
        enc = self._one_chunk()
        header = enc.header(self._tenant(), self._sid(), 1, chunk_digests=[chunk_digest(chunk)])
        return ser([pb.SpillRequest(header=header),
                     pb.SpillRequest(chunk=pb.Payload(key=header.chunk_keys[0], data=chunk))])

    def _spill_section_table(self):
        enc = self._one_chunk()
        return (self._forged_spill(forge.one_section_chunk(LAYOUT, enc.tokens, enc.chunks[0])),)

    def _bomb(self, kind: str) -> bytes:
        if kind not in self._bombs:
            tokens = self._one_chunk().tokens
            build = {"table": forge.table_bomb, "frame": forge.frame_bomb}[kind[:5]]
            self._bombs[kind] = build(LAYOUT, tokens, BOMB, kind.endswith("declared"))
        return self._bombs[kind]

    def _spill_bomb(self):
        kind = self.rng.choice(("table-declared", "table-undeclared", "frame-declared",
                                "frame-undeclared"))
        return (self._forged_spill(self._bomb(kind)),)

    def _spill_window_bomb(self):
        if "window" not in self._bombs:
            self._bombs["window"] = forge.window_bomb(LAYOUT, token_ids(200 * 512, 7))
        tokens = token_ids(200 * 512, 7)
        bomb = self._bombs["window"]
        enc = Encoded(tokens, (), b"", bomb)
        header = enc.header(self._tenant(), self._sid(), 1,
                            chunk_digests=[bytes(32)] * (len(tokens) // 512))
        return (ser([pb.SpillRequest(header=header),
                      pb.SpillRequest(window=pb.Payload(data=bomb))]),)

    def _spill_huge_ids(self):
        rng, enc = self.rng, self._enc()
        tenant = rng.choice(("a" * 100_000, "acme", "x" * 65))
        sid = rng.choice(("s" * 20_000, "f1", "s" * 129))
        return (ser(enc.spill(tenant, sid, 1)),)

    def _spill_huge_tokens(self):
        count = self.rng.choice((1 << 20, 1 << 22, (70 << 20) // 4))
        tokens = np.zeros(count, "<u4").tobytes()
        header = pb.SpillHeader(session=pb.SessionRef(tenant=self._tenant(),
                                                      session_id=self._sid()),
                                layout_id=LAYOUT.name, generation=1, token_ids=tokens)
        return (ser([pb.SpillRequest(header=header)]),)

    def _spill_registered_layout(self):
        """A header of many tokens under a layout the fuzzer registered (one-token chunks,
        some of them), naming few or no chunk keys: refused before the keys are hashed."""
        rng = self.rng
        tokens = np.zeros(rng.choice(HUGE_TOKENS[:2]), "<u4").tobytes()
        header = pb.SpillHeader(session=pb.SessionRef(tenant=self._tenant(),
                                                      session_id=self._sid()),
                                layout_id=self._layout_name(), generation=1, token_ids=tokens,
                                chunk_keys=["0" * 32] * rng.choice((0, 1, 1000)))
        return (ser([pb.SpillRequest(header=header)]),)

    def _spill_odd_tokens(self):
        enc = self._enc()
        header = enc.header(self._tenant(), self._sid(), 1,
                            token_ids=enc.tokens.tobytes()[:-self.rng.randint(1, 3)])
        return (ser([pb.SpillRequest(header=header)] + enc.spill("acme", "x", 1)[1:]),)

    def _spill_out_of_vocab(self):
        enc = self._enc()
        tokens = enc.tokens.copy()
        tokens[self.rng.randrange(len(tokens))] = self.rng.choice((LAYOUT.vocab_size, U32))
        bad = Encoded(tokens, enc.chunks, enc.tail, enc.window)
        return (ser(bad.spill(self._tenant(), self._sid(), 1)),)

    def _spill_bad_digest(self):
        rng = self.rng
        enc = self.pool[1, rng.choice("ab")]
        digests = [chunk_digest(c) for c in enc.chunks]
        digests = rng.choice(([d[:31] for d in digests], [bytes(32)] * 2, digests[:1],
                              digests * 2, [rng.randbytes(32)] * 2, list(reversed(digests))))
        changes = {"chunk_digests": digests}
        if rng.random() < 0.3:
            changes = {"tail_digest": rng.choice((b"", bytes(32), b"\x01" * 64))}
        return (ser(enc.spill(self._tenant(), self._sid(), 1, **changes)),)

    def _spill_order(self):
        rng, honest = self.rng, self._enc().spill(self._tenant(), self._sid(), 1)
        header, rest = honest[0], honest[1:] or [pb.SpillRequest(tail=pb.Payload(data=b"x"))]
        orders = ([*rest, header], [header, header, *rest], [header, *rest, *rest],
                  [header, *rest, header], [pb.SpillRequest(), header, *rest],
                  [header, pb.SpillRequest(), *rest], rest,
                  [header, pb.SpillRequest(chunk=pb.Payload(key="0" * 32, data=b"x")), *rest],
                  [header, *rest, pb.SpillRequest(window=pb.Payload(data=b"")),
                   pb.SpillRequest(window=pb.Payload(data=b""))], [])
        return (ser(rng.choice(orders)),)

    def _spill_abandon(self):
        honest = self._enc().spill(self._tenant(), self._sid(), 1)
        return ser(honest[:self.rng.randint(1, len(honest))]), 0, True

    def _spill_silent(self):
        honest = self._enc().spill(self._tenant(), self._sid(), 1)
        return ser(honest[:self.rng.randint(0, len(honest))]), 0, False, True

    def _spill_shm(self):
        rng = self.rng
        enc = self._one_chunk()
        offset = rng.choice((0, 0, 1, 1 << 20, U64, 1 << 63))
        length = rng.choice((len(enc.chunks[0]), 0, 1, U64, 1 << 32))
        ref = pb.SharedMemoryRef(lease_id=self._lease_id(), offset=offset, length=length)
        header = enc.header(self._tenant(), self._sid(), 1)
        return (ser([pb.SpillRequest(header=header),
                      pb.SpillRequest(chunk=pb.Payload(key=header.chunk_keys[0], shm=ref))]),)

    def _spill_fields(self):
        rng, enc = self.rng, self._enc()
        changes = rng.choice((
            {"layout_id": rng.choice(("deepseek-v3", "kvtier-bundled@00", "nope", ""))},
            {"dedupe_domain": rng.choice(("public", "evil", "x" * 100))},
            {"model_fingerprint": rng.choice(("m" * 257, "base-v1", "\x00"))},
            {"ttl_s": rng.choice(DOUBLES)}, {"ack": rng.choice((3, 99, -1))},
            {"hint": pb.ResumeHint(expected_pause_s=rng.choice(DOUBLES),
                                   priority=rng.choice(INTS[F.TYPE_INT32]))},
            {"generation": rng.choice((0, U64, 1 << 63))},
            {"chunk_keys": enc.keys(self._tenant())[:-1] + ["../../x"]}))
        generation = changes.pop("generation", 1)
        return (ser(enc.spill(self._tenant(), self._sid(), generation, **changes)),)

    # -- adversarial: the other methods --

    def _shm_request_fields(self) -> dict:
        rng = self.rng
        fields = {"use_shared_memory": rng.random() < 0.6}
        if rng.random() < 0.5:
            fields["reply_lease"] = self._lease_id()
        return fields

    def adv_Restore(self) -> Case:
        rng = self.rng
        request = pb.RestoreRequest(session=self._ref(readonly=True),
                                    layer_by_layer=rng.random() < 0.3,
                                    want_window=rng.random() < 0.7, **self._shm_request_fields())
        return Case("Restore", "restore", ser([request]), abandon=rng.random() < 0.1)

    def adv_Resume(self) -> Case:
        rng = self.rng
        request = pb.ResumeRequest(session=self._ref(readonly=True),
                                   replay_tokens=rng.choice((0, 0, 1, 16, 128, 129, 4096, U32)),
                                   **self._shm_request_fields())
        return Case("Resume", "resume", ser([request]), abandon=rng.random() < 0.1)

    def adv_Prefetch(self) -> Case:
        rng = self.rng
        request = pb.PrefetchRequest(session=self._ref(readonly=True),
                                     timeout_s=rng.choice((0.0, 0.001, 1.0, -1.0, math.nan,
                                                           math.inf, 1e300)),
                                     target_tier=rng.choice(("", "host", "disk", "nope")))
        return Case("Prefetch", "prefetch", ser([request]))

    def adv_Evict(self) -> Case:
        request = pb.EvictRequest(session=self._ref(readonly=True), target_tier=self.rng.choice(
            ("", "host", "disk", "object", "hbm", "redis", "..", "nope")))
        return Case("Evict", "evict", ser([request]))

    def adv_Delete(self) -> Case:
        return Case("Delete", "delete", ser([pb.DeleteRequest(
            session=self._ref(readonly=False))]))

    def adv_Stat(self) -> Case:
        session = self._ref(readonly=True) if self.rng.random() < 0.7 else None
        return Case("Stat", "stat", ser([pb.StatRequest(session=session)]))

    def adv_List(self) -> Case:
        rng = self.rng
        request = pb.ListRequest(tenant=rng.choice(("", *TENANTS, "UPPER", "x" * 1000)),
                                 page_size=rng.choice((0, 1, 2, 1000, U32)),
                                 page_token=rng.choice(("", "acme/f1", "\U0010ffff", "z" * 500)))
        return Case("List", "list", ser([request]))

    def adv_Drain(self) -> Case:
        """An interval the server must refuse (INVALID_ARGUMENT) before it starts
        draining; a valid Drain is driven by bench.seams (the drain event)."""
        interval = self.rng.choice((-1.0, -0.5, float("nan"), float("inf"), float("-inf"),
                                    60.5, 1e300, -1e-300))
        return Case("Drain", "drain", ser([pb.DrainRequest(progress_interval_s=interval)]))

    def adv_AdoptWindow(self) -> Case:
        """A window offered as a draining peer's, every part of it hostile or wrong for
        this node: a single node's manifests name no sending node, so none is adopted (a
        protected session keeps its own window); with --auth a tenant's token is refused."""
        rng, enc = self.rng, self._enc()
        window = rng.choice((enc.window or b"", rng.randbytes(rng.choice((1, 64, 4096))),
                             b""))
        header = pb.AdoptWindowHeader(
            session=self._ref(readonly=True),
            generation=rng.choice((0, 1, 2, U64)),
            window_replayed=rng.choice((0, 16, U32)),
            from_node=rng.choice(("", "node-a", "x" * 300, "\x00")),
            window_digest=rng.choice((chunk_digest(window), bytes(32), b"\x01" * 31,
                                      rng.randbytes(64))),
            window_bytes=rng.choice((len(window), 0, len(window) + 1, 1 << 40, U64)))
        head, body = (pb.AdoptWindowRequest(header=header),
                      pb.AdoptWindowRequest(window=window))
        orders = ([head, body], [head, body], [body, head], [head, head, body],
                  [head, body, body], [head], [body], [pb.AdoptWindowRequest(), head, body])
        return Case("AdoptWindow", "adopt", ser(rng.choice(orders)))

    def adv_LeaseSegment(self) -> Case:
        size = self.rng.choice((0, 1, 4096, 1 << 20, 3 << 20, 1 << 31, 1 << 40, U64))
        return Case("LeaseSegment", "lease", ser([pb.LeaseRequest(size=size)]))

    def adv_ReleaseSegments(self) -> Case:
        rng = self.rng
        ids = [self._lease_id() for _ in range(rng.choice((0, 1, 3)))]
        if rng.random() < 0.1:
            ids += [f"id{i}" for i in range(10_000)]
        return Case("ReleaseSegments", "release", ser([pb.ReleaseRequest(lease_ids=ids)]))

    def _rebuild_request(self, enc: Encoded, **changes) -> pb.ReplayRequest:
        fields = dict(layout_id=LAYOUT.name, token_ids=enc.tokens.tobytes(),
                      chunks=list(enc.chunks), tail=enc.tail, replay_tokens=16, job_id="fuzz")
        fields.update(changes)
        return pb.ReplayRequest(**fields)

    def adv_Rebuild(self) -> Case:
        rng, enc = self.rng, self._enc()
        tokens = enc.tokens.copy()
        tokens[-1] = LAYOUT.vocab_size
        one = self._one_chunk()
        changes = rng.choice((
            {}, {"replay_tokens": rng.choice((0, 129, 4096, U32))},
            {"layout_id": rng.choice(("deepseek-v3", "", "nope", "kvtier-bundled@00"))},
            {"token_ids": enc.tokens.tobytes()[:-1]}, {"token_ids": tokens.tobytes()},
            {"token_ids": np.zeros(1 << 22, "<u4").tobytes(), "chunks": []},
            {"chunks": list(enc.chunks) * 2}, {"chunks": [b"\0" * 100] * len(enc.chunks)},
            {"tail": rng.randbytes(64)},
            {"token_ids": one.tokens.tobytes(), "tail": b"",
             "chunks": [forge.one_section_chunk(LAYOUT, one.tokens, one.chunks[0])]},
            {"token_ids": one.tokens.tobytes(), "tail": b"",
             "chunks": [self._bomb(rng.choice(("table-declared", "frame-undeclared")))]}))
        return Case("Rebuild", "rebuild", ser([self._rebuild_request(enc, **changes)]))
